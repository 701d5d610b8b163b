"""Reference SwiGLU gate (Shazeer 2020): silu(gate) * up, elementwise, in float32."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxfuse import _checks


def validate(gate, up) -> None:
    _checks.check_float("gate", gate)
    _checks.check_ndim("gate", gate, min_ndim=1)
    if tuple(up.shape) != tuple(gate.shape) or up.dtype != gate.dtype:
        raise ValueError(f"up (shape={tuple(up.shape)}, dtype={up.dtype}) must match gate "
                         f"(shape={tuple(gate.shape)}, dtype={gate.dtype})")


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    validate(gate, up)
    return (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(gate.dtype)
