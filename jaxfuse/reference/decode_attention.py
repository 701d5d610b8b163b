"""Reference decoding attention: one new query per sequence over a ragged KV cache.

For batch b and query head h (KV head h // (Hq / Hkv)), over the positions j < kv_lengths[b]:

    s_j = scale * q . k_j   (then c * tanh(s_j / c) with logits_soft_cap=c),
    o = sum_j softmax(s)_j v_j,   lse = log sum_j exp(s_j).

Whatever the cache holds at positions >= kv_lengths[b] (stale values, NaN, inf) does not
change the result. A sequence of length 0 gives o = 0 and lse = -inf.

Append (a decoding step): with k_new and v_new [B, Hkv, D], the new token's key and value are
first written at position p_b = kv_lengths[b] (clipped to [0, S]; p_b = S, a full cache, writes
nothing), then the query attends over min(p_b + 1, S) positions; the updated caches are
returned with o.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxfuse import _checks


def validate(q, k_cache, v_cache, kv_lengths, num_splits=None, logits_soft_cap=None,
             scale=None, k_new=None, v_new=None) -> None:
    _checks.check_float("q", q)
    _checks.check_ndim("q", q, 3)
    for name, a in (("k_cache", k_cache), ("v_cache", v_cache)):
        _checks.check_float(name, a)
        _checks.check_ndim(name, a, 4)
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"q.dtype={q.dtype}, k_cache.dtype={k_cache.dtype} and "
                         f"v_cache.dtype={v_cache.dtype} must match")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache.shape={k_cache.shape} and v_cache.shape={v_cache.shape} "
                         "must match")
    b, hq, d = q.shape
    if k_cache.shape[0] != b or k_cache.shape[3] != d:
        raise ValueError(f"k_cache.shape={k_cache.shape} must be [B={b}, S, Hkv, D={d}] for "
                         f"q.shape={q.shape}")
    hkv = k_cache.shape[2]
    if hkv == 0 or d == 0:
        raise ValueError(f"k_cache.shape={k_cache.shape}, q.shape={q.shape}: the KV heads "
                         "(k_cache.shape[2]) and the head dim (last axis) must not be empty")
    if hq % hkv:
        raise ValueError(f"the number of query heads {hq} (q.shape[1]) must be a multiple of "
                         f"the number of KV heads {hkv} (k_cache.shape[2])")
    if tuple(kv_lengths.shape) != (b,):
        raise ValueError(f"kv_lengths.shape={tuple(kv_lengths.shape)} must be ({b},), one "
                         "length per sequence")
    if not jnp.issubdtype(kv_lengths.dtype, jnp.integer):
        raise ValueError(f"kv_lengths.dtype={kv_lengths.dtype} must be an integer type "
                         "(e.g. kv_lengths.astype(jnp.int32))")
    s = k_cache.shape[1]
    if num_splits is not None and not (isinstance(num_splits, int) and 1 <= num_splits <= max(s, 1)):
        raise ValueError(f"num_splits={num_splits!r} must be an int in [1, S={s}] or None")
    _checks.check_positive("logits_soft_cap", logits_soft_cap)
    _checks.check_positive("scale", scale)
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new go together: pass both (append the new token's key "
                         "and value) or neither")
    if k_new is not None:
        want = (b, hkv, d)
        for name, a in (("k_new", k_new), ("v_new", v_new)):
            if tuple(a.shape) != want or a.dtype != k_cache.dtype:
                raise ValueError(f"{name} {tuple(a.shape)} {a.dtype} must be [B, Hkv, D]="
                                 f"{want} in the cache's dtype {k_cache.dtype} (one new key "
                                 "and value per sequence and KV head)")


def validate_call(q, k_cache, v_cache, kv_lengths, num_splits, logits_soft_cap, scale, k_new,
                  v_new, packed_qkv: bool) -> None:
    """`validate`, for a packed q too (its heads checked as the three arrays they hold)."""
    if packed_qkv:
        q, k_new, v_new = unpack_qkv(q, k_cache, k_new, v_new)
    validate(q, k_cache, v_cache, kv_lengths, num_splits, logits_soft_cap, scale, k_new, v_new)


def unpack_qkv(qkv, k_cache, k_new, v_new):
    """`packed_qkv=True`: (q, k_new, v_new) sliced from qkv [B, Hq + 2 Hkv, D] (query heads,
    then the new key's, then the new value's: a fused q/k/v projection's output)."""
    if k_new is not None or v_new is not None:
        raise ValueError("packed_qkv=True takes k_new and v_new from q's last 2 * Hkv heads: "
                         "pass k_new=None and v_new=None")
    _checks.check_ndim("q", qkv, 3)
    _checks.check_ndim("k_cache", k_cache, 4)
    hkv = k_cache.shape[2]
    hq = qkv.shape[1] - 2 * hkv
    if hkv == 0 or hq < hkv or hq % hkv:
        raise ValueError(f"packed_qkv=True: q.shape={tuple(qkv.shape)} must be [B, Hq + 2 Hkv, D] "
                         f"with Hkv={hkv} (k_cache.shape[2]) and Hq a positive multiple of Hkv")
    return qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]


