"""Partitioning rules of `flash_attention` and `decode_attention`.

flash_attention: batch and KV heads split freely (a query head goes with its KV head, so GQA
groups stay whole: q's head axis is the compound (n, g) and only n splits). With dropout only
they split, and each shard's kernel draws the one-device mask at its (batch, head) rows. Self-attention
(Tq = Tk) with the sequence split runs ring attention (`ring.py`: K/V chunks pass around the
devices, causal work balanced by a zigzag layout; not with a sliding window). Cross-attention
(Tq != Tk) without a causal mask or window splits the queries only (each device attends its
queries over all keys; the backward psums dK and dV, which are sums over queries).

decode_attention: batch and KV heads split freely; a cache split along its length runs
split-KV across devices (Flash-Decoding across GPUs): each device attends over its slice of the
cache (lengths shifted to the slice), then the partial (o, lse) merge with
`reference.attention.merge_many` after an all-gather of one [B, Hq, D] row per device.
"""
from __future__ import annotations

import functools

import jax

from jaxfuse import _philox
from jaxfuse.pallas import _attn
from jaxfuse.pallas import _common as C
from jaxfuse.pallas import attention as _p_attn
from jaxfuse.pallas import decode_attention as _p_dec
from jaxfuse.pallas.decode_attention import DecodeBlocks
from jaxfuse.reference import attention as _r_attn
from jaxfuse.reference import decode_attention as _r_dec
from jaxfuse.reference.attention import merge_many
from jaxfuse.sharding import ring
from jaxfuse.sharding._core import MESH_ORDER, Layout, partitioned, vjp_op
from jaxfuse.sharding.blocks import shard_key

def _heads(hkv: int, groups: int):
    """Factor of q's head axis: KV head n major, group member g minor. Shardy takes no size-1
    factor inside a compound: MHA is n alone, MQA g alone (then heads do not split)."""
    return "n" if groups == 1 else "g" if hkv == 1 else ("n", "g")


# ---- flash_attention -------------------------------------------------------------------------

def _flash_plan(cfg, q, k, causal=None):
    kw = dict(cfg["kw"]) if causal is None else dict(cfg["kw"], causal=causal)
    return _p_attn.plan(q.shape, k.shape, q.dtype, segments=cfg["segments"],
                        dropout=cfg["dropout"], **kw)


def _split_rest(cfg, rest):
    """(q segment ids, kv segment ids, dropout key words with this shard's row map or None,
    the remaining operands)."""
    n = 2 if cfg["segments"] else 0
    qs, ks = rest[:n] if n else (None, None)
    key = rest[n] if cfg["dropout"] else None
    return qs, ks, key, rest[n + bool(cfg["dropout"]):]


def _shard_key(key, plan, q):
    """The mask is `jaxfuse.dropout`'s over the probabilities' [B * Hq * Tq, Tk] view: with
    batch and heads split, this shard's rows of it (`blocks.shard_key`)."""
    if key is None:
        return None
    return shard_key(key, plan, (q.shape[0], q.shape[2], q.shape[1]), ("b", "n", "_t"))


