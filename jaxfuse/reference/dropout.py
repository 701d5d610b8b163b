"""Reference dropout with the counter-based mask every jaxfuse kernel regenerates.

    dropout(x) = where(keep, x / p, 0)   (inverted dropout: E[dropout(x)] = x)

with p = P(keep) = 1 - rate rounded to a multiple of 2^-16 (`jaxfuse._philox.keep_prob`; within
2^-17 of 1 - rate).

`keep` is `jaxfuse._philox.keep` over the `[rows, x.shape[-1]]` view of x: a pure function of
(key, shape, element index), computed here with jax.numpy integer ops, so a kernel and this
reference drop exactly the same elements. `rate=0` or `key=None` is the identity.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxfuse import _checks, _philox


def check_key(key) -> None:
    if key is None:
        return
    if not hasattr(key, "dtype"):
        raise ValueError(f"key={key!r} must be a JAX PRNG key, e.g. jax.random.key(0)")
    typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    # A legacy key (`jax.random.PRNGKey`) is the raw uint32 data of the default generator's
    # key: [2] for threefry, [4] for "rbg".
    raw = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))).shape
    if not typed and not (key.dtype == jnp.uint32 and tuple(key.shape) == tuple(raw)):
        raise ValueError(f"key (dtype={key.dtype}, shape={tuple(key.shape)}) must be a JAX PRNG "
                         f"key, e.g. jax.random.key(0) (or a legacy uint32 key of shape {raw})")
    if typed and key.shape != ():
        raise ValueError(f"key.shape={tuple(key.shape)} must be () (one key); split keys are "
                         "passed one per call, or through jax.vmap")


def validate(x, rate, key) -> None:
    _checks.check_float("x", x)
    _checks.check_ndim("x", x, min_ndim=1)
    _philox.check_rate(rate)
    check_key(key)


def keep_mask(key, shape, rate: float, *, stream=0) -> jax.Array:
    """bool `shape`: the elements that dropout keeps (over the [rows, shape[-1]] view)."""
    n_cols = shape[-1]
    n_rows = math.prod(shape[:-1])
    rows = jax.lax.broadcasted_iota(jnp.int32, (n_rows, 1), 0)
    padded = -(-n_cols // _philox.BLOCK) * _philox.BLOCK     # whole blocks, then cut
    keep = _philox.keep_block(_philox.key_words(key), rows, 0, padded, rate, stream=stream)
    return keep[:, :n_cols].reshape(shape)


def apply(v: jax.Array, rate: float, key) -> jax.Array:
    """Inverted dropout of a float32 array (the identity when inactive): what every reference
    composition of this family calls."""
    if not _philox.active(rate, key):
        return v
    return jnp.where(keep_mask(key, v.shape, rate), v * _philox.scale(rate), 0.0)


def dropout(x: jax.Array, rate: float, key) -> jax.Array:
    validate(x, rate, key)
    return apply(x.astype(jnp.float32), rate, key).astype(x.dtype)
