"""A @ B on a Hopper GPU with each output tile handed to an epilogue (Pallas Mosaic GPU).

A persistent, warp-specialized GEMM: one CTA per multiprocessor walks [tiles.m, 2 * tiles.n]
output tiles; a memory warpgroup streams A and B tiles into shared memory with TMA
(`tiles.stages` deep), two compute warpgroups each multiply into a [tiles.m, tiles.n] float32
accumulator with wgmma, then call `epilogue` on it: the linear + cross-entropy reduces a logits
tile to per-token statistics (never stored), or turns it into dz, or stores it, possibly into
a buffer updated in place.

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
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxfuse.pallas import _common as C


@dataclasses.dataclass(frozen=True)
class Tiles:
    """m: output rows per CTA tile (shared by both compute warpgroups); n: columns per
    warpgroup (a CTA tile is 2n wide); k: the contraction step; stages: TMA pipeline depth;
    band: CTA tiles walked together, of columns (`order="cols"`: all row tiles of a band of
    columns before the next, see the module docstring) or of rows (`order="rows"`); epi:
    columns an epilogue works on at a time (its temporaries are [m, epi])."""
    m: int = 128
    n: int = 128
    k: int = 64
    stages: int = 4
    band: int = 16
    epi: int = 64
    order: str = "rows"

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


def available() -> bool:
    """The kernel can run here: a Hopper (sm90) GPU. wgmma is sm90-only (Blackwell has
    tcgen05 instead), so newer GPUs take the other path."""
    try:
        dev = jax.devices()[0]
        return dev.platform == "gpu" and int(float(dev.compute_capability)) == 9  # "9.0"
    except Exception:  # noqa: BLE001 - no GPU backend, or no compute capability to read
        return False


def _swizzle_elems(dtype, k: int) -> int:
    itemsize = jnp.dtype(dtype).itemsize
    return plgpu.find_swizzle(k * itemsize * 8) // itemsize


def fits(x: jax.Array, w: jax.Array, tiles: Tiles) -> bool:
    """Whether x @ w[:, cols] takes (x [N, D], w [D, V]) as they are: 16-bit operands of one
    dtype, N a multiple of tiles.m, D of tiles.k, and rows of W a whole number of TMA swizzle
    rows (the lowering refuses a [D, V] array whose V is not a multiple of the 64-element
    tiling). Which columns a call covers is the caller's business (multiples of tiles.cols)."""
    n, d = x.shape
    if not (x.dtype == w.dtype and x.dtype in (jnp.bfloat16, jnp.float16)):
        return False
    return (n > 0 and n % tiles.m == 0 and d % tiles.k == 0
            and w.shape[1] % _swizzle_elems(x.dtype, tiles.k) == 0)


