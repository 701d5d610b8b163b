"""Reference SwiGLU followed by the down projection: swiglu(gate, up) @ weight."""
from __future__ import annotations

import jax

from jaxfuse.reference import swiglu as _swiglu


def validate(gate, up, weight) -> None:
    _swiglu.validate(gate, up)
    if weight.ndim != 2 or weight.shape[0] != gate.shape[-1]:
        raise ValueError(f"weight (shape={tuple(weight.shape)}) must be [F, D] with F = "
                         f"gate.shape[-1] = {gate.shape[-1]}: the down projection of the "
                         f"SwiGLU output")
    if weight.dtype != gate.dtype:
        raise ValueError(f"weight.dtype={weight.dtype} must match gate.dtype={gate.dtype}; "
                         f"cast the weight (e.g. weight.astype(gate.dtype))")


def swiglu_linear(gate: jax.Array, up: jax.Array, weight: jax.Array) -> jax.Array:
    validate(gate, up, weight)
    return _swiglu.swiglu(gate, up) @ weight
