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

A fused projection's output (a decoding step's q/k/v in one matmul) can be handed over as it
comes: `packed_qkv` names its layout ("heads": the query heads, then the new keys, then the
new values; "grouped": each KV head's G query heads, its new key, its new value),
`partial_sums=True` takes it as P float32 partial sums [P, ...] of a matmul split along its
contraction (added here in float32), `rms_input` x [B, d] scales each row by x's
rsqrt(mean(x^2) + rms_eps) (the projection's input RMSNorm, whose weight the caller folded into
the projection: norm(x) @ W = rsqrt(mean(x^2) + eps) * (x @ (w * W))), and `rope_base`
rotates the query heads and the new key by RoPE at the new token's position p_b (as
`jaxfuse.rope`, the angles in float32). The new token's q, k and v are rounded to the cache's
dtype after the sum, the scale and the rotation.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxfuse import _checks
from jaxfuse.reference import rope as _rope

PACKED_LAYOUTS = (False, True, "heads", "grouped")


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
    _checks.check_array("kv_lengths", kv_lengths)
    if tuple(kv_lengths.shape) != (b,):
        raise ValueError(f"kv_lengths.shape={tuple(kv_lengths.shape)} must be ({b},), one "
                         "length per sequence")
    check_lengths_dtype(kv_lengths)
    s = k_cache.shape[1]
    if num_splits is not None and not (_checks.is_int(num_splits) and 1 <= num_splits <= max(s, 1)):
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


def check_lengths_dtype(kv_lengths) -> None:
    if not jnp.issubdtype(kv_lengths.dtype, jnp.integer):
        raise ValueError(f"kv_lengths.dtype={kv_lengths.dtype} must be an integer type "
                         "(e.g. kv_lengths.astype(jnp.int32))")


def validate_call(q, k_cache, v_cache, kv_lengths, num_splits, logits_soft_cap, scale, k_new,
                  v_new, packed_qkv=False, partial_sums=False, rope_base=None,
                  rope_interleaved=True, rms_input=None, rms_eps=1e-6) -> None:
    """`validate`, for the packed, partial-sum, RMS and RoPE forms too (checked as the arrays
    the kernel will attend with: `new_token`'s, traced for their shapes only)."""
    q, k_new, v_new = jax.eval_shape(
        lambda *a: new_token(*a[:6], packed_qkv, partial_sums, rope_base, rope_interleaved,
                             a[6], rms_eps),
        q, k_cache, v_cache, kv_lengths, k_new, v_new, rms_input)
    validate(q, k_cache, v_cache, kv_lengths, num_splits, logits_soft_cap, scale, k_new, v_new)


def new_token(q, k_cache, v_cache, kv_lengths, k_new, v_new, packed_qkv=False,
              partial_sums=False, rope_base=None, rope_interleaved=True, rms_input=None,
              rms_eps=1e-6, *, positions=None):
    """(q [B, Hq, D], k_new, v_new) from the call's arguments: partial sums added (float32),
    scaled by rms_input's rsqrt(mean(x^2) + eps) per row, a packed q unpacked, RoPE applied at
    position kv_lengths[b] (or `positions`, where the cache is one device's slice), and, where
    any of these happened, rounded to the cache's dtype."""
    if packed_qkv not in PACKED_LAYOUTS:
        raise ValueError(f"packed_qkv={packed_qkv!r} must be one of {PACKED_LAYOUTS} (True means "
                         "\"heads\")")
    if partial_sums:
        if not packed_qkv:
            raise ValueError("partial_sums=True needs packed_qkv (\"heads\" or \"grouped\"): "
                             "the partial sums are a fused q/k/v projection's")
        _checks.check_float("q", q)
        if q.ndim != 4:
            raise ValueError(f"partial_sums=True: q.shape={tuple(q.shape)} must be [P, B, heads, "
                             "D] (P partial sums of the packed q/k/v)")
        q = jnp.sum(q.astype(jnp.float32), axis=0)
    if rms_input is not None:
        if not packed_qkv:
            raise ValueError("rms_input needs packed_qkv: it is the input of the fused q/k/v "
                             "projection whose RMSNorm the kernel applies")
        _checks.check_float("rms_input", rms_input)
        if tuple(rms_input.shape[:1]) != (q.shape[0],) or rms_input.ndim != 2:
            raise ValueError(f"rms_input.shape={tuple(rms_input.shape)} must be [B={q.shape[0]}, "
                             "d] (the projection's input rows)")
        _checks.check_positive("rms_eps", rms_eps, allow_none=False)
        x = rms_input.astype(jnp.float32)
        q = q.astype(jnp.float32) * jax.lax.rsqrt(jnp.mean(x * x, axis=-1) + rms_eps)[:, None, None]
    if packed_qkv:
        q, k_new, v_new = unpack_qkv(q, k_cache, k_new, v_new, packed_qkv)
    if rope_base is not None:
        if k_new is None:
            raise ValueError("rope_base rotates the new token at position kv_lengths[b]: it "
                             "needs the token appended (k_new and v_new, or packed_qkv)")
        _checks.check_positive("rope_base", rope_base, allow_none=False)
        if q.shape[-1] % 2:
            raise ValueError(f"rope_base needs an even head dim, got D={q.shape[-1]}")
        check_lengths_dtype(kv_lengths)
    if not (partial_sums or rope_base is not None or rms_input is not None):
        return q, k_new, v_new
    if rope_base is not None:
        pos = (clip_lengths(kv_lengths, k_cache.shape[1]) if positions is None
               else positions)[:, None]                                     # [B, T=1]
        turn = lambda x: _rope.rope(x.astype(jnp.float32)[:, None], pos, base=rope_base,
                                    interleaved=rope_interleaved)[:, 0]
        q, k_new = turn(q), turn(k_new)
    return tuple(a.astype(k_cache.dtype) for a in (q, k_new, v_new))


