"""Reference LayerNorm over the last axis, and the Welford/Chan merge of partial statistics.

    y = (x - mean) / sqrt(var + eps) * weight + bias,    var = mean((x - mean)^2).

`welford_merge` combines the statistics `(count, mean, m2)` of two disjoint sets, where
m2 = sum((x - mean)^2) (Chan, Golub and LeVeque 1979):

    n = n_a + n_b,  d = mean_b - mean_a,  mean = mean_a + d n_b / n,  m2 = m2_a + m2_b + d^2 n_a n_b / n.

It is exact in exact arithmetic and, unlike var = E[x^2] - E[x]^2, never subtracts two large
nearly equal numbers: the kernel merges per-tile states with it so that a row longer than one
tile still needs one pass over the data and stays accurate when |mean| >> std.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxfuse import _checks


def welford_merge(a, b):
    """Merges two `(count, mean, m2)` states; an empty side (count 0) leaves the other unchanged."""
    n_a, mean_a, m2_a = a
    n_b, mean_b, m2_b = b
    n = n_a + n_b
    frac_b = jnp.where(n > 0, n_b / jnp.where(n > 0, n, 1), 0)
    delta = mean_b - mean_a
    mean = mean_a + delta * frac_b
    m2 = m2_a + m2_b + delta * delta * n_a * frac_b
    return n, mean, m2


def validate(x, weight, bias, eps=1e-5) -> None:
    _checks.check_finite("eps", eps, minimum=0.0)
    _checks.check_float("x", x)
    _checks.check_ndim("x", x, min_ndim=1)
    _checks.check_vector("weight", weight, x.shape[-1])
    _checks.check_vector("bias", bias, x.shape[-1])


def layer_norm(x: jax.Array, weight: jax.Array | None = None, bias: jax.Array | None = None, *,
               eps: float = 1e-5) -> jax.Array:
    """LayerNorm over the last axis, computed in float32, returned in x.dtype."""
    validate(x, weight, bias, eps)
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + eps)
    if weight is not None:
        y = y * weight.astype(jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(x.dtype)
