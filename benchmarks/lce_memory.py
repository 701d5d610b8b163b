"""Compiled temporary memory of the fused linear + cross-entropy at the large shape (compile
only) and the benchmark-shape step time: the quick check after a scheduling change."""
from __future__ import annotations

import jax
import jax.numpy as jnp

import jaxfuse
from benchmarks._timing import bench, record, temp_bytes
from benchmarks.lce import _inputs

if __name__ == "__main__":
    d = 4096
    f = jax.value_and_grad(lambda x, w, y: jaxfuse.linear_cross_entropy(x, w, y), argnums=(0, 1))
    for n, v in ((8192, 128256), (32768, 262144)):
        big = [jax.ShapeDtypeStruct((n, d), jnp.bfloat16),
               jax.ShapeDtypeStruct((d, v), jnp.bfloat16), jax.ShapeDtypeStruct((n,), jnp.int32)]
        record("lce", f"N{n} D{d} V{v} fwd+bwd temp", "jaxfuse", temp_GB=temp_bytes(f, *big) / 1e9)
    args = _inputs(jax.random.key(0), 8192, d, 128256)
    record("lce", "N8192 D4096 V128256 fwd+bwd", "jaxfuse",
           bench(jax.jit(f), [args], reps=3, repeats=3, warmup=1))
