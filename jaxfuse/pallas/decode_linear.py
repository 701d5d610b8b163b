"""The matmul of a decoding step: a few rows (one token per sequence) times a weight read once at
the copy rate, with the block's norm fused before it and SwiGLU or the residual add after it.

A decoding step multiplies [B, K] activations (B = 32 tokens) by each weight of the model: about
2 FLOPs per weight byte, so each matmul is a stream of its weight, and a step is a chain of
such streams. XLA's GEMM for 32 rows splits K over CTAs and adds the partial products in a second
kernel, and the norms, SwiGLU and residual adds around it are further kernels: on an H200 the
157M model's step is ~10 dependent launches a layer (benchmarks/NOTES.md s23 items 4-5), each
costing 1-4 us of launch and latency over its bytes. Here one kernel does it all:

    program j owns output features [j bn, (j + 1) bn): it streams their rows of the weight
    ([N, K], each feature's weights one contiguous row: bn rows of 2K bytes, read once by one
    program, no partial sums to add), and walks K in chunks of bk, each chunk of x (every row,
    from L2: x is small) normalized on the fly and fed to the matrix unit.

Norms (prologue). RMSNorm folds into the epilogue: y @ w = rstd * ((x * g) @ w), rstd a scale per
row, so the chunks of x need no statistics first and the sum of squares rides along the
product's loop. LayerNorm cannot fold the same way (subtracting mean * (g @ w) afterwards
cancels catastrophically when |mean| >> std, after x * g was rounded for the matrix unit), so
a first pass over x's chunks merges their exact (count, mean, m2) by Chan's rule (as
`layer_norm` does), then the product's loop normalizes each chunk.

SwiGLU (epilogue): the program also streams the same rows of `gate_weight` and writes
silu(y @ gate_weight.T) * (y @ weight.T); the gate/up product never reaches memory. Residual
(epilogue): out = residual + product, the block's residual add, so the next norm needs no add.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxfuse.pallas import _common as C
from jaxfuse.pallas import _norm
from jaxfuse.reference import add_norm as _an
from jaxfuse.reference import decode_linear as ref
from jaxfuse.reference.layer_norm import welford_merge


@dataclasses.dataclass(frozen=True)
class LinearBlocks:
    """Tiles of `decode_linear` (None: the rule of `_blocks`). `block_n` output features and
    `block_k` of the reduction per step of a program; every row of x (up to `block_m`) per
    program. `num_*` only matter on the GPU."""
    block_m: int | None = None
    block_n: int | None = None
    block_k: int | None = None
    split: int = 2          # independent accumulator chains a step (bk / split columns each)
    num_warps: int = 4
    num_stages: int = 3

    def validate(self) -> None:
        for name in ("block_m", "block_n", "block_k", "split", "num_warps", "num_stages"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, int) and v >= 1):
                raise ValueError(f"LinearBlocks({name}={v!r}): {name} must be a positive int")
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v is not None and (v < 16 or v != C.next_pow2(v)):
                raise ValueError(f"LinearBlocks({name}={v}) must be a power of two >= 16 (the "
                                 f"matrix unit's smallest tile), e.g. 16")
        if self.split != C.next_pow2(self.split):
            raise ValueError(f"LinearBlocks(split={self.split}) must be a power of two")


@dataclasses.dataclass(frozen=True)
class _Static:
    m: int
    n: int
    k: int
    bm: int
    bn: int
    bk: int
    bu: int               # a sub-chunk of bk: one independent accumulator chain
    norm: str | None
    eps: float
    has_norm_weight: bool
    has_norm_bias: bool
    gated: bool
    residual: bool


# What the staged chunks may take of a multiprocessor's shared memory (227 KiB on an H100/H200;
# Triton adds its own scratch for the layouts' conversions).
SHARED_BYTES = 160 * 1024


def _blocks(m: int, n: int, k: int, blocks: LinearBlocks | None, interpret: bool,
            gated: bool = False, itemsize: int = 2):
    """(bm, bn, bk, blocks). Interpreted: one program sees everything (house style) unless a
    tile is asked for. On the GPU:
    every row in one program (up to 64; more rows take more programs), 16 output features a
    program (N / 16 programs stream the weight: 64-352 for the 157M model's matmuls), K in
    chunks of 256 (see benchmarks/decode_linear.py for the sweep)."""
    blocks = blocks or LinearBlocks()
    blocks.validate()
    if interpret:           # a tile asked for is honoured (tests run the GPU's tiling)
        return blocks.block_m or m, blocks.block_n or n, blocks.block_k or k, blocks
    bm = blocks.block_m or min(max(C.next_pow2(m), 16), 64)
    bn = blocks.block_n or 16
    bk = blocks.block_k or min(max(C.next_pow2(k), 16), 256)
    if blocks.block_k is None:      # the pipeline's stages of x and weight chunks must fit
        per_k = (bm + bn * (1 + gated)) * itemsize * blocks.num_stages
        while bk > 16 and per_k * bk > SHARED_BYTES:
            bk //= 2
    return bm, bn, bk, blocks


def _kernel(x_ref, w_ref, *refs, st: _Static):
    # x_ref [M, K], w_ref / gw_ref [N, K], nw_ref / nb_ref [K], r_ref / o_ref [M, N]
    refs = list(refs)
    o_ref = refs.pop()
    gw_ref = refs.pop(0) if st.gated else None
    nw_ref = refs.pop(0) if st.has_norm_weight else None
    nb_ref = refs.pop(0) if st.has_norm_bias else None
    r_ref = refs.pop(0) if st.residual else None
    row0, col0 = pl.program_id(0) * st.bm, pl.program_id(1) * st.bn
    n_k = C.cdiv(st.k, st.bk)

    def x_chunk(k0, width):
        x, _, _, valid = C.load_tile(x_ref, row0, k0, st.bm, width, st.m, st.k)
        return x, valid

    def per_col(ref, k0):
        return C.load_vec(ref, k0, st.bu, st.k).astype(jnp.float32)[None, :]   # [1, bu]

    def dot(a, b):        # [m, k] x [n, k] -> [m, n], float32 (exact float32 for float32 input)
        prec = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
        return jnp.einsum("mk,nk->mn", a, b, preferred_element_type=jnp.float32,
                          precision=prec)

    mean = rstd = None
    if st.norm == "layer":       # pass 1: Chan's merge of each chunk's exact statistics
        def stats(kk, state):
            x, valid = x_chunk(kk * st.bk, st.bk)
            return welford_merge(state, _norm.row_state(x.astype(jnp.float32), valid,
                                                        center=True))
        zero = tuple(jnp.zeros((st.bm, 1), jnp.float32) for _ in range(3))
        mean, rstd = _norm._finalize(C.reduce_tiles(n_k, stats, zero), st.eps)

    # A step's chunk of K is `split` sub-chunks, each with accumulators of its own: the matrix
    # unit's results chain through an accumulator, so one chain over K is a serial walk of
    # dependent products that a few warps cannot hide; independent chains interleave.
    split = st.bk // st.bu

    def step(kk, carry):
        accs, accs_g, gram = carry
        accs, accs_g = list(accs), list(accs_g)
        for u in range(split):
            k0 = kk * st.bk + u * st.bu
            x, _ = x_chunk(k0, st.bu)                               # [bm, bu]
            if st.norm == "rms":
                # row sums of squares on the matrix unit: the diagonal of x x^T, one more
                # product instead of squaring and reducing x across the threads every step
                gram = gram + dot(x, x)
            xf = x.astype(jnp.float32)
            if st.norm == "layer":
                xf = (xf - mean) * rstd
            if st.has_norm_weight:
                xf = xf * per_col(nw_ref, k0)
            if st.has_norm_bias:
                xf = xf + per_col(nb_ref, k0)
            y = xf.astype(x_ref.dtype)                              # the matmul input
            w, *_ = C.load_tile(w_ref, col0, k0, st.bn, st.bu, st.n, st.k)     # [bn, bu]
            accs[u] = accs[u] + dot(y, w)
            if st.gated:
                g, *_ = C.load_tile(gw_ref, col0, k0, st.bn, st.bu, st.n, st.k)
                accs_g[u] = accs_g[u] + dot(y, g)
        return tuple(accs), tuple(accs_g), gram

    zeros = tuple(jnp.zeros((st.bm, st.bn), jnp.float32) for _ in range(split))
    init = (zeros, zeros if st.gated else (), jnp.zeros((st.bm, st.bm), jnp.float32))
    accs, accs_g, gram = C.reduce_tiles(n_k, step, init)
    acc = functools.reduce(jnp.add, accs)
    acc_g = functools.reduce(jnp.add, accs_g) if st.gated else None
    if st.norm == "rms":
        eye = (jax.lax.broadcasted_iota(jnp.int32, gram.shape, 0)
               == jax.lax.broadcasted_iota(jnp.int32, gram.shape, 1))
        ss = jnp.sum(jnp.where(eye, gram, 0.0), axis=-1, keepdims=True)        # [bm, 1]
        scale = jax.lax.rsqrt(ss / st.k + st.eps)
        acc = acc * scale
        acc_g = acc_g * scale if st.gated else None
    out = jax.nn.silu(acc_g) * acc if st.gated else acc
    if st.residual:
        r, *_ = C.load_tile(r_ref, row0, col0, st.bm, st.bn, st.m, st.n)
        out = r.astype(jnp.float32) + out
    C.store_tile(o_ref, out, row0, col0, st.m, st.n)


def decode_linear(x: jax.Array, weight: jax.Array, *, norm: str | None = None,
                  norm_weight: jax.Array | None = None, norm_bias: jax.Array | None = None,
                  eps: float | None = None, gate_weight: jax.Array | None = None,
                  residual: jax.Array | None = None, interpret: bool | None = None,
                  block_sizes: LinearBlocks | None = None) -> jax.Array:
    """Pallas `decode_linear`; see `jaxfuse.reference.decode_linear`. Its gradient is the
    reference's (XLA's matmuls): the kernel is for inference."""
    ref.validate(x, weight, norm, norm_weight, norm_bias, gate_weight, residual)
    interpret = C.resolve_interpret(interpret)
    eps = 0.0 if norm is None else _an.resolve_eps(norm, eps)
    lead, k = x.shape[:-1], x.shape[-1]
    n = weight.shape[0]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    bm, bn, bk, blocks = _blocks(m, n, k, block_sizes, interpret, gate_weight is not None,
                                 x.dtype.itemsize)
    bu = max(bk // blocks.split, 16) if not interpret or block_sizes is not None else bk
    st = _Static(m, n, k, bm, bn, bk, bu, norm, eps, norm_weight is not None,
                 norm_bias is not None, gate_weight is not None, residual is not None)
    args = [x2, weight] + [a for a in (gate_weight, norm_weight, norm_bias) if a is not None]
    if residual is not None:
        args.append(residual.reshape(m, n))
    run = functools.partial(_run, st=st, interpret=interpret, blocks=blocks)
    return _with_reference_grad(run, st, *args).reshape(*lead, n)


def _run(*args, st: _Static, interpret: bool, blocks: LinearBlocks):
    return C.pallas_call(
        functools.partial(_kernel, st=st),
        out_shape=jax.ShapeDtypeStruct((st.m, st.n), args[0].dtype),
        grid=(C.cdiv(st.m, st.bm), C.cdiv(st.n, st.bn)), name="jaxfuse_decode_linear",
        interpret=interpret, num_warps=blocks.num_warps, num_stages=blocks.num_stages)(*args)


def _reference(st: _Static, x2, weight, *rest):
    rest = list(rest)
    gate = rest.pop(0) if st.gated else None
    nw = rest.pop(0) if st.has_norm_weight else None
    nb = rest.pop(0) if st.has_norm_bias else None
    res = rest.pop(0) if st.residual else None
    return ref.decode_linear(x2, weight, norm=st.norm, norm_weight=nw, norm_bias=nb,
                             eps=st.eps or None, gate_weight=gate, residual=res)


def _with_reference_grad(run, st: _Static, *args):
    """run(*args) forward; the reference's vjp backward (a linear op: XLA's matmuls do it)."""
    @jax.custom_vjp
    def op(*a):
        return run(*a)

    def fwd(*a):
        return run(*a), a

    def bwd(a, dout):
        return jax.vjp(functools.partial(_reference, st), *a)[1](dout)

    op.defvjp(fwd, bwd)
    return op(*args)
