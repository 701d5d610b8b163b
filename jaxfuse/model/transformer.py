"""A tiny Flax-free Transformer whose every op goes through jaxfuse.

    h, d = embed(tokens), 0
    for each block:  h, y = add_norm(d, h);  h, y = add_norm(attn(y), h);  d = swiglu(y) @ w2
    logits = add_norm(d, h)[1] @ unembed

Each residual add is fused with the norm that follows it (`add_norm` returns the new residual
stream h and its normalization y), so a block carries (h, d): the stream and the MLP output
still to be added. Inside a block the norm and the matmuls that read y are one op
(`add_norm_linear`), and so are SwiGLU and the down projection (`swiglu_linear`): their
backward kernels rebuild y and swiglu's product for the weight gradients instead of keeping them
(fewer residuals; under `lax.scan`, fewer stacked copies). The layers' parameters are stacked ([n_layers, ...] leaves) and run with
`lax.scan`, optionally rematerialized per block (`Config.remat`).

Mixed precision: parameters are stored in `Config.param_dtype` (float32 master weights for
optax) and cast to `Config.dtype` on the way in (the layers' weights inside the layer loop,
one layer at a time: `cast_outer`); activations and matmul inputs are in
`Config.dtype`, norms, softmax and the loss accumulate in float32 inside the kernels.

Parameters are a plain dict pytree; `init` and `apply` are pure functions; `impl` routes every
jaxfuse op ("pallas" kernels or the "reference" jax.numpy versions).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

import jaxfuse
from jaxfuse.model import _block_ops as ops
from jaxfuse.model import _inputs
from jaxfuse.model.sharding import Out, constrain, gather_layer, on_auto_axes
from jaxfuse.model.config import Config, remat_policy


def init(key: jax.Array, cfg: Config) -> dict:
    """Random parameters in cfg.param_dtype: N(0, 1/fan_in) projections, unit norms, N(0, 1)
    embeddings. Block leaves are stacked: [n_layers, ...]."""
    d, hd, f, n = cfg.d_model, cfg.head_dim, cfg.d_ff, cfg.n_layers
    dt = jnp.dtype(cfg.param_dtype)
    k_embed, k_unembed, k_blocks = jax.random.split(key, 3)
    kb = iter(jax.random.split(k_blocks, 7))

    def dense(k, fan_in, fan_out, layers=(n,)):
        return (jax.random.normal(k, (*layers, fan_in, fan_out)) / math.sqrt(fan_in)).astype(dt)

    def norm_params(layers=(n,)):
        p = {"weight": jnp.ones((*layers, d), dt)}
        if cfg.norm == "layer":
            p["bias"] = jnp.zeros((*layers, d), dt)
        return p

    blocks = {
        "attn_norm": norm_params(),
        "wq": dense(next(kb), d, cfg.n_heads * hd),
        "wk": dense(next(kb), d, cfg.n_kv_heads * hd),
        "wv": dense(next(kb), d, cfg.n_kv_heads * hd),
        "wo": dense(next(kb), cfg.n_heads * hd, d),
        "mlp_norm": norm_params(),
        "w1": dense(next(kb), d, f),     # gate
        "w3": dense(next(kb), d, f),     # up
        "w2": dense(next(kb), f, d),     # down
    }
    params = {"embed": jax.random.normal(k_embed, (cfg.vocab_size, d)).astype(dt),
              "blocks": blocks, "final_norm": norm_params(())}
    if not cfg.tie_embeddings:
        params["unembed"] = dense(k_unembed, d, cfg.vocab_size, ())
    return params


def cast(params: dict, cfg: Config) -> dict:
    """The parameters in the compute dtype (a no-op where they already are)."""
    return jax.tree.map(lambda p: p.astype(cfg.compute_dtype), params)


def cast_outer(params: dict, cfg: Config) -> dict:
    """The parameters outside the layer stack in the compute dtype. The layers' weights are cast
    inside the layer loop, one layer at a time (`hidden`): a cast of the stacked weights writes a
    compute-dtype copy of all of them, which the loop then slices layer by layer through another
    copy (XLA hands cuBLAS no slice of a stack in place); in the loop the slice and the cast are
    one fusion, and so are the gradient's cast back to param_dtype and its update of the stacked
    gradient."""
    return cast({name: x for name, x in params.items() if name != "blocks"}, cfg)


def unembedding(params: dict, cfg: Config) -> jax.Array:
    """The [D, V] unembedding matrix (embed.T when the embeddings are tied)."""
    return params["embed"].T if cfg.tie_embeddings else params["unembed"]


def add_norm(p: dict, delta: jax.Array, h: jax.Array, cfg: Config, impl: str,
             key: jax.Array | None = None):
    """(h + dropout(delta), norm of it) with the norm parameters p."""
    return ops.add_norm(delta, h, p["weight"], p.get("bias"), norm=cfg.norm, rate=cfg.dropout,
                        key=key, impl=impl)


def add_norm_project(p: dict, delta: jax.Array, h: jax.Array, weights: tuple, cfg: Config,
                     impl: str, key: jax.Array | None = None):
    """(h + dropout(delta), (norm of it) @ w for w in weights): the norm's output is not kept
    for the weights' gradients but rebuilt in the backward (`jaxfuse.add_norm_linear`)."""
    return ops.add_norm_linear(delta, h, p["weight"], p.get("bias"), projections=weights,
                               norm=cfg.norm, rate=cfg.dropout, key=key, impl=impl)


