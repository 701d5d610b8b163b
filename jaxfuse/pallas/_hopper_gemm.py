"""A @ B on a Hopper GPU with each output tile handed to an epilogue (Pallas Mosaic GPU).

A persistent, warp-specialized GEMM: one CTA per multiprocessor walks the output tiles; a
memory warpgroup streams A and B tiles into shared memory with TMA (up to `tiles.stages` deep),
two compute warpgroups each multiply into a [tiles.m, tiles.n] float32 accumulator with wgmma,
then call `epilogue` on it: the linear + cross-entropy reduces a logits tile to per-token
statistics (never stored), or turns it into dz, or stores it, possibly into a buffer updated
in place. Two schedules (`Tiles.schedule`): "cooperative", both warpgroups on the halves of one
[m, 2n] tile (one A tile feeds both; their epilogues run together while the tensor cores
wait), and "pingpong", each warpgroup on a tile of its own, one multiplying while the other
runs its epilogue (it reads a third more operand bytes per FLOP: on an H200 it won where the
epilogue is heavy -- the LCE forward's statistics and its dz -- and lost where the epilogue
only stores a tile, dx and dW; benchmarks/NOTES.md runs 24-25, 34-36).

Operands are read in place, never copied: either may be transposed (wgmma reads a transposed
16-bit tile from shared memory as cheaply as a plain one: x^T for dW = x^T dz, W^T for
dx = dz W^T), and B may be a window of columns [off, off + width) of a larger matrix, `off`
a traced scalar (the vocabulary slab of a loop) read by the kernel from memory -- a column range
of a [D, V] matrix is just a TMA box at an offset, so no slab of W is ever copied.

Why not Pallas-Triton (`pallas_call` on the GPU) as everywhere else in jaxfuse: its tile
matmuls ran at 260-320 TFLOP/s on an H200, against 740-780 for cuBLAS and for this kind of
kernel (benchmarks/NOTES.md, runs 5, 12, 13). The linear + cross-entropy is all matmul.

Tile order: `plgpu.planar_snake` walks bands of `tiles.band` tiles so that what the CTAs in
flight read stays in the 50 MB L2. Bands of token tiles (`order="rows"`: 16 x 128 tokens sweep
the columns of one call together) ran the LCE forward in 12.9-13.2 ms on an H200, bands of
column tiles (the slab order) in 13.4-13.8 (benchmarks/NOTES.md, run 15); callers keep each
call's columns to a chunk (the whole 128256-column W in one sweep lost 15% in run 13).

Regimes: compiled with Mosaic GPU on an sm90 GPU; on a CPU the same kernel runs in Mosaic GPU's
interpret mode (it simulates the warpgroups, TMA and barriers), which is how the tests check it.
Two gaps of that interpreter (jax 0.10.2) are bridged outside the kernel's MMA loop: it cannot
read transposed wgmma operands (`matmul_epilogue` transposes them before the kernel there) nor
do a reducing TMA store (`add_tile` reads, adds and writes there); the compiled forms are
checked by lowering for sm90 on the CPU (tests/test_gpu_lowering.py) and on the GPU
(benchmarks/lce.py `check`). The kernel wants whole tiles: callers send it the part of a
problem that is a multiple of the tiles and do the rest another way (`fits`).

Shared Hopper pieces (the kernel wrapper, layouts, launch orders) are `_hopper`'s.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxfuse.pallas import _common as C
from jaxfuse.pallas import _hopper as H


@dataclasses.dataclass(frozen=True)
class Tiles:
    """m: output rows per tile; n: columns per warpgroup tile (a cooperative CTA tile is
    [m, 2n]; callers' column counts are multiples of 2n either way); k: the contraction step;
    stages: the most TMA pipeline stages (fewer where shared memory does not hold them beside
    the epilogue's); band: tiles walked together, of columns (`order="cols"`: all row tiles of
    a band of columns before the next, see the module docstring) or of rows (`order="rows"`);
    epi: columns an epilogue works on at a time (its temporaries are [m, epi]); schedule: how
    the two compute warpgroups share the tensor cores (see the module docstring):
    "cooperative" (both on halves of one [m, 2n] tile, epilogues together) or "pingpong" (each
    on its own [m, n] tile, one multiplying while the other runs its epilogue); piece: columns
    of the [64, piece] pieces in which an epilogue stores a tile through shared memory
    (`store_tile`, two slots per warpgroup) -- 32 leaves a cooperative GEMM 4 pipeline stages
    beside a dz epilogue's per-row values or a float32 dx tile, where [64, 64] pieces left it
    3 (benchmarks/NOTES.md run 30). Pieces are whole 64-row stripes because a wgmma
    accumulator's rows are spread over the warpgroup's four warps 16 at a time: Mosaic GPU
    cannot slice a register tile to fewer rows than that layout repeats over."""
    m: int = 128
    n: int = 128
    k: int = 64
    stages: int = 8
    band: int = 16
    epi: int = 64
    order: str = "rows"
    schedule: str = "cooperative"
    piece: int = 32

    def __post_init__(self):
        if self.order not in ("rows", "cols"):
            raise ValueError(f"Tiles(order={self.order!r}) must be 'rows' or 'cols'")
        if self.schedule not in ("cooperative", "pingpong"):
            raise ValueError(f"Tiles(schedule={self.schedule!r}) must be 'cooperative' or "
                             f"'pingpong'")
        if self.epi < 1 or self.n % self.epi:
            raise ValueError(f"Tiles(epi={self.epi}) must divide n={self.n}: an epilogue works "
                             f"on the tile in whole chunks")
        if self.piece < 16 or self.piece % 16 or self.epi % self.piece:
            raise ValueError(f"Tiles(piece={self.piece}) must be a multiple of 16 that divides "
                             f"epi={self.epi}: an epilogue stores its chunks in whole pieces")

    @property
    def cols(self) -> int:
        return 2 * self.n


@dataclasses.dataclass(frozen=True)
class Ctx:
    """What an epilogue gets besides the accumulator: the warpgroup (0 or 1), the first output
    row and column of its tile (columns counted from the window's start), the window offset
    `off`, the outputs (and in-place refs) and its shared-memory scratch."""
    wg: jax.Array
    row: jax.Array
    col: jax.Array
    off: jax.Array
    outs: Sequence
    scratch: object


def fits(x: jax.Array, w: jax.Array, tiles: Tiles) -> bool:
    """Whether x @ w[:, cols] takes (x [N, D], w [D, V]) as they are: 16-bit operands of one
    dtype, N a multiple of tiles.m, D of tiles.k, and rows of W a whole number of TMA swizzle
    rows (the lowering refuses a [D, V] array whose V is not a multiple of the 64-element
    tiling). Which columns a call covers is the caller's business (multiples of tiles.cols)."""
    n, d = x.shape
    if not (x.dtype == w.dtype and x.dtype in (jnp.bfloat16, jnp.float16)):
        return False
    return (n > 0 and n % tiles.m == 0 and d % tiles.k == 0
            and w.shape[1] % H._swizzle_elems(x.dtype, tiles.k) == 0)


def matmul_epilogue(a: jax.Array, b: jax.Array, off=0, per_row: jax.Array | None = None, *,
                    a_t: bool = False, b_t: bool = False, b_window: int | None = None,
                    epilogue: Callable, out_types=(), scratch_types=(), refs: Sequence = (),
                    tiles: Tiles, interpret: bool, name: str, batchable: bool = True):
    """Runs `epilogue(z, rows, ctx)` on every [tiles.m, tiles.n] float32 tile z of A @ B.

    A is `a` [M, K] (`a_t`: a is [K, M]); B is `b` [K, N] (`b_t`: b is [N, K]), or with
    `b_window` the columns [off, off + b_window) of b; `off` may be traced. `rows` holds the
    tile's slice [m] of each row of `per_row`, an [R, M] float32 array of per-row values
    (labels, lse, ...) or None (one stacked array: Mosaic GPU's interpreter hung when the
    pipeline carried two). The epilogue writes `out_types` (returned) and `refs` (JAX refs,
    updated in place; in interpret mode made with `memory_space=plgpu.GMEM`) through
    `ctx.outs`, outputs first. M must be a multiple of tiles.m, N of tiles.cols, K of tiles.k.
    `batchable=False` (implied by `refs`) gives a kernel that does not batch under vmap, the
    kind a function with refs may hold (callers batch around it; see `kernel`)."""
    t = tiles
    if interpret and (a_t or b_t):
        # Mosaic GPU's interpreter (jax 0.10.2) cannot read a transposed wgmma operand: here the
        # operands are transposed before the kernel, which then runs its plain path (the
        # transposed one is checked by the lowering test and on the GPU).
        if a_t:
            a, a_t = a.T, False
        if b_t:
            if b_window is not None:
                b = lax.dynamic_slice_in_dim(b, off, b_window, axis=1)
            b, b_t, b_window = b.T, False, None
    m_dim, k_dim = (a.shape[1], a.shape[0]) if a_t else a.shape
    width = b.shape[1] if b_window is None else b_window
    b_k, n_dim = (width, b.shape[0]) if b_t else (b.shape[0], width)
    if b_k != k_dim or m_dim % t.m or n_dim % t.cols or k_dim % t.k:
        raise ValueError(f"A {a.shape} (transposed: {a_t}) and B {b.shape} (transposed: {b_t}, "
                         f"window {b_window}) must be [M, K] @ [K, N] with M, N, K multiples "
                         f"of {t.m}, {t.cols}, {t.k}")
    itemsize = jnp.dtype(a.dtype).itemsize
    # One layout serves every operand tile: its minor dimension (k, m, n or 2n) is a multiple of
    # the 64-element swizzle row.
    transforms = H._tma_transforms(a.dtype, t.k)
    per_row = [] if per_row is None else [per_row.astype(jnp.float32).reshape(-1, m_dim)]
    n_rows = len(per_row[0]) if per_row else 0
    t = dataclasses.replace(t, stages=_stages(t, itemsize, scratch_types, n_rows))
    g = _Gemm(t=t, a_t=a_t, b_t=b_t, b_window=b_window, static_off=isinstance(off, int),
              m_iters=m_dim // t.m, n_dim=n_dim, k_iters=k_dim // t.k,
              n_rows=n_rows, n_out=len(jax.tree.leaves(out_types)),
              transforms=transforms, epilogue=epilogue, scratch_types=scratch_types,
              n_sms=2 if interpret else C.num_multiprocessors())
    body = _pingpong if t.schedule == "pingpong" else _cooperative
    f = H.kernel(functools.partial(body, g, off if g.static_off else None), out_types,
               grid=(g.n_sms,), num_threads=3, interpret=interpret,
               batchable=batchable and not refs, name=name)
    return f(jnp.asarray(off, jnp.int32).reshape(1), a, b, *per_row, *refs)


def _stages(t: Tiles, itemsize: int, scratch_types, n_rows: int) -> int:
    """The pipeline depth: t.stages, or as many stages as shared memory holds beside the
    epilogue's scratch and the per-row values (a dx epilogue's float32 slots leave room for
    fewer than a forward's statistics)."""
    scratch = sum(math.prod(s.shape) * jnp.dtype(s.dtype).itemsize
                  for s in jax.tree.leaves(scratch_types))
    rows = n_rows * t.m * 4                  # float32 per-row values of one tile
    if t.schedule == "pingpong":             # [m, n] tiles; rows in one buffer per warpgroup
        stage, rows = (t.m + t.n) * t.k * itemsize, 2 * max(rows, t.m * 4)
    else:                                    # [m, 2n] tiles; rows ride every stage
        stage, rows = (t.m + t.cols) * t.k * itemsize + rows, 0
    return max(1, min(t.stages, (H.SMEM_BYTES - scratch - rows) // stage))


@dataclasses.dataclass(frozen=True)
class _Gemm:
    """What the kernel bodies need to know of one `matmul_epilogue` call."""
    t: Tiles
    a_t: bool
    b_t: bool
    b_window: int | None
    static_off: bool
    m_iters: int
    n_dim: int
    k_iters: int
    n_rows: int          # rows of the per-row array (0: none)
    n_out: int
    transforms: tuple
    epilogue: Callable
    scratch_types: object
    n_sms: int

    def split(self, refs_):
        """(per-row input or None, outputs first then the in-place refs): the refs (inputs)
        come before the outputs in the kernel's arguments; the epilogue wants outputs first."""
        rows = refs_[0] if self.n_rows else None
        outs = refs_[1:] if self.n_rows else refs_
        return rows, (*outs[len(outs) - self.n_out:], *outs[:len(outs) - self.n_out])

    def views(self, off, off_gmem, a_gmem, b_gmem):
        """(off, A rows(row, m) -> [m or transposed, K], B cols(col, n) -> [K, n] or
        transposed): the operand windows of a tile."""
        # TMA boxes want offsets known to be whole tiles.
        off_ = off if self.static_off else pl.multiple_of(off_gmem[0], self.t.cols)
        b_view = b_gmem if self.b_window is None else b_gmem.at[:, pl.ds(off_, self.b_window)]
        a_rows = ((lambda r, m: a_gmem.at[:, pl.ds(r, m)]) if self.a_t
                  else (lambda r, m: a_gmem.at[pl.ds(r, m), :]))
        b_cols = ((lambda c, n: b_view.at[pl.ds(c, n), :]) if self.b_t
                  else (lambda c, n: b_view.at[:, pl.ds(c, n)]))
        return off_, a_rows, b_cols

    def operands(self, a_smem, b_smem):
        """The wgmma operands of one stage's tiles (transposed in place where stored so)."""
        return (a_smem.transpose((1, 0)) if self.a_t else a_smem,
                b_smem.transpose((1, 0)) if self.b_t else b_smem)

    def tile(self, lin, n_iters):
        """The first row and column tile of the `lin`-th tile in the walk (see the module
        docstring, "Tile order")."""
        return plgpu.planar_snake(lin, (self.m_iters, n_iters),
                                  1 if self.t.order == "cols" else 0, self.t.band)


def _cooperative(g: _Gemm, off, off_gmem, a_gmem, b_gmem, *refs_):
    """Both compute warpgroups on one [m, 2n] CTA tile (n columns each), sharing its A tile;
    the memory warpgroup streams stages with `emit_pipeline_warp_specialized`. Epilogues of
    the two warpgroups run together, so the tensor cores idle through them."""
    t = g.t
    rows_gmem, outs = g.split(refs_)
    rows_gmem = [] if rows_gmem is None else [rows_gmem]
    n_iters = g.n_dim // t.cols
    spec = functools.partial(plgpu.BlockSpec, memory_space=plgpu.SMEM, transforms=g.transforms)
    a_spec = spec((t.k, t.m), lambda k: (k, 0)) if g.a_t else spec((t.m, t.k), lambda k: (0, k))
    b_spec = (spec((t.cols, t.k), lambda k: (0, k)) if g.b_t
              else spec((t.k, t.cols), lambda k: (k, 0)))

    def pipeline(body, context):
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(g.k_iters,), memory_registers=40, wg_axis="wg", num_compute_wgs=2,
            # More stages than steps would wait for steps that never come.
            max_concurrent_steps=min(t.stages, g.k_iters), compute_context=context,
            in_specs=[a_spec, b_spec,
                      # The tile's per-row values ride along with every step (a few hundred
                      # bytes next to 48 KiB of operands); the last step's copy reaches the
                      # epilogue through the carry. (Mosaic GPU's interpreter hung on a
                      # separate TMA copy + barrier per tile; the pipeline only takes blocks
                      # whose index mentions the step, hence `k * 0`.)
                      *[plgpu.BlockSpec((g.n_rows, t.m), lambda k: (k * 0, 0),
                                        memory_space=plgpu.SMEM) for _ in rows_gmem]])

    def ignore(*_, **__):   # the allocations do not depend on the bodies
        return None

    @functools.partial(
        pl.run_scoped,
        allocs=pipeline(ignore, ignore).get_allocations(a_gmem, b_gmem, *rows_gmem),
        scratch=g.scratch_types,
        collective_axes="wg")
    def _scope(allocs, scratch):
        wg = lax.axis_index("wg")
        off_, a_rows, b_cols = g.views(off, off_gmem, a_gmem, b_gmem)

        @plgpu.nd_loop((g.m_iters * n_iters,), collective_axes="sm")
        def _tile(info):
            (lin,) = info.index
            m_idx, n_idx = g.tile(lin, n_iters)
            row, cta_col = m_idx * t.m, n_idx * t.cols

            def context(eval_pipeline):
                @functools.partial(pl.run_scoped, acc=plgpu.ACC((t.m, t.n), jnp.float32))
                def _acc(acc):
                    zeros = [jnp.zeros((t.m,), jnp.float32) for _ in range(g.n_rows)]
                    _, vals = eval_pipeline((acc, zeros))
                    g.epilogue(acc[...], vals,
                               Ctx(wg, row, cta_col + wg * t.n, off_, outs, scratch))

            def mma(_, a_smem, b_smem, *rest):
                *rows_smem, (acc, _) = rest
                half = pl.ds(wg * t.n, t.n)
                a_op, b_op = g.operands(a_smem, b_smem.at[half, :] if g.b_t
                                        else b_smem.at[:, half])
                plgpu.wgmma(acc, a_op, b_op)
                vals = [r[j] for r in rows_smem for j in range(g.n_rows)]
                plgpu.wgmma_wait(0)
                return acc, vals

            pipeline(mma, context)(a_rows(row, t.m), b_cols(cta_col, t.cols),
                                   *[r.at[:, pl.ds(row, t.m)] for r in rows_gmem],
                                   allocations=allocs)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _pingpong(g: _Gemm, off, off_gmem, a_gmem, b_gmem, *refs_):
    """Each compute warpgroup on its own [m, n] tile, the CTA's tiles dealt to them in turn:
    while one multiplies, the other runs the epilogue of its last tile (FlashAttention-3's
    ping-pong), so the epilogue hides under MMAs instead of idling the tensor cores. One ring
    of `stages` shared-memory slots serves both, filled in tile order by the memory
    warpgroup, which is what alternates them: a warpgroup's next tile arrives after the other's
    current one. Each slot has a "full" barrier per warpgroup (a barrier's phase is tracked
    by the threads that wait on it, and a warpgroup waits only for its own tiles) and one
    "empty" barrier. The per-row values of a tile go to a per-warpgroup buffer with its own
    full/empty pair."""
    t = g.t
    rows_gmem, outs = g.split(refs_)
    n_iters = g.n_dim // t.n
    n_tiles, stages = g.m_iters * n_iters, t.stages
    a_shape = (t.k, t.m) if g.a_t else (t.m, t.k)
    b_shape = (t.n, t.k) if g.b_t else (t.k, t.n)
    f32 = jnp.float32

    def scope(a_smem, b_smem, rows_smem, full, empty, rows_full, rows_empty, scratch):
        wg, sm = lax.axis_index("wg"), lax.axis_index("sm")
        local = H.cta_share(n_tiles, g.n_sms, sm)
        off_, a_rows, b_cols = g.views(off, off_gmem, a_gmem, b_gmem)

        def coords(j):
            m_idx, n_idx = g.tile(sm + j * g.n_sms, n_iters)
            return m_idx * t.m, n_idx * t.n

        def ks(k):
            return pl.ds(k * t.k, t.k)

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")

            @pl.loop(0, local)
            def _tile(j):
                row, col = coords(j)
                w = lax.rem(j, 2)
                if rows_gmem is not None:
                    @pl.when(j >= 2)
                    def _():
                        plgpu.barrier_wait(rows_empty.at[w])
                    plgpu.copy_gmem_to_smem(rows_gmem.at[:, pl.ds(row, t.m)], rows_smem.at[w],
                                            rows_full.at[w])
                a_tile, b_tile = a_rows(row, t.m), b_cols(col, t.n)

                @pl.loop(0, g.k_iters)
                def _step(k):
                    step = j * g.k_iters + k
                    slot = lax.rem(step, stages)

                    @pl.when(step >= stages)
                    def _():
                        plgpu.barrier_wait(empty.at[slot])
                    plgpu.copy_gmem_to_smem(a_tile.at[ks(k), :] if g.a_t else a_tile.at[:, ks(k)],
                                            a_smem.at[slot], full.at[w * stages + slot])
                    plgpu.copy_gmem_to_smem(b_tile.at[:, ks(k)] if g.b_t else b_tile.at[ks(k), :],
                                            b_smem.at[slot], full.at[w * stages + slot])

            # Wait for the releases not yet waited for (of the last `stages` steps and the last
            # two tiles' per-row values): every completion of a barrier is observed before the
            # kernel ends (Mosaic GPU's interpreter checks that; on the GPU it costs nothing).
            total = local * g.k_iters

            @pl.loop(total, total + stages)
            def _drain(step):
                @pl.when(step >= stages)
                def _():
                    plgpu.barrier_wait(empty.at[lax.rem(step, stages)])
            if rows_gmem is not None:
                @pl.loop(local, local + 2)
                def _drain_rows(j):
                    @pl.when(j >= 2)
                    def _():
                        plgpu.barrier_wait(rows_empty.at[lax.rem(j, 2)])

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(232, action="increase")

            @pl.loop(wg, local, step=2)
            def _tile(j):
                row, col = coords(j)
                first = j * g.k_iters

                def mma(acc):
                    @pl.loop(0, g.k_iters)
                    def _step(k):
                        slot = lax.rem(first + k, stages)
                        plgpu.barrier_wait(full.at[wg * stages + slot])
                        plgpu.wgmma(acc, *g.operands(a_smem.at[slot], b_smem.at[slot]))
                        # One group in flight: the tensor cores have the next step queued
                        # while this warpgroup waits for the last, whose slot it then frees.
                        plgpu.wgmma_wait(1)

                        @pl.when(k > 0)
                        def _():
                            plgpu.barrier_arrive(empty.at[lax.rem(first + k - 1, stages)])
                    plgpu.wgmma_wait(0)
                    plgpu.barrier_arrive(empty.at[lax.rem(first + g.k_iters - 1, stages)])
                    return acc[...]
                z = pl.run_scoped(mma, plgpu.ACC((t.m, t.n), f32))
                vals = []
                if rows_gmem is not None:
                    plgpu.barrier_wait(rows_full.at[wg])
                    vals = [rows_smem[wg, i] for i in range(g.n_rows)]
                    plgpu.barrier_arrive(rows_empty.at[wg])
                g.epilogue(z, vals, Ctx(wg, row, col, off_, outs, scratch))
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    dtype = a_gmem.dtype
    pl.run_scoped(
        scope,
        plgpu.SMEM((stages, *a_shape), dtype, transforms=g.transforms),
        plgpu.SMEM((stages, *b_shape), dtype, transforms=g.transforms),
        plgpu.SMEM((2, max(g.n_rows, 1), t.m), f32),
        plgpu.Barrier(num_arrivals=2, num_barriers=2 * stages),    # A and B copies
        plgpu.Barrier(num_arrivals=1, num_barriers=stages),
        plgpu.Barrier(num_arrivals=1, num_barriers=2),
        plgpu.Barrier(num_arrivals=1, num_barriers=2),
        g.scratch_types,
        collective_axes="wg")


def store_tile(value: jax.Array, smem, out, row, col, k: int = 0, reduction_op=None) -> int:
    """Writes a [m, n] register tile to out[row:row + m, col:col + n] through shared memory in
    pieces of smem's shape ([2 slots, rows, cols], see `tile_smem`), the two slots in turn so
    that one TMA store drains while the next fills (`reduction_op="add"`: TMA adds the pieces
    to what `out` holds instead). `k` counts pieces across calls for one tile (it picks the
    slot); returns the new count."""
    m, n = value.shape
    pm, pn = smem.shape[-2:]
    if m % pm or n % pn:
        # Whole pieces only: a remainder would be silently left unwritten.
        raise ValueError(f"store_tile: a [{m}, {n}] tile is not whole [{pm}, {pn}] pieces; "
                         f"store tiles (and epilogue chunks, Tiles.epi) of multiples of "
                         f"Tiles.piece columns and {pm} rows")
    for i in range(m // pm):
        for j in range(n // pn):
            slot = k % 2
            k += 1
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)
            smem[slot] = value[i * pm:(i + 1) * pm, j * pn:(j + 1) * pn]
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(smem.at[slot],
                                    out.at[pl.ds(row + i * pm, pm), pl.ds(col + j * pn, pn)],
                                    reduction_op=reduction_op)
    return k


def tile_smem(dtype, tiles: Tiles):
    """The shared memory `store_tile` needs for a GEMM on `tiles`: [2 warpgroups, 2 slots, 64,
    tiles.piece], swizzled for TMA."""
    return plgpu.SMEM((2, 2, 64, tiles.piece), dtype,
                      transforms=H._tma_transforms(dtype, tiles.piece))


def add_tile(value: jax.Array, smem, out, row, col, interpret: bool):
    """out[row:row + m, col:col + n] += value ([m, n] float32 registers). Compiled: a TMA store
    that adds (`store_tile(reduction_op="add")`), so the epilogue never waits for the old
    values (a read-modify-write by the warpgroup: 0.48 against 0.46 ms for the dx GEMM of a
    4096-column slab on an H200, benchmarks/NOTES.md run 21). Each
    element has one writer per kernel, so the sums are deterministic. Mosaic GPU's interpreter
    (jax 0.10.2) has no reducing TMA store; there the warpgroup reads, adds and writes."""
    if not interpret:
        store_tile(value, smem, out, row, col, reduction_op="add")
        return
    m, n = value.shape
    piece = (pl.ds(row, m), pl.ds(col, n))
    out[piece] = out[piece] + value
