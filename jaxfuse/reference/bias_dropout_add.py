"""Reference bias + dropout + residual (LightSeq's most common fusion, lecture 10 sec. 2.3):

    out = residual + dropout(x + bias)

with the mask of `jaxfuse.reference.dropout` (same key, same shape: the same elements dropped).
Arithmetic in float32; the output has x's dtype.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxfuse import _checks
from jaxfuse.reference import dropout as _dropout


def validate(x, bias, residual, rate, key) -> None:
    _dropout.validate(x, rate, key)
    _checks.check_vector("bias", bias, x.shape[-1])
    if residual is not None:
        _checks.check_array("residual", residual)
    if residual is None or tuple(residual.shape) != tuple(x.shape) or residual.dtype != x.dtype:
        got = None if residual is None else (tuple(residual.shape), residual.dtype)
        raise ValueError(f"residual (shape, dtype)={got} must match x (shape={tuple(x.shape)}, "
                         f"dtype={x.dtype}); for dropout(x + bias) alone use bias_act_dropout")


def bias_dropout_add(x: jax.Array, bias: jax.Array | None, residual: jax.Array, *,
                     rate: float = 0.0, key=None) -> jax.Array:
    validate(x, bias, residual, rate, key)
    v = x.astype(jnp.float32)
    if bias is not None:
        v = v + bias.astype(jnp.float32)
    return (residual.astype(jnp.float32) + _dropout.apply(v, rate, key)).astype(x.dtype)
