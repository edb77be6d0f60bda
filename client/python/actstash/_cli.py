"""Console entry points of the installed package: `actstash` and `actstashd` run the
native executables that ship inside it (see actstash._daemon.binary)."""
import os
import sys

from actstash._connect import binary


def _run(name):
    path = binary(name)
    if path is None:
        sys.stderr.write(f"{name}: this actstash package has no {name} executable "
                         f"(installed without its binaries?)\n")
        sys.exit(127)
    os.execv(path, [path, *sys.argv[1:]])


def actstash():
    _run("actstash")


def actstashd():
    _run("actstashd")