def unpack_qkv(qkv, k_cache, k_new, v_new, layout=True):
    """(q, k_new, v_new) from a packed qkv: [B, Hq + 2 Hkv, D] in the "heads" layout (True:
    query heads, then the new key's, then the new value's), [B, Hkv (G + 2), D] "grouped" (KV
    head h's G query heads, its new key, its new value: a fused projection whose columns are
    grouped by KV head)."""
    if k_new is not None or v_new is not None:
        raise ValueError(f"packed_qkv={layout!r} takes k_new and v_new from q's heads: "
                         "pass k_new=None and v_new=None")
    _checks.check_ndim("q", qkv, 3)
    _checks.check_ndim("k_cache", k_cache, 4)
    b, heads, d = qkv.shape
    hkv = k_cache.shape[2]
    if layout == "grouped":
        if hkv == 0 or heads % hkv or heads // hkv < 3:
            raise ValueError(f"packed_qkv=\"grouped\": q.shape={tuple(qkv.shape)} must be [B, "
                             f"Hkv (G + 2), D] with Hkv={hkv} (k_cache.shape[2]) and G >= 1")
        g = heads // hkv - 2
        grouped = qkv.reshape(b, hkv, g + 2, d)
        return grouped[:, :, :g].reshape(b, hkv * g, d), grouped[:, :, g], grouped[:, :, g + 1]
    hq = heads - 2 * hkv
    if hkv == 0 or hq < hkv or hq % hkv:
        raise ValueError(f"packed_qkv=True: q.shape={tuple(qkv.shape)} must be [B, Hq + 2 Hkv, D] "
                         f"with Hkv={hkv} (k_cache.shape[2]) and Hq a positive multiple of Hkv")
    return qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]


def clip_lengths(kv_lengths: jax.Array, s_len: int) -> jax.Array:
    """kv_lengths of any integer dtype clipped to [0, S], as int32 (`_checks.clip_int32`: a
    cast first would wrap uint32 lengths >= 2^31 to negative ones, zeros instead of S)."""
    return _checks.clip_int32(kv_lengths, 0, s_len)


def decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                     kv_lengths: jax.Array, *, scale: float | None = None,
                     num_splits: int | None = None, logits_soft_cap: float | None = None,
                     return_lse: bool = False, k_new: jax.Array | None = None,
                     v_new: jax.Array | None = None, packed_qkv: bool | str = False,
                     partial_sums: bool = False, rope_base: float | None = None,
                     rope_interleaved: bool = True, rms_input: jax.Array | None = None,
                     rms_eps: float = 1e-6):
    """q [B, Hq, D] over caches [B, S, Hkv, D] up to kv_lengths [B]; returns o [B, Hq, D]
    (and float32 lse [B, Hq]), then with k_new/v_new the updated caches (module docstring).
    `packed_qkv`, `partial_sums`, `rms_input`, `rope_base`: the new token's q, k and v as a
    fused projection gives them (module docstring). `num_splits` only matters to the kernel; it
    is accepted here so that both implementations share one signature."""
    validate_call(q, k_cache, v_cache, kv_lengths, num_splits, logits_soft_cap, scale, k_new,
                  v_new, packed_qkv, partial_sums, rope_base, rope_interleaved, rms_input,
                  rms_eps)
    q, k_new, v_new = new_token(q, k_cache, v_cache, kv_lengths, k_new, v_new, packed_qkv,
                                partial_sums, rope_base, rope_interleaved, rms_input, rms_eps)
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
