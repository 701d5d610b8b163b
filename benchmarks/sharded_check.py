"""The ops under jax.sharding on all GPUs of one machine against one GPU: same results, no
gathered operands in the compiled HLO, and the time of the sharded step against one GPU's
(the issue measured 12.2 ms on two H200s against 10.6 on one for batch-sharded flash attention
before the rules existed).

    PYTHONPATH=. python benchmarks/sharded_check.py --out sharded.json          # GPUs
    XLA_FLAGS=--xla_force_host_platform_device_count=8 PYTHONPATH=. \\
        python benchmarks/sharded_check.py --tiny --out /tmp/s.json            # CPU smoke test

Each workload: loss + gradients under one jax.jit, bf16 inputs, on device 0 alone and on a mesh
of all devices with the inputs placed by NamedSharding; the one-device run does n times the
per-device work of the sharded one ("weak scaling" would keep it equal), so the ideal
speed-up is n.
"""
from __future__ import annotations

import argparse
import json
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxfuse


def _time(f, args, reps=5, calls=10):
    out = f(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            out = f(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / calls)
    return float(np.median(times)) * 1e3


def _workloads(tiny: bool, n: int):
    s = (lambda big, small: small) if tiny else (lambda big, small: big)
    k = jax.random.split(jax.random.key(0), 8)
    r = lambda i, shape, scale=1.0: (jax.random.normal(k[i], shape) * scale).astype(jnp.bfloat16)
    rows, d = s(32768, 16 * n), s(4096, 64)
    x, w = r(0, (rows, d)), r(1, (d,))
    yield ("rms_norm fwd+bwd, rows over devices", lambda x, w: jaxfuse.rms_norm(x, w), (x, w),
           (P("x"), P()))
    b, t, h, hd = s(8, n), s(4096, 32), s(32, 4), s(128, 64)
    q, kk, v = r(2, (b, t, h, hd)), r(3, (b, t, h // 4 or 1, hd)), r(4, (b, t, h // 4 or 1, hd))
    yield ("flash_attention causal fwd+bwd, batch over devices",
           lambda q, k, v: jaxfuse.flash_attention(q, k, v, causal=True), (q, kk, v),
           (P("x"),) * 3)
    tr = s(32768, 32 * n)
    q1, k1, v1 = r(2, (1, tr, h, hd)), r(3, (1, tr, h // 4 or 1, hd)), r(4, (1, tr, h // 4 or 1, hd))
    yield ("ring attention causal fwd+bwd, sequence over devices",
           lambda q, k, v: jaxfuse.flash_attention(q, k, v, causal=True), (q1, k1, v1),
           (P(None, "x"),) * 3)
    n_tok, dm, vocab = s(8192, 16 * n), s(4096, 64), s(128256, 128 * n)
    xs, wv = r(5, (n_tok, dm)), r(6, (dm, vocab), 0.02)
    labels = jax.random.randint(k[7], (n_tok,), 0, vocab)
    yield ("linear_cross_entropy fwd+bwd, vocabulary over devices",
           lambda x, w: jaxfuse.linear_cross_entropy(x, w, labels), (xs, wv), (P(), P(None, "x")))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiny", action="store_true", help="small shapes (CPU smoke test)")
    args = ap.parse_args()
    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("x",), axis_types=(AxisType.Auto,))
    results = []
    for name, f, inputs, specs in _workloads(args.tiny, n):
        loss = lambda *a: jnp.sum(f(*a).astype(jnp.float32))
        step = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(inputs)))))
        one = step(*inputs)
        placed = [jax.device_put(a, NamedSharding(mesh, sp)) for a, sp in zip(inputs, specs)]
        many = step(*placed)
        err = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))) /
                        (float(jnp.max(jnp.abs(a.astype(jnp.float32)))) + 1e-30))
                  for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(many)))
        hlo = step.lower(*placed).compile().as_text()
        gathers = re.findall(r"= (\w+\[[\d,]*\])[^=]*? all-gather\(", hlo)
        t1, tn = _time(step, inputs), _time(step, placed)
        row = dict(workload=name, devices=n, one_device_ms=t1, sharded_ms=tn, speedup=t1 / tn,
                   max_rel_err=err, all_gathers=gathers)
        results.append(row)
        print(f"{name}: 1 device {t1:.3f} ms, {n} devices {tn:.3f} ms ({t1 / tn:.2f}x, ideal "
              f"{n}x), rel err {err:.1e}, all-gathers {gathers or 'none'}", flush=True)
    with open(args.out, "w") as fh:
        json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
