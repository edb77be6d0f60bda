"""The memory a trainer holds on the CPU: RssAnon (resident anonymous memory),
and its peak over a step, sampled by a thread (the planner's budget counts the
same span: from the first block's forward to the end of backward).

glibc keeps freed blocks below its mmap threshold in the heap, where RssAnon
still counts them; with MALLOC_MMAP_THRESHOLD_ (MMAP_THRESHOLD_ENV) blocks of
128 KiB and more are mmapped and go back to the system when freed, so that
RssAnon follows what the trainer holds (every allocation of that size then pays
page faults). The variable must be in the environment when the process starts:
a child gets it from its parent, a script re-executes itself
(reexec_with_mmap_threshold).
"""
import os
import sys
import threading
import time

PAGE = os.sysconf("SC_PAGE_SIZE")
MMAP_THRESHOLD_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}
SAMPLE_INTERVAL_S = 0.0002


def rss_anon():
    """RssAnon of this process in bytes (/proc/self/statm: resident - shared)."""
    with open("/proc/self/statm") as f:
        fields = f.read().split()
    return (int(fields[1]) - int(fields[2])) * PAGE


def reexec_with_mmap_threshold():
    """Re-executes this script with MMAP_THRESHOLD_ENV unless it has it already."""
    if all(os.environ.get(k) == v for k, v in MMAP_THRESHOLD_ENV.items()):
        return
    os.environ.update(MMAP_THRESHOLD_ENV)
    os.execv(sys.executable, [sys.executable] + sys.argv)


class PeakMeter:
    """Peak RssAnon above RssAnon at the first block's forward: a forward
    pre-hook on `first_block` starts a sampling thread (every 0.2 ms), stop()
    ends it and returns the peak.

    A forward starts a measurement only while `armed` (set it per step to
    measure some steps only) and, with only_with_grad, only when grad mode is
    on; a forward while one runs (recomputation in backward) does not.
    """

    def __init__(self, first_block, armed=True, only_with_grad=False):
        self.armed, self.only_with_grad = armed, only_with_grad
        self.baseline, self.peak, self.running, self.thread = None, 0, False, None
        first_block.register_forward_pre_hook(self._begin)

    def _begin(self, module, args):
        if self.running or not self.armed:
            return
        if self.only_with_grad:
            import torch
            if not torch.is_grad_enabled():
                return
        self.baseline, self.peak, self.running = rss_anon(), 0, True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _sample(self):
        while self.running:
            self.peak = max(self.peak, rss_anon() - self.baseline)
            time.sleep(SAMPLE_INTERVAL_S)

    def stop(self):
        """Ends the measurement (the last sample taken here) and returns its
        peak; without one running, the last measurement's peak."""
        if self.running:
            self.running = False
            self.thread.join()
            self.peak = max(self.peak, rss_anon() - self.baseline)
        return self.peak

    def cancel(self):
        """Ends the sampling thread without a last sample or a join (a step that
        raised)."""
        self.running = False
