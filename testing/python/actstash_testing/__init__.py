"""Support shared by the Python tests (tests/python) and the Python benchmarks
(bench/*.py), the Python side of testing/ (actstash::testing is the C++ side):

    paths     where the source tree and the build tree are (ACTSTASH_BUILD_DIR)
    daemon    DaemonProcess: a real actstashd child process on a private socket
    memory    rss_anon() and PeakMeter: the resident anonymous memory a trainer
              holds, and its peak over a step
    training  gradients, bitwise comparison, the spill tier's GPT and batches
    sim_device  SimulatedCopies: OffloadAdamW's device path on CPU tensors, its
              side stream a thread that sleeps before each copy

Nothing here is built: tests/python/conftest.py and each benchmark put this
folder's parent (testing/python) on sys.path, from the source tree, so it is
found the same way from a build tree, with the installed package
(ACTSTASH_TEST_INSTALLED=1) and in the bundle (scripts/bundle packs the whole
source tree). Layer: the modules import the actstash package, never tests/ or
bench/; none imports torch at import time (the benchmarks set glibc's malloc
options before torch allocates anything).
"""