def qkv_weight(wq: jax.Array, wk: jax.Array, wv: jax.Array, cfg: Config) -> jax.Array:
    """wq, wk, wv ([..., d, H hd], [..., d, Hkv hd] twice) as one [..., d, Hkv (G + 2) hd]
    matrix, grouped by KV head: each KV head's G query heads, then its k, then its v.

    One matmul then forms q, k and v, and its backward one dy = dqkv W^T, where three matmuls
    left XLA three [tokens, d] products to add (an elementwise pass; 157M model on an H200,
    session s11). Grouped, not [wq | wk | wv]: split over devices by KV head (Megatron's
    tensor parallel), each device's columns are then its own heads' q, k and v."""
    *lead, d, _ = wq.shape
    hkv, hd = cfg.n_kv_heads, cfg.head_dim
    parts = [w.reshape(*lead, d, hkv, -1, hd) for w in (wq, wk, wv)]
    return jnp.concatenate(parts, axis=-2).reshape(*lead, d, -1)


def qkv_weights(blk: dict, cfg: Config) -> tuple:
    """The attention input projection: decoding's precomputed `qkv_weight` or the layer's."""
    return (blk["wqkv"],) if "wqkv" in blk else (qkv_weight(blk["wq"], blk["wk"], blk["wv"],
                                                             cfg),)


def qkv(outs: tuple, positions: jax.Array, cfg: Config, impl: str):
    """The `qkv_weight` projection's output as heads, with RoPE: q [B, T, H, hd], k and v
    [B, T, Hkv, hd], split and turned in one pass (`jaxfuse.rope_qkv`: slices would copy q, k
    and v out first, and the backward assemble the projection's gradient by pad + add)."""
    b, t, _ = outs[0].shape
    hkv, g, hd = cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads, cfg.head_dim
    q, k, v = ops.rope_qkv(outs[0].reshape(b, t, hkv, g + 2, hd), positions, base=cfg.rope_base,
                           impl=impl)
    return (constrain(q, "batch", "seq", "heads", None),
            *(constrain(x, "batch", "seq", "kv_heads", None) for x in (k, v)))


def attn_out(blk: dict, o: jax.Array, head_mask: jax.Array | None) -> jax.Array:
    """o [..., H, hd] -> [..., d_model]; `head_mask` [H] zeroes heads (ablations)."""
    if head_mask is not None:
        o = o * head_mask[:, None].astype(o.dtype)
    o = constrain(o, "batch", "seq", "heads", None)
    # Contract (heads, head_dim) directly rather than over o.reshape(..., H * hd): the matmul
    # then keeps o itself for its backward, the array flash attention already keeps. A reshaped
    # copy is another residual, under lax.scan another [layers, B, T, d] stack filled by a copy.
    h, hd = o.shape[-2:]
    return jnp.einsum("...hd,hde->...e", o, blk["wo"].reshape(h, hd, -1))


def mlp_weights(blk: dict) -> tuple:
    """The MLP's gate and up projections: decoding's one fused matrix or two."""
    return (blk["w13"],) if "w13" in blk else (blk["w1"], blk["w3"])


