"""The connection: connect() and the private actstashd it may start (start="auto"
or "always"), and where the package's native executables are. connect() imports
torch (the Stash it returns) on first use only, so that the commands (_cli.py)
run without torch."""
from actstash._connect._daemon import PrivateDaemon, binary, private_daemon

__all__ = ["PrivateDaemon", "binary", "connect", "private_daemon"]


def __getattr__(name):
    if name == "connect":
        from actstash._connect._connect import connect
        globals()["connect"] = connect
        return connect
    raise AttributeError(f"module 'actstash._connect' has no attribute {name!r}")
