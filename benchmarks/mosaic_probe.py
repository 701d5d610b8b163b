"""Go/no-go probe for the next step of linear + cross-entropy (BENCHMARKS.md): does a Pallas
Mosaic GPU (wgmma + TMA) GEMM run the slab-shaped logits matmul as fast as cuBLAS on this GPU?

Times JAX's own Hopper example kernel (`jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu`)
on x [8192, 4096] @ W_slab [4096, S] bf16 for a few tile configurations against `jnp.dot`
(S = 128256: the whole vocabulary, the forward of a fused kernel that walks W in place).
Only an experiment: nothing in jaxfuse uses it.

    PYTHONPATH=. python benchmarks/mosaic_probe.py
"""
from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp

from benchmarks._timing import bench, guarded, record, rel_err

S = "mosaic"


def main() -> None:
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm
    n, d = 8192, 4096
    k = jax.random.split(jax.random.key(0), 2)
    x = jax.random.normal(k[0], (n, d), jnp.bfloat16)
    for slab in (4096, 8192, 128256):
        w = (jax.random.normal(k[1], (d, slab), jnp.float32) * d ** -0.5).astype(jnp.bfloat16)
        flops = 2 * n * d * slab
        ref = jax.jit(jnp.dot)(x, w)
        t = bench(jax.jit(jnp.dot), [(x, w)], reps=20, repeats=3, warmup=2)
        record(S, f"x @ W_slab S={slab}", "cublas", t, TFLOPs=flops / t / 1e12)
        for tm, tn, minor, width, wg in itertools.product(
                (128,), (128,), (hm.MatmulDimension.M, hm.MatmulDimension.N), (8, 16),
                (hm.MatmulDimension.N,)):
            cfg = hm.TuningConfig(tile_m=tm, tile_n=tn, tile_k=64, max_concurrent_steps=4,
                                  grid_minor_dim=minor, grid_tile_width=width, wg_dimension=wg)
            name = f"mgpu {tm}x{tn} minor={minor.name} w={width}"

            def run(cfg=cfg, name=name):
                f = jax.jit(lambda a, b: hm.matmul(a, b, None, cfg))
                err = rel_err(f(x, w), ref)
                t = bench(f, [(x, w)], reps=20, repeats=3, warmup=2)
                record(S, f"x @ W_slab S={slab}", name, t, TFLOPs=flops / t / 1e12,
                       rel_err=err)
            guarded(S, f"x @ W_slab S={slab}", name, run)


if __name__ == "__main__":
    main()
