"""Reference scaled dot-product attention, written the standard way (S and P in full), and the
associative merge of partial attention results.

For each batch b, query head h (KV head h // (Hq / Hkv)), query i and key j:

    s_ij = scale * q_i . k_j           (then c * tanh(s_ij / c) with logits_soft_cap=c)
    s_ij = -inf where j is not visible  (causal, sliding window, segment ids, see `_masks`)
    o_i  = sum_j softmax(s_i)_j v_j,    lse_i = log sum_j exp(s_ij).

A query that sees no key gets o = 0 and lse = -inf (and zero gradients), not 0/0.

`merge_states` combines two results computed over disjoint key sets (lecture 5, sec. 4.4-4.5):

    lse = log(exp(lse_a) + exp(lse_b)),   o = (exp(lse_a - lse) o_a + exp(lse_b - lse) o_b).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxfuse import _checks, _philox
from jaxfuse.reference import dropout as _dropout
from jaxfuse.reference._masks import keep_mask


def validate(q, k, v, q_segment_ids=None, kv_segment_ids=None, sliding_window=None,
             logits_soft_cap=None, scale=None, dropout_rate=0.0, dropout_key=None) -> None:
    """Checks shared by every attention implementation (raises ValueError naming the value)."""
    for name, a in (("q", q), ("k", k), ("v", v)):
        _checks.check_float(name, a)
        _checks.check_ndim(name, a, 4)
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q.dtype={q.dtype}, k.dtype={k.dtype}, v.dtype={v.dtype} must match")
    b, _, hq, d = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k.shape={k.shape} and v.shape={v.shape} must match")
    if k.shape[0] != b:
        raise ValueError(f"batch sizes differ: q.shape={q.shape}, k.shape={k.shape}")
    if k.shape[3] != d:
        raise ValueError(f"head dims differ: q.shape[-1]={d}, k.shape[-1]={k.shape[3]}")
    hkv = k.shape[2]
    if hkv == 0 or d == 0:
        raise ValueError(f"k.shape={k.shape}, q.shape={q.shape}: the KV heads (k.shape[2]) and "
                         "the head dim (last axis) must not be empty")
    if hq % hkv:
        raise ValueError(f"the number of query heads {hq} (q.shape[2]) must be a multiple of "
                         f"the number of KV heads {hkv} (k.shape[2])")
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("pass both q_segment_ids and kv_segment_ids, or neither")
    if q_segment_ids is not None:
        for name, seg, t in (("q_segment_ids", q_segment_ids, q.shape[1]),
                             ("kv_segment_ids", kv_segment_ids, k.shape[1])):
            _checks.check_array(name, seg)
            if tuple(seg.shape) != (b, t):
                raise ValueError(f"{name}.shape={tuple(seg.shape)} must be ({b}, {t}) = "
                                 "[batch, sequence length]")
            _checks.check_int(name, seg)
    if sliding_window is not None and (not _checks.is_int(sliding_window) or sliding_window < 1):
        raise ValueError(f"sliding_window={sliding_window!r} must be a positive int or None")
    _checks.check_positive("logits_soft_cap", logits_soft_cap)
    _checks.check_positive("scale", scale)
    try:
        _philox.check_rate(dropout_rate)
    except ValueError as e:
        raise ValueError(f"dropout_{e}") from None
    _dropout.check_key(dropout_key)


def effective_window(sliding_window, k):
    """The window as the masks take it: None where it hides no key. A window of w drops keys
    j < i + (Tk - Tq) - w + 1, none of which exist once w >= Tk; and a window near int32's
    largest value would overflow the masks' int32 bounds (a window of 2^31 - 1 hid every
    key). Anything that is not such a window is returned for `validate` to judge."""
    if (_checks.is_int(sliding_window) and getattr(k, "ndim", 0) == 4
            and sliding_window >= k.shape[1]):
        return None
    return sliding_window


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = False,
              scale: float | None = None, q_segment_ids: jax.Array | None = None,
              kv_segment_ids: jax.Array | None = None, sliding_window: int | None = None,
              logits_soft_cap: float | None = None, return_lse: bool = False,
              dropout_rate: float = 0.0, dropout_key=None):
    """Attention of q [B, Tq, Hq, D] over k, v [B, Tk, Hkv, D]; returns o (and lse [B, Hq, Tq]).

    `dropout_rate` with `dropout_key`: the normalized probabilities P [B, Hq, Tq, Tk] go through
    `jaxfuse.reference.dropout` (the same mask as `jaxfuse.dropout` of a tensor of that shape)
    before P V; lse is that of the undropped scores."""
    validate(q, k, v, q_segment_ids, kv_segment_ids, sliding_window, logits_soft_cap, scale,
             dropout_rate, dropout_key)
    b, tq, hq, d = q.shape
    tk, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else scale      # may be traced here
    qf = q.astype(jnp.float32).reshape(b, tq, hkv, g, d)
    keep = keep_mask(jnp.arange(tq)[:, None], jnp.arange(tk)[None, :], n_q=tq, n_k=tk,
                     causal=causal, window=sliding_window)[None, None, None]
    if q_segment_ids is not None:
        keep = keep & (q_segment_ids[:, None, None, :, None]
                       == kv_segment_ids[:, None, None, None, :])
    # Masked keys may hold anything (padding, keys outside a window): P = 0 for them, but
    # 0 * NaN = NaN in the products, so K and V enter with non-finite entries zeroed and the
    # NaN goes back only to the queries that see such a key (their rows are NaN, as the maths
    # says); nothing of a masked key reaches an output or a gradient.
    kf, bad_k = _finite_rows(k.astype(jnp.float32))
    vf, bad_v = _finite_rows(v.astype(jnp.float32))
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qf, kf) * scale
    if logits_soft_cap is not None:
        s = logits_soft_cap * jnp.tanh(s / logits_soft_cap)
    sees = lambda bad: jnp.any(keep & bad.transpose(0, 2, 1)[:, :, None, None, :], axis=-1,
                               keepdims=True)                                # [B, Hkv, 1, Tq, 1]
    # The NaN added, not selected: a select would cut the gradient of such a row's scores, and
    # its dq and its keys' dk would read 0 where the kernels (and the maths) give NaN.
    s = s + jnp.where(sees(bad_k), jnp.nan, 0.0)
    s = jnp.where(keep, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True, initial=-jnp.inf)   # initial: Tk may be 0
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    p = jnp.where(keep, jnp.exp(s - m), 0.0)
    l = jnp.sum(p, axis=-1, keepdims=True)
    # where(keep, ...) again after the division: a NaN row (it saw garbage) must not send its
    # NaN through p / l into the gradients of keys it does not see.
    pn = jnp.where(keep, p / jnp.where(l == 0, 1.0, l), 0.0)
    if _philox.active(dropout_rate, dropout_key):
        pn = _dropout.apply(pn.reshape(b, hq, tq, tk), dropout_rate, dropout_key).reshape(pn.shape)
    o = jnp.einsum("bhgqk,bkhd->bhgqd", pn, vf)
    # (Selected, so the gradients of a row that sees a non-finite value differ from the
    # kernels': there dq and dk take NaN through dP = dO V^T, here 0; its output is NaN in both.)
    o = jnp.where(sees(bad_v), jnp.nan, o).transpose(0, 3, 1, 2, 4)
    o = o.reshape(b, tq, hq, d).astype(q.dtype)
    if not return_lse:
        return o
    lse = jnp.where(l == 0, -jnp.inf, m + jnp.log(jnp.where(l == 0, 1.0, l)))[..., 0]
    return o, lse.reshape(b, hq, tq)


def _finite_rows(x):
    """(x [B, T, H, D] with non-finite entries zeroed, [B, T, H]: rows that held one)."""
    return _zeroed(x), ~jnp.all(jnp.isfinite(x), axis=-1)


@jax.custom_jvp
def _zeroed(x):
    """x with its non-finite entries zeroed, whose gradient passes as it comes (a select's would
    be 0 there): a key that some query sees gets the NaN gradient that query's row sends it,
    as in the kernels; a key no query sees gets 0, as there."""
    return jnp.where(jnp.isfinite(x), x, 0.0)


_zeroed.defjvp(lambda primals, tangents: (_zeroed(*primals), tangents[0]))


def merge_states(o_a: jax.Array, lse_a: jax.Array, o_b: jax.Array, lse_b: jax.Array):
    """Merges two partial attention results over disjoint key sets into one.

    Layouts: `flash_attention`'s (o [B, T, H, D], lse [B, H, T]) or `decode_attention`'s
    (o [B, H, D], lse [B, H]). A side with lse = -inf (no keys) leaves the other unchanged.
    Returns (o in o_a's dtype, float32 lse).
    """
    if o_a.shape != o_b.shape or lse_a.shape != lse_b.shape:
        raise ValueError(f"shapes differ: o {o_a.shape} vs {o_b.shape}, lse {lse_a.shape} vs "
                         f"{lse_b.shape}")
    flash = o_a.ndim == 4 and lse_a.ndim == 3      # lse [B, H, T] for o [B, T, H, D]
    if not flash and o_a.ndim != lse_a.ndim + 1:
        raise ValueError(f"o.shape={o_a.shape} with lse.shape={lse_a.shape} is neither "
                         "([B, T, H, D], [B, H, T]) nor ([B, H, D], [B, H])")
    to_o = (lambda lse: jnp.swapaxes(lse, 1, 2)) if flash else (lambda lse: lse)
    o, lse = merge_many(jnp.stack([o_a, o_b]), jnp.stack([to_o(lse_a), to_o(lse_b)]), axis=0)
    return o.astype(o_a.dtype), to_o(lse)


def merge_many(o_parts: jax.Array, lse_parts: jax.Array, axis: int):
    """`merge_states` folded over `axis` (partial results over disjoint key sets, e.g. the splits
    of Flash-Decoding), in closed form: lse = logsumexp(lse_i), o = sum_i exp(lse_i - lse) o_i.
    `o_parts` has a trailing feature axis that `lse_parts` lacks. Returns (float32 o, lse)."""
    lse_parts = lse_parts.astype(jnp.float32)
    m = jnp.max(lse_parts, axis=axis, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(lse_parts - m)
    total = jnp.sum(w, axis=axis, keepdims=True)
    lse = jnp.where(total == 0, -jnp.inf, m + jnp.log(jnp.where(total == 0, 1.0, total)))
    w = w * jnp.where(total == 0, 0.0, 1.0 / jnp.where(total == 0, 1.0, total))
    o = jnp.sum(w[..., None] * o_parts.astype(jnp.float32), axis=axis)
    return o, jnp.squeeze(lse, axis)
