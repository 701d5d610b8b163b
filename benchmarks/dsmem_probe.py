"""Distributed shared memory's rate on the H200: the cost at the heart of a reproducible
5-product attention backward (benchmarks/NOTES.md s21 item 5, s29 items 6 and 10).

In that design a cluster of C CTAs over C consecutive key tiles of one head walks the same
query tiles in lockstep; every step each CTA holds its float32 dQ partial [64, 128] (32 KiB)
in shared memory, and after a cluster barrier sums its 1/C of the columns over the C partials
in a fixed order, reading its peers' shared memory. This probe runs exactly that exchange
`STEPS` times a CTA with no products around it, for C = 1 (own memory only), 2, 4 and 8:

    PYTHONPATH=. PYTHONUNBUFFERED=1 python benchmarks/dsmem_probe.py [OUT.json]

Each row: time a step (one write of the partial, two cluster barriers, the C reads) and the
bytes read a step and multiprocessor over it. Against the backward's step (~1.6 us at B4 H32
T4096 D128, 128 keys x 64 queries a CTA, s29): a step of this probe well under that leaves
room for the design; near it, the exchange alone would cost what recomputing S and dP does.
The sums are checked against numpy's on the first call.
"""
from __future__ import annotations

import functools

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from jaxfuse.pallas import _hopper as H
from benchmarks import _timing
from benchmarks._timing import bench, guarded, record

S = "dsmem"
ROWS, COLS = 64, 128          # a consumer pair's dQ partial of one step (query rows, D)
STEPS = 256                   # exchanges a CTA per call
_TICK = 2.0 ** -10            # each step's partial is the CTA's x plus step * _TICK (exact)
CLUSTERS = 132 // 8 * 8 // 8  # clusters of 8 that fit the H200's 132 multiprocessors (16)


def exchange(x, c: int, interpret: bool = False):
    """out[g, m] = sum over the cluster's CTAs m' of x[g, m'] (in order m' = 0..c-1), for the
    columns CTA m owns ([64, 128 / c] of them), with every partial rewritten and re-read
    `STEPS` times; x [n_clusters, c, 64, 128] float32 -> [n_clusters, c, 64, 128 / c].
    `interpret`: Mosaic GPU's interpreter, which runs c = 1 only (no cluster ops there)."""
    n, _, rows, cols = x.shape
    w = cols // c

    def body(x_gmem, out_gmem, tile, part, out_smem, loaded, written, read):
        g, m = lax.axis_index("grid"), lax.axis_index("cl")
        plgpu.copy_gmem_to_smem(x_gmem.at[g, m], part, loaded)
        plgpu.barrier_wait(loaded)
        mine = part[...]

        def step(s, acc):
            tile[...] = mine + s.astype(jnp.float32) * _TICK   # this step's partial
            plgpu.commit_smem()
            plgpu.barrier_arrive(written)                # every CTA's partial is in
            plgpu.barrier_wait(written)
            total = None
            for j in range(c):                           # the fixed order of the sum
                peer = plgpu.cluster_ref(tile, {"cl": j}) if c > 1 else tile
                v = peer[:, pl.ds(m * w, w)]
                total = v if total is None else total + v
            plgpu.barrier_arrive(read)                   # every CTA has read this step's
            plgpu.barrier_wait(read)
            return acc + total

        # A zero in the layout of the loop's loads (a constant's would differ from it).
        zero = part[:, pl.ds(m * w, w)] * 0.0
        acc = lax.fori_loop(0, STEPS, step, zero)
        out_smem[...] = acc
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[g, m])
        plgpu.wait_smem_to_gmem(0)

    barrier = (functools.partial(plgpu.ClusterBarrier, collective_axes=("cl",))
               if c > 1 else plgpu.Barrier)
    return plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((n, c, rows, w), jnp.float32),
        scratch_types=[plgpu.SMEM((rows, cols), jnp.float32),
                       plgpu.SMEM((rows, cols), jnp.float32),
                       plgpu.SMEM((rows, w), jnp.float32),
                       plgpu.Barrier(),
                       barrier(num_arrivals=1), barrier(num_arrivals=1)],
        grid=(n,), grid_names=("grid",), cluster=(c,), cluster_names=("cl",),
        kernel_name=f"jaxfuse_dsmem_probe_{c}",
        **({"interpret": H._interpret_params()} if interpret else {}))(x)


def expected(x, c: int):
    """What `exchange` computes, in numpy (float64 sums; the kernel's are float32)."""
    x = np.asarray(x, np.float64)
    n, _, rows, cols = x.shape
    w = cols // c
    steps = np.arange(STEPS, dtype=np.float64)
    per_step = x.sum(axis=1)                                          # [n, 64, 128]
    total = STEPS * per_step + c * _TICK * steps.sum()
    return np.stack([total[:, :, m * w:(m + 1) * w] for m in range(c)], axis=1)


def main():
    for c in (1, 2, 4, 8):
        def run(c=c):
            x = jax.random.normal(jax.random.key(c), (CLUSTERS * 8 // c, c, ROWS, COLS))
            f = jax.jit(functools.partial(exchange, c=c))
            got = np.asarray(f(x))
            err = float(np.abs(got - expected(x, c)).max() / np.abs(expected(x, c)).max())
            tm = bench(f, [(x,)], reps=10, repeats=5)
            step = tm / STEPS
            # Bytes a CTA reads a step: its columns of all c partials (c x 64 x 128/c x 4).
            read = ROWS * COLS * 4
            record(S, f"cluster of {c}", "jaxfuse", tm, us_per_step=step * 1e6,
                   read_GBps_per_sm=read / step / 1e9, rel_err=err,
                   status="ok" if err < 1e-4 else "FAIL")
        guarded(S, f"cluster of {c}", "jaxfuse", run)


if __name__ == "__main__":
    _timing.script(main)
