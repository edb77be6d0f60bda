"""The package is typed for its users (py.typed, annotations on the public API, the
lazily imported names visible to type checkers): mypy accepts a trainer that uses the
API as documented and refuses one that misuses it. Needs mypy (scripts/setup installs
it for scripts/lint, which checks the package itself)."""
import os
import subprocess
import sys

import pytest

import actstash

pytestmark = pytest.mark.torch_agnostic

GOOD = """
import actstash
import torch
from actstash.optim import OffloadAdamW

stash: actstash.Stash = actstash.connect(start="never", quota="1GiB")
with stash.offload(min_bytes=0):
    pass
stats: dict = stash.stats()
model = actstash.wrap(torch.nn.Sequential(), stash, policy="auto", budget="6GiB")
opt = OffloadAdamW(model.parameters(), 1e-3, stash=stash)
defaults = actstash.client_defaults()
error: type = actstash.StashInvalidArgument
"""

# Each a misuse the annotations must catch, with what mypy says of it.
BAD = [
    ("x: int = actstash.connect()", 'has type "Stash"'),
    ("actstash.connect(prefetch='two')", 'Argument "prefetch" to "connect"'),
    ("stash: actstash.Stash = actstash.connect()\nstash.offload(min_bytes='big')",
     'Argument "min_bytes" to "offload"'),
    ("from actstash.optim import OffloadAdamW\nOffloadAdamW([], betas=0.9)",
     'Argument "betas" to "OffloadAdamW"'),
    ("actstash.no_such_name", 'has no attribute "no_such_name"'),
]


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def checked(tmp_path_factory):
    """mypy's messages per snippet (good.py, bad0.py, ...), from one run over all of them
    against the package under test, with the project's settings (client/python/mypy.ini)."""
    if subprocess.run([sys.executable, "-m", "mypy", "--version"],
                      capture_output=True).returncode != 0:
        pytest.skip("mypy is not installed for this Python")
    folder = tmp_path_factory.mktemp("typing")
    names = ["good.py"] + [f"bad{i}.py" for i in range(len(BAD))]
    (folder / "good.py").write_text(GOOD)
    for i, (line, _) in enumerate(BAD):
        (folder / f"bad{i}.py").write_text("import actstash\n" + line + "\n")
    # Installed, mypy finds the package as a user's mypy does: in site-packages, typed
    # because it ships py.typed (without it, every name would be Any and the misuses
    # below would pass). In the build tree, through MYPYPATH.
    package = os.path.dirname(os.path.dirname(os.path.abspath(actstash.__file__)))
    env = dict(os.environ)
    if os.path.basename(package) not in ("site-packages", "dist-packages"):
        env["MYPYPATH"] = package
    done = subprocess.run([sys.executable, "-m", "mypy", "--config-file",
                           os.path.join(ROOT, "client", "python", "mypy.ini"), "--cache-dir",
                           str(folder / "cache"), "--no-error-summary", *names],
                          capture_output=True, text=True, cwd=folder, env=env)
    out = {name: "" for name in names}
    for message in (done.stdout + done.stderr).splitlines():
        name = message.split(":", 1)[0]
        out[name if name in out else "good.py"] += message + "\n"
    return out


def test_the_package_says_it_is_typed():
    folder = os.path.dirname(os.path.abspath(actstash.__file__))
    assert os.path.isfile(os.path.join(folder, "py.typed"))


def test_a_trainer_that_uses_the_api_as_documented_type_checks(checked):
    assert checked["good.py"] == "", checked["good.py"]


@pytest.mark.parametrize("index", range(len(BAD)), ids=[b[1] for b in BAD])
def test_a_misuse_is_a_type_error(checked, index):
    out = checked[f"bad{index}.py"]
    assert "error:" in out and BAD[index][1] in out, out
