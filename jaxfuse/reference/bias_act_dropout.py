"""Reference bias + activation + dropout (LightSeq's feed-forward fusion, lecture 10 sec. 3):

    out = dropout(act(x + bias)),   act in {gelu (erf), gelu_tanh, relu, silu} as in `jax.nn`,

with the mask of `jaxfuse.reference.dropout`. Arithmetic in float32; the output has x's dtype.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxfuse import _checks
from jaxfuse.reference import dropout as _dropout


# |z| past which gelu_tanh's gate (0.5 (1 + tanh)) is 0 or 1 in float32; both paths clamp z
# there for the slope (the kernels' `_dropout.act_grad` too).
GELU_TANH_FLAT = 20.0


def _gelu_tanh(z):
    """jax.nn.gelu(z, approximate=True), whose values it gives, with z clamped to
    +-GELU_TANH_FLAT inside tanh, where tanh is +-1 in float32 already: autodiff of the
    unclamped form made 0 * inf = NaN gradients at |z| ~ 1e19 (sech^2 0 times the cube's inf)."""
    zc = jnp.clip(z, -GELU_TANH_FLAT, GELU_TANH_FLAT)
    sqrt_2_over_pi = np.sqrt(2 / np.pi).astype(z.dtype)        # jax.nn's arithmetic, in order
    return z * (0.5 * (1.0 + jnp.tanh(sqrt_2_over_pi * (zc + 0.044715 * (zc ** 3)))))


ACTIVATIONS = {
    "gelu": lambda z: jax.nn.gelu(z, approximate=False),
    "gelu_tanh": _gelu_tanh,
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
