"""scripts/check-layers fails on what it exists to refuse: an import of another part's
private module, a reach into another part's private attribute, a part README that is
missing or that names other parts than its files use. Each is planted in a shared
clone of the repository's HEAD, which is clean before the plant."""
import os
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.torch_agnostic

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PLAN = "client/python/actstash/_plan/"


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    if shutil.which("git") is None or not os.path.isdir(os.path.join(ROOT, ".git")):
        pytest.skip("needs the git repository")
    path = str(tmp_path_factory.mktemp("layers") / "repo")
    subprocess.run(["git", "clone", "-q", "--shared", "--no-checkout", ROOT, path], check=True)
    # The working tree's own check-layers and the tracked files as they are now.
    subprocess.run(["git", "-C", path, "checkout", "-q", "HEAD"], check=True)
    for relative in subprocess.run(["git", "ls-files", "-m", "-o", "--exclude-standard"],
                                   cwd=ROOT, check=True, capture_output=True,
                                   text=True).stdout.split():
        source = os.path.join(ROOT, relative)
        if os.path.isfile(source):
            os.makedirs(os.path.dirname(os.path.join(path, relative)), exist_ok=True)
            shutil.copyfile(source, os.path.join(path, relative))
            subprocess.run(["git", "-C", path, "add", relative], check=True)
    return path


def check(path):
    done = subprocess.run([sys.executable, os.path.join(path, "scripts", "check-layers")],
                          capture_output=True, text=True)
    return done.returncode, done.stdout + done.stderr


def planted(clone, relative, old, new):
    """Replaces `old` by `new` in one file of the clone; returns a function that undoes it."""
    path = os.path.join(clone, relative)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    assert old in text, (relative, old)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text.replace(old, new, 1))

    def undo():
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    return undo


def test_the_tree_as_it_is_passes(clone):
    code, out = check(clone)
    assert code == 0, out


@pytest.mark.parametrize("relative,old,new,expected", [
    # a private module of another part
    (PLAN + "_measure.py", "from actstash._hooks import (",
     "from actstash._hooks._stash import (", "a private name of part"),
    # a private attribute only another part defines
    (PLAN + "_auto.py", "_hooks.inline_bytes(self.stash)", "self.stash._inline_bytes",
     "reaches _inline_bytes, a private name of another part"),
    # a part it may not use
    ("client/python/actstash/_native/lib.py", "import ctypes\n",
     "import ctypes\nfrom actstash import _hooks  # noqa: F401\n", "may import"),
    # a README whose Uses line is not what its files use
    ("server/spill/README.md", "Uses: base/, sessions/.", "Uses: base/, pool/, sessions/.",
     "says it uses server/base/, server/pool/, server/sessions/; its files use "
     "server/base/, server/sessions/"),
])
def test_a_planted_violation_fails(clone, relative, old, new, expected):
    undo = planted(clone, relative, old, new)
    try:
        code, out = check(clone)
    finally:
        undo()
    assert code == 1 and expected in out, out


def test_a_part_without_a_readme_fails(clone):
    subprocess.run(["git", "-C", clone, "rm", "-q", "--cached", PLAN + "README.md"], check=True)
    try:
        code, out = check(clone)
    finally:
        subprocess.run(["git", "-C", clone, "add", PLAN + "README.md"], check=True)
    assert code == 1 and f"{PLAN}README.md: missing" in out, out
