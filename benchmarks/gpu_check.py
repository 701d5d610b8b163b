"""Compile every jaxfuse kernel on the GPU, check it against the reference, time it against the
peers, all in one process, and print one table (also written as JSON).

    PYTHONPATH=. PYTHONUNBUFFERED=1 python benchmarks/gpu_check.py [sections...] [--out FILE]

Sections: rows (softmax, norms, cross-entropy), attention, decode, lce (linear + cross-entropy),
hardening (issue 19's extreme-value and NaN cases, compiled; checks only), block (dropout
family, add_norm, swiglu, rope, embedding), rope_qkv (the q/k/v split with RoPE).
No section named = all. `--no-sweep` skips the block-size sweeps; `--no-check` the checks,
`--no-perf` the timings (a correctness pass over every section); `--resume N` skips the
first N checks or timings (a pass that a time limit cut goes on there). Peers that are not installed
(tokamax) are reported as such, not fatal.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from benchmarks import _timing  # noqa: E402

SECTIONS = ("rows", "attention", "decode", "lce", "hardening", "block", "rope_qkv")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("sections", nargs="*", default=list(SECTIONS))
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--no-perf", action="store_true")
    ap.add_argument("--resume", type=int, default=0,
                    help="skip the first N guarded checks/timings (a pass cut by a time limit)")
    args = ap.parse_args()
    _timing.RESUME["skip"] = args.resume
    dev = jax.devices()[0]
    print(f"device={dev.device_kind} jax={jax.__version__} backend={jax.default_backend()}")
    copy_bw = _timing.copy_ceiling()
    mm = _timing.matmul_ceiling()
    _timing.record("ceiling", "copy 1 GiB f32 (read+write)", "xla", None, TBps=copy_bw / 1e12)
    _timing.record("ceiling", "matmul 8192^3 bf16", "xla", None, TFLOPs=mm / 1e12)
    for name in args.sections:
        try:
            mod = importlib.import_module(f"benchmarks.{name}")
        except ModuleNotFoundError as e:
            print(f"section {name}: not available ({e})")
            continue
        if not args.no_check:
            mod.check()
        if not args.no_perf:
            mod.perf(copy_bw, sweep=not args.no_sweep)
        _timing.save(args.out)
    _timing.save(args.out)


if __name__ == "__main__":
    main()
