"""Fused linear + cross-entropy that never holds the logits (lecture 10, sec. 5.2).

With a 128K vocabulary the logits x @ W of a batch outweigh the model: 8192 tokens give a
[8192, 128256] array of 2.1 GB in bf16 (4.2 GB in float32), and its gradient as much again.
Here the vocabulary is walked in slabs of `slab` columns, and only one [N, slab] slab of logits
exists at a time (the Flash-Decoding idea applied to the vocabulary: partial log-sum-exps merged
with the online rule).

Forward, per slab: z = x @ W[:, slab] (one large matmul, cuBLAS on the GPU, logits in x's dtype
exactly as `x @ weight` rounds them), then one Pallas row pass folds the slab into each token's
running state (m, l, sum of logits, label's logit) with the online (m, l) merge, applying the
soft cap in float32 on the way. After the last slab, lse = m + log l gives the per-token loss.
On a Hopper GPU the forward instead runs one fused GEMM (`_hopper_gemm`, Pallas Mosaic GPU) over
all whole 256-column tiles of W, read in place: each [128, 128] logits tile is reduced to its
per-token partial state in registers and never written; the partials are merged here. Its two
compute warpgroups ping-pong (`HopperTiles`): one reduces its tile while the other multiplies.
It took the forward from 14.5 to 12.5-12.8 ms at N=8192, D=4096, V=128256 (XLA's 13.6-14.2).

Backward (`custom_vjp`, saves x, weight, labels, lse), per slab: recompute z, one Pallas pass
turns it in place into dz = (q (1 + 2 z_loss lse) - p) * g (times 1 - tanh^2 under a soft cap),
then two matmuls add dz @ W_slab^T into a float32 dx and give dW_slab = x^T dz whole (each element
accumulated over all tokens in float32 and cast once). No atomics: gradients are deterministic.
On a Hopper GPU (and D a multiple of 256) the three are Hopper GEMMs instead (`_backward_fused`):
dz straight from the logits tile in registers (no row pass), dx added by reducing TMA stores and
dW stored at its columns, both updated in place through JAX refs; W, x and dz are read in place
(the transposed operands by wgmma), so no weight slab is copied, no dW slab placed and no dW
zero-filled. With those temporaries gone the slabs are twice as wide for the same memory, and
their width is nudged so that the dz and dW GEMMs fill whole waves of the GPU (`whole_waves`).
Measured at N=8192, D=4096, V=128256 bf16 on an H200 (benchmarks/NOTES.md, runs 19-28): the
whole step 56.5 ms with cuBLAS around row passes, 54.8 with the Hopper forward, 52.9 with the
Hopper backward too, 51.5 with the forward ping-ponged (0.27 GB of temporaries), whole waves
took another 0.9 ms of kernel time off and a ping-ponged dz GEMM 0.3-0.6 ms of the step (runs
34-36); per 4096-column slab the dW GEMM beat cuBLAS (0.374 against 0.381-0.408 ms), the dz
GEMM matched it and dx lost (0.464 against 0.42: its float32 tile stores).

Why cuBLAS matmuls around Pallas row passes elsewhere rather than the matmul inside a Triton
kernel: the Pallas (Triton) tile matmul ran at 260-320 TFLOP/s on an H200 against 680-790 for
cuBLAS, and this op is all matmul (4 x 2NDV FLOPs: the logits are computed twice, the price of
not storing them, against XLA's 3). The row passes move 2 bytes per bf16 logit forward and 4
backward: ~0.5 and ~1 ms at N=8192, V=128256. Temporary memory: one slab (`_SLAB_BYTES`) + the
float32 dx + a weight slab (Hopper backward: one `_HOPPER_SLAB_BYTES` dz slab + the float32 dx),
whatever V is.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxfuse.pallas import _common as C
from jaxfuse.pallas import _hopper, _hopper_gemm, _rows
from jaxfuse.pallas import linear_cross_entropy_slabs as _slabs
from jaxfuse.pallas._rows import RowBlocks
from jaxfuse.pallas.cross_entropy import empty_state, fold_logits
from jaxfuse.reference import cross_entropy as ce
from jaxfuse.reference import linear_cross_entropy as ref

# Bytes of one [N, slab] logits slab on the GPU. Larger slabs mean fewer, larger matmuls and
# fewer read-modify-writes of the float32 dx accumulator, but more temporary memory. Measured on
# an H200 at N=8192, D=4096, V=128256 bf16 (BENCHMARKS.md, run 10): slabs of 2048 / 4096 / 8192
# / 16384 columns took 56.5 / 54.7 / 52.5 / 53.4 ms with 0.30 / 0.30 / 0.55 / 0.78 GB of
# temporaries; 64 MiB (4096 columns there) is the largest that stays under 5% of XLA's 6.3 GB.
_SLAB_BYTES = 64 << 20
# The Hopper backward copies no weight slab and places no dW slab: its temporaries are the dz
# slab and the float32 dx, so its slabs can be twice as wide for the same memory (run 20:
# 4096 / 8192 columns, 54.6 / 53.6 ms, 0.13 / 0.27 GB).
_HOPPER_SLAB_BYTES = 128 << 20

_INTERPRET_SLAB_BYTES = 4 << 20


@dataclasses.dataclass(frozen=True)
class HopperTiles:
    """The tiles of each Hopper GEMM of the LCE: the forward's (logits -> per-token statistics)
    and the backward's dz (logits -> dz, stored), dx (dz W^T, added into dx) and dW (x^T dz,
    stored). All four need the same m and n (their tiles partition the same columns).

    Defaults, from an H200 (benchmarks/NOTES.md, runs 24-25 and 33-36): the GEMMs with a heavy
    epilogue ping-pong (see `_hopper_gemm.Tiles.schedule`), each warpgroup's epilogue hidden
    under the other's MMAs: the forward's (an exp and four row sums per logit; forward 12.8 against
    13.5 ms) and dz's (an exp per logit and a bf16 tile stored; step 0.33-0.61 ms faster over
    12-16 interleaved rounds, runs 34-36), with at most 4 stages (with 6 the main loop lost 10%;
    likely a fuller shared memory leaving less L1). dx and dW, whose epilogues only store,
    cooperate on wider [m, 2n] tiles (a third fewer operand bytes per FLOP): ping-ponged, dx
    cost 1.3 ms more per step and dW lost 7% in isolation."""
    fwd: _hopper_gemm.Tiles = _hopper_gemm.Tiles(schedule="pingpong", stages=4)
    dz: _hopper_gemm.Tiles = _hopper_gemm.Tiles(schedule="pingpong", stages=4)
    dx: _hopper_gemm.Tiles = _hopper_gemm.Tiles()
    dw: _hopper_gemm.Tiles = _hopper_gemm.Tiles()

    @classmethod
    def of(cls, hopper: _hopper_gemm.Tiles | HopperTiles | bool | None) -> HopperTiles:
        """A `Tiles` means those tiles for every GEMM; True or None the defaults."""
        if isinstance(hopper, _hopper_gemm.Tiles):
            return cls(hopper, hopper, hopper, hopper)
        return hopper if isinstance(hopper, HopperTiles) else cls()

    def __post_init__(self):
        if len({(t.m, t.n) for t in (self.fwd, self.dz, self.dx, self.dw)}) != 1:
            raise ValueError(f"{self} must give every GEMM the same m and n")

    @property
    def cols(self) -> int:
        return self.fwd.cols


@dataclasses.dataclass(frozen=True)
class LCEBlocks:
    """`slab`: vocabulary columns per step (one [N, slab] matmul and logits buffer); None picks
    the largest power of two whose slab fits the memory budget (for the Hopper backward then
    nudged to whole waves of the GPU, `whole_waves`). `rows`: tiles of the two row
    passes over a slab (None: `RowBlocks.for_shape`). `hopper`: run the matmuls as Hopper GEMMs
    (`_hopper_gemm`, Mosaic GPU) where the shapes allow -- the forward's with N % 128 = 0,
    D % 64 = 0, V % 64 = 0 and 16-bit inputs, the backward's when also D % 256 = 0; None means on a
    Hopper GPU, True also in interpret mode (Mosaic GPU's interpreter), False never; a
    `jaxfuse.pallas._hopper_gemm.Tiles` means True with those tiles for every GEMM, a `HopperTiles`
    True with tiles per GEMM (True and None take `HopperTiles()`). `token_slab`: None, or a
    number of tokens: a differentiated loss reduced to one number then forms its gradient in
    the forward, that many tokens at a time (three products instead of four, one
    [token_slab, V] logits slab held; `linear_cross_entropy_slabs`; `jaxfuse.linear_cross_entropy`
    only, the bare `jaxfuse.pallas` kernel ignores it)."""
    slab: int | None = None
    rows: RowBlocks | None = None
    hopper: bool | _hopper_gemm.Tiles | HopperTiles | None = None
    token_slab: int | None = None

    def __post_init__(self):
        _slabs.check_token_slab(self.token_slab)

    @classmethod
    def for_shape(cls, n: int, d: int, itemsize: int, interpret: bool,
                  hopper: HopperTiles | None = None) -> LCEBlocks:
        """The default slab: the largest power of two of columns within the memory budget,
        for the Hopper backward (`hopper` tiles and D a multiple of their width) then nudged
        to whole waves of the GPU."""
        fused = _hopper_backward(hopper, d)
        budget = (_INTERPRET_SLAB_BYTES if interpret else
                  _HOPPER_SLAB_BYTES if fused else _SLAB_BYTES) // itemsize
        slab = max(128, C.prev_pow2(budget // max(n, 1)))
        if fused and not interpret:
            slab = whole_waves(slab, n, d, hopper, C.num_multiprocessors())
        return cls(slab)


@dataclasses.dataclass(frozen=True)
class _Static:
    label_smoothing: float
    ignore_index: int
    z_loss: float
    softcap: float | None
    v: int
    slab: int
    rows: RowBlocks
    interpret: bool
    hopper: HopperTiles | None     # None: cuBLAS + row passes only
    n_cls: int | None = None       # the whole vocabulary when W holds a slice of it (else v)

    @property
    def classes(self) -> int:
        return self.v if self.n_cls is None else self.n_cls


def _capped(z, softcap):
    """Float32 logits after the soft cap c tanh(z / c), and tanh(z / c) (None without a cap).
    The cap keeps 0 at 0, so fill-0 tiles still sum correctly in `fold_logits`."""
    if softcap is None:
        return z, None
    t = jnp.tanh(z / softcap)
    return softcap * t, t


def _over_columns(step, carry, lo: int, hi: int, slab: int):
    """`carry = step(offset, width, carry)` for the vocabulary columns [lo, hi) in slabs of
    `slab`: a loop over the full slabs (one compiled body, the offset traced) and the narrower
    tail, if any, after it."""
    n_full, tail = divmod(hi - lo, slab)
    if n_full:
        carry = jax.lax.fori_loop(0, n_full, lambda i, c: step(lo + i * slab, slab, c), carry)
    if tail:
        carry = step(hi - tail, tail, carry)
    return carry


def _w_slab(w, off, width: int):
    """W[:, off:off + width] (a copy: cuBLAS wants its operands whole)."""
    return jax.lax.dynamic_slice_in_dim(w, off, width, axis=1)


def _tile_columns(st: _Static) -> int:
    """The columns [0, v_h) the Hopper GEMMs take: whole CTA tiles of W."""
    return st.v // st.hopper.cols * st.hopper.cols


def _fold_slab(z, labels_rel, state, st: _Static):
    """The running per-token state (m, l, sum of logits, label's logit), each [N] float32, with
    the logits slab z [N, width] folded in. `labels_rel` is labels minus the slab's offset."""
    def step(s, tile):
        return fold_logits(s, _capped(tile.x[0], st.softcap)[0], tile.valid, tile.cols,
                           tile.per_row[0])

    return _rows.reduce_pass(lambda per_row: per_row[1:], step, lambda s, _: s, tiled=[z],
                             fills=[0.0], per_row=[labels_rel, *state],
                             out_dtypes=(jnp.float32,) * 4, blocks=st.rows,
                             name="jaxfuse_linear_cross_entropy_fwd", interpret=st.interpret)


def _logits_grad(zc, th, cols, label, lse, g, st: _Static):
    """dz at the capped logits zc (columns `cols`), for the row pass and the Hopper epilogue
    alike: `ce.logits_grad` times the soft cap's derivative 1 - tanh(z / c)^2 (th: tanh(z / c),
    None without a cap)."""
    dz = ce.logits_grad(zc, cols, label, lse, g, st.classes, label_smoothing=st.label_smoothing,
                        z_loss=st.z_loss)
    return dz if th is None else dz * (1.0 - th * th)


def _dz_slab(z, labels_rel, lse, g, st: _Static):
    """dz for the logits slab z [N, width], written over z."""
    def emit(tile):
        label, lse_, g_ = tile.per_row
        return (_logits_grad(*_capped(tile.x[0], st.softcap), tile.cols, label, lse_, g_, st),
                ), (), ()

    (dz,) = _rows.map_pass(emit, tiled=[z], fills=[0.0], per_row=[labels_rel, lse, g],
                           out_dtypes=(z.dtype,), blocks=st.rows, in_place=True,
                           name="jaxfuse_linear_cross_entropy_bwd", interpret=st.interpret)
    return dz


def _fold_hopper(x2, w, labels, state, st: _Static):
    """Folds the columns [0, v_h) of W, v_h the largest multiple of the Hopper CTA tile, into
    the per-token state with the fused GEMM: each warpgroup tile writes its partial (m, l, sum,
    label's logit) per token, and the partials of a chunk of columns are merged here (the
    Flash-Decoding merge). Chunks keep the partials near `_SLAB_BYTES / 2`; W is read in
    place. Returns the state and v_h."""
    t = st.hopper.fwd
    n = x2.shape[0]
    v_h = _tile_columns(st)
    band = t.cols * t.band
    # 4 float32 partials per token per t.n columns: 16 n / t.n bytes per column.
    chunk = max(band, (_SLAB_BYTES // 2) // (16 * n) * t.n // band * band)
    labels_row = labels.astype(jnp.float32)[None]
    for lo in range(0, v_h, chunk):
        width = min(chunk, v_h - lo)
        tiles = width // t.n
        # The chunks are independent, and XLA would run all of them before the first merge,
        # holding every chunk's partials at once (1 GB at N=32768, V=262144): the barrier makes
        # each chunk's kernel wait for the previous merge.
        x_dep, state = lax.optimization_barrier((x2, state))
        parts = _hopper_gemm.matmul_epilogue(
            x_dep, w, lo, labels_row, b_window=width,
            epilogue=functools.partial(_stats_epilogue, st=st, dtype=x2.dtype),
            out_types=jax.ShapeDtypeStruct((tiles * 4, n), jnp.float32),
            scratch_types=plgpu.SMEM((2, 4, t.m), jnp.float32), tiles=t, interpret=st.interpret,
            name="jaxfuse_linear_cross_entropy_fwd_hopper").reshape(tiles, 4, n)
        state = _merge(state, parts)
    return state, v_h


def _epilogue_chunks(z, st: _Static, ctx, dtype, epi: int):
    """The accumulator tile z [m, n] of the logits in column chunks of `epi` (the temporaries of
    a whole tile at once would not fit the registers): (chunk offset, logits rounded as
    `x @ weight` rounds them and capped in float32 as in the row passes, tanh(z / c) or None,
    vocabulary column of each entry, broadcast of a per-row [m] vector to the chunk). The row
    passes' [m, 1] keepdims form fails Mosaic GPU's layout inference (jax 0.10.2, checked by
    the lowering test), hence [m] vectors broadcast explicitly."""
    for j in range(0, z.shape[1], epi):
        zj, th = _capped(z[:, j:j + epi].astype(dtype).astype(jnp.float32), st.softcap)
        cols = lax.broadcasted_iota(jnp.int32, zj.shape, 1) + (ctx.off + ctx.col + j)
        yield j, zj, th, cols, functools.partial(lax.broadcast_in_dim, shape=zj.shape,
                                                 broadcast_dimensions=[0])


def _stats_epilogue(z, rows, ctx, st: _Static, dtype):
    """One [m, n] logits tile -> its per-token (max, sum exp(z - finite_shift(max)), sum z,
    label's logit), written to the tile's 4 rows of the partials, folded chunk by chunk with
    the online (m, l) merge."""
    rows_t, cols_t = z.shape
    label = rows[0].astype(jnp.int32)
    state = None
    fs = C.finite_shift      # each l relative to its max's finite shift (`_merge`)
    for _, zj, _, cols, row_wise in _epilogue_chunks(z, st, ctx, dtype, st.hopper.fwd.epi):
        mj = zj.max(axis=1)
        part = (mj, jnp.exp(zj - row_wise(fs(mj))).sum(axis=1), zj.sum(axis=1),
                jnp.where(cols == row_wise(label), zj, 0.0).sum(axis=1))
        if state is None:
            state = part
        else:
            m = jnp.maximum(state[0], mj)
            shift = fs(m)
            state = (m, state[1] * C.rescale(state[0], shift) + part[1] * C.rescale(mj, shift),
                     state[2] + part[2], state[3] + part[3])
    smem = ctx.scratch
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the previous tile's stats have left
    for i, s in enumerate(state):
        smem[ctx.wg, i] = s
    plgpu.commit_smem()
    tile = ctx.col // cols_t
    plgpu.copy_smem_to_gmem(smem.at[ctx.wg],
                            ctx.outs[0].at[pl.ds(tile * 4, 4), pl.ds(ctx.row, rows_t)])


def _dz_epilogue(z, rows, ctx, st: _Static, dtype):
    """One [m, n] logits tile -> dz (as `_dz_slab`), stored in x's dtype at the tile's place in
    the slab's dz."""
    label, lse, g = rows
    label = label.astype(jnp.int32)
    k = 0
    for j, zj, th, cols, row_wise in _epilogue_chunks(z, st, ctx, dtype, st.hopper.dz.epi):
        dz = _logits_grad(zj, th, cols, row_wise(label), row_wise(lse), row_wise(g), st)
        k = _hopper_gemm.store_tile(dz.astype(dtype), ctx.scratch.at[ctx.wg], ctx.outs[0], ctx.row,
                               ctx.col + j, k=k)


def _dx_epilogue(z, rows, ctx, interpret: bool):
    """dx[tile] += the tile of dz @ W_slab^T (float32, in place)."""
    _hopper_gemm.add_tile(z, ctx.scratch.at[ctx.wg], ctx.outs[0], ctx.row, ctx.col, interpret)


def _dw_epilogue(z, rows, ctx, dtype):
    """dW[:, off + tile] = the tile of x^T dz, accumulated over all tokens in float32 and
    rounded once, stored in place."""
    _hopper_gemm.store_tile(z.astype(dtype), ctx.scratch.at[ctx.wg], ctx.outs[0], ctx.row,
                       ctx.off + ctx.col)


def _merge(state, parts):
    """state (m, l, sum, picked), each [N], merged with partials [tiles, 4, N] of disjoint
    column tiles: the online-softmax merge m = max m_i, l = sum l_i exp(m_i - m), each l
    relative to its max's `finite_shift` (as `cross_entropy`'s pass): a +inf logit (a product
    past float32's range) gives lse = +inf, as the reference's logsumexp, not NaN."""
    m0, l0, s0, p0 = state
    m_t, l_t, s_t, p_t = (parts[:, i] for i in range(4))
    m = jnp.maximum(m0, m_t.max(axis=0))
    shift = C.finite_shift(m)
    l = l0 * C.rescale(m0, shift) + (l_t * C.rescale(m_t, shift)).sum(axis=0)
    return m, l, s0 + s_t.sum(axis=0), p0 + p_t.sum(axis=0)


def _forward(x2, w, labels, st: _Static, offset=0, merge=None):
    """(per-token loss, lse). With W a slice of the vocabulary starting at column `offset`
    (vocab parallel, `sharding.rows`), `merge` combines the per-token states of all slices."""
    local = labels - offset

    def step(off, width, state):
        return _fold_slab(jnp.dot(x2, _w_slab(w, off, width)), local - off, state, st)

    state = tuple(s[:, 0] for s in empty_state(x2.shape[0]))
    start = 0
    if st.hopper is not None:
        state, start = _fold_hopper(x2, w, local, state, st)
    state = _over_columns(step, state, start, st.v, st.slab)
    m, l, sum_z, picked = state if merge is None else merge(state)
    lse = m + jnp.log(l)
    loss = ce.loss_from_stats(lse, picked, sum_z, labels, st.classes,
                              label_smoothing=st.label_smoothing, ignore_index=st.ignore_index,
                              z_loss=st.z_loss)
    return loss, lse


def whole_waves(slab: int, n: int, d: int, tiles: HopperTiles, sms: int) -> int:
    """A Hopper backward slab near `slab` columns (at most 1/8 wider) whose dz and dW GEMMs
    are whole waves of `sms` multiprocessors, else `slab`. A persistent GEMM of T tiles takes
    ceil(T / sms) tile times, so 2048 dz tiles (N=8192, slab 8192) on 132 SMs take 16 where
    15.5 would do, and dW's 1024 take 8 for 7.8: 33 column tiles (8448 columns) make 2112 and
    1056, whole waves, for 3% more memory. dx's tiles ([N, D]) do not depend on the slab."""
    cols = tiles.cols

    def period(rows: int, t: _hopper_gemm.Tiles) -> int:
        # Tiles per slab column tile: (rows / m) of them, twice as many when ping-ponged.
        per_col = rows // t.m * (2 if t.schedule == "pingpong" else 1)
        return sms // math.gcd(sms, per_col)

    q = math.lcm(period(n, tiles.dz), period(d, tiles.dw))   # in column tiles
    budget = slab // cols
    fits = [k * q for k in (budget // q, -(-budget // q)) if 0 < k * q <= budget * 9 // 8]
    return min(fits, key=lambda c: abs(c - budget)) * cols if fits else slab


def _hopper_backward(tiles: HopperTiles | None, d: int) -> bool:
    """Whether the backward runs on the Hopper GEMMs too: their dx tiles are [m, 2n] of D."""
    return tiles is not None and d % tiles.cols == 0


def _backward(x2, w, labels, lse, g, st: _Static):
    if _hopper_backward(st.hopper, x2.shape[1]):
        return _backward_hopper(x2, w, labels, lse, g, st)

    def step(off, width, carry):
        dx, dw = carry
        w_s = _w_slab(w, off, width)
        dz = _dz_slab(jnp.dot(x2, w_s), labels - off, lse, g, st)         # [N, width]
        dx = dx + jnp.einsum("nv,dv->nd", dz, w_s, preferred_element_type=jnp.float32)
        # dW_slab over all N tokens in one matmul: cuBLAS (and XLA on the CPU) accumulate a
        # 16-bit GEMM in float32 and round each element once, so asking for w's dtype directly
        # is "accumulate in float32, cast once" without a float32 [D, slab] temporary.
        dw_s = jnp.einsum("nd,nv->dv", x2, dz)
        return dx, jax.lax.dynamic_update_slice_in_dim(dw, dw_s, off, axis=1)

    init = (jnp.zeros(x2.shape, jnp.float32), jnp.zeros_like(w))
    dx, dw = _over_columns(step, init, 0, st.v, st.slab)
    return dx.astype(x2.dtype), dw


def _backward_hopper(x2, w, labels, lse, g, st: _Static):
    """The backward with the Hopper GEMM: per slab of columns, dz from the logits tile in
    registers (no row pass), then dx += dz W_slab^T and dW[:, slab] = x^T dz, each a GEMM that
    reads W, x and dz in place and updates dx (float32) and dW in place: no slab of W copied,
    no dW slab placed, no dW zero-filled."""
    run = jax.custom_batching.custom_vmap(
        _hopper.discharged(functools.partial(_backward_fused, st=st)))

    @run.def_vmap
    def _one_by_one(axis_size, in_batched, *args):
        # The kernels update dx and dW through refs, which pallas kernels do not batch: the
        # examples run one after another (memory stays that of one example).
        def one(batched):
            it = iter(batched)
            return run(*[next(it) if b else a for a, b in zip(args, in_batched)])
        return lax.map(one, [a for a, b in zip(args, in_batched) if b]), (True, True)

    return run(x2, w, labels, lse, g)


def _backward_fused(x2, w, labels, lse, g, st: _Static):
    """(dx, dW) of `_backward_hopper`, with dx and dW as refs (see `_hopper.discharged`)."""
    t = st.hopper
    n, d = x2.shape
    v_h = _tile_columns(st)
    slab = max(t.cols, st.slab // t.cols * t.cols)
    per_row = jnp.stack([labels.astype(jnp.float32), lse, g])
    kw = dict(interpret=st.interpret)
    # Mosaic GPU's interpreter in jax 0.10 needs the refs' memory space spelled out; jax 0.11's
    # discharge of the loop below (compiled, and interpreted under vmap's lax.map) sees unequal
    # carry types with it (float32<gmem> in, float32 out), and its interpreter does without.
    space = {"memory_space": plgpu.GMEM} if st.interpret and _hopper.INTERPRETER_010 else {}
    dx = jax.new_ref(jnp.zeros((n, d), jnp.float32), **space)
    dw = jax.new_ref(_hopper.uninitialized(w.shape, w.dtype, st.interpret), **space)

    def columns(off, width, carry):          # dx and dW are refs: nothing to carry
        dz = _hopper_gemm.matmul_epilogue(
            x2, w, off, per_row, b_window=width,
            epilogue=functools.partial(_dz_epilogue, st=st, dtype=x2.dtype),
            out_types=jax.ShapeDtypeStruct((n, width), x2.dtype),
            scratch_types=_hopper_gemm.tile_smem(x2.dtype, t.dz), name="jaxfuse_lce_bwd_dz",
            batchable=False, tiles=t.dz, **kw)
        _hopper_gemm.matmul_epilogue(
            dz, w, off, b_t=True, b_window=width, refs=(dx,),
            epilogue=functools.partial(_dx_epilogue, interpret=st.interpret),
            scratch_types=_hopper_gemm.tile_smem(jnp.float32, t.dx), name="jaxfuse_lce_bwd_dx",
            tiles=t.dx, **kw)
        _hopper_gemm.matmul_epilogue(
            x2, dz, off, a_t=True, refs=(dw,),
            epilogue=functools.partial(_dw_epilogue, dtype=w.dtype),
            scratch_types=_hopper_gemm.tile_smem(w.dtype, t.dw), name="jaxfuse_lce_bwd_dw",
            tiles=t.dw, **kw)

    _over_columns(columns, None, 0, v_h, slab)
    if v_h < st.v:                       # the last < 2 n columns: cuBLAS and the row pass
        w_t = w[:, v_h:]
        dz = _dz_slab(jnp.dot(x2, w_t), labels - v_h, lse, g, st)
        dx[...] = dx[...] + jnp.einsum("nv,dv->nd", dz, w_t, preferred_element_type=jnp.float32)
        dw[:, v_h:] = jnp.einsum("nd,nv->dv", x2, dz)
    return dx[...].astype(x2.dtype), dw[...]


def _hopper_tiles(hopper: bool | _hopper_gemm.Tiles | HopperTiles | None, x2, w,
                  interpret: bool) -> HopperTiles | None:
    """The fused Hopper GEMMs' tiles if they are to be used, else None (see
    `LCEBlocks.hopper`). They need whole token tiles and 16-bit operands; other shapes take the
    cuBLAS path."""
    if hopper is False or (hopper is None and (interpret or not _hopper.available())):
        return None
    if hopper is not None:
        _hopper.check_forced(f"LCEBlocks(hopper={hopper})")
    tiles = HopperTiles.of(hopper)
    t = tiles.fwd
    # Labels travel to the kernel as float32 (per-row values): exact below 2^24.
    if not (all(_hopper_gemm.fits(x2, w, u) for u in (t, tiles.dz, tiles.dx, tiles.dw))
            and w.shape[1] < 1 << 24):
        if hopper:
            raise ValueError(
                f"LCEBlocks(hopper=True) needs bf16/f16 x and weight of one dtype, tokens a "
                f"multiple of {t.m}, D of {t.k}, V of 64 and V < 2^24; got x {x2.shape} "
                f"{x2.dtype}, weight {w.shape} {w.dtype}. Use hopper=None to fall back where it "
                f"does not fit")
        return None
    return tiles


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def token_loss(x2, w, labels, st: _Static):
    """Per-token loss [N] (0 at ignored tokens, NaN at out-of-range labels)."""
    return _forward(x2, w, labels, st)[0]


def _token_loss_fwd(x2, w, labels, st):
    loss, lse = _forward(x2, w, labels, st)
    return loss, (x2, w, labels, lse)


def _token_loss_bwd(st, res, g):
    x2, w, labels, lse = res
    dx, dw = _backward(x2, w, labels, lse, ce.token_cotangent(g, labels, st.classes, st.ignore_index),
                       st)
    return dx, dw, jnp.zeros(labels.shape, jax.dtypes.float0)


token_loss.defvjp(_token_loss_fwd, _token_loss_bwd)


def linear_cross_entropy(x: jax.Array, weight: jax.Array, labels: jax.Array, *,
                         label_smoothing: float = 0.0, ignore_index: int = -100,
                         z_loss: float = 0.0, logits_soft_cap: float | None = None,
                         reduction: str = "mean", interpret: bool | None = None,
                         block_sizes: LCEBlocks | None = None) -> jax.Array:
    """Pallas linear + cross-entropy; see `jaxfuse.reference.linear_cross_entropy`."""
    ref.validate(x, weight, labels, label_smoothing, reduction, z_loss, logits_soft_cap,
                 ignore_index)
    labels = ce.canonical_labels(labels, weight.shape[1], ignore_index)
    x2 = x.reshape(-1, weight.shape[0])
    st = static(x2, weight, label_smoothing=label_smoothing, ignore_index=ignore_index,
                z_loss=z_loss, logits_soft_cap=logits_soft_cap, interpret=interpret,
                block_sizes=block_sizes)
    labels1 = labels.reshape(-1)
    loss = token_loss(x2, weight, labels1, st).reshape(labels.shape)
    return ce.reduce_loss(loss, labels != ignore_index, reduction)


def static(x2, weight, *, label_smoothing, ignore_index, z_loss, logits_soft_cap, interpret,
           block_sizes: LCEBlocks | None, n_cls: int | None = None) -> _Static:
    """The settings for x2 [N, D] and weight [D, V] (also used per shard by `sharding`, where
    weight is a slice of `n_cls` classes)."""
    interpret = C.resolve_interpret(interpret)
    d, v = weight.shape
    n = x2.shape[0]
    blocks = block_sizes or LCEBlocks()
    tiles = _hopper_tiles(blocks.hopper, x2, weight, interpret)
    slab = blocks.slab
    if slab is None:
        slab = LCEBlocks.for_shape(n, d, x2.dtype.itemsize, interpret, tiles).slab
    if not (isinstance(slab, int) and slab >= 1):
        raise ValueError(f"slab={slab!r} must be a positive number of vocabulary columns")
    slab = min(slab, v)                       # a slab wider than the vocabulary is all of it
    rows = _rows.resolve_blocks(blocks.rows, n, slab, interpret)
    return _Static(float(label_smoothing), int(ignore_index), float(z_loss),
                   None if logits_soft_cap is None else float(logits_soft_cap), v, slab, rows,
                   interpret, tiles, n_cls)
