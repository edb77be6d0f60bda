"""The plan: wrap() (a mode per block, or policy="auto": a plan per block chosen
by _planner's model from costs _measure measured, and checked by _auto as it
runs), unwrap(), and use_for_gradient_checkpointing(). _planner imports nothing
of torch nor of the other parts: the model and the solver alone."""
from actstash._plan._wrap import unwrap, use_for_gradient_checkpointing, wrap

__all__ = ["unwrap", "use_for_gradient_checkpointing", "wrap"]
