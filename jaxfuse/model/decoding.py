"""KV-cache decoding: `prefill` a batch of right-padded prompts, then `decode_step` one token per
sequence at a time.

The cache is a dict of arrays: k and v [n_layers, B, S, Hkv, hd] (preallocated, S = max_len) and
lengths [B], the number of valid positions per sequence. Every layer computes where to write the
new token from the `lengths` it is given, never from another layer's cache (lecture 5, sec. 8.2:
reading layer 0's length after layer 0 has appended shifted every later layer by one).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

import jaxfuse
from jaxfuse.model import transformer as T
from jaxfuse.model.config import Config


def init_cache(cfg: Config, batch: int, max_len: int | None = None,
               dtype=jnp.float32) -> dict:
    s = cfg.max_len if max_len is None else max_len
    shape = (cfg.n_layers, batch, s, cfg.n_kv_heads, cfg.head_dim)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype),
            "lengths": jnp.zeros((batch,), jnp.int32)}


def prefill(params: dict, cache: dict, prompts: jax.Array, prompt_lengths: jax.Array,
            cfg: Config, *, impl: str = "pallas"):
    """Runs the right-padded prompts [B, P] with causal flash attention, writes their K/V into
    the cache and returns (logits of each prompt's last token [B, V], cache).

    Padding sits after each prompt, so the causal mask keeps it out of every real position; its
    K/V land in the cache beyond `lengths` and are overwritten by the first decoded tokens."""
    p = prompts.shape[1]
    logits, qkvs = T.forward(params, prompts, cfg, impl=impl)                  # [B, P, V]
    ks = [k for _, k, _ in qkvs]
    vs = [v for _, _, v in qkvs]
    last = jnp.take_along_axis(logits, (prompt_lengths - 1)[:, None, None], axis=1)[:, 0]
    k_all = jnp.stack(ks).astype(cache["k"].dtype)                           # [L, B, P, Hkv, hd]
    v_all = jnp.stack(vs).astype(cache["v"].dtype)
    cache = {"k": cache["k"].at[:, :, :p].set(k_all), "v": cache["v"].at[:, :, :p].set(v_all),
             "lengths": prompt_lengths.astype(jnp.int32)}
    return last, cache


def decode_step(params: dict, cache: dict, tokens: jax.Array, cfg: Config, *,
                impl: str = "pallas", head_mask: jax.Array | None = None):
    """Appends one token per sequence (tokens [B]) and returns (next-token logits [B, V], cache).

    Sequence b's token sits at position lengths[b]; attention covers positions <= lengths[b]."""
    lengths = cache["lengths"]                                               # [B], same for every layer
    b = tokens.shape[0]
    rows = jnp.arange(b)
    x = params["embed"][tokens][:, None]                                     # [B, 1, D]
    k_cache, v_cache = cache["k"], cache["v"]
    for i, blk in enumerate(params["blocks"]):
        q, k, v = T.qkv(blk, T.norm(blk["attn_norm"], x, cfg, impl), lengths[:, None], cfg)
        k_cache = k_cache.at[i, rows, lengths].set(k[:, 0].astype(k_cache.dtype))
        v_cache = v_cache.at[i, rows, lengths].set(v[:, 0].astype(v_cache.dtype))
        o = jaxfuse.decode_attention(q[:, 0], k_cache[i], v_cache[i], lengths + 1, impl=impl)
        x = x + T.attn_out(blk, o[:, None], None if head_mask is None else head_mask[i])
        x = x + T.swiglu(blk, T.norm(blk["mlp_norm"], x, cfg, impl))
    logits = (T.norm(params["final_norm"], x, cfg, impl) @ params["unembed"])[:, 0]
    return logits, {"k": k_cache, "v": v_cache, "lengths": lengths + 1}
