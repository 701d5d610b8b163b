"""Reference bias + activation + dropout (LightSeq's feed-forward fusion, lecture 10 sec. 3):

    out = dropout(act(x + bias)),   act in {gelu (erf), gelu_tanh, relu, silu} as in `jax.nn`,

with the mask of `jaxfuse.reference.dropout`. Arithmetic in float32; the output has x's dtype.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxfuse import _checks
from jaxfuse.reference import dropout as _dropout

ACTIVATIONS = {
    "gelu": lambda z: jax.nn.gelu(z, approximate=False),
    "gelu_tanh": lambda z: jax.nn.gelu(z, approximate=True),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
}


def validate(x, bias, activation, rate, key) -> None:
    _dropout.validate(x, rate, key)
    _checks.check_vector("bias", bias, x.shape[-1])
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} must be one of {sorted(ACTIVATIONS)}")


def bias_act_dropout(x: jax.Array, bias: jax.Array | None, *, activation: str = "gelu",
                     rate: float = 0.0, key=None) -> jax.Array:
    validate(x, bias, activation, rate, key)
    v = x.astype(jnp.float32)
    if bias is not None:
        v = v + bias.astype(jnp.float32)
    return _dropout.apply(ACTIVATIONS[activation](v), rate, key).astype(x.dtype)