def clip_lengths(kv_lengths: jax.Array, s_len: int) -> jax.Array:
    """kv_lengths of any integer dtype clipped to [0, S] in their own dtype, then int32: a
    cast first would wrap uint32 lengths >= 2^31 to negative ones (zeros instead of S)."""
    info = jnp.iinfo(kv_lengths.dtype)
    return jnp.clip(kv_lengths, 0, min(s_len, info.max)).astype(jnp.int32)


def decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                     kv_lengths: jax.Array, *, scale: float | None = None,
                     num_splits: int | None = None, logits_soft_cap: float | None = None,
                     return_lse: bool = False, k_new: jax.Array | None = None,
                     v_new: jax.Array | None = None, packed_qkv: bool = False):
    """q [B, Hq, D] over caches [B, S, Hkv, D] up to kv_lengths [B]; returns o [B, Hq, D]
    (and float32 lse [B, Hq]), then with k_new/v_new the updated caches (module docstring).
    `packed_qkv`: q is [B, Hq + 2 Hkv, D] and holds k_new and v_new as its last heads.
    `num_splits` only matters to the kernel; it is accepted here so that both implementations
    share one signature."""
    if packed_qkv:
        q, k_new, v_new = unpack_qkv(q, k_cache, k_new, v_new)
    validate(q, k_cache, v_cache, kv_lengths, num_splits, logits_soft_cap, scale, k_new, v_new)
    if k_new is not None:
        s_len = k_cache.shape[1]
        pos = clip_lengths(kv_lengths, s_len)        # S, a full cache: dropped
        put = lambda c, new: c.at[jnp.arange(c.shape[0]), pos].set(new, mode="drop")
        k_cache, v_cache = put(k_cache, k_new), put(v_cache, v_new)
        out = decode_attention(q, k_cache, v_cache, jnp.minimum(pos + 1, s_len), scale=scale,
                               logits_soft_cap=logits_soft_cap, return_lse=return_lse)
        return (*(out if return_lse else (out,)), k_cache, v_cache)
    b, hq, d = q.shape
    s_len, hkv = k_cache.shape[1], k_cache.shape[2]
    g = hq // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    keep = jnp.arange(s_len)[None, :] < clip_lengths(kv_lengths, s_len)[:, None]   # [B, S]
    # Zero the cache beyond each length so NaN/inf there cannot leak through 0 * NaN.
    kf = jnp.where(keep[:, :, None, None], k_cache.astype(jnp.float32), 0.0)
    vf = jnp.where(keep[:, :, None, None], v_cache.astype(jnp.float32), 0.0)
    s = jnp.einsum("bhgd,bshd->bhgs", q.astype(jnp.float32).reshape(b, hkv, g, d), kf) * scale
    if logits_soft_cap is not None:
        s = logits_soft_cap * jnp.tanh(s / logits_soft_cap)
    keep = keep[:, None, None, :]
    s = jnp.where(keep, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True, initial=-jnp.inf)   # initial: S may be 0
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    p = jnp.where(keep, jnp.exp(s - m), 0.0)
    l = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("bhgs,bshd->bhgd", p / jnp.where(l == 0, 1.0, l), vf)
    o = o.reshape(b, hq, d).astype(q.dtype)
    if not return_lse:
        return o
    lse = jnp.where(l == 0, -jnp.inf, m + jnp.log(jnp.where(l == 0, 1.0, l)))
    return o, lse.reshape(b, hq)
