"""Reference softmax with scale, boolean mask and bottom-right causal mask.

    y_j = exp(s_j - m) / sum_k exp(s_k - m),   s = scale * x  (masked entries: s = -inf),

with m the row maximum. A row whose every entry is masked has no softmax; it returns zeros (and
zero gradient) rather than the 0/0 = NaN of the formula. A NaN in a row makes that row NaN.
`scale` must be finite.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxfuse import _checks
from jaxfuse.reference._masks import keep_mask


def causal_keep(shape) -> jax.Array:
    """Boolean [n_q, n_k] mask: key j is kept for query i iff j <= i + (n_k - n_q)."""
    n_q, n_k = shape[-2], shape[-1]
    return keep_mask(jnp.arange(n_q)[:, None], jnp.arange(n_k)[None, :], n_q=n_q, n_k=n_k,
                     causal=True)


def validate(x, mask, causal, scale=1.0) -> None:
    _checks.check_finite("scale", scale)
    _checks.check_float("x", x)
    _checks.check_ndim("x", x, min_ndim=1)
    _checks.check_mask(mask, x.shape)
    if causal and x.ndim < 2:
        raise ValueError(f"causal=True needs x with [..., queries, keys] axes; x.shape={x.shape}")


def softmax(x: jax.Array, *, scale: float = 1.0, mask: jax.Array | None = None,
            causal: bool = False) -> jax.Array:
    """Softmax over the last axis of `scale * x`, keeping entries where `mask` is True."""
    validate(x, mask, causal, scale)
    s = x.astype(jnp.float32) * scale
    keep = jnp.ones(x.shape, bool)
    if mask is not None:
        keep = keep & mask
    if causal:
        keep = keep & causal_keep(x.shape)
    s = jnp.where(keep, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True, initial=-jnp.inf)   # initial: rows may be empty
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    e = jnp.where(keep, jnp.exp(s - m), 0.0)
    l = jnp.sum(e, axis=-1, keepdims=True)
    # Only an empty row (l == 0) is special: a NaN in the row makes l NaN and the row NaN.
    return (e / jnp.where(l == 0, 1.0, l)).astype(x.dtype)
