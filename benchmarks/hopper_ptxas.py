"""ptxas's report (registers, spills, wgmma serialization warnings) for the Hopper attention
forward's schedules, on the GPU: Mosaic GPU prints it when MOSAIC_GPU_DUMP_PTXAS is set (this
script sets it before jax is imported). A "wgmma ... serialized" warning means ptxas waits for
each product before the next instruction, which undoes any overlap the schedule asks for.

    PYTHONPATH=. python benchmarks/hopper_ptxas.py [d ...] > ptxas.log 2>&1
"""
from __future__ import annotations

import dataclasses
import os
import sys

os.environ.setdefault("MOSAIC_GPU_DUMP_PTXAS", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxfuse  # noqa: E402
from jaxfuse import AttnBlocks  # noqa: E402
from jaxfuse.pallas.attention_hopper import HopperAttnTiles  # noqa: E402


def report(d: int, causal: bool, **kw):
    tiles = dataclasses.replace(HopperAttnTiles.for_head_dim(d), backward=False, **kw)
    q = jax.ShapeDtypeStruct((1, 1024, 4, d), jnp.bfloat16)
    f = jax.jit(lambda q, k, v: jaxfuse.flash_attention(
        q, k, v, causal=causal, block_sizes=AttnBlocks(hopper=tiles)))
    print(f"=== D={d} causal={causal} {kw}", flush=True)
    f.lower(q, q, q).compile()
    sys.stdout.flush()


if __name__ == "__main__":
    for d in [int(a) for a in sys.argv[1:]] or [128]:
        for causal in (False, True):
            report(d, causal)
            report(d, causal, overlap=True)