def mlp(blk: dict, outs: tuple, impl: str) -> jax.Array:
    """SwiGLU and the down projection of the gate/up projections' outputs."""
    gate, up = jnp.split(outs[0], 2, axis=-1) if len(outs) == 1 else outs
    gate, up = (constrain(x, "batch", "seq", "ff") for x in (gate, up))
    return ops.swiglu_linear(gate, up, blk["w2"], impl=impl)


def block(blk: dict, h: jax.Array, delta: jax.Array, positions: jax.Array, cfg: Config, attend,
          *, impl: str, key: jax.Array | None = None, head_mask: jax.Array | None = None):
    """One pre-norm block on (stream h, pending MLP output delta) -> (h, delta, (q, k, v)).

    `attend(q, k, v, key)` is the attention: causal flash attention in training and prefill, the
    KV cache in decoding."""
    keys = (None,) * 3 if key is None else tuple(jax.random.split(key, 3))
    h, outs = add_norm_project(blk["attn_norm"], delta, h, qkv_weights(blk, cfg), cfg, impl,
                               keys[0])
    q, k, v = qkv(outs, positions, cfg, impl)
    h, delta = after_attention(blk, attend(q, k, v, keys[1]), h, cfg, impl, keys[2], head_mask)
    return h, delta, (q, k, v)


def after_attention(blk: dict, o: jax.Array, h: jax.Array, cfg: Config, impl: str,
                    key: jax.Array | None = None, head_mask: jax.Array | None = None):
    """The block past attention's output o [B, T, H, hd]: (h + o W_o, the MLP's output of
    its norm, still to be added)."""
    h, outs = add_norm_project(blk["mlp_norm"], attn_out(blk, o, head_mask), h, mlp_weights(blk),
                               cfg, impl, key)
    return h, _stream(mlp(blk, outs, impl))


def _stream(x: jax.Array) -> jax.Array:
    """The residual stream's layout on a mesh: rows split over batch and sequence, d_model
    whole on every tensor-parallel device (Megatron: wo and w2's partial sums are reduced)."""
    return constrain(x, "batch", "seq", None)


def _remat(fn, cfg: Config):
    enabled, policy = remat_policy(cfg.remat)
    if not enabled:
        return fn
    # Inside scan the loop already keeps recomputation from being CSE'd away (jax.checkpoint docs).
    return jax.checkpoint(fn, policy=policy, prevent_cse=not cfg.scan_layers)


def _hidden_layout(tokens, cfg, collect_qkv, **_):
    """hidden's layout on a mesh (`on_auto_axes`): y [B, T, D] and the stacked q, k, v."""
    (b, t), hd = tokens.shape, cfg.head_dim
    heads = lambda n, name: Out((cfg.n_layers, b, t, n, hd), (None, "batch", "seq", name, None))
    kv = heads(cfg.n_kv_heads, "kv_heads")
    qkvs = (heads(cfg.n_heads, "heads"), kv, kv) if collect_qkv else None
    return Out((b, t, cfg.d_model), ("batch", "seq", None)), qkvs


