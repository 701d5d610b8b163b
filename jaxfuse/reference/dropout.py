"""Reference dropout with the counter-based mask every jaxfuse kernel regenerates.

    dropout(x) = where(keep, x / (1 - rate), 0)   (inverted dropout: E[dropout(x)] = x)

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
    typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    if not typed and not (key.dtype == jnp.uint32 and tuple(key.shape) == (2,)):
        raise ValueError(f"key (dtype={key.dtype}, shape={tuple(key.shape)}) must be a JAX PRNG "
                         "key, e.g. jax.random.key(0)")
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
    rows = jax.lax.broadcasted_iota(jnp.int32, (n_rows, n_cols), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (n_rows, n_cols), 1)
    return _philox.keep(_philox.key_words(key), rows, cols, n_cols, rate,
                        stream=stream).reshape(shape)


def apply(v: jax.Array, rate: float, key) -> jax.Array:
    """Inverted dropout of a float32 array (the identity when inactive): what every reference
    composition of this family calls."""
    if not _philox.active(rate, key):
        return v
    return jnp.where(keep_mask(key, v.shape, rate), v * (1.0 / (1.0 - float(rate))), 0.0)


def dropout(x: jax.Array, rate: float, key) -> jax.Array:
    validate(x, rate, key)
    return apply(x.astype(jnp.float32), rate, key).astype(x.dtype)
