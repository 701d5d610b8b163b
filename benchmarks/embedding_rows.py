"""Sweep of the embedding backward's tile (`embedding._BWD_TILE`: table rows, columns, warps of
a program) at block.py's shape (V = 128256, d = 4096, [8, 2048] tokens, bf16, dropout 0.1):
fwd+bwd time, dtable bitwise equal across tiles (each row sums in the same order), and the
kernel times of the default (profiler).

    PYTHONPATH=. PYTHONUNBUFFERED=1 python benchmarks/embedding_rows.py [OUT.json]
"""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

import jaxfuse
from jaxfuse.pallas import embedding as E
from benchmarks import _timing
from benchmarks._timing import bench, record

S = "emb_rows"


def main():
    print(f"device={jax.devices()[0].device_kind} jax={jax.__version__}")
    v, d, b, t = 128256, 4096, 8, 2048
    sets = []
    for i in range(2):
        k = jax.random.split(jax.random.key(i), 4)
        sets.append((jax.random.randint(k[0], (b, t), 0, v),
                     jax.random.normal(k[1], (v, d), jnp.bfloat16) * 0.02,
                     jax.random.normal(k[2], (b, t, d), jnp.bfloat16), k[3]))

    def step(tok, table, dy, key):
        f = lambda table: jaxfuse.embedding(tok, table, scale=64.0, rate=0.1, key=key)
        y, vjp = jax.vjp(f, table)
        return y, vjp(dy)[0]
    base = None
    for tile in ((16, 512, 4), (1, 4096, 8), (8, 1024, 4), (32, 512, 8), (64, 256, 4),
                 (16, 1024, 8)):
        E._BWD_TILE = tile
        run = jax.jit(step)
        _, dt = run(*sets[0])
        if base is None:
            base = dt
        same = bool(jnp.array_equal(dt, base))
        tm = bench(run, sets, reps=10, repeats=5)
        record(S, "embedding fwd+bwd V128256 d4096 N16384", f"bwd tile {tile}", tm,
               dtable_equal_to_first=same)
    from benchmarks import _profile
    E._BWD_TILE = (16, 512, 4)
    _profile.report(S, "embedding fwd+bwd, default tile", jax.jit(step), sets[0], top=10)
    _timing.save(sys.argv[1] if len(sys.argv) > 1 else None)


if __name__ == "__main__":
    main()