@on_auto_axes(_hidden_layout)
def hidden(params: dict, tokens: jax.Array, cfg: Config, *, impl: str = "pallas",
           key: jax.Array | None = None, head_mask: jax.Array | None = None,
           collect_qkv: bool = False):
    """(final normalized hidden states [B, T, D] in cfg.dtype, each layer's (q, k, v) after RoPE
    stacked [n_layers, ...] or None) for tokens [B, T], causal.

    `key` turns dropout on (cfg.dropout > 0); without it the pass is deterministic."""
    _inputs.tokens(tokens, cfg)
    _inputs.head_mask(head_mask, cfg)
    _inputs.kernels(cfg, impl)
    p = cast_outer(params, cfg)          # the layers' weights are cast inside the loop
    b, t = tokens.shape
    positions = constrain(jnp.broadcast_to(jnp.arange(t), (b, t)), "batch", "seq")
    k_embed, k_layers, k_final = (None,) * 3 if key is None else jax.random.split(key, 3)
    h = ops.embedding(tokens, p["embed"], rate=cfg.dropout, key=k_embed, impl=impl)  # [B, T, D]
    h = _stream(h)

    def attend(q, k, v, key):
        return ops.attention(q, k, v, causal=True, dropout_rate=cfg.dropout, dropout_key=key,
                             deterministic=cfg.deterministic_attention, impl=impl)

    def body(carry, xs):
        blk, i, mask = xs
        blk = gather_layer(cast(blk, cfg))   # FSDP: this layer's weights whole, one at a time
        layer_key = None if k_layers is None else jax.random.fold_in(k_layers, i)
        h, delta, qkv_i = block(blk, *carry, positions, cfg, attend, impl=impl, key=layer_key,
                                head_mask=mask)
        return (_stream(h), delta), (qkv_i if collect_qkv else None)

    body = _remat(body, cfg)
    xs = (params["blocks"], jnp.arange(cfg.n_layers), head_mask)
    carry = (h, jnp.zeros_like(h))
    if cfg.scan_layers:
        carry, qkvs = jax.lax.scan(body, carry, xs)
    else:
        outs = []
        for i in range(cfg.n_layers):
            carry, out = body(carry, jax.tree.map(lambda x: x[i], xs))
            outs.append(out)
        qkvs = jax.tree.map(lambda *a: jnp.stack(a), *outs) if collect_qkv else None
    _, y = add_norm(p["final_norm"], carry[1], carry[0], cfg, impl, k_final)
    return _stream(y), qkvs


@on_auto_axes(lambda tokens, cfg, **_: Out((*tokens.shape, cfg.vocab_size),
                                                  ("batch", "seq", "vocab")))
def apply(params: dict, tokens: jax.Array, cfg: Config, *, impl: str = "pallas",
          head_mask: jax.Array | None = None, key: jax.Array | None = None) -> jax.Array:
    """Logits [B, T, V] (cfg.dtype) of tokens [B, T] (causal). `head_mask` [n_layers, n_heads]
    multiplies each head's attention output (1 keeps it, 0 ablates it). Deterministic unless a
    dropout `key` is given."""
    y, _ = hidden(params, tokens, cfg, impl=impl, key=key, head_mask=head_mask)
    return y @ unembedding(cast_outer(params, cfg), cfg)


@on_auto_axes(lambda *_, **__: Out((), ()))
def loss(params: dict, tokens: jax.Array, targets: jax.Array, cfg: Config, *,
         impl: str = "pallas", key: jax.Array | None = None) -> jax.Array:
    """Mean cross-entropy over targeted positions. tokens, targets [B, T]: the caller shifts
    (targets[t] is the token after tokens[t]); -100 marks positions without a target. An id
    outside the vocabulary raises a ValueError where the ids are known (an eager call); under
    `jax.jit` (as in `train_step`) it cannot be read, and the loss is NaN (`model._inputs`).

    Through `jaxfuse.linear_cross_entropy`: the [B, T, V] logits are never materialized
    (with `cfg.loss_token_slab`, one [n, V] slab of them at a time; on a mesh, of each
    device's tokens and slice of the vocabulary)."""
    _inputs.targets(targets, cfg)
    y, _ = hidden(params, tokens, cfg, impl=impl, key=key)
    blocks = (None if cfg.loss_token_slab is None
              else jaxfuse.LCEBlocks(token_slab=cfg.loss_token_slab))
    return jaxfuse.linear_cross_entropy(y, unembedding(cast_outer(params, cfg), cfg), targets,
                                        label_smoothing=cfg.label_smoothing, ignore_index=-100,
                                        impl=impl, block_sizes=blocks)


@on_auto_axes(lambda tokens, cfg, **_: Out(
    (cfg.n_layers, tokens.shape[0], cfg.n_heads, tokens.shape[1], tokens.shape[1]),
    (None, "batch", "heads", None, None)))
def attention_maps(params: dict, tokens: jax.Array, cfg: Config) -> jax.Array:
    """Attention probabilities [n_layers, B, H, T, T] (for plots), via `jaxfuse.softmax`."""
    g = cfg.n_heads // cfg.n_kv_heads
    _, (q, k, _) = hidden(params, tokens, cfg, impl="reference", collect_qkv=True)
    s = jnp.einsum("lbqhd,lbkhd->lbhqk", q, jnp.repeat(k, g, axis=3),
                   preferred_element_type=jnp.float32)
    return jaxfuse.softmax(s, scale=cfg.head_dim ** -0.5, causal=True)