def _interpret_params():
    # Mosaic GPU's interpreter is only reachable through a private module in jax 0.10 / 0.11.
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    return InterpretGPUParams()


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
    if t.order not in ("rows", "cols"):
        raise ValueError(f"Tiles(order={t.order!r}) must be 'rows' or 'cols'")
    m_iters, n_iters, k_iters = m_dim // t.m, n_dim // t.cols, k_dim // t.k
    swizzle = _swizzle_elems(a.dtype, t.k)
    itemsize = jnp.dtype(a.dtype).itemsize
    # One layout serves every operand tile: its minor dimension (k, m or 2n) is a multiple of
    # the 64-element swizzle row.
    spec = functools.partial(
        plgpu.BlockSpec, memory_space=plgpu.SMEM,
        transforms=(plgpu.TilingTransform((8, swizzle)),
                    plgpu.SwizzleTransform(swizzle * itemsize)))
    a_spec = spec((t.k, t.m), lambda k: (k, 0)) if a_t else spec((t.m, t.k), lambda k: (0, k))
    b_spec = (spec((t.cols, t.k), lambda k: (0, k)) if b_t
              else spec((t.k, t.cols), lambda k: (k, 0)))
    per_row = [] if per_row is None else [per_row.astype(jnp.float32).reshape(-1, m_dim)]
    n_rows, n_out = len(per_row), len(jax.tree.leaves(out_types))
    off_arr = jnp.asarray(off, jnp.int32).reshape(1)

    def body(off_gmem, a_gmem, b_gmem, *refs_):
        rows_gmem, outs = refs_[:n_rows], refs_[n_rows:]
        # The refs (inputs) come before the outputs in the kernel's arguments; the epilogue
        # wants the outputs first.
        outs = (*outs[len(outs) - n_out:], *outs[:len(outs) - n_out])

        def pipeline(body, context):
            return plgpu.emit_pipeline_warp_specialized(
                body, grid=(k_iters,), memory_registers=40, wg_axis="wg", num_compute_wgs=2,
                # More stages than steps would wait for steps that never come.
                max_concurrent_steps=min(t.stages, k_iters), compute_context=context,
                in_specs=[a_spec, b_spec,
                          # The tile's per-row values ride along with every step (a few
                          # hundred bytes next to 48 KiB of operands); the last step's copy
                          # reaches the epilogue through the carry. (Mosaic GPU's interpreter
                          # hung on a separate TMA copy + barrier per tile; the pipeline only
                          # takes blocks whose index mentions the step, hence `k * 0`.)
                          *[plgpu.BlockSpec((r.shape[0], t.m), lambda k: (k * 0, 0),
                                            memory_space=plgpu.SMEM) for r in per_row]])

        def ignore(*_, **__):   # the allocations do not depend on the bodies
            return None

        @functools.partial(
            pl.run_scoped,
            allocs=pipeline(ignore, ignore).get_allocations(a_gmem, b_gmem, *rows_gmem),
            scratch=scratch_types,
            collective_axes="wg")
        def _scope(allocs, scratch):
            wg = lax.axis_index("wg")

            @plgpu.nd_loop((m_iters * n_iters,), collective_axes="sm")
            def _tile(info):
                (lin,) = info.index
                m_idx, n_idx = plgpu.planar_snake(lin, (m_iters, n_iters),
                                                  1 if t.order == "cols" else 0, t.band)
                row = m_idx * t.m
                cta_col = n_idx * t.cols
                # TMA boxes want offsets known to be whole tiles.
                off_ = off if isinstance(off, int) else pl.multiple_of(off_gmem[0], t.cols)
                b_view = b_gmem if b_window is None else b_gmem.at[:, pl.ds(off_, b_window)]

                def context(eval_pipeline):
                    @functools.partial(pl.run_scoped,
                                       acc=plgpu.ACC((t.m, t.n), jnp.float32))
                    def _acc(acc):
                        zeros = [jnp.zeros((t.m,), r.dtype) for r in per_row
                                 for _ in range(r.shape[0])]
                        _, vals = eval_pipeline((acc, zeros))
                        epilogue(acc[...], vals,
                                 Ctx(wg, row, cta_col + wg * t.n, off_, outs, scratch))

                def mma(_, a_smem, b_smem, *rest):
                    *rows_smem, (acc, _) = rest
                    a_op = plgpu.transpose_ref(a_smem, (1, 0)) if a_t else a_smem
                    if b_t:
                        b_op = plgpu.transpose_ref(b_smem.at[pl.ds(wg * t.n, t.n), :], (1, 0))
                    else:
                        b_op = b_smem.at[:, pl.ds(wg * t.n, t.n)]
                    plgpu.wgmma(acc, a_op, b_op)
                    vals = [r[j] for r in rows_smem for j in range(r.shape[0])]
                    plgpu.wgmma_wait(0)
                    return acc, vals

                pipeline(mma, context)(
                    a_gmem.at[:, pl.ds(row, t.m)] if a_t else a_gmem.at[pl.ds(row, t.m), :],
                    b_view.at[pl.ds(cta_col, t.cols), :] if b_t
                    else b_view.at[:, pl.ds(cta_col, t.cols)],
                    *[r.at[:, pl.ds(row, t.m)] for r in rows_gmem],
                    allocations=allocs)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    f = kernel(body, out_types, grid=(2 if interpret else C.num_multiprocessors(),),
               num_threads=3, interpret=interpret, batchable=batchable and not refs, name=name)
    return f(off_arr, a, b, *per_row, *refs)


