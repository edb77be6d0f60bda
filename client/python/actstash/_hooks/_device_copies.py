"""Copies between a device and host memory for OffloadAdamW's device path.

OffloadAdamW needs five operations from a device, all on streams, none of which
blocks the caller except sync(): record an event on a stream, make a stream wait
for an event, copy on a stream, keep a tensor's memory alive for a stream, and
wait on the CPU for an event. CudaCopies does them with torch.cuda; tests on a
machine without a GPU pass an object with the same methods that runs each stream
on a thread of its own (actstash_testing.sim_device), so that every missing wait
shows up as wrong numbers there.

Streams are the objects current() and side() return; events the ones record()
returns. Any thread may call these; OffloadAdamW calls them from the thread that
runs backward and step().
"""
import torch


class CudaCopies:
    """The CUDA device `device`: copies on one side stream of its own."""

    def __init__(self, device):
        self.device = torch.device(device)
        self._side = torch.cuda.Stream(device=self.device)

    def current(self):
        """The stream the trainer's kernels run on now."""
        return torch.cuda.current_stream(self.device)

    def side(self):
        """The stream the copies run on."""
        return self._side

    def record(self, stream):
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait(self, stream, event):
        """`stream` runs nothing more until `event` has happened; the CPU goes on."""
        stream.wait_event(event)

    def copy(self, dst, src, stream):
        """dst.copy_(src) in stream order on `stream`; host memory must be pinned (the
        pool's is registered with CUDA on a GPU node)."""
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def keep(self, tensor, stream):
        """The caching allocator keeps `tensor`'s memory until `stream` is done with it."""
        if tensor.is_cuda:
            tensor.record_stream(stream)

    def sync(self, event):
        """The CPU waits for `event`."""
        event.synchronize()
