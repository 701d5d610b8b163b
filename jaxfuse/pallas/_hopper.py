"""z = x @ W[:, cols] on a Hopper GPU with the result handed to an epilogue, never stored whole.

A persistent, warp-specialized GEMM in Pallas Mosaic GPU: one CTA per multiprocessor walks
[tiles.m, 2 * tiles.n] output tiles; a memory warpgroup streams x and W tiles into shared memory
with TMA (`tiles.stages` deep), two compute warpgroups each multiply into a [tiles.m, tiles.n]
float32 accumulator with wgmma, and then call `epilogue` on it instead of writing it to memory.
W is read in place: a column range of a [D, V] matrix is just a TMA box at an offset, so no
slab of W is ever copied.

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
The kernel wants whole tiles: callers send it the part of a problem that is a multiple of the
tiles and do the rest another way (`fits`).
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
    """m: token rows per CTA tile (shared by both compute warpgroups); n: columns per
    warpgroup (a CTA tile is 2n wide); k: the contraction step; stages: TMA pipeline depth;
    band: CTA tiles walked together, of columns (`order="cols"`: all token tiles of a band of
    W before the next, see the module docstring) or of token rows (`order="rows"`); epi:
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
    """What an epilogue gets besides the accumulator: the warpgroup (0 or 1), the first token
    row and first column (in W) of its tile, the outputs and its shared-memory scratch."""
    wg: jax.Array
    row: jax.Array
    col: jax.Array
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


def fits(x: jax.Array, w: jax.Array, tiles: Tiles) -> bool:
    """Whether the kernel takes (x, w) as they are: 16-bit operands of one dtype, N a multiple
    of tiles.m, D of tiles.k, and rows of W a whole number of TMA swizzle rows (the lowering
    refuses a [D, V] array whose V is not a multiple of the 64-element tiling). Which columns
    it covers is the caller's business (multiples of tiles.cols)."""
    n, d = x.shape
    if not (x.dtype == w.dtype and x.dtype in (jnp.bfloat16, jnp.float16)):
        return False
    swizzle_elems = plgpu.find_swizzle(tiles.k * x.dtype.itemsize * 8) // x.dtype.itemsize
    return n > 0 and n % tiles.m == 0 and d % tiles.k == 0 and w.shape[1] % swizzle_elems == 0


def _interpret_params():
    # Mosaic GPU's interpreter is only reachable through a private module in jax 0.10 / 0.11.
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    return InterpretGPUParams()


def xw_epilogue(x: jax.Array, w: jax.Array, per_row: jax.Array | None, *, col_lo: int,
                n_cols: int, epilogue: Callable, out_types, scratch_types, tiles: Tiles,
                interpret: bool, name: str):
    """Runs `epilogue(z, rows, ctx)` on every [tiles.m, tiles.n] tile z (float32) of
    x @ w[:, col_lo:col_lo + n_cols]. `rows` holds the tile's slice [m] of each row of
    `per_row`, an [R, N] float32 array of per-token values (labels, lse, ...) or None (one
    stacked array: Mosaic GPU's interpreter hung when the pipeline carried two). n_cols must be
    a multiple of tiles.cols; the epilogue writes `out_types` through `ctx.outs`."""
    t = tiles
    n, d = x.shape
    if n_cols % t.cols or n % t.m or d % t.k:
        raise ValueError(f"{x.shape=} and {n_cols=} must be multiples of {t}")
    if t.order not in ("rows", "cols"):
        raise ValueError(f"Tiles(order={t.order!r}) must be 'rows' or 'cols'")
    m_iters, n_iters, k_iters = n // t.m, n_cols // t.cols, d // t.k
    itemsize = jnp.dtype(x.dtype).itemsize
    swizzle = plgpu.find_swizzle(t.k * itemsize * 8)
    transforms = (plgpu.TilingTransform((8, swizzle // itemsize)),
                  plgpu.SwizzleTransform(swizzle))
    per_row = [] if per_row is None else [per_row.astype(jnp.float32).reshape(-1, n)]
    n_rows = len(per_row)
    n_out = len(jax.tree.leaves(out_types))

    def kernel(x_gmem, w_gmem, *refs):
        rows_gmem, outs = refs[:n_rows], refs[n_rows:n_rows + n_out]

        def pipeline(body, context):
            return plgpu.emit_pipeline_warp_specialized(
                body, grid=(k_iters,), memory_registers=40, wg_axis="wg", num_compute_wgs=2,
                # More stages than steps would wait for steps that never come.
                max_concurrent_steps=min(t.stages, k_iters), compute_context=context,
                in_specs=[plgpu.BlockSpec((t.m, t.k), lambda k: (0, k), transforms=transforms,
                                          memory_space=plgpu.SMEM),
                          plgpu.BlockSpec((t.k, t.cols), lambda k: (k, 0),
                                          transforms=transforms, memory_space=plgpu.SMEM),
                          # The tile's per-token values ride along with every step (a few
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
            allocs=pipeline(ignore, ignore).get_allocations(x_gmem, w_gmem, *rows_gmem),
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
                cta_col = col_lo + n_idx * t.cols

                def context(eval_pipeline):
                    @functools.partial(pl.run_scoped,
                                       acc=plgpu.ACC((t.m, t.n), jnp.float32))
                    def _acc(acc):
                        zeros = [jnp.zeros((t.m,), r.dtype) for r in per_row
                                 for _ in range(r.shape[0])]
                        _, vals = eval_pipeline((acc, zeros))
                        epilogue(acc[...], vals,
                                 Ctx(wg, row, cta_col + wg * t.n, outs, scratch))

                def mma(_, x_smem, w_smem, *rest):
                    *rows_smem, (acc, _) = rest
                    plgpu.wgmma(acc, x_smem, w_smem.at[:, pl.ds(wg * t.n, t.n)])
                    vals = [r[j] for r in rows_smem for j in range(r.shape[0])]
                    plgpu.wgmma_wait(0)
                    return acc, vals

                pipeline(mma, context)(x_gmem.at[pl.ds(row, t.m), :],
                                       w_gmem.at[:, pl.ds(cta_col, t.cols)],
                                       *[r.at[:, pl.ds(row, t.m)] for r in rows_gmem],
                                       allocations=allocs)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    num_sms = 2 if interpret else C.num_multiprocessors()
    extra = {"interpret": _interpret_params()} if interpret else {}
    f = plgpu.kernel(
        kernel, out_type=out_types, grid=(num_sms,), grid_names=("sm",), num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup), **extra)
    with jax.named_scope(name):
        return f(x, w, *per_row)
