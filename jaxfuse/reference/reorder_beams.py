"""Reference beam-search cache reorder (LightSeq's cache refresh, lecture 10 sec. 6).

After each beam-search step, beam j of batch row b continues beam parent[b, j]; its KV cache
must become that beam's. For caches [B, K, S, ...] (K beams, S positions) and int [B] start,
stop:

    out[b, j, s] = cache[b, parent[b, j], s]   where start[b] <= s < stop[b]
    out[b, j, s] = cache[b, j, s]              elsewhere.

Beams that grew from one prompt hold identical keys and values at the prompt's positions, and
positions past what has been decoded are never read, so beam search reorders only the positions
decoded so far: [prompt length, prompt length + step). parent is clipped to [0, K), start and
stop to [0, S].
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxfuse import _checks


def validate(caches, parent, start, stop) -> None:
    if not isinstance(caches, (tuple, list)) or not caches:
        raise ValueError(f"caches must be a non-empty tuple or list of arrays [B, K, S, ...], "
                         f"got {type(caches).__name__}")
    _checks.check_ndim("parent", parent, 2)
    _checks.check_int("parent", parent)
    b, k = parent.shape
    s = caches[0].shape[2] if caches[0].ndim >= 3 else None
    for i, c in enumerate(caches):
        if c.ndim < 3 or tuple(c.shape[:3]) != (b, k, s):
            raise ValueError(f"caches[{i}].shape={tuple(c.shape)} must be [B={b}, K={k}, S, ...] "
                             f"with parent.shape={tuple(parent.shape)} and one S={s} for all "
                             "(reshape a [B * K, S, ...] cache to [B, K, S, ...])")
    for name, v in (("start", start), ("stop", stop)):
        _checks.check_int(name, v)
        if tuple(v.shape) != (b,):
            raise ValueError(f"{name}.shape={tuple(v.shape)} must be ({b},), one position per "
                             "batch row")


def clip(parent, start, stop, k: int, s: int):
    """parent clipped to [0, K), start and stop to [0, S], all int32, whatever their integer
    dtypes (`_checks.clip_int32`: S = 300 taken as a uint8 bound would be 44)."""
    return (_checks.clip_int32(parent, 0, k - 1), _checks.clip_int32(start, 0, s),
            _checks.clip_int32(stop, 0, s))


def reorder_beams(caches, parent: jax.Array, start: jax.Array, stop: jax.Array) -> tuple:
    """The caches with each beam's positions [start, stop) taken from its parent beam."""
    validate(caches, parent, start, stop)
    b, k = parent.shape
    s = caches[0].shape[2]
    parent, start, stop = clip(parent, start, stop, k, s)
    pos = jnp.arange(s)
    inside = (pos >= start[:, None]) & (pos < stop[:, None])                # [B, S]
    out = []
    for c in caches:
        moved = c[jnp.arange(b)[:, None], parent]                           # [B, K, S, ...]
        keep = inside.reshape((b, 1, s) + (1,) * (c.ndim - 3))
        out.append(jnp.where(keep, moved, c))
    return tuple(out)
