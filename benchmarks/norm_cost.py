"""What the norms' overflow guard costs (s52): statistics of x / s, s a power of two from the
row's max|x| (`reference.layer_norm.row_scale`), one more reduction per row. Today's kernels
against the tree before the change, imported as `jaxfuse_base` (`smoke/s52.sh norms` builds it
from `.baseline/jaxfuse`), timed interleaved in one process at 32768 x 4096 bf16: rms_norm and
layer_norm forward and fwd+bwd, add_norm (rms) fwd+bwd; forwards also as % of the copy rate.

    PYTHONPATH=/tmp/base:. python benchmarks/norm_cost.py [OUT.json]
"""
from __future__ import annotations

import statistics

import jax
import jax.numpy as jnp

import jaxfuse
from benchmarks._timing import copy_ceiling, interleaved, record, script

R, D = 32768, 4096


def _cases(lib):
    def fb(f):
        def step(x, r, w, b, ct):
            y, vjp = jax.vjp(lambda x, w: f(x, r, w, b), x, w)
            return vjp(ct)
        return jax.jit(step)
    return {
        "rms_norm fwd": jax.jit(lambda x, r, w, b, ct: lib.rms_norm(x, w)),
        "layer_norm fwd": jax.jit(lambda x, r, w, b, ct: lib.layer_norm(x, w, b)),
        "rms_norm fwd+bwd": fb(lambda x, r, w, b: lib.rms_norm(x, w)),
        "layer_norm fwd+bwd": fb(lambda x, r, w, b: lib.layer_norm(x, w, b)),
        "add_norm fwd": jax.jit(lambda x, r, w, b, ct: lib.add_norm(x, r, w)),
        "add_norm fwd+bwd": fb(lambda x, r, w, b: lib.add_norm(x, r, w)[1]),
    }


def main():
    import jaxfuse_base
    k = jax.random.split(jax.random.key(0), 5)
    args = [(jax.random.normal(k[0], (R, D), jnp.bfloat16),
             jax.random.normal(k[1], (R, D), jnp.bfloat16),
             jax.random.normal(k[2], (D,), jnp.bfloat16),
             jax.random.normal(k[3], (D,), jnp.bfloat16),
             jax.random.normal(k[4], (R, D), jnp.bfloat16))]
    copy = copy_ceiling()
    new, base = _cases(jaxfuse), _cases(jaxfuse_base)
    for name in new:
        # bitwise equal on normal inputs (s = 1 for every row)
        same = all(bool(jnp.array_equal(a, b)) for a, b in zip(
            jax.tree.leaves(new[name](*args[0])), jax.tree.leaves(base[name](*args[0]))))
        t = interleaved({"new": new[name], "base": base[name]}, args, rounds=5, reps=20)
        tn, tb = statistics.median(t["new"]), statistics.median(t["base"])
        moved = {"rms_norm fwd": 2, "layer_norm fwd": 2, "add_norm fwd": 4}.get(name)
        pct = {"copy_pct": round(100 * moved * R * D * 2 / tn / copy, 1)} if moved else {}
        record("norm_cost", name, "new", tn, base_ms=round(tb * 1e3, 4),
               new_over_base=round(tn / tb, 4), bitwise=same, **pct)


if __name__ == "__main__":
    script(main)
