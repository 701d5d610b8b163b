"""Every block-level op of the model, in one place: add + norm, SwiGLU, RoPE, the embedding,
dropout and attention (with probability dropout).

The signatures are those of the fused block ops of issue 15 (`jaxfuse.add_norm`, `jaxfuse.swiglu`,
`jaxfuse.rope`, `jaxfuse.embedding`, `jaxfuse.dropout`, `jaxfuse.flash_attention(...,
dropout_rate=, dropout_key=)`), so that moving the model onto those kernels changes this file
only. Until they exist, each is composed here from the existing jaxfuse ops (norms, flash
attention) and jax.numpy; dropout draws its mask with `jax.random.bernoulli`.
`impl="reference"` routes every jaxfuse op it calls to its reference.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

import jaxfuse

_EPS = {"rms": 1e-6, "layer": 1e-5}      # the defaults of jaxfuse.rms_norm / layer_norm


def _check_rate(rate: float) -> None:
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"rate={rate!r} must be in [0, 1)")


def dropout(x: jax.Array, rate: float, key: jax.Array | None, *, impl: str = "pallas") -> jax.Array:
    """Inverted dropout: x * mask / (1 - rate); rate=0 or key=None is the identity."""
    _check_rate(rate)
    if rate == 0.0 or key is None:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros((), x.dtype))


def add_norm(x: jax.Array, residual: jax.Array, weight: jax.Array, bias: jax.Array | None = None,
             *, norm: str = "rms", eps: float | None = None, rate: float = 0.0,
             key: jax.Array | None = None, impl: str = "pallas"):
    """(h, norm(h)) with h = residual + dropout(x): the pre-norm block's "add, then normalize"."""
    h = residual + dropout(x, rate, key, impl=impl)
    eps = _EPS[norm] if eps is None else eps
    if norm == "rms":
        return h, jaxfuse.rms_norm(h, weight, eps=eps, impl=impl)
    return h, jaxfuse.layer_norm(h, weight, bias, eps=eps, impl=impl)


def swiglu(gate: jax.Array, up: jax.Array, *, impl: str = "pallas") -> jax.Array:
    """silu(gate) * up (Shazeer 2020)."""
    return jax.nn.silu(gate) * up


def rope(x: jax.Array, positions: jax.Array, *, base: float = 10000.0, interleaved: bool = True,
         impl: str = "pallas") -> jax.Array:
    """Rotates pairs of x [..., T, H, D] by positions [..., T] * base^(-2i/D) (RoFormer, Su et
    al. 2021): pairs (x[2i], x[2i+1]) when interleaved, else halves (x[i], x[i + D/2])."""
    d = x.shape[-1]
    freq = base ** (-jnp.arange(0, d, 2, dtype=jnp.float32) / d)            # [D/2]
    angle = positions[..., None].astype(jnp.float32) * freq                  # [..., T, D/2]
    cos, sin = jnp.cos(angle)[..., None, :], jnp.sin(angle)[..., None, :]    # [..., T, 1, D/2]
    xf = x.astype(jnp.float32)
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).reshape(x.shape)
    else:
        x1, x2 = xf[..., :d // 2], xf[..., d // 2:]
        out = jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    return out.astype(x.dtype)


def embedding(tokens: jax.Array, table: jax.Array, *, scale: float = 1.0,
              pos_table: jax.Array | None = None, positions: jax.Array | None = None,
              rate: float = 0.0, key: jax.Array | None = None, impl: str = "pallas") -> jax.Array:
    """dropout(scale * table[tokens] + pos_table[positions])."""
    x = table[tokens]
    if scale != 1.0:
        x = x * jnp.asarray(scale, x.dtype)
    if pos_table is not None:
        x = x + pos_table[positions]
    return dropout(x, rate, key, impl=impl)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True,
              dropout_rate: float = 0.0, dropout_key: jax.Array | None = None,
              impl: str = "pallas") -> jax.Array:
    """Flash attention; with probability dropout on, the composition that holds P [B, H, T, T]
    (until flash_attention takes dropout_rate / dropout_key in-kernel)."""
    _check_rate(dropout_rate)
    if dropout_rate == 0.0 or dropout_key is None:
        return jaxfuse.flash_attention(q, k, v, causal=causal, impl=impl)
    g = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
    p = jaxfuse.softmax(s, scale=q.shape[-1] ** -0.5, causal=causal, impl=impl)
    p = dropout(p, dropout_rate, dropout_key, impl=impl)
    return jnp.einsum("bhqk,bkhd->bqhd", p.astype(v.dtype), v,
                      preferred_element_type=jnp.float32).astype(q.dtype)
