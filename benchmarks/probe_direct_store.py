"""Probe (NOTES s51 item 6): a wgmma accumulator stored from registers straight into a Mosaic GPU
kernel's output in global memory, no shared memory, no TMA. Each of 4 CTAs computes a [64, 128]
tile of A @ B and stores it at its own rows (a dynamic offset); checked against jnp.dot. On a
CPU it lowers for sm90 through jax.export; on an sm90 GPU it compiles and runs.

    PYTHONPATH=. python benchmarks/probe_direct_store.py
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import jax.experimental.pallas.mosaic_gpu as plgpu
import numpy as np
from jax import export
from jax.experimental import pallas as pl

M, N, K, CTAS = 64, 128, 64, 4


def _kernel():
    t = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

    def body(a_gmem, b_gmem, o_gmem):
        cta = jax.lax.axis_index("x")

        def scoped(a_smem, b_smem, acc, bar):
            plgpu.copy_gmem_to_smem(a_gmem.at[pl.ds(cta * M, M)], a_smem, bar)
            plgpu.copy_gmem_to_smem(b_gmem, b_smem, bar)
            plgpu.barrier_wait(bar)
            plgpu.wgmma(acc, a_smem, b_smem)
            plgpu.wgmma_wait(0)
            o_gmem[pl.ds(cta * M, M), :] = acc[...].astype(o_gmem.dtype)   # the probe
        pl.run_scoped(scoped, plgpu.SMEM((M, K), jnp.bfloat16, transforms=t),
                      plgpu.SMEM((K, N), jnp.bfloat16, transforms=t),
                      plgpu.ACC((M, N), jnp.float32), plgpu.Barrier(num_arrivals=2))
    return plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((CTAS * M, N), jnp.bfloat16), grid=(CTAS,),
        grid_names=("x",),
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup))


def main():
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (CTAS * M, K), jnp.float32).astype(jnp.bfloat16)
    b = jax.random.normal(kb, (K, N), jnp.float32).astype(jnp.bfloat16)
    f = jax.jit(_kernel())
    if jax.default_backend() != "gpu":
        mesh = jax.sharding.AbstractMesh((), (), abstract_device=jax.sharding.AbstractDevice(
            device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu"))
        with jax.sharding.use_abstract_mesh(mesh):
            export.export(f, platforms=["cuda"])(a, b)
        print("direct store: lowers for sm90 (no GPU here to run it)")
        return
    out = np.asarray(f(a, b), np.float32)
    want = np.asarray(jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16),
                      np.float32)
    err = float(np.abs(out - want).max() / np.abs(want).max())
    print(f"direct store: ran on {jax.devices()[0].device_kind}, max error {err:.2e}, "
          f"status={'ok' if err < 1e-2 else 'FAIL'}")


if __name__ == "__main__":
    main()
