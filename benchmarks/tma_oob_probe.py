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
checked in the interpreter as it is; its CPU regime would keep the padding copies.
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


def main() -> None:
    x = jnp.arange(T * D, dtype=jnp.float32).reshape(T, D)
    _report("interpreter", _kernel(True)(x))
    exp = export.export(jax.jit(_kernel(False)), platforms=["cuda"])(x)
    print(f"sm90 lowering: accepted ({len(exp.mlir_module())} chars of MLIR)")
    if jax.default_backend() == "gpu":
        _report(f"compiled on {jax.devices()[0].device_kind}", jax.jit(_kernel(False))(x))


if __name__ == "__main__":
    main()
