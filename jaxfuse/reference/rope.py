"""Reference rotary position embedding (RoFormer, Su et al. 2021), x [..., T, H, D] with integer
positions [..., T]. Pair i (of D/2) turns by the angle theta_i = position * base^(-2i/D):

    x'_a = x_a cos(theta_i) - x_b sin(theta_i),   x'_b = x_b cos(theta_i) + x_a sin(theta_i)

where (a, b) = (2i, 2i + 1) with `interleaved=True` (RoFormer, and `jaxfuse.model`) or
(i, i + D/2) with `interleaved=False` (GPT-NeoX's halves, Llama checkpoints in that layout).
Rotations are orthogonal: the gradient is the inverse rotation of the cotangent.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxfuse import _checks
from jaxfuse._philox import join_last


def validate(x, positions, base) -> None:
    _checks.check_float("x", x)
    _checks.check_ndim("x", x, min_ndim=3)
    _checks.check_int("positions", positions)
    if tuple(positions.shape) != tuple(x.shape[:-2]):
        raise ValueError(f"positions.shape={tuple(positions.shape)} must be x.shape[:-2]="
                         f"{tuple(x.shape[:-2])} (x is [..., T, H, D], positions [..., T])")
    if x.shape[-1] % 2:
        raise ValueError(f"the head dim x.shape[-1]={x.shape[-1]} must be even")
    _checks.check_positive("base", base, allow_none=False)


def pair_freqs(d: int, base: float) -> jax.Array:
    """float32 [D/2]: base^(-2i/D) of pair i, whichever columns the pair holds (the kernels and
    this reference use the same numbers; each angle is then position * freq)."""
    return jnp.float32(base) ** (-(2 * jnp.arange(d // 2)).astype(jnp.float32) / d)


def column_freqs(d: int, base: float, interleaved: bool) -> jax.Array:
    """float32 [D]: `pair_freqs` of the pair that column c belongs to."""
    c = jnp.arange(d)
    return pair_freqs(d, base)[c // 2 if interleaved else c % (d // 2)]


def rope(x: jax.Array, positions: jax.Array, *, base: float = 10000.0,
         interleaved: bool = True) -> jax.Array:
    validate(x, positions, base)
    d = x.shape[-1]
    freq = pair_freqs(d, base)                                                # [D/2]
    angle = positions.astype(jnp.float32)[..., None, None] * freq             # [..., T, 1, D/2]
    return rotate(x.astype(jnp.float32), jnp.cos(angle), jnp.sin(angle),
                  interleaved).astype(x.dtype)


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array, interleaved: bool) -> jax.Array:
    """float32 x [..., D] with each pair turned by the angle whose cos and sin ([..., D/2],
    broadcast against x's leading axes) are given. Written with reshapes, a split and a join
    of a trailing axis of 2 (no strided slices), so that kernels use it too: Pallas's Triton
    lowering has those (`decode_attention` rotates its new token's q and k with it)."""
    *lead, d = x.shape
    lead = tuple(lead)
    if interleaved:
        pairs = x.reshape(lead + (d // 2, 2))                                 # [..., D/2, 2]
    else:
        pairs = jnp.swapaxes(x.reshape(lead + (2, d // 2)), -1, -2)          # [..., D/2, 2]
    xa, xb = (h.reshape(lead + (d // 2,)) for h in jnp.split(pairs, 2, axis=-1))
    y = join_last(xa * cos - xb * sin, xb * cos + xa * sin)                   # [..., D/2, 2]
    return (y if interleaved else jnp.swapaxes(y, -1, -2)).reshape(lead + (d,))
