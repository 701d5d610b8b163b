"""Partitioning rules of `flash_attention` and `decode_attention`.

flash_attention: batch and KV heads split freely (a query head goes with its KV head, so GQA
groups stay whole: q's head axis is the compound (n, g) and only n splits). Without a causal
mask or window, the query axis splits too (each device attends its queries over all keys; the
backward psums dK and dV, which are sums over queries). Keys and values whole on each device.

decode_attention: batch and KV heads split freely; a cache split along its length runs
split-KV across devices (Flash-Decoding across GPUs): each device attends over its slice of the
cache (lengths shifted to the slice), then the partial (o, lse) merge with
`reference.attention.merge_many` after an all-gather of one [B, Hq, D] row per device.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxfuse.pallas import _common as C
from jaxfuse.pallas import attention as _p_attn
from jaxfuse.pallas import decode_attention as _p_dec
from jaxfuse.pallas.decode_attention import DecodeBlocks
from jaxfuse.reference import attention as _r_attn
from jaxfuse.reference import decode_attention as _r_dec
from jaxfuse.reference.attention import merge_many
from jaxfuse.sharding._core import Layout, partitioned, present, vjp_op

_Q, _KV, _LSE = ("b", "t", ("n", "g"), "d"), ("b", "s", "n", "d"), ("b", ("n", "g"), "t")


# ---- flash_attention -------------------------------------------------------------------------

def _flash_plan(cfg, q, k):
    return _p_attn.plan(q.shape, k.shape, q.dtype, segments=cfg["segments"], **cfg["kw"])


def _flash_fwd(cfg, plan, q, k, v, *segs):
    qs, ks = segs if segs else (None, None)
    return _p_attn.forward(q, k, v, qs, ks, *_flash_plan(cfg, q, k))


def _flash_bwd(cfg, plan, q, k, v, *rest):
    segs, (o, lse, do, dlse) = rest[:-4], rest[-4:]
    qs, ks = segs if segs else (None, None)
    dq, dk, dv = _p_attn.backward(q, k, v, qs, ks, o, lse, do, dlse, *_flash_plan(cfg, q, k))
    if plan.get("t"):        # queries split, keys whole: dK and dV sum over every query
        dk, dv = (jax.lax.psum(x, plan["t"]) for x in (dk, dv))
    return dq, dk, dv


@functools.lru_cache(maxsize=None)
def _flash_op(groups: int, segments: bool, causal: bool, scale, sliding_window, logits_soft_cap,
              interpret, block_sizes):
    cfg = dict(segments=segments, kw=dict(causal=causal, scale=scale,
                                          sliding_window=sliding_window,
                                          logits_soft_cap=logits_soft_cap, interpret=interpret,
                                          block_sizes=block_sizes))
    # Masks that depend on a query's global position keep the query axis whole.
    splittable = ("b", "n") + (("t",) if not causal and sliding_window is None else ())
    segs = (("b", "t"), ("b", "s")) if segments else ()
    sizes = (("g", groups),)
    fwd = Layout((_Q, _KV, _KV, *segs), (_Q, _LSE), splittable, sizes)
    bwd = Layout((_Q, _KV, _KV, *segs, _Q, _LSE, _Q, _LSE), (_Q, _KV, _KV), splittable, sizes)
    return vjp_op(functools.partial(_flash_fwd, cfg), functools.partial(_flash_bwd, cfg), fwd,
                  bwd, n_out=2, diff=(True, True, True) + (False, False)[:len(segs)])


def flash_attention(q, k, v, *, causal=False, scale=None, q_segment_ids=None,
                    kv_segment_ids=None, sliding_window=None, logits_soft_cap=None,
                    return_lse=False, dropout_rate=0.0, dropout_key=None, interpret=None,
                    block_sizes=None):
    """`jaxfuse.pallas.flash_attention` partitioned over batch and KV heads (see above). With
    dropout it is the unpartitioned kernel: the mask is defined by global (batch, head, query)
    indices, which a shard does not know."""
    if dropout_rate and dropout_key is not None:
        return _p_attn.flash_attention(
            q, k, v, causal=causal, scale=scale, q_segment_ids=q_segment_ids,
            kv_segment_ids=kv_segment_ids, sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap, return_lse=return_lse, dropout_rate=dropout_rate,
            dropout_key=dropout_key, interpret=interpret, block_sizes=block_sizes)
    _r_attn.validate(q, k, v, q_segment_ids, kv_segment_ids, sliding_window, logits_soft_cap,
                     scale)
    _p_attn.check_head_dim(q.shape[-1])
    segs = () if q_segment_ids is None else (q_segment_ids.astype(jnp.int32),
                                             kv_segment_ids.astype(jnp.int32))
    op = _flash_op(q.shape[2] // k.shape[2], bool(segs), bool(causal), scale, sliding_window,
                   logits_soft_cap, interpret, block_sizes)
    o, lse = op(q, k, v, *segs)
    return (o, lse) if return_lse else o


# ---- decode_attention ------------------------------------------------------------------------

def _decode_local(kw, plan, q, k_cache, v_cache, lengths):
    axes = plan.get("s", ())
    if not axes:
        return _p_dec._decode(q, k_cache, v_cache, lengths, **kw)
    s_loc = k_cache.shape[1]
    start = jax.lax.axis_index(axes) * s_loc
    o, lse = _p_dec._decode(q, k_cache, v_cache, jnp.clip(lengths - start, 0, s_loc), **kw)
    o, lse = merge_many(jax.lax.all_gather(o, axes), jax.lax.all_gather(lse, axes), axis=0)
    return o.astype(q.dtype), lse


def decode_attention(q, k_cache, v_cache, kv_lengths, *, scale=None, num_splits=None,
                     logits_soft_cap=None, return_lse=False, interpret=None, block_sizes=None):
    """`jaxfuse.pallas.decode_attention` partitioned over batch, KV heads and cache length."""
    _r_dec.validate(q, k_cache, v_cache, kv_lengths, num_splits, logits_soft_cap, scale)
    _p_attn.check_head_dim(q.shape[-1])
    kw = dict(scale=scale, num_splits=num_splits, logits_soft_cap=logits_soft_cap,
              interpret=C.resolve_interpret(interpret),
              blocks=block_sizes or DecodeBlocks())
    q_dims, kv_dims, lse_dims = ("b", ("n", "g"), "d"), ("b", "s", "n", "d"), ("b", ("n", "g"))
    layout = Layout((q_dims, kv_dims, kv_dims, ("b",)), (q_dims, lse_dims), ("b", "n", "s"),
                    (("g", q.shape[1] // k_cache.shape[2]),))
    run = lambda *a: partitioned(functools.partial(_decode_local, kw), layout, a)
    o, lse = _p_dec._inference_op(run)(*present(q, k_cache, v_cache,
                                                kv_lengths.astype(jnp.int32)))
    return (o, lse) if return_lse else o
