"""scripts/check-docs fails on a document that contradicts the repository: a command
marked (CI) that .ci/run does not run, one said not to be in CI that it runs, a line
saying nothing ran on a GPU while docs/gpu-runs/ holds a run, a figure beside a
citation of docs/RESULTS.md that the cited sections do not hold, a cited section that
does not exist. Each is planted in a
clone of the tree under test, which is clean before the plant."""
import pytest
from actstash_testing.repo_clone import clone_or_skip, planted, run_check

pytestmark = pytest.mark.torch_agnostic


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    return clone_or_skip(tmp_path_factory, "docs")


def test_the_tree_as_it_is_passes(clone):
    code, out = run_check(clone, "check-docs")
    assert code == 0, out


@pytest.mark.parametrize("relative,old,new,expected", [
    # a lane that CI does not run, marked as CI's
    ("docs/COMPATIBILITY.md", "`scripts/test` (CI)", "`scripts/test-torch2` (CI)",
     "`scripts/test-torch2` is marked (CI), but .ci/run does not run it"),
    # CI runs the image test: it cannot be "not part of CI"
    ("docs/OPERATIONS.md", "\n## ", "\n`deploy/test-image.sh` is not part of CI.\n\n## ",
     "`deploy/test-image.sh` is said not to be in CI, but .ci/run runs it"),
    # a GPU run is on record
    ("README.md", "\n## ", "\nNo GPU has been lent yet.\n\n## ",
     "says nothing ran on a GPU, but docs/gpu-runs/ holds"),
    # a figure the cited RESULTS sections do not hold (44–49 ms is theirs)
    ("README.md", "a pause of 44–49 ms", "a pause of 43–49 ms",
     "quotes 43 ms beside RESULTS 'Take-over under training load', 'Upgrade in place'"),
    # a cited section that does not exist
    ("README.md", '"Upgrade in place"', '"Upgrade in a hurry"',
     'cites docs/RESULTS.md "Upgrade in a hurry", which has no such section'),
])
def test_a_planted_contradiction_fails(clone, relative, old, new, expected):
    with planted(clone, relative, old, new):
        code, out = run_check(clone, "check-docs")
    assert code == 1 and expected in out, out


def test_a_lane_that_leaves_ci_makes_its_ci_mark_a_contradiction(clone):
    with planted(clone, ".ci/run", "scripts/check-gpu-kit\n", "true\n"):
        code, out = run_check(clone, "check-docs")
    assert code == 1 and "`scripts/check-gpu-kit` is marked (CI)" in out, out
