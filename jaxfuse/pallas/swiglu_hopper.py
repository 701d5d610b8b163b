"""SwiGLU's kernels on a Hopper GPU (Pallas Mosaic GPU): the same arithmetic as `swiglu.py`'s,
for one reason, where they run inside a `lax.scan` over layers.

The backward reads gate and up, which the forward pass kept: under `lax.scan` they sit in
stacked [layers, ...] residual buffers, and XLA hands a kernel its layer's slice. A Mosaic GPU
kernel reads the slice where it lies (XLA's dynamic-slice fusion rewrites the custom call's
operand into an offset into the stack); a Triton kernel gets a copy, sliced out first (XLA
does not apply that rewrite to its Triton calls). At the 157M model's shapes that copy is 2 x
92 MB read and written per layer and step, ~0.7 ms of an 8-layer step on an H200, as much as
the kernel itself. The forward runs here too, so that the backward's rebuilt product
(`swiglu_linear`) comes from the same code as the forward's, bit for bit.

The kernels are elementwise: each CTA (one warpgroup) takes one [rows, cols] tile of every
operand by TMA into shared memory, computes in float32 registers and stores its outputs by
TMA; several CTAs share a multiprocessor, so one's loads are in flight while another computes.
They run at the Triton kernels' speed (90-94% of the copy rate) and, compiled, round like them
to within an ulp (`exp` differs), not bit for bit; the forward and the backward's rebuilt
product take the same kernels (the same [rows, cols] decides both; sharded, as long as the
cotangent is not split where gate and up are whole, each shard's shape does), so those two
agree bit for bit.
Whole tiles only (`fits`): other shapes take the Triton kernels, which mask a ragged edge.
On a CPU the same kernels run in Mosaic GPU's interpreter (the tests); `available()` picks
them on an sm90 GPU.
"""
from __future__ import annotations

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxfuse.pallas import _dropout, _hopper

# A tile of each operand per CTA: 32 x 128 16-bit elements (8 KiB; the backward's six take 48
# KiB, so four CTAs share a multiprocessor). Swept on an H200 (benchmarks/swiglu_tiles.py, run
# s11-4): at [16384, 2816] bf16 forward + backward 0.223 ms against 0.224-0.229 for 32 x 256,
# 16 x 256 and 64 x 128, 0.230 for the Triton kernels, 0.31 for 64 x 256 (two CTAs a
# multiprocessor); at [16384, 4096] 0.319 against 0.313-0.325 and Triton's 0.319.
ROWS, COLS = 32, 128


def fits(x: jax.Array, tile: tuple[int, int] = (ROWS, COLS)) -> bool:
    """Whether these kernels take x ([rows, cols]) as it is: 16-bit, whole tiles."""
    n, f = x.shape
    # (A grid dimension beyond 65535 CTAs is more than CUDA launches: 2M rows.)
    return (x.dtype in (jnp.bfloat16, jnp.float16) and n > 0 and n % tile[0] == 0
            and f % tile[1] == 0 and max(n // tile[0], f // tile[1]) <= 65535)


def _elementwise(emit, ins, n_out: int, *, name: str, interpret: bool, tile=(ROWS, COLS)):
    """outs = emit(*float32 tiles of ins) (n_out arrays like ins[0]), tile by tile."""
    n, f = ins[0].shape
    dt = ins[0].dtype
    rows, cols = tile

    def body(*refs):
        srcs, dsts = refs[:len(ins)], refs[len(ins):]
        window = (pl.ds(jax.lax.axis_index("r") * rows, rows),
                  pl.ds(jax.lax.axis_index("c") * cols, cols))

        def scope(in_smem, out_smem, loaded):
            for src, buf in zip(srcs, in_smem):
                plgpu.copy_gmem_to_smem(src.at[window], buf, loaded)
            plgpu.barrier_wait(loaded)
            outs = emit(*(buf[...].astype(jnp.float32) for buf in in_smem))
            for buf, value in zip(out_smem, outs):
                buf[...] = value.astype(dt)
            plgpu.commit_smem()
            for buf, dst in zip(out_smem, dsts):
                plgpu.copy_smem_to_gmem(buf, dst.at[window])
            plgpu.wait_smem_to_gmem(0)

        smem = plgpu.SMEM((rows, cols), dt)
        pl.run_scoped(scope, [smem] * len(ins), [smem] * n_out,
                      plgpu.Barrier(num_arrivals=len(ins)))

    kernel = plgpu.kernel(body, out_type=[jax.ShapeDtypeStruct((n, f), dt)] * n_out,
                          grid=(n // rows, f // cols), grid_names=("r", "c"),
                          kernel_name=name,
                          **({"interpret": _hopper._interpret_params()} if interpret else {}))
    return tuple(kernel(*ins))


def swiglu(g2: jax.Array, u2: jax.Array, *, interpret: bool, tile=(ROWS, COLS)) -> jax.Array:
    """silu(gate) * up of [rows, cols] arrays that `fits`."""
    emit = lambda g, u: (_dropout.swiglu(g, u),)
    return _elementwise(emit, (g2, u2), 1, name="jaxfuse_swiglu_fwd_hopper",
                        interpret=interpret, tile=tile)[0]


def grads(g2: jax.Array, u2: jax.Array, dy2: jax.Array, *, with_product: bool,
          interpret: bool, tile=(ROWS, COLS)) -> tuple:
    """(dgate, dup[, silu(gate) * up]) as `swiglu._grads` computes them."""
    emit = lambda g, u, dy: _dropout.swiglu_grads(g, u, dy, with_product)
    return _elementwise(emit, (g2, u2, dy2), 2 + with_product, name="jaxfuse_swiglu_bwd_hopper",
                        interpret=interpret, tile=tile)
