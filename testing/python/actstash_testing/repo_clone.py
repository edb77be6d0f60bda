"""A clone of the repository's working tree in which a test plants a defect for one of
the project's checks (scripts/check-layers, scripts/check-docs) and sees it fail."""
import contextlib
import os
import shutil
import subprocess
import sys

# The repository this module is in (testing/python/actstash_testing/).
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))))


def clone_or_skip(tmp_path_factory, name):
    """For a module-scoped pytest fixture: a clone of this repository's tree under test
    (clone_worktree) in a temporary folder named after `name`; the test is skipped
    without git or a repository."""
    import pytest
    path = clone_worktree(ROOT, str(tmp_path_factory.mktemp(name) / "repo"))
    if path is None:
        pytest.skip("needs the git repository")
    return path


def clone_worktree(root, dest):
    """A shared clone of `root` at HEAD, plus its tracked changes and untracked files
    (added), so that the clone is the tree under test. None without git or a repository."""
    if shutil.which("git") is None or not os.path.isdir(os.path.join(root, ".git")):
        return None
    subprocess.run(["git", "clone", "-q", "--shared", "--no-checkout", root, dest], check=True)
    subprocess.run(["git", "-C", dest, "checkout", "-q", "HEAD"], check=True)
    for relative in subprocess.run(["git", "ls-files", "-m", "-o", "--exclude-standard"],
                                   cwd=root, check=True, capture_output=True,
                                   text=True).stdout.split():
        source = os.path.join(root, relative)
        if os.path.isfile(source):
            os.makedirs(os.path.dirname(os.path.join(dest, relative)), exist_ok=True)
            shutil.copyfile(source, os.path.join(dest, relative))
            subprocess.run(["git", "-C", dest, "add", relative], check=True)
    return dest


def run_check(clone, script):
    """(exit code, output) of scripts/`script` in the clone."""
    done = subprocess.run([sys.executable, os.path.join(clone, "scripts", script)],
                          capture_output=True, text=True)
    return done.returncode, done.stdout + done.stderr


@contextlib.contextmanager
def planted(clone, relative, old, new):
    """`old` replaced by `new` in one file of the clone while the block runs."""
    path = os.path.join(clone, relative)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    assert old in text, (relative, old)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text.replace(old, new, 1))
    try:
        yield
    finally:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
