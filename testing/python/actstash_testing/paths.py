"""Where things are: the source tree this package sits in, and the build tree
(ACTSTASH_BUILD_DIR, default build/ in the source tree)."""
import os

# testing/python/actstash_testing/paths.py -> the source root.
TESTING_PYTHON = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(os.path.dirname(TESTING_PYTHON))
EXAMPLES = os.path.join(ROOT, "examples")
BUILD = os.environ.get("ACTSTASH_BUILD_DIR", os.path.join(ROOT, "build"))
# The package laid out by the build (PYTHONPATH=build/python imports it) and the daemon.
BUILD_PYTHON = os.path.join(BUILD, "python")
BUILT_DAEMON = os.path.join(BUILD, "server", "actstashd")
