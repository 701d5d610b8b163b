"""A tiny Flax-free Transformer whose norms, attention and loss all go through jaxfuse ops.

    x = embed(tokens)
    for each block:  x = x + attn(norm(x));  x = x + swiglu(norm(x))
    logits = norm(x) @ unembed

Parameters are a plain dict pytree; `init` and `apply` are pure functions; `impl` routes every
jaxfuse op ("pallas" kernels or the "reference" jax.numpy versions).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

import jaxfuse
from jaxfuse.model.config import Config


def init(key: jax.Array, cfg: Config) -> dict:
    """Random parameters: N(0, 1/fan_in) projections, unit norms, N(0, 1) embeddings."""
    d, hd, f = cfg.d_model, cfg.head_dim, cfg.d_ff
    dense = lambda k, fan_in, fan_out: jax.random.normal(k, (fan_in, fan_out)) / math.sqrt(fan_in)
    keys = iter(jax.random.split(key, 2 + 7 * cfg.n_layers))

    def norm_params():
        p = {"weight": jnp.ones((d,))}
        if cfg.norm == "layer":
            p["bias"] = jnp.zeros((d,))
        return p

    blocks = []
    for _ in range(cfg.n_layers):
        blocks.append({
            "attn_norm": norm_params(),
            "wq": dense(next(keys), d, cfg.n_heads * hd),
            "wk": dense(next(keys), d, cfg.n_kv_heads * hd),
            "wv": dense(next(keys), d, cfg.n_kv_heads * hd),
            "wo": dense(next(keys), cfg.n_heads * hd, d),
            "mlp_norm": norm_params(),
            "w1": dense(next(keys), d, f),     # gate
            "w3": dense(next(keys), d, f),     # up
            "w2": dense(next(keys), f, d),     # down
        })
    return {"embed": jax.random.normal(next(keys), (cfg.vocab_size, d)),
            "blocks": blocks, "final_norm": norm_params(),
            "unembed": dense(next(keys), d, cfg.vocab_size)}


def norm(p: dict, x: jax.Array, cfg: Config, impl: str) -> jax.Array:
    if cfg.norm == "rms":
        return jaxfuse.rms_norm(x, p["weight"], impl=impl)
    return jaxfuse.layer_norm(x, p["weight"], p["bias"], impl=impl)


def rope(x: jax.Array, positions: jax.Array, base: float) -> jax.Array:
    """Rotates pairs (x[2i], x[2i+1]) by positions * base^(-2i/hd) (RoFormer, Su et al. 2021).

    x [B, T, H, hd], positions int [B, T]: q.k then depends only on the position difference."""
    hd = x.shape[-1]
    freq = base ** (-jnp.arange(0, hd, 2, dtype=jnp.float32) / hd)           # [hd/2]
    angle = positions[..., None].astype(jnp.float32) * freq                   # [B, T, hd/2]
    cos, sin = jnp.cos(angle)[:, :, None, :], jnp.sin(angle)[:, :, None, :]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    return out.reshape(x.shape).astype(x.dtype)


def qkv(blk: dict, h: jax.Array, positions: jax.Array, cfg: Config):
    """Projections with RoPE: q [B, T, H, hd], k and v [B, T, Hkv, hd]."""
    b, t, _ = h.shape
    q = (h @ blk["wq"]).reshape(b, t, cfg.n_heads, cfg.head_dim)
    k = (h @ blk["wk"]).reshape(b, t, cfg.n_kv_heads, cfg.head_dim)
    v = (h @ blk["wv"]).reshape(b, t, cfg.n_kv_heads, cfg.head_dim)
    return rope(q, positions, cfg.rope_base), rope(k, positions, cfg.rope_base), v


def attn_out(blk: dict, o: jax.Array, head_mask: jax.Array | None) -> jax.Array:
    """o [..., H, hd] -> [..., d_model]; `head_mask` [H] zeroes heads (ablations)."""
    if head_mask is not None:
        o = o * head_mask[:, None].astype(o.dtype)
    return o.reshape(*o.shape[:-2], -1) @ blk["wo"]


def swiglu(blk: dict, h: jax.Array) -> jax.Array:
    return (jax.nn.silu(h @ blk["w1"]) * (h @ blk["w3"])) @ blk["w2"]


def forward(params: dict, tokens: jax.Array, cfg: Config, *, impl: str = "pallas",
            head_mask: jax.Array | None = None):
    """(logits [B, T, V], each layer's (q, k, v) after RoPE) for tokens [B, T], causal.

    `apply` keeps the logits, `prefill` also the keys and values, `attention_maps` the queries
    and keys; under jit whatever a caller drops is never computed."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    x = params["embed"][tokens]                                              # [B, T, D]
    qkvs = []
    for i, blk in enumerate(params["blocks"]):
        q, k, v = qkv(blk, norm(blk["attn_norm"], x, cfg, impl), positions, cfg)
        qkvs.append((q, k, v))
        o = jaxfuse.flash_attention(q, k, v, causal=True, impl=impl)         # [B, T, H, hd]
        x = x + attn_out(blk, o, None if head_mask is None else head_mask[i])
        x = x + swiglu(blk, norm(blk["mlp_norm"], x, cfg, impl))
    return norm(params["final_norm"], x, cfg, impl) @ params["unembed"], qkvs


def apply(params: dict, tokens: jax.Array, cfg: Config, *, impl: str = "pallas",
          head_mask: jax.Array | None = None) -> jax.Array:
    """Logits [B, T, V] of tokens [B, T] (causal). `head_mask` [n_layers, n_heads] multiplies
    each head's attention output (1 keeps it, 0 ablates it)."""
    return forward(params, tokens, cfg, impl=impl, head_mask=head_mask)[0]


def loss(params: dict, tokens: jax.Array, targets: jax.Array, cfg: Config, *,
         impl: str = "pallas") -> jax.Array:
    """Mean cross-entropy over targeted positions. tokens, targets [B, T]: the caller shifts
    (targets[t] is the token after tokens[t]); -100 marks positions without a target."""
    logits = apply(params, tokens, cfg, impl=impl)
    return jaxfuse.cross_entropy(logits, targets, label_smoothing=cfg.label_smoothing,
                                 ignore_index=-100, impl=impl)


def attention_maps(params: dict, tokens: jax.Array, cfg: Config) -> jax.Array:
    """Attention probabilities [n_layers, B, H, T, T] (for plots), via `jaxfuse.softmax`."""
    g = cfg.n_heads // cfg.n_kv_heads
    maps = []
    for q, k, _ in forward(params, tokens, cfg, impl="reference")[1]:
        s = jnp.einsum("bqhd,bkhd->bhqk", q, jnp.repeat(k, g, axis=2))
        maps.append(jaxfuse.softmax(s, scale=cfg.head_dim ** -0.5, causal=True))
    return jnp.stack(maps)
