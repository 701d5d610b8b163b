"""Forward tiles of `jaxfuse.embedding` (`RowBlocks(rows, columns, warps)`; rows walked one by one
per program) at block.py's shape (V = 128256, d = 4096, [8, 2048] tokens, bf16, dropout 0.1):
time and fraction of the copy rate on the bytes moved (the gathered rows read, the output
written).

    PYTHONPATH=. PYTHONUNBUFFERED=1 python benchmarks/embedding_fwd_tiles.py [OUT.json]
"""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

import jaxfuse
from benchmarks import _timing
from benchmarks._timing import bench, record

S = "emb_fwd"


def main():
    print(f"device={jax.devices()[0].device_kind} jax={jax.__version__}")
    copy_bw = _timing.copy_ceiling()
    v, d, b, t = 128256, 4096, 8, 2048
    sets = []
    for i in range(2):
        k = jax.random.split(jax.random.key(i), 3)
        sets.append((jax.random.randint(k[0], (b, t), 0, v),
                     jax.random.normal(k[1], (v, d), jnp.bfloat16), k[2]))
    nbytes = 2 * b * t * d * 2
    base = None
    for tile in (None, (1, 4096, 4), (1, 2048, 4), (1, 1024, 2), (1, 2048, 8), (2, 4096, 8),
                 (4, 2048, 4)):
        blocks = None if tile is None else jaxfuse.RowBlocks(*tile)
        f = jax.jit(lambda tok, table, key, blocks=blocks: jaxfuse.embedding(
            tok, table, scale=64.0, rate=0.1, key=key, block_sizes=blocks))
        y = f(*sets[0])
        base = y if base is None else base
        tm = bench(f, sets, reps=20, repeats=5)
        record(S, "embedding fwd V128256 d4096 N16384", str(tile or "default"), tm,
               frac_copy=nbytes / tm / copy_bw, same_as_default=bool(jnp.array_equal(y, base)))
    _timing.save(sys.argv[1] if len(sys.argv) > 1 else None)


if __name__ == "__main__":
    main()
