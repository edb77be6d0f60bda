"""Trainers: processes of tests/python/takeover_run.py (a GPT with offloaded
blocks, each step checked bitwise against plain autograd) attached to one
daemon, for the tests and benchmarks that replace or kill the daemon under
them. Started and ready on construction; finish() stops them and returns
each one's JSON result line as a dict."""
import json
import os
import subprocess
import sys
import time

from actstash_testing.paths import ROOT

RUNNER = os.path.join(ROOT, "tests", "python", "takeover_run.py")


class Trainers:
    def __init__(self, socket, count, work_dir, env, extra=(), start_timeout=120, each=None):
        """`extra`: arguments of every trainer; `each`: one tuple of arguments per
        trainer (count of them), after `extra`."""
        self.stop_file = os.path.join(work_dir, "stop")
        ready = [os.path.join(work_dir, f"ready{i}") for i in range(count)]
        each = each or [()] * count
        assert len(each) == count, each
        self.procs = [subprocess.Popen([sys.executable, RUNNER, socket, self.stop_file, r,
                                        *extra, *own], env=env, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True)
                      for r, own in zip(ready, each)]
        deadline = time.time() + start_timeout
        while not all(os.path.exists(r) for r in ready):
            if any(p.poll() is not None for p in self.procs):
                self.kill()
                raise RuntimeError("a trainer failed to start: "
                                   + "\n".join(p.communicate()[1][-2000:] for p in self.procs))
            if time.time() > deadline:
                self.kill()
                raise RuntimeError(f"trainers not ready after {start_timeout} s")
            time.sleep(0.05)

    def finish(self, timeout=120):
        """Asks them to stop; their results, or RuntimeError with a failed one's stderr."""
        open(self.stop_file, "w").close()
        results = []
        for p in self.procs:
            out, err = p.communicate(timeout=timeout)
            if p.returncode != 0:
                raise RuntimeError("a trainer failed: " + err[-3000:])
            results.append(json.loads(out.strip().splitlines()[-1]))
        return results

    def kill(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
