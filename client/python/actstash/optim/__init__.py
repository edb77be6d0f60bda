"""actstash.optim: optimizers whose states live in actstashd's pool.

OffloadAdamW (_adamw.py) is torch's AdamW with its states in the pool. Its
concerns each have their module: where the states live and when they may
spill (_pool_states.py), the fp32 master weights of bf16/fp16 parameters
(_masters.py), the device path's copies and hooks (_device_path.py), and the
exact and fast steps (_stepping.py).
"""
from actstash.optim._adamw import OffloadAdamW

__all__ = ["OffloadAdamW"]
