"""Reference RMSNorm over the last axis: y = x / sqrt(mean(x^2) + eps) * weight.

One reduction instead of LayerNorm's mean and variance (Zhang and Sennrich 2019). A row whose
squares would overflow float32 is first divided by a power of two (`layer_norm.row_scale`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxfuse import _checks
from jaxfuse.reference.layer_norm import row_scale, scaled_rstd


def validate(x, weight, eps=1e-6) -> None:
    _checks.check_finite("eps", eps, minimum=0.0)
    _checks.check_float("x", x)
    _checks.check_ndim("x", x, min_ndim=1)
    _checks.check_vector("weight", weight, x.shape[-1])


def rms_norm(x: jax.Array, weight: jax.Array | None = None, *, eps: float = 1e-6) -> jax.Array:
    """RMSNorm over the last axis, computed in float32, returned in x.dtype."""
    validate(x, weight, eps)
    xf = x.astype(jnp.float32)
    s, inv = row_scale(jnp.max(jnp.abs(xf), axis=-1, keepdims=True, initial=0.0))
    y = xf * scaled_rstd(jnp.mean(jnp.square(xf * inv), axis=-1, keepdims=True), s, eps)
    if weight is not None:
        y = y * weight.astype(jnp.float32)
    return y.astype(x.dtype)
