"""The fp32 master weights of OffloadAdamW's bf16/fp16 parameters: the step runs on
the master with the gradient cast to fp32, then rounds the master into the
parameter (the mixed-precision recipe of Megatron and DeepSpeed).

_MasterWeights owns, on the optimizer: _masters (parameter -> its master, a
pooled view or a tensor of the process), _versions (parameter -> its version
when its master was last written into it) and _scratch (the fp32 gradient).
"""
import torch

# A bf16/fp16 parameter's fp32 copy, which the step updates (its state key).
_MASTER = "master_weight"
_LOW_PRECISION = (torch.bfloat16, torch.float16)


class _MasterWeights:
    """A mixin of OffloadAdamW: what keeps masters and parameters in step."""

    def _master_follows(self, p, source):
        """p (a bf16/fp16 parameter, located when parking) changed since its master was
        written into it, to `source`'s values (p itself, or its host copy): unless that
        still holds the master rounded (the same checkpoint loaded again), the master
        follows it."""
        master = self._masters[p]
        if not torch.equal(source, master.to(p.dtype)):
            master.copy_(source)

    def _fp32_grad(self, p):
        """A bf16/fp16 parameter's gradient cast to fp32, in a scratch buffer the size of
        the largest master (kept: a fresh buffer each step would fault its pages in
        again); valid until the next call. step() refused sparse gradients."""
        if self._scratch is None or self._scratch.numel() < p.numel():
            self._scratch = torch.empty(max(m.numel() for m in self._masters.values()),
                                        dtype=torch.float32)
        out = self._scratch[:p.numel()].view(p.shape)
        out.copy_(p.grad)
        return out
