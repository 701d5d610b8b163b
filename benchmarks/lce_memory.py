"""Compiled temporary memory of the fused linear + cross-entropy at the two benchmark shapes
(compile only) and the N=8192 step time for a few slab widths against XLA's: the quick check
after a scheduling change.

    PYTHONPATH=. python benchmarks/lce_memory.py
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

import jaxfuse
from benchmarks._timing import bench, guarded, record, temp_bytes
from benchmarks.lce import _inputs


def _step(**kw):
    return jax.value_and_grad(lambda x, w, y: jaxfuse.linear_cross_entropy(x, w, y, **kw),
                              argnums=(0, 1))


if __name__ == "__main__":
    d = 4096
    variants = {"jaxfuse": {}, "jaxfuse[slab=4096]": dict(block_sizes=jaxfuse.LCEBlocks(4096)),
                "jaxfuse[slab=10240]": dict(block_sizes=jaxfuse.LCEBlocks(10240)),
                "jaxfuse[hopper=False]": dict(block_sizes=jaxfuse.LCEBlocks(hopper=False)),
                "xla_reference": dict(impl="reference")}
    for n, v in ((8192, 128256), (32768, 262144)):
        big = [jax.ShapeDtypeStruct((n, d), jnp.bfloat16),
               jax.ShapeDtypeStruct((d, v), jnp.bfloat16), jax.ShapeDtypeStruct((n,), jnp.int32)]
        for name in ("jaxfuse", "jaxfuse[slab=10240]"):
            guarded("lce", f"N{n} D{d} V{v} fwd+bwd temp", name, lambda name=name: record(
                "lce", f"N{n} D{d} V{v} fwd+bwd temp", name,
                temp_GB=temp_bytes(_step(**variants[name]), *big) / 1e9))
    args = _inputs(jax.random.key(0), 8192, d, 128256)
    for name, kw in variants.items():
        guarded("lce", "N8192 D4096 V128256 fwd+bwd", name, lambda kw=kw, name=name: record(
            "lce", "N8192 D4096 V128256 fwd+bwd", name,
            bench(jax.jit(_step(**kw)), [args], reps=3, repeats=3, warmup=1)))
