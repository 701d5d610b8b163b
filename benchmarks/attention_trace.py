"""Where the Hopper attention kernels spend their cycles: Mosaic GPU's on-device trace
(`_hopper.traced`) of every warpgroup's named scopes (wait_k, qk, softmax, ... in the kernel
bodies), summed per scope, with how often the two consumer warpgroups of a CTA are in
tensor-core work and in vector (exp, FMA) work at the same time.

Per scope: cycles per step (mean over every consumer warpgroup's steps) and share of the
consumers' time. "overlap": of the time both consumers of a CTA are busy, the fraction where
one runs a product while the other runs vector work (what ping-pong scheduling is for), and
where both run vector work at once (the exponentials then queue on the same units).

    PYTHONPATH=. PYTHONUNBUFFERED=1 python benchmarks/attention_trace.py [OUT.json [KERNELS [WORKLOAD]]]

KERNELS (comma-separated, of fwd, dkv, dq, dkv_dq) and WORKLOAD (a part of a workload's
label) trace only those: one kernel of one workload is a minute of the GPU, all of them
three.
"""
from __future__ import annotations

import collections
import functools
import glob
import json
import os
import tempfile

import jax
import jax.numpy as jnp

import jaxfuse
from jaxfuse import AttnBlocks
from jaxfuse.pallas import _hopper as H
from jaxfuse.pallas.attention_hopper import HopperAttnTiles
from jaxfuse.pallas.attention_hopper_bwd import HopperBwdTiles
from benchmarks._timing import guarded, record

S = "attn_trace"
# (B, T, Hq, Hkv, D, causal): the 1B model's attention shrunk to T = 4096 and 16/4 heads, the
# 157M model's, and issue 14's D = 128 shape at B = 1, T = 2048 (the traces' shared memory and
# the Python that writes them grow with the events).
WORKLOADS = {"1B-like B1 T4096 H16/4 D64 causal": (1, 4096, 16, 4, 64, True),
             "157M B8 T2048 H16/4 D64 causal": (8, 2048, 16, 4, 64, True),
             "B1 T2048 H32 D128": (1, 2048, 32, 32, 128, False),
             "B1 T2048 H32 D128 causal": (1, 2048, 32, 32, 128, True)}
# Scopes that are products (tensor cores) and vector work; the rest are waits.
MMA = {"qk", "pv", "st", "dv_dpt", "dk", "s_dp", "drain", "dq"}
VEC = {"softmax", "p", "ds"}
STEP = {"fwd": "wait_k", "dkv": "wait_q", "dq": "wait_kv", "dkv_dq": "wait_q"}   # one a step


def _intervals(events):
    """{tid: [(name, start, end)]} of a trace's B/E events (times in cycles, nested scopes
    kept as their own intervals)."""
    out, stacks = collections.defaultdict(list), collections.defaultdict(list)
    for ev in events:
        t = ev["ts"] * 1e3
        if ev["ph"] == "B":
            stacks[ev["tid"]].append((ev["name"], t))
        else:
            name, t0 = stacks[ev["tid"]].pop()
            out[ev["tid"]].append((name, t0, t))
    return out


def _busy(ivs, kinds):
    """Merged [start, end) intervals of the scopes in `kinds`."""
    spans = sorted((a, b) for n, a, b in ivs if n in kinds)
    merged = []
    for a, b in spans:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return merged


