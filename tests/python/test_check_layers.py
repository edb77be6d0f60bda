"""scripts/check-layers fails on what it exists to refuse: an import of another part's
private module, a reach into another part's private attribute, a part README that is
missing or that names other parts than its files use. Each is planted in a shared
clone of the repository's HEAD, which is clean before the plant."""
import subprocess

import pytest
from actstash_testing.repo_clone import clone_or_skip, planted, run_check

pytestmark = pytest.mark.torch_agnostic

PLAN = "client/python/actstash/_plan/"


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    return clone_or_skip(tmp_path_factory, "layers")


def check(path):
    return run_check(path, "check-layers")


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
    with planted(clone, relative, old, new):
        code, out = check(clone)
    assert code == 1 and expected in out, out


def test_a_part_without_a_readme_fails(clone):
    subprocess.run(["git", "-C", clone, "rm", "-q", "--cached", PLAN + "README.md"], check=True)
    try:
        code, out = check(clone)
    finally:
        subprocess.run(["git", "-C", clone, "add", PLAN + "README.md"], check=True)
    assert code == 1 and f"{PLAN}README.md: missing" in out, out
