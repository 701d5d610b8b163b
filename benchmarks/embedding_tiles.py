"""Tiles of `jaxfuse.embedding` at block.py's shape (V = 128256, d = 4096, [8, 2048] tokens, bf16,
dropout 0.1), on the GPU:

    PYTHONPATH=. PYTHONUNBUFFERED=1 python benchmarks/embedding_tiles.py fwd|bwd [OUT.json]

fwd: forward tiles (`RowBlocks(rows, columns, warps)`, rows walked one by one per program,
each row's gather issued before the row before it is written):
time, fraction of the copy rate on the bytes moved (gathered rows read, output written) and
output bitwise equal to the default's. bwd: the backward's tile (`embedding._BWD_TILE`: table
rows, columns, warps of a program): fwd+bwd time, dtable bitwise equal across tiles (each row
sums in the same order), then the kernel times of the default (profiler).
"""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

import jaxfuse
from jaxfuse.pallas import embedding as E
from benchmarks import _timing
from benchmarks._timing import bench, record

V, D, B, T = 128256, 4096, 8, 2048
# Rows > 1: since s29 a program gathers its next row before it writes the current one.
FWD_TILES = (None, (1, 4096, 4), (1, 2048, 4), (1, 1024, 2), (1, 2048, 8), (2, 4096, 8),
             (4, 2048, 4), (2, 4096, 4), (4, 4096, 8), (8, 2048, 4), (8, 4096, 8))
BWD_TILES = ((16, 512, 4), (1, 4096, 8), (8, 1024, 4), (32, 512, 8), (64, 256, 4),
             (16, 1024, 8))


def _sets():
    """Two input sets (tokens, table, dy, key)."""
    sets = []
    for i in range(2):
        k = jax.random.split(jax.random.key(i), 4)
        sets.append((jax.random.randint(k[0], (B, T), 0, V),
                     jax.random.normal(k[1], (V, D), jnp.bfloat16) * 0.02,
                     jax.random.normal(k[2], (B, T, D), jnp.bfloat16), k[3]))
    return sets


def _emb(tok, table, key, blocks=None):
    return jaxfuse.embedding(tok, table, scale=64.0, rate=0.1, key=key, block_sizes=blocks)


def fwd(sets):
    copy_bw = _timing.copy_ceiling()
    nbytes = 2 * B * T * D * 2
    base = None
    for tile in FWD_TILES:
        blocks = None if tile is None else jaxfuse.RowBlocks(*tile)
        f = jax.jit(lambda tok, table, dy, key, blocks=blocks: _emb(tok, table, key, blocks))
        y = f(*sets[0])
        base = y if base is None else base
        tm = bench(f, sets, reps=20, repeats=5)
        record("emb_fwd", "embedding fwd V128256 d4096 N16384", str(tile or "default"), tm,
               frac_copy=nbytes / tm / copy_bw, same_as_default=bool(jnp.array_equal(y, base)))


def bwd(sets):
    def step(tok, table, dy, key):
        y, vjp = jax.vjp(lambda table: _emb(tok, table, key), table)
        return y, vjp(dy)[0]
    default, base = E._BWD_TILE, None
    for tile in BWD_TILES:
        E._BWD_TILE = tile
        run = jax.jit(step)
        _, dt = run(*sets[0])
        base = dt if base is None else base
        record("emb_rows", "embedding fwd+bwd V128256 d4096 N16384", f"bwd tile {tile}",
               bench(run, sets, reps=10, repeats=5),
               dtable_equal_to_first=bool(jnp.array_equal(dt, base)))
    from benchmarks import _profile
    E._BWD_TILE = default
    _profile.report("emb_rows", "embedding fwd+bwd, default tile", jax.jit(step), sets[0],
                    top=10)


if __name__ == "__main__":
    print(f"device={jax.devices()[0].device_kind} jax={jax.__version__}")
    {"fwd": fwd, "bwd": bwd}[sys.argv[1]](_sets())
    _timing.save(sys.argv[2] if len(sys.argv) > 2 else None)
