"""The matmul of a decoding step: a few rows (one token per sequence) times a weight read once at
the copy rate, with the block's norm fused before it and SwiGLU or the residual add after it,
in one launch.

A decoding step multiplies [B, K] activations (B = 32 tokens) by each weight of the model: about
2 FLOPs per weight byte, so each matmul is a stream of its weight, and a step is a chain of such
streams. XLA's GEMM for 32 rows splits K over CTAs and adds the partial products in a second
kernel, and the norms around it are further kernels: on an H200 the 157M model's step is ~10
dependent launches a layer (benchmarks/NOTES.md s23 items 4-5), each costing 1-4 us of launch
and latency over its bytes. One program per output tile walking all of K is no better: its
products chain through one accumulator, and too few programs keep the memory busy (NOTES s24
item 1). So here too K is split over programs, but the partial sums are added in the same
launch (split-K with a serial fix-up):

    program (i, j, s) multiplies rows tile i by output features tile j over K range s (the
    weight's rows [N, K]: each feature's weights one contiguous row, streamed once), writes its
    float32 partial to a workspace and counts itself in tile (i, j)'s counter (an atomic add);
    the program that arrives last adds the partials in split order (deterministic: the same
    sum whatever order the programs ran in), runs the epilogue and writes the tile.

Norms (prologue). RMSNorm folds into the epilogue: y @ w = rstd * ((x * g) @ w), rstd a scale
per row, so no program needs the row statistics first: each adds its K range's sum of squares
(the diagonal of x x^T, on the matrix unit) to its partial. LayerNorm cannot fold so (subtracting
mean * (g @ w) afterwards cancels catastrophically when |mean| >> std, after x * g was rounded for
the matrix unit): each program first merges the whole rows' exact (count, mean, m2) by Chan's
rule, as `layer_norm` does, then normalizes its chunks.

SwiGLU (epilogue): the program also streams the same rows of `gate_weight` and the tile is
silu(y @ gate_weight.T) * (y @ weight.T); the gate/up product never reaches memory. Residual
(epilogue): out = residual + product, the block's residual add, so the next norm needs no add.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jaxfuse.pallas import _common as C
from jaxfuse.pallas import _norm
from jaxfuse.reference import add_norm as _an
from jaxfuse.reference import decode_linear as ref
from jaxfuse.reference.layer_norm import welford_merge


@dataclasses.dataclass(frozen=True)
class LinearBlocks:
    """Tiles of `decode_linear` (None: the rule of `_blocks`): `block_m` rows and `block_n`
    output features a program, K in chunks of `block_k`, split over `k_splits` programs a tile
    (1: no split, no workspace). `num_*` only matter on the GPU."""
    block_m: int | None = None
    block_n: int | None = None
    block_k: int | None = None
    k_splits: int | None = None
    programs_per_sm: int = 2     # what k_splits=None aims at: programs a multiprocessor
    num_warps: int = 2
    num_stages: int = 3

    def validate(self) -> None:
        for name in ("block_m", "block_n", "block_k", "k_splits", "programs_per_sm",
                     "num_warps", "num_stages"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, int) and v >= 1):
                raise ValueError(f"LinearBlocks({name}={v!r}): {name} must be a positive int")
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v is not None and (v < 16 or v != C.next_pow2(v)):
                raise ValueError(f"LinearBlocks({name}={v}) must be a power of two >= 16 (the "
                                 f"matrix unit's smallest tile), e.g. 32")


@dataclasses.dataclass(frozen=True)
class _Static:
    m: int
    n: int
    k: int
    bm: int
    bn: int
    bk: int
    splits: int           # programs a tile, each over `chunks` chunks of K
    chunks: int
    norm: str | None
    eps: float
    has_norm_weight: bool
    has_norm_bias: bool
    gated: bool
    residual: bool
    interpret: bool

    @property
    def tiles(self) -> tuple[int, int]:
        return C.cdiv(self.m, self.bm), C.cdiv(self.n, self.bn)


# What the staged chunks may take of a multiprocessor's shared memory (227 KiB on an H100/H200;
# Triton adds its own scratch for the layouts' conversions).
SHARED_BYTES = 160 * 1024


def _blocks(m: int, n: int, k: int, blocks: LinearBlocks | None, interpret: bool,
            gated: bool, itemsize: int) -> tuple:
    """(bm, bn, bk, splits, chunks). Interpreted: one program sees everything (house style)
    unless a tile is asked for. On the GPU: every row in one program (up to 64), 32 output
    features (with 2 warps: Triton lays a [32, 32] product's warps over the rows, and a third
    or fourth warp would repeat their work), K in chunks of 128, split so that there are
    about `programs_per_sm` programs a multiprocessor."""
    blocks = blocks or LinearBlocks()
    blocks.validate()
    if interpret:
        bm, bn, bk = blocks.block_m or m, blocks.block_n or n, blocks.block_k or k
    else:
        bm = blocks.block_m or min(max(C.next_pow2(m), 16), 64)
        bn = blocks.block_n or 32
        bk = blocks.block_k or min(max(C.next_pow2(k), 16), 128)
        if blocks.block_k is None:      # the pipeline's stages of x and weight chunks must fit
            per_k = (bm + bn * (1 + gated)) * itemsize * blocks.num_stages
            while bk > 16 and per_k * bk > SHARED_BYTES:
                bk //= 2
    n_chunks = C.cdiv(k, bk)
    splits = blocks.k_splits
    if splits is None:
        tiles = C.cdiv(m, bm) * C.cdiv(n, bn)
        splits = 1 if interpret else C.cdiv(blocks.programs_per_sm * C.num_multiprocessors(),
                                             tiles)
    chunks = C.cdiv(n_chunks, min(splits, n_chunks))
    return bm, bn, bk, C.cdiv(n_chunks, chunks), chunks


def _kernel(x_ref, w_ref, *refs, st: _Static):
    # x_ref [M, K], w_ref / gw_ref [N, K], nw_ref / nb_ref [K], r_ref [M, N], count_ref
    # [row tiles * col tiles] int32 (zeros); outputs o_ref [M, N], then with splits > 1 the
    # workspace: part_ref (and gpart_ref) [splits * bm row tiles, N] and, for RMSNorm, ss_ref
    # [splits * bm row tiles, col tiles] float32, and count_out_ref (count_ref, aliased).
    refs = list(refs)
    gw_ref = refs.pop(0) if st.gated else None
    nw_ref = refs.pop(0) if st.has_norm_weight else None
    nb_ref = refs.pop(0) if st.has_norm_bias else None
    r_ref = refs.pop(0) if st.residual else None
    count_ref = refs.pop(0) if st.splits > 1 else None
    o_ref = refs.pop(0)
    i, j, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    row0, col0 = i * st.bm, j * st.bn
    n_k = C.cdiv(st.k, st.bk)

    # The splits' chunks may reach past K (the last split's tail): those load as zeros.
    over = st.splits * st.chunks * st.bk > st.k

    def x_chunk(k0, predicate=over):
        x, _, _, valid = C.load_tile(x_ref, row0, k0, st.bm, st.bk, st.m, st.k,
                                     predicate=predicate)
        return x, valid

    def per_col(ref, k0):
        return C.load_vec(ref, k0, st.bk, st.k).astype(jnp.float32)[None, :]   # [1, bk]

    def dot(a, b):        # [m, k] x [n, k] -> [m, n], float32 (exact float32 for float32 input)
        prec = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
        return jnp.einsum("mk,nk->mn", a, b, preferred_element_type=jnp.float32,
                          precision=prec)

    mean = rstd = None
    if st.norm == "layer":       # the whole rows' statistics: Chan's merge of exact chunks
        def stats(kk, state):
            x, valid = x_chunk(kk * st.bk, predicate=False)
            return welford_merge(state, _norm.row_state(x.astype(jnp.float32), valid,
                                                        center=True))
        zero = tuple(jnp.zeros((st.bm, 1), jnp.float32) for _ in range(3))
        mean, rstd = _norm._finalize(C.reduce_tiles(n_k, stats, zero), st.eps)

    def step(kk, carry):
        acc, acc_g, gram = carry
        k0 = (s * st.chunks + kk) * st.bk
        x, _ = x_chunk(k0)                                          # [bm, bk]
        if st.norm == "rms":
            # row sums of squares on the matrix unit: the diagonal of x x^T, one more product
            # instead of squaring and reducing x across the threads every chunk
            gram = gram + dot(x, x)
        xf = x.astype(jnp.float32)
        if st.norm == "layer":
            xf = (xf - mean) * rstd
        if st.has_norm_weight:
            xf = xf * per_col(nw_ref, k0)
        if st.has_norm_bias:
            xf = xf + per_col(nb_ref, k0)
        y = xf.astype(x_ref.dtype)                                  # the matmul input
        w, *_ = C.load_tile(w_ref, col0, k0, st.bn, st.bk, st.n, st.k,
                              predicate=over)
        acc = acc + dot(y, w)                                       # [bm, bn]
        if st.gated:
            g, *_ = C.load_tile(gw_ref, col0, k0, st.bn, st.bk, st.n, st.k,
                              predicate=over)
            acc_g = acc_g + dot(y, g)
        return acc, acc_g, gram

    zeros = jnp.zeros((st.bm, st.bn), jnp.float32)
    acc, acc_g, gram = C.reduce_tiles(st.chunks, step, (
        zeros, zeros, jnp.zeros((st.bm, st.bm) if st.norm == "rms" else (1, 1), jnp.float32)))
    ss = None
    if st.norm == "rms":
        eye = (jax.lax.broadcasted_iota(jnp.int32, gram.shape, 0)
               == jax.lax.broadcasted_iota(jnp.int32, gram.shape, 1))
        ss = jnp.sum(jnp.where(eye, gram, 0.0), axis=-1, keepdims=True)        # [bm, 1]

    def epilogue(acc, acc_g, ss):
        if st.norm == "rms":
            scale = jax.lax.rsqrt(ss / st.k + st.eps)
            acc = acc * scale
            acc_g = acc_g * scale if st.gated else None
        out = jax.nn.silu(acc_g) * acc if st.gated else acc
        if st.residual:
            r, *_ = C.load_tile(r_ref, row0, col0, st.bm, st.bn, st.m, st.n)
            out = r.astype(jnp.float32) + out
        C.store_tile(o_ref, out, row0, col0, st.m, st.n)

    if st.splits == 1:
        epilogue(acc, acc_g, ss)
        return
    part_ref = refs.pop(0)
    gpart_ref = refs.pop(0) if st.gated else None
    ss_ref = refs.pop(0) if st.norm == "rms" else None
    rows_p = st.tiles[0] * st.bm                     # a split's rows in the workspace
    p0 = s * rows_p + row0
    # The workspace holds whole tiles: no masks (the epilogue masks what it writes).
    pltriton.store(part_ref.at[pl.ds(p0, st.bm), pl.ds(col0, st.bn)], acc)
    if st.gated:
        pltriton.store(gpart_ref.at[pl.ds(p0, st.bm), pl.ds(col0, st.bn)], acc_g)
    if st.norm == "rms":
        pltriton.store(ss_ref.at[pl.ds(p0, st.bm), pl.ds(j, 1)], ss)
    # Every thread's partial is written before the count says so (the atomic is acquire-release
    # at GPU scope, issued after this barrier); the last program then reads all of them.
    if not st.interpret:          # interpreted, programs run one after another
        pltriton.debug_barrier()
    arrived = pltriton.atomic_add(count_ref, (i * st.tiles[1] + j,), jnp.array(1, jnp.int32))

    @pl.when(arrived == st.splits - 1)
    def _fix_up():
        # Every partial's load is issued before the first add (a static loop: a loop of
        # load-then-add waits one L2 round trip per split), then they are added in split order.
        def read(ref, q, c0, w):     # volatile: from L2, never an L1 line of an earlier call
            return pltriton.load(ref.at[pl.ds(q * rows_p + row0, st.bm), pl.ds(c0, w)],
                                 volatile=True)
        parts = [read(part_ref, q, col0, st.bn) for q in range(st.splits)]
        gparts = [read(gpart_ref, q, col0, st.bn) for q in range(st.splits)] if st.gated else []
        sss = [read(ss_ref, q, j, 1) for q in range(st.splits)] if st.norm == "rms" else []
        total = lambda xs: functools.reduce(jnp.add, xs) if xs else None
        epilogue(total(parts), total(gparts), total(sss))


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
    blocks = block_sizes or LinearBlocks()
    bm, bn, bk, splits, chunks = _blocks(m, n, k, blocks, interpret, gate_weight is not None,
                                         x.dtype.itemsize)
    st = _Static(m, n, k, bm, bn, bk, splits, chunks, norm, eps, norm_weight is not None,
                 norm_bias is not None, gate_weight is not None, residual is not None,
                 interpret)
    args = [x2, weight] + [a for a in (gate_weight, norm_weight, norm_bias) if a is not None]
    if residual is not None:
        args.append(residual.reshape(m, n))
    run = functools.partial(_run, st=st, interpret=interpret, blocks=blocks)
    return _with_reference_grad(run, st, *args).reshape(*lead, n)


def _run(*args, st: _Static, interpret: bool, blocks: LinearBlocks):
    out = [jax.ShapeDtypeStruct((st.m, st.n), args[0].dtype)]
    aliases = None
    if st.splits > 1:
        rt, ct = st.tiles
        ws = (st.splits * rt * st.bm, ct * st.bn)
        out += [jax.ShapeDtypeStruct(ws, jnp.float32)] * (1 + st.gated)
        if st.norm == "rms":
            out.append(jax.ShapeDtypeStruct((ws[0], ct), jnp.float32))
        out.append(jax.ShapeDtypeStruct((rt * ct,), jnp.int32))
        # Zeros made in the call: XLA fills them off the chain of dependent launches (they
        # depend on nothing); the last program of each tile leaves its count at splits.
        args = (*args, jnp.zeros((rt * ct,), jnp.int32))
        aliases = {len(args) - 1: len(out) - 1}
    outs = C.pallas_call(
        functools.partial(_kernel, st=st), out_shape=tuple(out),
        grid=(*st.tiles, st.splits), name="jaxfuse_decode_linear", interpret=interpret,
        num_warps=blocks.num_warps, num_stages=blocks.num_stages,
        input_output_aliases=aliases)(*args)
    return outs[0]


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
