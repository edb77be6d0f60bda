"""The connection: connect() and the private actstashd it may start (start="auto"
or "always"), and where the package's native executables are. connect() imports
torch (the Stash it returns) on first use only, so that the commands (_cli.py)
run without torch."""
from typing import TYPE_CHECKING, Any

from actstash._connect._daemon import PrivateDaemon, binary, private_daemon

if TYPE_CHECKING:  # imported on first use below
    from actstash._connect._connect import connect, process_stash  # noqa: F401

__all__ = ["PrivateDaemon", "binary", "connect", "private_daemon", "process_stash"]


if not TYPE_CHECKING:  # type checkers see the imports above, and no other name
    def __getattr__(name: str) -> Any:
        if name in ("connect", "process_stash"):
            from actstash._connect import _connect
            value = getattr(_connect, name)
            globals()[name] = value
            return value
        raise AttributeError(f"module 'actstash._connect' has no attribute {name!r}")
