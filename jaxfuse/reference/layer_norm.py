"""Reference LayerNorm over the last axis, and the Welford/Chan merge of partial statistics.

    y = (x - mean) / sqrt(var + eps) * weight + bias,    var = mean((x - mean)^2).

`welford_merge` combines the statistics `(count, mean, m2)` of two disjoint sets, where
m2 = sum((x - mean)^2) (Chan, Golub and LeVeque 1979):

    n = n_a + n_b,  d = mean_b - mean_a,  mean = mean_a + d n_b / n,  m2 = m2_a + m2_b + d^2 n_a n_b / n.

It is exact in exact arithmetic and, unlike var = E[x^2] - E[x]^2, never subtracts two large
nearly equal numbers: the kernel merges per-tile states with it so that a row longer than one
tile still needs one pass over the data and stays accurate when |mean| >> std.

Huge rows. A row whose sum of squares overflows float32 (|x| ~ 1e19 and up) would give
rsqrt(inf) = 0 and an output of zeros. So both norms take their statistics of x / s, with s a
power of two chosen from the row's largest |x| (`row_scale`): s = 1 (nothing changes, bit for
bit) unless max|x| >= 2^41, and then x / s < 2^41, whose squares sum without overflow. Scaling
by a power of two is exact, so mean = s * mean(x / s) and rstd = rsqrt(var(x / s) + eps / s^2)
/ s (`scaled_rstd`, `scaled_stats`). Tile states then carry their s: `(count, mean, m2, s)` in units of s,
merged at the larger s (`scaled_merge`).
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


SCALE_FREE_EXPONENT = 40      # rows with max|x| < 2^41 are never rescaled (s = 1)


def row_scale(amax):
    """(s, 1 / s): powers of two, s = 1 unless amax >= 2^41, else amax / s in [2^40, 2^41).

    Bit arithmetic, not log2/exp2, so that s is exact on every backend. With x / s < 2^41 a row
    of n < 2^46 entries sums its squares below 2^128. A NaN or inf amax gives the largest s (the
    output is NaN, as it would be anyway)."""
    bits = jax.lax.bitcast_convert_type(jnp.asarray(amax, jnp.float32), jnp.int32)
    # 254: the largest finite float32's biased exponent (inf and NaN, 255, take its s)
    e = jnp.clip((bits >> 23) - (127 + SCALE_FREE_EXPONENT), 0, 254 - 127 - SCALE_FREE_EXPONENT)
    as_float = lambda biased: jax.lax.bitcast_convert_type(biased << 23, jnp.float32)
    return as_float(127 + e), as_float(127 - e)


def scaled_rstd(var, s, eps: float):
    """1 / sqrt(var(x) + eps) from var = var(x / s) (s a power of two, `row_scale`)."""
    inv = 1.0 / s                 # exact: s is a power of two
    # eps / s^2 underflows to 0 for s > 2^60 or so: keep it at least float32's smallest normal
    # (when eps is) so a constant row (var = 0) still gets a finite rstd. At s = 1 it is eps.
    eps_s = jnp.maximum(eps * inv * inv, min(eps, float(jnp.finfo(jnp.float32).tiny)))
    return jax.lax.rsqrt(var + eps_s) * inv


def scaled_stats(state, eps: float):
    """(mean, rstd) in x's units from a `(count, mean, m2, s)` state in units of s."""
    n, mean, m2, s = state
    return mean * s, scaled_rstd(m2 / jnp.maximum(n, 1.0), s, eps)


def scaled_merge(a, b):
    """`welford_merge` of two `(count, mean, m2, s)` states, each first brought to the larger s
    (an exact division by a power of two; at equal s a multiplication by 1)."""
    s = jnp.maximum(a[3], b[3])

    def at(state):
        n, mean, m2, s_own = state
        r = s_own / s
        return n, mean * r, m2 * r * r
    return (*welford_merge(at(a), at(b)), s)


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
    s, inv = row_scale(jnp.max(jnp.abs(xf), axis=-1, keepdims=True, initial=0.0))
    xs = xf * inv
    mean_s = jnp.mean(xs, axis=-1, keepdims=True)
    var_s = jnp.mean(jnp.square(xs - mean_s), axis=-1, keepdims=True)
    y = (xf - mean_s * s) * scaled_rstd(var_s, s, eps)
    if weight is not None:
        y = y * weight.astype(jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(x.dtype)
