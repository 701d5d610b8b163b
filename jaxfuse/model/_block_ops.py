"""Every block-level op of the model, in one place: add + norm, SwiGLU, RoPE, the embedding,
dropout and attention (with probability dropout).

These are the fused block kernels of issue 15 (`jaxfuse.add_norm` and `add_norm_linear`,
`jaxfuse.swiglu_linear`, `jaxfuse.rope`, `jaxfuse.rope_qkv`, `jaxfuse.embedding`,
`jaxfuse.dropout`, `jaxfuse.flash_attention(..., dropout_rate=, dropout_key=)`), whose dropout
masks come from one counter-based generator (Philox) in every kernel. The model calls them only
through this module, so swapping an implementation (a benchmark's cuDNN attention, a future kernel)
changes this file alone. `impl="reference"` routes every one of them to its jax.numpy reference.

One exception, for CPU runs only: where the Pallas kernels are interpreted (a CPU backend,
`JAXFUSE_INTERPRET=1`), `embedding`, `rope`, `rope_qkv` and `reorder_beams` take their references,
which compute the same function (the same Philox masks, the same reorder). The interpreter turns
their grids into loops: measured on 2 CPU cores, the embedding and RoPE kernels took LikesWorld's
training step from about 0.13 to 0.37 s, past its 3-minute budget; the reorder runs once per
beam-search step. Compiled, every op is the kernel, but for add + norm, RoPE and SwiGLU on a
decoding step's few rows (`FEW_ROWS`, below).
"""
from __future__ import annotations

import math

import jax
from jax.ad_checkpoint import checkpoint_name

import jaxfuse
from jaxfuse.model.sharding import constrain
from jaxfuse.pallas import _common

dropout = jaxfuse.dropout            # (x, rate, key): inverted dropout

# A decoding step's few rows (one token per sequence): there add + norm, RoPE and SwiGLU go to
# XLA, which fuses each with its neighbours: RoPE and SwiGLU with the slice of the fused q/k/v or
# gate/up projection that feeds them (a custom call takes whole arrays, so a kernel needs its
# operand copied out first), add + norm with the split-K reduction of the matmul before it. The
# step is a chain of ~2-7 us launches, so launches are what count (157M model on the H200,
# B = 32: RoPE and SwiGLU here and the one-split decode attention took the step from 0.40 to
# 0.36 ms, add + norm then to 0.343; measured before `rope_qkv`, which reads the projection
# whole and needs no copy, but is still a launch of its own where XLA fuses the slices and RoPE
# into their neighbours, so it too goes to XLA there). Above this many rows (prefill,
# training) the kernels are the faster ones.
FEW_ROWS = 64


def _unless_interpreted(impl: str) -> str:
    return "reference" if impl == "pallas" and _common.resolve_interpret(None) else impl


def _unless_few(impl: str, rows: int) -> str:
    """"reference" for a compiled call on at most FEW_ROWS rows (see above), else impl."""
    if impl == "pallas" and rows <= FEW_ROWS and not _common.resolve_interpret(None):
        return "reference"
    return impl


def add_norm(x: jax.Array, residual: jax.Array, weight: jax.Array, bias: jax.Array | None = None,
             *, norm: str = "rms", rate: float = 0.0, key: jax.Array | None = None,
             impl: str = "pallas") -> tuple[jax.Array, jax.Array]:
    """(h, norm(h)) with h = residual + dropout(x) (`jaxfuse.add_norm`)."""
    return jaxfuse.add_norm(x, residual, weight, bias, norm=norm, rate=rate, key=key,
                            impl=_unless_few(impl, math.prod(x.shape[:-1])))


def add_norm_linear(x: jax.Array, residual: jax.Array, weight: jax.Array,
                    bias: jax.Array | None = None, *, projections: tuple, norm: str = "rms",
                    rate: float = 0.0, key: jax.Array | None = None,
                    impl: str = "pallas") -> tuple[jax.Array, tuple]:
    """(h, tuple(norm(h) @ p for p in projections)), h = residual + dropout(x)
    (`jaxfuse.add_norm_linear`: its backward rebuilds norm(h) instead of keeping it)."""
    return jaxfuse.add_norm_linear(x, residual, weight, bias, projections=projections, norm=norm,
                                   rate=rate, key=key,
                                   impl=_unless_few(impl, math.prod(x.shape[:-1])))


