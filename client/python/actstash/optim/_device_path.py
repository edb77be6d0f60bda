"""OffloadAdamW's device path: parameters on a CUDA device (or a simulated one)
get host copies of themselves and of their gradients in the pool. A gradient is
copied to the host on a side stream as soon as it is final (hooks), the step runs
on the host copies, and the new parameters go back on the side stream.

_DevicePath owns, on the optimizer: _copies (the streams and events, CudaCopies or
a simulation), _host and _host_grads (parameter -> its host copy, its gradient's),
_pending (parameter -> the copy of its gradient in flight) and _hooks.
"""
import weakref

import torch


def _drain(copies, hooks):
    for handle in hooks:
        handle.remove()
    copies.sync(copies.record(copies.side()))


class _DevicePath:
    """A mixin of OffloadAdamW: the device path's copies, hooks and step."""

    def _device_hooks(self, p):
        """p's two hooks on the device path; they hold the optimizer weakly (a parameter
        outlives its optimizer often enough). Before: autograd is about to accumulate a
        new gradient into p.grad, which the side stream may still be copying to the host,
        so the trainer's stream waits for that copy first (the CPU does not). After
        (register_post_accumulate_grad_hook): _grad_to_host."""
        this = weakref.ref(self)

        @torch.utils.hooks.unserializable_hook
        def before(grad):
            optimizer = this()
            pending = optimizer._pending.get(p) if optimizer is not None else None
            if pending is not None:
                optimizer._copies.wait(optimizer._copies.current(), pending[0])

        @torch.utils.hooks.unserializable_hook
        def after(param):
            optimizer = this()
            if optimizer is not None and param in optimizer._host_grads and \
                    not param.grad.is_sparse:  # step() refuses those, with its message
                optimizer._grad_to_host(param)
        return before, after

    def _grad_to_host(self, p):
        """register_post_accumulate_grad_hook: p.grad is final for this backward."""
        grad = p.grad
        self._pending[p] = (self._copy_grad(p), grad, grad._version)

    def _copy_grad(self, p):
        """Starts p.grad's copy to its host copy on the side stream, after what the
        trainer's stream has queued (which produces it); returns the copy's event."""
        c, grad = self._copies, p.grad
        side = c.side()
        c.wait(side, c.record(c.current()))
        c.keep(grad, side)
        c.copy(self._host_grads[p], grad, side)
        return c.record(side)

    def _step_device(self, inv_scale):
        """The device path's step: the gradients' copies to the host finished (or made
        now) and unscaled by `inv_scale` (GradScaler's, or None), the step on the host
        copies, the new parameters copied back."""
        c = self._copies
        current, side = c.current(), c.side()
        hosted = list(self._host)
        for p in hosted:
            pending, grad = self._pending.pop(p, None), p.grad
            if grad is None or (pending is not None and pending[1] is grad
                                and pending[2] == grad._version):
                continue
            # Not copied by the hook (torch < 2.1, a gradient set by hand) or changed
            # since (clip_grad_norm_).
            self._copy_grad(p)
        # A parameter changed on the device since its host copy was written into it (a
        # checkpoint loaded, a manual edit): the host copy, and its master, follow it.
        changed = [p for p in hosted if p._version != self._versions[p]]
        if changed:
            c.wait(side, c.record(current))
            for p in changed:
                c.copy(self._host[p], p.detach(), side)
        # The side stream runs in order: this covers every copy above and the previous
        # step's copies to the device, which read the host copies about to be written.
        c.sync(c.record(side))
        for p in changed:
            self._versions[p] = p._version
        if inv_scale is not None:
            for p in hosted:
                if p.grad is not None:
                    self._host_grads[p].mul_(inv_scale.cpu())
        # Back to the device (a piece at a time when parking), after the trainer's stream
        # is done with the old values (step() queues nothing on it meanwhile); the
        # trainer's stream waits for them before it runs anything more (the next
        # forward), the CPU does not.
        c.wait(side, c.record(current))
        changed = set(changed)
        stepping = [p for p in hosted if p.grad is not None or p in changed]
        try:
            with self._stepping(len(stepping)) as stepped:
                for chunk in self._chunks(stepping):
                    with self._states_located(chunk):
                        for p in changed.intersection(self._masters).intersection(chunk):
                            self._master_follows(p, self._host[p])
                        self._step_on_host(chunk)
                    for p in chunk:
                        if p.grad is not None:
                            c.copy(p.detach(), self._host[p], side)
                            self._versions[p] = p._version
                    stepped.append(len(chunk))
        finally:  # what went back to the device, however far the step got
            c.wait(current, c.record(side))
        rest = [[p for p in group["params"] if p not in self._host] for group in self.param_groups]
        if any(rest):  # fraction < 1: the others' states are on the device, torch steps them
            with self._groups_kept():
                for group, params in zip(self.param_groups, rest):
                    group["params"] = params
                self._torch_step()

    def _step_on_host(self, hosted):
        """The CPU trainer's step (exact or fast) on the host copies of `hosted`, their
        states and gradients' copies standing in for the device parameters'."""
        masters, versions = self._masters, self._versions
        host, some = self._host, set(hosted)
        with self._groups_kept() as kept:
            try:
                self._masters = {host[p]: m for p, m in masters.items() if p in some}
                self._versions = {host[p]: host[p]._version for p in hosted}
                for group, params in zip(self.param_groups, kept):
                    group["params"] = [host[p] for p in params if p in some]
                for p in hosted:
                    self.state[host[p]] = self.state[p]  # the same dict: stepped in place
                    host[p].grad = self._host_grads[p] if p.grad is not None else None
                if self._mode == "exact":
                    self._step_exact()
                else:
                    self._step_fast()
            finally:
                for p in hosted:
                    host[p].grad = None
                    self.state.pop(host[p], None)
                self._masters, self._versions = masters, versions
