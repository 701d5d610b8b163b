"""Tile sweep of the Hopper SwiGLU kernels (`jaxfuse/pallas/swiglu_hopper.py`) against the
Triton ones, at the 157M model's MLP shape ([16384, 2816] bf16) and the block benchmark's
([16384, 4096]): forward (3 units of bytes) and the backward that rebuilds the product (6
units), as a fraction of the copy rate measured in the same run.

    PYTHONPATH=. PYTHONUNBUFFERED=1 python benchmarks/swiglu_tiles.py --out swiglu_tiles.json
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks import _timing  # noqa: E402
from benchmarks._timing import bench, guarded, record  # noqa: E402
from jaxfuse.pallas import swiglu as _p_swiglu  # noqa: E402
from jaxfuse.pallas import swiglu_hopper as H  # noqa: E402
from jaxfuse.pallas._rows import RowBlocks  # noqa: E402

TILES = ((32, 256), (16, 256), (64, 128), (32, 128), (64, 256), (128, 64))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    print(f"device={jax.devices()[0].device_kind} jax={jax.__version__}")
    copy_bw = _timing.copy_ceiling()
    record("ceiling", "copy 1 GiB f32 (read+write)", "xla", None, TBps=copy_bw / 1e12)
    for shape in ((16384, 2816), (16384, 4096)):
        ks = jax.random.split(jax.random.key(0), 9)
        sets = [tuple(jax.random.normal(ks[3 * i + j], shape, jnp.bfloat16) for j in range(3))
                for i in range(3)]
        unit = shape[0] * shape[1] * 2
        triton = RowBlocks.for_shape(*shape, interpret=False)
        impls = {"triton": None, **{f"hopper {r}x{c}": (r, c) for r, c in TILES}}
        ref = None
        for name, tile in impls.items():
            if tile is None:
                blocks = RowBlocks(triton.block_rows, triton.block_cols, triton.num_warps,
                                   hopper=False)
                fwd = jax.jit(lambda g, u, dy: _p_swiglu.swiglu(g, u, block_sizes=blocks))
                bwd = jax.jit(lambda g, u, dy: _p_swiglu.swiglu_grads(g, u, dy,
                                                                      block_sizes=blocks))
            else:
                fwd = jax.jit(lambda g, u, dy, t=tile: H.swiglu(g, u, interpret=False, tile=t))
                bwd = jax.jit(lambda g, u, dy, t=tile: H.grads(g, u, dy, with_product=True,
                                                               interpret=False, tile=t))

            def run(name=name, fwd=fwd, bwd=bwd):
                nonlocal ref
                out = bwd(*sets[0])
                if ref is None:
                    ref = out
                same = all(bool(jnp.array_equal(a, b)) for a, b in zip(out, ref))
                tf, tb = bench(fwd, sets), bench(bwd, sets)
                record("swiglu_tiles", f"{shape} fwd", name, tf, frac_copy=3 * unit / tf / copy_bw)
                record("swiglu_tiles", f"{shape} bwd (+product)", name, tb,
                       frac_copy=6 * unit / tb / copy_bw, equal_to_triton=same)
            guarded("swiglu_tiles", f"{shape}", name, run)
    _timing.save(args.out)


if __name__ == "__main__":
    main()
