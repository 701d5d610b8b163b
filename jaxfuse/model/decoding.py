"""KV-cache decoding: `prefill` a batch of right-padded prompts, then `decode_step` one token per
sequence at a time.

The cache is a dict: k and v, each a tuple of n_layers arrays [B, S, Hkv, hd] in cfg.dtype
(preallocated, S = max_len), and lengths [B], the number of valid positions per sequence. One
array per layer rather than one stacked [n_layers, ...] array: `decode_attention` then reads a
layer's cache where it lies (a slice of a stacked cache is copied before a custom call), and
the new token's K/V is written into it in place by the attention kernel itself
(`decode_attention(..., k_new=, v_new=)`). Every layer computes
where to write the new token from the `lengths` it is given, never from another layer's cache
(lecture 5, sec. 8.2: reading layer 0's length after layer 0 has appended shifted every later
layer by one).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jaxfuse
from jaxfuse import _checks
from jaxfuse.model import _block_ops as ops
from jaxfuse.model import _inputs
from jaxfuse.model import transformer as T
from jaxfuse.model.config import Config
from jaxfuse.model.sharding import Out, constrain, on_auto_axes
from jaxfuse.reference import add_norm as add_norm_ref


# The cache's layout on a mesh: rows over data x fsdp, KV heads over tensor (as the projections
# that fill it).
KV_NAMES = ("batch", None, "kv_heads", None)


def _layout_of(cache: dict) -> dict:
    """The cache's `Out` layout (for `on_auto_axes`), from its arrays or their shapes."""
    kv = lambda cs: tuple(Out(tuple(c.shape), KV_NAMES) for c in cs)
    return {"k": kv(cache["k"]), "v": kv(cache["v"]),
            "lengths": Out(tuple(cache["lengths"].shape), ("batch",))}


def _new_cache_layout(cfg: Config, batch: int, max_len=None, **_) -> dict:
    s = cfg.max_len if max_len is None else max_len
    kv = (jax.ShapeDtypeStruct((batch, s, cfg.n_kv_heads, cfg.head_dim), jnp.float32),
          ) * cfg.n_layers
    return _layout_of({"k": kv, "v": kv, "lengths": jax.ShapeDtypeStruct((batch,), jnp.int32)})


@on_auto_axes(_new_cache_layout)
def init_cache(cfg: Config, batch: int, max_len: int | None = None, dtype=None) -> dict:
    """An empty cache; `dtype` defaults to cfg.dtype (the dtype of the keys and values)."""
    _inputs.new_cache(batch, max_len, dtype)
    s = cfg.max_len if max_len is None else max_len
    dt = cfg.compute_dtype if dtype is None else jnp.dtype(dtype)
    shape = (batch, s, cfg.n_kv_heads, cfg.head_dim)
    zeros = lambda: tuple(jnp.zeros(shape, dt) for _ in range(cfg.n_layers))
    return constrain_cache({"k": zeros(), "v": zeros(),
                            "lengths": jnp.zeros((batch,), jnp.int32)})


def constrain_cache(cache: dict) -> dict:
    """The cache pinned to its layout on the current mesh (`KV_NAMES`), a no-op without one."""
    kv = lambda cs: tuple(constrain(c, *KV_NAMES) for c in cs)
    return dict(cache, k=kv(cache["k"]), v=kv(cache["v"]),
                lengths=constrain(cache["lengths"], "batch"))


def decode_params(params: dict, cfg: Config) -> dict:
    """The parameters as decoding reads them: in cfg.dtype, the stacked blocks split into a
    tuple of per-layer dicts, and each layer's q/k/v and gate/up projections concatenated (one
    matmul each: a decoding step is a chain of small, weight-bound launches). `greedy` and
    `beam_search` do this once, outside their loops, so that no step re-casts, re-slices or
    re-concatenates the weights; `decode_step` accepts either form."""
    p = T.cast(params, cfg)
    if isinstance(p["blocks"], tuple):
        return p
    blocks = []
    for i in range(cfg.n_layers):
        blk = jax.tree.map(lambda x: x[i], p["blocks"])
        blk["wqkv"] = T.qkv_weight(blk.pop("wq"), blk.pop("wk"), blk.pop("wv"), cfg)
        if cfg.norm == "rms":
            # The attention's RMSNorm weight folded into the projection (one rounding), for the
            # Pallas step, whose attention kernel applies the norm's per-row scale itself.
            w = blk["attn_norm"]["weight"].astype(jnp.float32)[:, None]
            blk["wqkv_normed"] = (w * blk["wqkv"].astype(jnp.float32)).astype(blk["wqkv"].dtype)
        blk["w13"] = jnp.concatenate([blk.pop("w1"), blk.pop("w3")], axis=-1)
        blocks.append(blk)
    p["blocks"] = tuple(blocks)
    p["unembed"] = T.unembedding(p, cfg)
    return p


