"""A simulated device for OffloadAdamW's device path on a machine without a GPU:
the same methods as actstash._hooks._device_copies.CudaCopies, on CPU tensors.

The trainer's own stream is the calling thread (its kernels run as it calls
them, so recording an event on it is immediate and making it wait blocks the
caller); the side stream is a thread of its own that runs what is queued on it
in order, sleeping `delay_s` before each copy. A copy that OffloadAdamW reads
without waiting for its event, or a parameter the next forward reads before its
copy has landed, therefore shows up as numbers that differ from plain autograd
and torch's AdamW. Counters (copies, bytes each way) show that the copies ran.
"""
import queue
import threading
import time


class _Event:
    def __init__(self):
        self.done = threading.Event()


class _Current:
    """The trainer's stream: the calling thread."""


class _Side:
    def __init__(self, delay_s):
        self.delay_s = delay_s
        self.error = None  # the first exception a queued operation raised
        self.closed = False
        self.queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="sim-side-stream", daemon=True)
        self.thread.start()

    def _run(self):
        while True:
            work = self.queue.get()
            if work is None:
                return
            try:
                work()
            except BaseException as error:  # sync() raises it
                self.error = self.error or error


class SimulatedCopies:
    def __init__(self, delay_s=0.002):
        self._current = _Current()
        self._side = _Side(delay_s)
        self._lock = threading.Lock()
        self.copies = 0
        self.bytes_to_host = 0    # copies whose source is a "device" tensor (a parameter's)
        self.bytes_to_device = 0  # the others
        self.waits = 0            # times the trainer's stream waited for the side stream
        # data_ptr()s of the "device" tensors (the parameters), which the test fills in:
        # a copy into one of them is counted as a copy to the device.
        self.device_addresses = set()

    def current(self):
        return self._current

    def side(self):
        return self._side

    def record(self, stream):
        event = _Event()
        if stream is self._current or stream.closed:
            event.done.set()
        else:
            stream.queue.put(event.done.set)
        return event

    def wait(self, stream, event):
        if stream is self._current or stream.closed:
            with self._lock:
                self.waits += 1
            event.done.wait()
        else:
            stream.queue.put(event.done.wait)

    def copy(self, dst, src, stream):
        # As CUDA's non_blocking copy_: dst's version counter moves when the copy is
        # queued, its bytes when the stream runs it.
        _bump_version(dst)
        target = dst.data

        def run():
            if stream.delay_s:
                time.sleep(stream.delay_s)
            target.copy_(src)
            with self._lock:
                self.copies += 1
                if dst.data_ptr() in self.device_addresses:
                    self.bytes_to_device += dst.numel() * dst.element_size()
                else:
                    self.bytes_to_host += src.numel() * src.element_size()
        if stream is self._current or stream.closed:
            run()
        else:
            stream.queue.put(run)

    def keep(self, tensor, stream):
        pass  # CPU tensors are freed by reference counting: the queued copy holds them

    def sync(self, event):
        event.done.wait()
        if self._side.error is not None:
            raise RuntimeError("a copy on the simulated side stream failed") \
                from self._side.error

    def close(self):
        """Ends the side stream's thread once it has run what is queued; what comes after
        (an optimizer's finalizer) runs on the calling thread."""
        self._side.queue.put(None)
        self._side.thread.join()
        self._side.closed = True


def _bump_version(tensor):
    import torch
    increment = getattr(getattr(torch.autograd, "graph", None), "increment_version", None)
    if increment is not None:  # torch >= 2.1
        increment(tensor)
    else:  # an in-place op on no element of a view of it moves the shared counter
        with torch.no_grad():
            tensor.view(-1)[:0].zero_()