def kernel(body, out_types, *, grid, num_threads, interpret: bool, batchable: bool,
           name: str = "jaxfuse_hopper"):
    """A Mosaic GPU kernel `name` over a grid "sm" (threads "wg"), compiled or interpreted.
    `batchable`: plgpu.kernel, which batches under vmap; else pl.kernel, which takes JAX refs
    (aliased in and out) and may sit in a function with refs (plgpu.kernel's vmap wrapper has
    no rule for those)."""
    params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)
    mesh = dict(grid=grid, grid_names=("sm",), num_threads=num_threads, thread_name="wg",
                kernel_name=name)
    if batchable:
        return plgpu.kernel(body, out_type=out_types, compiler_params=params, **mesh,
                            **({"interpret": _interpret_params()} if interpret else {}))
    return pl.kernel(body, out_type=out_types, compiler_params=params, mesh=plgpu.Mesh(**mesh),
                     interpret=_interpret_params() if interpret else False, name=name)


def store_tile(value: jax.Array, smem, out, row, col, sub: int = 64, k: int = 0,
               reduction_op=None) -> int:
    """Writes a [m, n] register tile to out[row:row + m, col:col + n] through shared memory in
    [sub, sub] pieces, two slots in turn so that one TMA store drains while the next fills
    (`reduction_op="add"`: TMA adds the pieces to what `out` holds instead). `k` counts pieces
    across calls for one tile (it picks the slot); returns the new count."""
    m, n = value.shape
    for i in range(m // sub):
        for j in range(n // sub):
            slot = k % 2
            k += 1
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)
            smem[slot] = value[i * sub:(i + 1) * sub, j * sub:(j + 1) * sub]
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(smem.at[slot],
                                    out.at[pl.ds(row + i * sub, sub), pl.ds(col + j * sub, sub)],
                                    reduction_op=reduction_op)
    return k


def tile_smem(dtype, sub: int = 64):
    """The shared memory `store_tile` needs: [2 warpgroups, 2 slots, sub, sub], swizzled for
    TMA."""
    swizzle = _swizzle_elems(dtype, sub)
    return plgpu.SMEM((2, 2, sub, sub), dtype,
                      transforms=(plgpu.TilingTransform((8, swizzle)),
                                  plgpu.SwizzleTransform(swizzle * jnp.dtype(dtype).itemsize)))


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


def uninitialized(shape, dtype, interpret: bool) -> jax.Array:
    """A GPU buffer whose contents are left as they come (a kernel that writes nothing): for an
    output every element of which later kernels write, where zero-filling would cost a pass over
    it (0.6 ms for a 1 GB dW on an H200). For functions with refs (not batchable)."""
    return kernel(lambda out: None, jax.ShapeDtypeStruct(shape, dtype), grid=(1,),
                  num_threads=1, interpret=interpret, batchable=False, name="uninitialized")()


def discharged(f: Callable) -> Callable:
    """f, whose body updates JAX refs in place (`matmul_epilogue(refs=...)`), as a function of
    arrays with those refs discharged into aliased kernel operands, as jit would do them. Needed
    to wrap it in `jax.custom_batching.custom_vmap`, which has no rule for refs inside."""
    from jax._src import core
    from jax._src.state.discharge import discharge_state   # no public API in jax 0.10 / 0.11

    def pure(*args):
        closed, shapes = jax.make_jaxpr(f, return_shape=True)(*args)
        pure_ = discharge_state(closed)
        out = core.eval_jaxpr(pure_.jaxpr, pure_.consts, *jax.tree.leaves(args))
        return jax.tree.unflatten(jax.tree.structure(shapes), out)
    return pure