# A decoding step's q/k/v projection as this many float32 partial sums (a batched matmul over
# slices of d_model). Measured on an H200 in the 157M model's greedy step (s26, profiler,
# `DECODE_QKV_PARTS=p decode_flags.py profile`, the projection's GEMM + the attention kernel a
# layer): 2 parts 4.8 + 9.4 us, 4 parts 4.3 + 9.6, 8 parts 3.5 + 10.0, 16 parts 3.6 + 10.3;
# XLA's split-K GEMM was 3.6 us plus its 2.2-us reduction + RoPE fusion. More parts: more
# programs stream the weight, and each attention program reads one more [G + 2, hd] partial.
QKV_PARTS = 8


def _qkv_partials(y: jax.Array, w: jax.Array, cfg: Config) -> jax.Array:
    """y [B, D] @ w [D, N] as P float32 partial sums [P, B, N / hd, hd] (P = QKV_PARTS where it
    divides D, else 1): nothing for XLA to reduce, `decode_attention` adds them."""
    b, d = y.shape
    parts = QKV_PARTS if d % QKV_PARTS == 0 else 1
    out = jnp.einsum("bpk,pkn->pbn", y.reshape(b, parts, d // parts),
                     w.reshape(parts, d // parts, -1), preferred_element_type=jnp.float32)
    return out.reshape(parts, b, -1, cfg.head_dim)


def check_prompt_lengths(prompt_lengths, p: int) -> None:
    """Every prompt length in [1, P] (a prompt is at least the token that decoding continues),
    checked where the lengths are known (not traced): a `ValueError` naming the first bad one.
    Under `jax.jit` they cannot be read, and `prefill` clips them to [1, P] instead."""
    if p < 1:
        raise ValueError(f"prompts have width P={p}: each prompt needs at least one token")
    if isinstance(prompt_lengths, jax.core.Tracer):
        return
    n = np.asarray(prompt_lengths)
    bad = np.flatnonzero((n < 1) | (n > p))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"prompt_lengths[{i}]={n.flat[i]} must lie in [1, P={p}] (P = "
                         "prompts.shape[1], the padded width; pad each prompt on the right "
                         "and pass its own length)")


def _logits_and_cache(cache, cfg, **_):
    """prefill's and decode_step's layout: logits [B, V] and the cache."""
    b = cache["lengths"].shape[0]
    return Out((b, cfg.vocab_size), ("batch", "vocab")), _layout_of(cache)


@on_auto_axes(_logits_and_cache)
def prefill(params: dict, cache: dict, prompts: jax.Array, prompt_lengths: jax.Array,
            cfg: Config, *, impl: str = "pallas"):
    """Runs the right-padded prompts [B, P] with causal flash attention, writes their K/V into
    the cache and returns (logits of each prompt's last token [B, V], cache).

    Padding sits after each prompt, so the causal mask keeps it out of every real position; its
    K/V land in the cache beyond `lengths` and are overwritten by the first decoded tokens.
    prompt_lengths [B] lie in [1, P]: a `ValueError` where they are known, clipped to that
    range under `jax.jit` (`check_prompt_lengths`)."""
    _inputs.tokens(prompts, cfg, "prompts")
    p = prompts.shape[1]
    _inputs.cache(cache, cfg, prompts.shape[0], p, after_lengths=False)
    _inputs.lengths("prompt_lengths", prompt_lengths, prompts.shape[0], "prompt")
    check_prompt_lengths(prompt_lengths, p)
    prompt_lengths = _checks.clip_int32(prompt_lengths, 1, p)
    y, (_, k_all, v_all) = T.hidden(params, prompts, cfg, impl=impl, collect_qkv=True)
    last = jnp.take_along_axis(y, (prompt_lengths - 1)[:, None, None], axis=1)[:, 0]   # [B, D]
    logits = last @ T.unembedding(T.cast_outer(params, cfg), cfg)            # [B, V]
    put = lambda c, new: c.at[:, :p].set(new.astype(c.dtype))
    cache = {"k": tuple(put(c, k_all[i]) for i, c in enumerate(cache["k"])),
             "v": tuple(put(c, v_all[i]) for i, c in enumerate(cache["v"])),
             "lengths": prompt_lengths}
    return logits, cache


@on_auto_axes(_logits_and_cache)
def decode_step(params: dict, cache: dict, tokens: jax.Array, cfg: Config, *,
                impl: str = "pallas", head_mask: jax.Array | None = None):
    """Appends one token per sequence (tokens [B]) and returns (next-token logits [B, V], cache).

    Sequence b's token sits at position lengths[b]; attention covers positions <= lengths[b].
    Called step by step, `jax.jit(decode_step, static_argnames=("cfg", "impl"),
    donate_argnums=1)` updates the cache in place (greedy and beam search do it in their loop)."""
    _inputs.tokens(tokens, cfg, ndim=1)
    _inputs.head_mask(head_mask, cfg)
    _inputs.kernels(cfg, impl)
    _inputs.cache(cache, cfg, tokens.shape[0], 1, after_lengths=True)
    p = decode_params(params, cfg)
    lengths = cache["lengths"]                              # [B], the same for every layer
    h = ops.embedding(tokens[:, None], p["embed"], impl=impl)                # [B, 1, D]
    delta = jnp.zeros_like(h)
    k_out, v_out = [], []
    for i, blk in enumerate(p["blocks"]):
        k_c, v_c = cache["k"][i], cache["v"][i]
        mask = None if head_mask is None else head_mask[i]
        if impl == "pallas":
            # The attention's input in one kernel: the q/k/v projection reaches it as float32
            # partial sums (`_qkv_partials`), and the kernel adds them, turns q and k by RoPE,
            # writes the new token's K/V into the cache (in place) and attends. In a step of
            # microsecond launches this saves the projection's reduction (XLA's split-K GEMM
            # reduces in a launch of its own, there with RoPE and the heads' regrouping:
            # ~2.2 us a layer of the 157M model on an H200) and the step's cos/sin launch, for
            # ~0.5 us more in the attention kernel (s26: the step's kernels 17.57 -> 17.00 ms a
            # 32-token call, with the token's write in `search`; 16.82 with the norm folded).
            h, y = T.add_norm(blk["attn_norm"], delta, h, cfg, impl)            # [B, 1, D]
            if "wqkv_normed" in blk:
                # RMSNorm(h) @ W = rsqrt(mean(h^2) + eps) * (h @ (w * W)): the kernel applies the
                # per-row scale, so no launch normalizes h first (y goes unused: XLA drops it).
                parts = _qkv_partials(h[:, 0], blk["wqkv_normed"], cfg)
                norm = dict(rms_input=h[:, 0], rms_eps=add_norm_ref.DEFAULT_EPS["rms"])
            else:
                parts, norm = _qkv_partials(y[:, 0], blk["wqkv"], cfg), {}
            o, k_c, v_c = jaxfuse.decode_attention(        # parts: [P, B, Hkv (G + 2), hd]
                parts, k_c, v_c, lengths, packed_qkv="grouped", partial_sums=True,
                rope_base=cfg.rope_base, impl=impl, **norm)
            # o comes in the cache's dtype, which may differ from the model's (`init_cache`).
            h, delta = T.after_attention(blk, o[:, None].astype(h.dtype), h, cfg, impl,
                                         head_mask=mask)
        else:
            def attend(q, k, v, _key):
                # q, k, v reach the kernel as one array: XLA writes it in one fusion with RoPE.
                nonlocal k_c, v_c
                qkv = jnp.concatenate([x[:, 0].astype(k_c.dtype) for x in (q, k, v)], axis=1)
                o, k_c, v_c = jaxfuse.decode_attention(qkv, k_c, v_c, lengths,
                                                       packed_qkv=True, impl=impl)
                return o[:, None].astype(q.dtype)           # from the cache's dtype
            h, delta, _ = T.block(blk, h, delta, lengths[:, None], cfg, attend, impl=impl,
                                  head_mask=mask)
        k_out.append(k_c)
        v_out.append(v_c)
    _, y = T.add_norm(p["final_norm"], delta, h, cfg, impl)
    logits = (y @ p["unembed"])[:, 0]
    return logits, {"k": tuple(k_out), "v": tuple(v_out), "lengths": lengths + 1}
