"""Why a decoding step's RoPE is slow (GPU diagnostic): jaxfuse.rope at decoding shapes
(B=32 tokens, one position each) and at the training shape, across tiles and positions,
against the same rotation written in jax.numpy under jax.jit.

    PYTHONPATH=. python benchmarks/rope_probe.py
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxfuse  # noqa: E402
from benchmarks._timing import bench  # noqa: E402
from jaxfuse.pallas._rows import RowBlocks  # noqa: E402


def main():
    print(f"device={jax.devices()[0].device_kind} jax={jax.__version__}")
    for shape in ((32, 1, 16, 64), (32, 1, 4, 64), (8, 2048, 16, 64), (8, 2048, 4, 64)):
        x = jax.random.normal(jax.random.key(0), shape, jnp.bfloat16)
        for p0 in (0, 600):
            pos = p0 + jnp.broadcast_to(jnp.arange(shape[1]), shape[:2]).astype(jnp.int32)
            xla = jax.jit(lambda x, p: jaxfuse.rope(x, p, impl="reference"))
            rows = [("xla", xla)]
            rows.append(("pallas default", jax.jit(lambda x, p: jaxfuse.rope(x, p))))
            for br, nw in ((1, 1), (1, 4), (4, 4), (8, 4), (32, 4), (8, 1)):
                if br <= shape[0] * shape[1]:
                    blk = RowBlocks(block_rows=br, block_cols=shape[-1], num_warps=nw)
                    rows.append((f"pallas rows={br} warps={nw}", jax.jit(
                        lambda x, p, blk=blk: jaxfuse.rope(x, p, block_sizes=blk))))
            for name, f in rows:
                try:
                    t = bench(f, [(x, pos)], reps=50, repeats=3)
                    print(f"rope {str(shape):18s} pos0={p0:4d} {name:26s} {t * 1e6:8.2f} us")
                except Exception as e:  # noqa: BLE001
                    print(f"rope {str(shape):18s} pos0={p0:4d} {name:26s} error {e!r:.120}")


if __name__ == "__main__":
    main()
