"""Does a TMA copy that runs past the end of an array do what the hardware promises (loads
zero-filled past the end, stores clipped) in each regime of Pallas Mosaic GPU?

The question behind it (issue 14): the Hopper attention kernels pad ragged lengths up to whole
tiles with XLA copies of q, k and v (`_attn.pad_length`; about 1.0 / 0.7 ms of a B4 H32 T4000
D128 fwd+bwd on an H100, s33-1). TMA's bounds would take partial tiles for free on the GPU,
but the CPU tests run the kernels in Mosaic GPU's interpreter, which must agree.

    PJRT_NPROC=16 python benchmarks/tma_oob_probe.py      # CPU: interpreter + sm90 lowering
    PYTHONPATH=. python benchmarks/tma_oob_probe.py       # GPU: also compiled and run

A [80, 64] float32 array, three CTAs of 64 rows: the second copies rows 64..127 in (16 real),
adds 1, and stores them back; the third's box (rows 128..191) lies wholly past the end (as a
second consumer's rows can in the last tile of a 128-row CTA): its copy must still complete
(the barrier counts the box's bytes) and its store change nothing. Prints, per regime, the
error of the 80 real rows and what the 16 real rows of the partial tile hold.

Found on the CPU (s34, jax 0.10.2): the sm90 lowering accepts the copies, but the interpreter
leaves all 16 real rows of the partial tile unwritten (NaN, its fill for outputs never
stored), and does the same when only the store runs past the end (the load kept in bounds): it
drops such a store whole where TMA clips it. So a kernel that relies on TMA's bounds cannot be
checked in the interpreter as it is; its CPU regime would keep the padding copies. Found on the
H200 (s34-2, the 2-CTA version: a float32 tile, which Mosaic GPU copies as a plain bulk copy):
the partial tile right, zeros read past the end, the store clipped. Since then the probe also
asks about a box wholly past the end, and about the attention kernels' own copies (second
part: swizzled bf16 tiles of a [B, T, H, D] array, tensor TMA): to be run on the GPU.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.experimental.pallas.mosaic_gpu as plgpu  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import export  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402

from jaxfuse.pallas import _hopper as H  # noqa: E402

T, D, R = 80, 64, 64


def _body(x_gmem, o_gmem, smem, bar):
    start = pl.program_id(0) * R
    plgpu.copy_gmem_to_smem(x_gmem.at[pl.ds(start, R)], smem, bar)
    plgpu.barrier_wait(bar)
    smem[...] = smem[...] + 1.0
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(smem, o_gmem.at[pl.ds(start, R)])
    plgpu.wait_smem_to_gmem(0)


def _kernel(interpret: bool):
    kw = {"interpret": H._interpret_params()} if interpret else {}
    return plgpu.kernel(_body, out_type=jax.ShapeDtypeStruct((T, D), jnp.float32), grid=(3,),
                        grid_names=("x",),
                        scratch_types=[plgpu.SMEM((R, D), jnp.float32),
                                       plgpu.Barrier(num_arrivals=1)], **kw)


def _report(regime: str, out) -> None:
    x = np.arange(T * D, dtype=np.float32).reshape(T, D)
    err = np.abs(np.asarray(out) - (x + 1))
    print(f"{regime}: full tile max err {np.nanmax(err[:R]):.3g}, partial tile's {T - R} real "
          f"rows: max err {np.nanmax(err[R:]) if not np.isnan(err[R:]).all() else 'all NaN'}"
          f" ({int(np.isnan(np.asarray(out)[R:]).sum())} NaN of {(T - R) * D})")


# The attention kernels' own kind of copy: a [64, D] bf16 tile of a [B, T, H, D] array at
# (b, rows, h), swizzled in shared memory (`_hopper._tma_transforms`), so Mosaic GPU issues
# tensor TMA copies (the [80, 64] float32 tile above goes as a plain bulk copy). T = 80: CTA
# 1's rows 64..127 are partial, CTA 2's 128..191 wholly past the end, in each of the B x H =
# 2 x 2 (b, h) pairs. (The fused dQ's float32 reducing store is not probed here.)
B4, H4 = 2, 2


def _body4(x_gmem, o_gmem, smem, bar):
    r0, bh = pl.program_id(0) * R, pl.program_id(1)
    b, h = bh // H4, bh % H4
    plgpu.copy_gmem_to_smem(x_gmem.at[b, pl.ds(r0, R), h], smem, bar)
    plgpu.barrier_wait(bar)
    smem[...] = (smem[...].astype(jnp.float32) + 1.0).astype(smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(smem, o_gmem.at[b, pl.ds(r0, R), h])
    plgpu.wait_smem_to_gmem(0)


def _kernel4(interpret: bool):
    kw = {"interpret": H._interpret_params()} if interpret else {}
    return plgpu.kernel(
        _body4, out_type=jax.ShapeDtypeStruct((B4, T, H4, D), jnp.bfloat16),
        grid=(3, B4 * H4), grid_names=("x", "bh"),
        scratch_types=[plgpu.SMEM((R, D), jnp.bfloat16,
                                  transforms=H._tma_transforms(jnp.bfloat16, D)),
                       plgpu.Barrier(num_arrivals=1)], **kw)


def _report4(regime: str, x, o) -> None:
    err = np.abs(np.asarray(o, np.float32) - (np.asarray(x, np.float32) + 1))
    part = err[:, R:]
    print(f"{regime}, bf16 [B, T, H, D] swizzled tensor copies: full tiles max err "
          f"{np.nanmax(err[:, :R]):.3g}, partial tile's real rows "
          f"{'all NaN' if np.isnan(part).all() else f'max err {np.nanmax(part):.3g}'}"
          f" ({int(np.isnan(part).sum())} NaN of {part.size})")


def main() -> None:
    x = jnp.arange(T * D, dtype=jnp.float32).reshape(T, D)
    _report("interpreter", _kernel(True)(x))
    exp = export.export(jax.jit(_kernel(False)), platforms=["cuda"])(x)
    print(f"sm90 lowering: accepted ({len(exp.mlir_module())} chars of MLIR)")
    if jax.default_backend() == "gpu":
        _report(f"compiled on {jax.devices()[0].device_kind}", jax.jit(_kernel(False))(x))
    x4 = (jnp.arange(B4 * T * H4 * D) % 251).astype(jnp.bfloat16).reshape(B4, T, H4, D)
    _report4("interpreter", x4, _kernel4(True)(x4))
    exp = export.export(jax.jit(_kernel4(False)), platforms=["cuda"])(x4)
    print(f"sm90 lowering of the tensor copies: accepted ({len(exp.mlir_module())} chars)")
    if jax.default_backend() == "gpu":
        _report4(f"compiled on {jax.devices()[0].device_kind}", x4,
                 jax.jit(_kernel4(False))(x4))

if __name__ == "__main__":
    main()
