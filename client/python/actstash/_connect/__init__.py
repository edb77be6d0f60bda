"""The connection: connect() and the private actstashd it may start (start="auto"
or "always"), and where the package's native executables are. connect() imports
torch (the Stash it returns) on first use only, so that the commands (_cli.py)
run without torch."""
from actstash._connect._daemon import PrivateDaemon, binary, private_daemon

__all__ = ["PrivateDaemon", "binary", "connect", "private_daemon", "process_stash"]


def __getattr__(name):
    if name in ("connect", "process_stash"):
        from actstash._connect import _connect
        value = getattr(_connect, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'actstash._connect' has no attribute {name!r}")