def _ring_plans(cfg, plan, q, k):
    """The (unmasked, causal) kernel settings of one ring block pair: chunks of T / 2 with the
    causal zigzag layout, else T."""
    axes = ring.RingAxes(plan["t"], plan[MESH_ORDER])
    c = 2 if cfg["kw"]["causal"] else 1
    assert q.shape[1] % c == 0, "the plan splits a causal ring's sequence in even chunks"
    qc = (q.shape[0], q.shape[1] // c, *q.shape[2:])
    kc = (k.shape[0], k.shape[1] // c, *k.shape[2:])
    mk = lambda causal: _p_attn.plan(qc, kc, q.dtype, segments=cfg["segments"],
                                     **dict(cfg["kw"], causal=causal))
    return axes, cfg["kw"]["causal"], (mk(False), mk(True))


def _flash_fwd(cfg, plan, q, k, v, *rest):
    qs, ks, key, _ = _split_rest(cfg, rest)
    if cfg["ring"] and plan.get("t"):
        axes, causal, plans = _ring_plans(cfg, plan, q, k)
        o, lse = ring.forward(axes, causal, plans, q, k, v, qs, ks)
        # The ring's lse is merged from partials in natural units: its residual is converted
        # (exact up to one rounding, see `_attn.residual_from_lse`).
        return o, lse, _attn.residual_from_lse(lse, plans[0][0])
    return _p_attn.forward(q, k, v, qs, ks, *_flash_plan(cfg, q, k),
                           key=_shard_key(key, plan, q))


def _flash_bwd(cfg, plan, q, k, v, *rest):
    qs, ks, key, (o, lse, lse_u, do, dlse) = _split_rest(cfg, rest)
    if cfg["ring"] and plan.get("t"):
        return ring.backward(*_ring_plans(cfg, plan, q, k), q, k, v, qs, ks, o, lse, do, dlse)
    dq, dk, dv = _p_attn.backward(q, k, v, qs, ks, o, lse_u, do, dlse, *_flash_plan(cfg, q, k),
                                  key=_shard_key(key, plan, q))
    if plan.get("t"):        # queries split, keys whole: dK and dV sum over every query
        dk, dv = (jax.lax.psum(x, plan["t"]) for x in (dk, dv))
    return dq, dk, dv


@functools.lru_cache(maxsize=None)
def _flash_op(hkv: int, groups: int, self_attention: bool, segments: bool, causal: bool, scale,
              sliding_window, logits_soft_cap, interpret, block_sizes, dropout: float = 0.0,
              deterministic: bool = True):
    # Self-attention (Tq = Tk) names both sequence axes "t": split, it runs ring attention.
    # Otherwise only the queries may split, where no mask depends on their global position.
    # With dropout only batch and heads split (the mask's rows map to the global ones).
    ring_ok = self_attention and sliding_window is None and not dropout
    cfg = dict(segments=segments, ring=ring_ok, dropout=dropout,
               kw=dict(causal=causal, scale=scale, sliding_window=sliding_window,
                       logits_soft_cap=logits_soft_cap, interpret=interpret,
                       block_sizes=block_sizes, deterministic=deterministic))
    h = _heads(hkv, groups)
    q_dims, lse_dims = ("b", "t", h, "d"), ("b", h, "t")
    kv = ("b", "t" if self_attention else "s", "n", "d")
    q_split = ring_ok or (not self_attention and not causal and sliding_window is None
                          and not dropout)
    splittable = ("b", "n") + (("t",) if q_split else ())
    segs = (("b", "t"), ("b", kv[1])) if segments else ()
    segs += (("k",),) if dropout else ()                     # the key words: never split
    sizes = (("g", groups),) if isinstance(h, tuple) else ()
    # The causal ring cuts each device's chunk in two halves (`ring`, zigzag): a sequence that
    # does not give every device an even chunk stays whole (gathered), as other uneven splits.
    multiples = (("t", 2),) if ring_ok and causal else ()
    # Outputs o and the natural lse, then lse_u: the backward's residual (`pallas.attention`).
    fwd = Layout((q_dims, kv, kv, *segs), (q_dims, lse_dims, lse_dims), splittable, sizes,
                 multiples)
    bwd = Layout((q_dims, kv, kv, *segs, q_dims, lse_dims, lse_dims, q_dims, lse_dims),
                 (q_dims, kv, kv), splittable, sizes, multiples)
    return vjp_op(functools.partial(_flash_fwd, cfg), functools.partial(_flash_bwd, cfg), fwd,
                  bwd, n_out=2, diff=(True, True, True) + (False,) * len(segs), name="attention",
                  partition=not C.mosaic_interpreted(interpret, block_sizes))


def flash_attention(q, k, v, *, causal=False, scale=None, q_segment_ids=None,
                    kv_segment_ids=None, sliding_window=None, logits_soft_cap=None,
                    return_lse=False, dropout_rate=0.0, dropout_key=None, deterministic=True,
                    interpret=None, block_sizes=None):
    """`jaxfuse.pallas.flash_attention` partitioned over batch, KV heads and the sequence. With
    dropout over batch and KV heads only: the mask is defined by global (batch, head, query)
    indices, which each shard's kernel gets as a row map with its key (`blocks.shard_key`)."""
    _r_attn.validate(q, k, v, q_segment_ids, kv_segment_ids, sliding_window, logits_soft_cap,
                     scale, dropout_rate, dropout_key)
    rate = float(dropout_rate) if _philox.active(dropout_rate, dropout_key) else 0.0
    _p_attn.check_head_dim(q.shape[-1])
    segs = () if q_segment_ids is None else _p_attn.segment_ids_int32(q_segment_ids,
                                                                       kv_segment_ids)
    keys = (_philox.key_words(dropout_key),) if rate else ()
    op = _flash_op(k.shape[2], q.shape[2] // k.shape[2], q.shape[1] == k.shape[1], bool(segs),
                   bool(causal), scale, sliding_window, logits_soft_cap, interpret, block_sizes,
                   rate, bool(deterministic))
    o, lse = op(q, k, v, *segs, *keys)
    return (o, lse) if return_lse else o


# ---- decode_attention ------------------------------------------------------------------------

def _decode_local(kw, plan, q, k_cache, v_cache, lengths, *append):
    axes = plan.get("s", ())
    if not axes:
        return _p_dec._decode(q, k_cache, v_cache, lengths, *append, **kw)
    if kw["partial_sums"] or kw["rope_base"] is not None or kw["rms_eps"] is not None:
        # A device holding a slice of the cache sees its lengths shifted to that slice, not the
        # new token's position that RoPE turns by: XLA forms the token first (global lengths).
        k_new, v_new, rms = _p_dec.split_operands(append, kw["rms_eps"] is not None)
        q, *append = _r_dec.new_token(q, k_cache, v_cache, lengths, k_new, v_new, kw["packed"],
                                      kw["partial_sums"], kw["rope_base"], kw["rope_interleaved"],
                                      rms, kw["rms_eps"], positions=lengths)
        kw = dict(kw, packed=False, partial_sums=False, rope_base=None, rms_eps=None)
    # Lengths shifted to this device's slice, unclipped (the kernel clips): with an append, the
    # new row lands on the device whose slice holds its position.
    start = jax.lax.axis_index(axes) * k_cache.shape[1]
    out = _p_dec._decode(q, k_cache, v_cache, lengths - start, *append, **kw)
    o, lse = merge_many(jax.lax.all_gather(out[0], axes), jax.lax.all_gather(out[1], axes),
                        axis=0)
    return (o.astype(k_cache.dtype), lse, *out[2:])


def decode_attention(q, k_cache, v_cache, kv_lengths, *, scale=None, num_splits=None,
                     logits_soft_cap=None, return_lse=False, k_new=None, v_new=None,
                     packed_qkv=False, partial_sums=False, rope_base=None,
                     rope_interleaved=True, rms_input=None, rms_eps=1e-6, interpret=None,
                     block_sizes=None):
    """`jaxfuse.pallas.decode_attention` partitioned over batch, KV heads and cache length
    (packed q: batch and cache length; its heads hold the three kinds and stay whole)."""
    _r_dec.validate_call(q, k_cache, v_cache, kv_lengths, num_splits, logits_soft_cap, scale,
                         k_new, v_new, packed_qkv, partial_sums, rope_base, rope_interleaved,
                         rms_input, rms_eps)
    _p_attn.check_head_dim(q.shape[-1])
    interpret = C.resolve_interpret(interpret)
    blocks = block_sizes or DecodeBlocks()
    blocks.validate(interpret if blocks.folded is None else blocks.folded)
    kw = dict(scale=scale, num_splits=num_splits, logits_soft_cap=logits_soft_cap,
              interpret=interpret, blocks=blocks, packed=packed_qkv, partial_sums=partial_sums,
              rope_base=rope_base, rope_interleaved=rope_interleaved,
              rms_eps=None if rms_input is None else rms_eps)
    kv_dims = ("b", "s", "n", "d")
    if packed_qkv:   # its heads hold the three kinds: none split (nor its partial sums)
        q_dims = ("r", "b", "p", "d") if partial_sums else ("b", "p", "d")
        o_dims, lse_dims = ("b", "h", "d"), ("b", "h")
        new_dims, split, sizes = ((("b", "m"),) if rms_input is not None else ()), ("b", "s"), ()
    else:
        hkv, groups = k_cache.shape[2], q.shape[1] // k_cache.shape[2]
        h = _heads(hkv, groups)
        q_dims = o_dims = ("b", h, "d")
        lse_dims, split = ("b", h), ("b", "n", "s")
        new_dims = () if k_new is None else (("b", "n", "d"),) * 2
        sizes = (("g", groups),) if isinstance(h, tuple) else ()
    appends = packed_qkv or k_new is not None
    layout = Layout((q_dims, kv_dims, kv_dims, ("b",), *new_dims),
                    (o_dims, lse_dims) + ((kv_dims, kv_dims) if appends else ()), split, sizes)
    run = lambda *a: partitioned(functools.partial(_decode_local, kw), layout, a)
    # With an append the lengths are also where the new row goes (`_p_dec._kernel`).
    outs = _p_dec._inference_op(run, q_batch_axis=1 if partial_sums else 0)(q, k_cache, v_cache,
                                     _r_dec.clip_lengths(kv_lengths, k_cache.shape[1]),
                                     *_p_dec.operands(k_new, v_new, rms_input))
    return _p_dec.results(outs, return_lse)