def _overlap(x, y) -> float:
    i = j = 0
    total = 0.0
    while i < len(x) and j < len(y):
        total += max(0.0, min(x[i][1], y[j][1]) - max(x[i][0], y[j][0]))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def summarize(path: str, kernel: str, wgs: int = 3) -> dict:
    """The trace's per-scope cycles (module docstring); `wgs`: warpgroups a CTA (consumers and
    the producer, which comes last). The producer's own scopes (the forward's "land" and
    "clean" of edge tiles) are reported as cycles per occurrence."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    ivs = _intervals(events)
    per_scope, steps, span = collections.Counter(), 0, 0.0
    mixed = both_vec = both_busy = 0.0
    producer, producer_n = collections.Counter(), collections.Counter()
    for tid, xs in ivs.items():
        if (tid - 1) % wgs == wgs - 1:            # the producer warpgroup
            for name, a, b in xs:
                producer[name] += b - a
                producer_n[name] += 1
            continue
        if not xs:
            continue
        for name, a, b in xs:
            per_scope[name] += b - a
        steps += sum(1 for n, _, _ in xs if n == STEP[kernel])
        span += max(b for _, _, b in xs) - min(a for _, a, _ in xs)
        # The overlap figures pair consumers 0 and 1 of a CTA (a third, D = 64's forward,
        # is left out of them; its scopes count above).
        if (tid - 1) % wgs == 0 and tid + 1 in ivs:  # consumer 0 with its CTA's consumer 1
            other = ivs[tid + 1]
            m0, v0, m1, v1 = (_busy(i, k) for i in (xs, other) for k in (MMA, VEC))
            mixed += _overlap(m0, v1) + _overlap(v0, m1)
            both_vec += _overlap(v0, v1)
            both_busy += _overlap(_busy(xs, MMA | VEC), _busy(other, MMA | VEC))
    steps = max(steps, 1)
    out = {f"{n} cyc/step": round(c / steps, 1) for n, c in per_scope.most_common()}
    out.update({f"{n} share": round(c / span, 3) for n, c in per_scope.most_common()})
    out.update(steps=steps, span_cyc_per_step=round(span / steps, 1),
               mma_under_vec=round(mixed / max(both_busy, 1), 3),
               vec_with_vec=round(both_vec / max(both_busy, 1), 3))
    out.update({f"producer {n} cyc/each": round(c / producer_n[n], 1)
                for n, c in producer.most_common() if n != "Init"})
    out.update({f"producer {n} count": producer_n[n] for n in producer_n if n != "Init"})
    return out


def main() -> None:
    import sys
    only = sys.argv[2].split(",") if len(sys.argv) > 2 else None
    workload = sys.argv[3] if len(sys.argv) > 3 else ""
    for label, (b, t, hq, hkv, d, causal) in WORKLOADS.items():
        if workload not in label:
            continue
        ks = jax.random.split(jax.random.key(0), 4)
        q = jax.random.normal(ks[0], (b, t, hq, d), jnp.bfloat16)
        k, v = (jax.random.normal(kk, (b, t, hkv, d), jnp.bfloat16) for kk in ks[1:3])
        do = jax.random.normal(ks[3], q.shape, jnp.bfloat16)
        attend = functools.partial(jaxfuse.flash_attention, causal=causal,
                                   block_sizes=AttnBlocks(hopper=True))
        # One kernel traced per call; trace space, in scope ranges per warpgroup: at most T / 128
        # forward steps of 6 scopes, g * T / 64 dK/dV steps of 7 (11 with its ping-pong's 4
        # turns), T / 64 dQ steps of 6.
        g = hq // hkv
        # "dkv_dq": the fused dQ (deterministic=False) forced, where the consumers also form
        # dQ ("wait_ds", "dq", "dq_store": 3 more scopes every step at D = 128, where each
        # forms half the columns; every other step at 64), and the ping-pong's 4 "turn"
        # scopes if on: 14 (and "bwd_dkv" names it too, so it runs alone).
        kernels = {"fwd": ("flash_fwd", 16 * (t // 128)), "dkv": ("bwd_dkv", 11 * g * t // 64),
                   "dq": ("bwd_dq", 6 * (t // 64)),
                   "dkv_dq": ("bwd_dkv_dq", 14 * g * t // 64)}
        fused = functools.partial(
            jaxfuse.flash_attention, causal=causal, deterministic=False,
            block_sizes=AttnBlocks(hopper=HopperAttnTiles(backward=HopperBwdTiles(fused_dq=True))))
        for kernel, (part, entries) in kernels.items():
            if only and kernel not in only:
                continue

            def run(kernel=kernel, part=part, entries=entries):
                d_out = tempfile.mkdtemp()
                with H.traced({part: entries + 8}, d_out):
                    f = fused if kernel == "dkv_dq" else attend
                    fn = f if kernel == "fwd" else (
                        lambda q, k, v: jax.vjp(f, q, k, v)[1](do))
                    jax.block_until_ready(jax.jit(fn)(q, k, v))
                    jax.effects_barrier()
                (path,) = glob.glob(os.path.join(d_out, "*-trace.json"))
                # Warpgroups a CTA: the forward's consumers (three at D = 64) and the producer.
                wgs = (HopperAttnTiles().n_consumers(d) if kernel == "fwd" else 2) + 1
                record(S, label, kernel, None, **summarize(path, kernel, wgs))
            guarded(S, label, kernel, run)


if __name__ == "__main__":
    from benchmarks import _timing
    _timing.script(main)
