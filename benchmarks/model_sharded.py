"""The model's training step on a mesh of all GPUs of one machine (`jaxfuse.model.sharding`):
data, FSDP, tensor and sequence parallel against one GPU. Per layout: the loss of one step
against the one-GPU step on the same batch, the step time, tokens per second, and the
all-gathers left in the compiled HLO.

    PYTHONPATH=. python benchmarks/model_sharded.py --out model_sharded.json            # GPUs
    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu PYTHONPATH=. \\
        python benchmarks/model_sharded.py --tiny --out /tmp/m.json                    # CPU smoke

The one-GPU run does the whole batch; the mesh splits it (strong scaling, ideal speed-up n).
The sequence-parallel layout runs a long context (ring attention) at batch 1 per data row.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
import time

import jax
import numpy as np
from jax.sharding import AxisType

from jaxfuse import model as M


def _time(step, state, batch, reps: int):
    params, opt_state = state
    params, opt_state, loss = step(params, opt_state, *batch)       # compile + warm
    jax.block_until_ready(loss)
    t0 = time.perf_counter()
    for _ in range(reps):
        params, opt_state, loss = step(params, opt_state, *batch)
    jax.block_until_ready(loss)
    return (time.perf_counter() - t0) / reps * 1e3


def _layouts(n: int):
    t = 2 if n % 2 == 0 else 1
    yield "data", dict(data=n)
    yield "fsdp", dict(fsdp=n)
    if t > 1:
        yield f"data x tensor={t}", dict(data=n // t, tensor=t)
        yield f"data x fsdp x tensor={t}", dict(data=max(1, n // (2 * t)),
                                                fsdp=2 if n >= 4 else 1, tensor=t)
        yield f"tensor={n}", dict(tensor=n)
    yield "seq (ring attention)", dict(seq=n)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiny", action="store_true", help="a tiny model (CPU smoke test)")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    n = jax.device_count()
    if args.tiny:
        cfg = M.Config(vocab_size=64, d_model=64, n_layers=2, n_heads=8, n_kv_heads=8, d_ff=128,
                       max_len=64)
        batch, seq_len, long_len = 2 * n, 16, 16 * n
    else:
        cfg = M.preset("157m", n_heads=16, n_kv_heads=8)
        batch, seq_len, long_len = 8 * n, 2048, 4096 * n
    opt = M.optimizer(1e-3, 100, warmup_steps=1)
    params0 = M.init(jax.random.key(0), cfg)
    # fresh buffers for every run: the sharded step donates its inputs, and device_put may
    # alias a replicated placement with params0's own buffer
    fresh = lambda: jax.tree.map(lambda x: x.copy(), params0)
    rng = np.random.default_rng(0)
    results = []
    for name, axes in _layouts(n):
        seq = "seq" in axes
        b, t = (n // axes.get("seq", 1) or 1, long_len) if seq else (batch, seq_len)
        b = max(b, axes.get("data", 1) * axes.get("fsdp", 1))
        tokens = rng.integers(0, cfg.vocab_size, (b, t)).astype(np.int32)
        targets = np.roll(tokens, -1, axis=1)
        c = dataclasses.replace(cfg, max_len=max(cfg.max_len, t))
        one_step = jax.jit(lambda p, s, a, y: M.train_step(p, s, a, y, cfg=c, opt=opt))
        try:
            one_loss = float(one_step(params0, opt.init(params0), tokens, targets)[2])
            t1 = _time(one_step, (params0, opt.init(params0)), (tokens, targets), args.reps)
        except Exception as e:              # a long context may not fit one GPU
            one_loss, t1 = None, None
            print(f"{name}: one device failed ({type(e).__name__}: {str(e)[:120]})")
        mesh = jax.make_mesh(tuple(axes.values()), tuple(axes),
                             axis_types=(AxisType.Auto,) * len(axes))
        step = M.sharded_train_step(c, opt, mesh, batch=b, seq_len=t)
        place = lambda: M.sharding.shard_train_state(fresh(), opt.init(params0), c, opt, mesh)
        data = M.sharding.shard_batch((tokens, targets), mesh)
        p, s = place()
        hlo = step.lower(p, s, *data, None).compile().as_text()
        loss = float(step(p, s, *data)[2])
        tn = _time(step, place(), data, args.reps)
        gathers = re.findall(r"= (\w+\[[\d,]*\])[^=]*? all-gather\(", hlo)
        row = dict(layout=name, mesh=axes, batch=b, seq_len=t, loss=loss, one_device_loss=one_loss,
                   one_device_ms=t1, sharded_ms=tn, speedup=None if t1 is None else t1 / tn,
                   tokens_per_s=b * t / tn * 1e3, all_gathers=sorted(set(gathers)))
        results.append(row)
        print(f"{name} {axes}: loss {loss:.4f} (1 GPU {one_loss}), {tn:.1f} ms "
              f"(1 GPU {t1 and round(t1, 1)} ms), {b * t / tn * 1e3:,.0f} tok/s, "
              f"all-gathers {sorted(set(gathers)) or 'none'}", flush=True)
    with open(args.out, "w") as fh:
        json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