def swiglu_linear(gate: jax.Array, up: jax.Array, weight: jax.Array, *,
                  impl: str = "pallas") -> jax.Array:
    """silu(gate) * up @ weight, the MLP's down projection included (`jaxfuse.swiglu_linear`:
    its backward rebuilds the product instead of keeping it). gate and up are named like SwiGLU's
    outputs (`jaxfuse.residual_name("swiglu")`), so `Config.remat="...+swiglu"` keeps them and
    the backward reruns neither the gate/up matmuls nor the kernel."""
    gate, up = (checkpoint_name(a, jaxfuse.residual_name("swiglu")) for a in (gate, up))
    return jaxfuse.swiglu_linear(gate, up, weight,
                                 impl=_unless_few(impl, math.prod(gate.shape[:-1])))


def rope(x: jax.Array, positions: jax.Array, *, base: float = 10000.0, interleaved: bool = True,
         impl: str = "pallas") -> jax.Array:
    """x [..., T, H, D] rotated by positions [..., T] (`jaxfuse.rope`)."""
    impl = _unless_few(impl, math.prod(x.shape[:-2]))
    return jaxfuse.rope(x, positions, base=base, interleaved=interleaved,
                        impl=_unless_interpreted(impl))


def rope_qkv(qkv: jax.Array, positions: jax.Array, *, base: float = 10000.0,
             interleaved: bool = True, impl: str = "pallas") -> tuple:
    """The grouped q/k/v projection [..., T, Hkv, G + 2, D] as q, k (turned) and v
    (`jaxfuse.rope_qkv`)."""
    impl = _unless_few(impl, math.prod(qkv.shape[:-3]))
    return jaxfuse.rope_qkv(qkv, positions, base=base, interleaved=interleaved,
                            impl=_unless_interpreted(impl))


def embedding(tokens: jax.Array, table: jax.Array, *, scale: float = 1.0,
              pos_table: jax.Array | None = None, positions: jax.Array | None = None,
              rate: float = 0.0, key: jax.Array | None = None, impl: str = "pallas") -> jax.Array:
    """dropout(scale * table[tokens] + pos_table[positions]) (`jaxfuse.embedding`)."""
    impl = _unless_interpreted(impl)
    if impl == "reference":
        # XLA's gather cannot take rows of a table whose d_model is split over fsdp to tokens
        # split over fsdp too (it replicated the table with a warning): gathered first, as FSDP
        # gathers every weight where it is used. The kernel's rule splits d_model itself.
        table = constrain(table, "vocab", None)
    return jaxfuse.embedding(tokens, table, scale=scale, pos_table=pos_table, positions=positions,
                             rate=rate, key=key, impl=impl)


def reorder_beams(caches, parent: jax.Array, start: jax.Array, stop: jax.Array, *,
                  impl: str = "pallas") -> tuple:
    """Beam search's cache reorder of positions [start, stop) (`jaxfuse.reorder_beams`)."""
    return jaxfuse.reorder_beams(caches, parent, start, stop, impl=_unless_interpreted(impl))


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True,
              dropout_rate: float = 0.0, dropout_key: jax.Array | None = None,
              deterministic: bool = True, impl: str = "pallas") -> jax.Array:
    """Flash attention, with attention-probability dropout inside the kernel. q, k and v are
    named like attention's outputs (`jaxfuse.residual_name("attention")`), so that
    `Config.remat="...+attention"` keeps them too and the backward reruns no attention input."""
    q, k, v = (checkpoint_name(a, jaxfuse.residual_name("attention")) for a in (q, k, v))
    return jaxfuse.flash_attention(q, k, v, causal=causal, dropout_rate=dropout_rate,
                                   dropout_key=dropout_key, deterministic=deterministic,
                                   impl=impl)
