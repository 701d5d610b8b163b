"""What a change costs: today's kernels against the tree before it, imported as `jaxfuse_base`
(the smoke scripts build it from `.baseline/jaxfuse`: `git archive REV jaxfuse | tar -x -C
.baseline`, then every `jaxfuse` renamed), timed interleaved in one process (rounds of 5,
medians), with cuDNN beside them where the op has it.

    PYTHONPATH=/tmp/base:. python benchmarks/change_cost.py GROUP [OUT.json]

Groups:
  norms      (s52) the norms' overflow guard: statistics of x / s, s a power of two from the
             row's max|x|. rms_norm, layer_norm and add_norm (rms) at 32768 x 4096 bf16,
             forward and fwd+bwd; forwards also as % of the copy rate; bitwise against base.
  attention  (s53) the Hopper kernels' exponents as exp2((u - m) c2), not one FMA u c2 - m c2
             (FlashAttention-3's form, which gave NaN at scores ~1e9): the forward and the
             default fwd+bwd at issue 14's shapes and the models', with cuDNN; the largest
             difference from base (not bitwise: the exponents round differently).
"""
from __future__ import annotations

import statistics

import jax
import jax.numpy as jnp

import jaxfuse
from benchmarks._timing import commands, copy_ceiling, guarded, interleaved, record

R, D = 32768, 4096


def _norm_cases(lib):
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


def norms():
    import jaxfuse_base
    k = jax.random.split(jax.random.key(0), 5)
    args = [(jax.random.normal(k[0], (R, D), jnp.bfloat16),
             jax.random.normal(k[1], (R, D), jnp.bfloat16),
             jax.random.normal(k[2], (D,), jnp.bfloat16),
             jax.random.normal(k[3], (D,), jnp.bfloat16),
             jax.random.normal(k[4], (R, D), jnp.bfloat16))]
    copy = copy_ceiling()
    new, base = _norm_cases(jaxfuse), _norm_cases(jaxfuse_base)
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


# (label, B, T, Hq, Hkv, D, causal): issue 14's D = 128 rows, the 157M model's and the 1B's.
ATTENTION_ROWS = [
    ("B4 H32 T4096 D128 full", 4, 4096, 32, 32, 128, False),
    ("B4 H32 T4096 D128 causal", 4, 4096, 32, 32, 128, True),
    ("157M: B8 Hq16 Hkv4 T2048 D64 causal", 8, 2048, 16, 4, 64, True),
    ("1B: B2 Hq32 Hkv8 T8192 D64 causal", 2, 8192, 32, 8, 64, True),
    ("B2 H16 T4096 D256 causal", 2, 4096, 16, 16, 256, True),
]


def attention(rounds: int = 5):
    import jaxfuse_base

    def fns(causal):
        def fwd(lib):
            return jax.jit(lambda q, k, v, do: lib.flash_attention(q, k, v, causal=causal))

        def fwd_bwd(lib):
            def step(q, k, v, do):
                o, vjp = jax.vjp(lambda q, k, v: lib.flash_attention(q, k, v, causal=causal),
                                 q, k, v)
                return o, vjp(do)
            return jax.jit(step)

        def cudnn(backward):
            f = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                             implementation="cudnn")
            if not backward:
                return jax.jit(lambda q, k, v, do: f(q, k, v))
            return jax.jit(lambda q, k, v, do: (lambda o, vjp: (o, vjp(do)))(
                *jax.vjp(f, q, k, v)))
        return {"fwd": {"new": fwd(jaxfuse), "base": fwd(jaxfuse_base), "cudnn": cudnn(False)},
                "fwd+bwd": {"new": fwd_bwd(jaxfuse), "base": fwd_bwd(jaxfuse_base),
                            "cudnn": cudnn(True)}}

    for label, b, t, hq, hkv, d, causal in ATTENTION_ROWS:
        ks = jax.random.split(jax.random.key(1), 8)
        mk = lambda i, h: jax.random.normal(ks[i], (b, t, h, d), jnp.bfloat16)
        sets = [(mk(0, hq), mk(1, hkv), mk(2, hkv), mk(3, hq)),
                (mk(4, hq), mk(5, hkv), mk(6, hkv), mk(7, hq))]
        for form, impls in fns(causal).items():
            def run(form=form, impls=impls):
                out = {n: jax.tree.leaves(f(*sets[0])) for n, f in impls.items()
                       if n != "cudnn"}
                diff = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - c.astype(jnp.float32))))
                           for a, c in zip(out["new"], out["base"]))
                tm = interleaved(impls, sets, rounds=rounds, reps=10, repeats=3)
                med = {n: statistics.median(v) for n, v in tm.items()}
                record("attn_cost", f"{label} {form}", "new", med["new"],
                       base_ms=round(med["base"] * 1e3, 4), cudnn_ms=round(med["cudnn"] * 1e3, 4),
                       new_over_base=round(med["new"] / med["base"], 4),
                       cudnn_over_new=round(med["cudnn"] / med["new"], 4), max_diff=diff)
            guarded("attn_cost", f"{label} {form}", "new,base,cudnn", run)


if __name__ == "__main__":
    commands({"norms": norms, "attention": attention})
