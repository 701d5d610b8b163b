"""Host dispatch cost of a jitted call (diagnostic, s27): per-call wall time of small problems,
pipelined over many calls (the GPU's own time is microseconds, so what is measured is the host's
dispatch), with each executable's effects and host-callback flags (either makes jax's C++ fast
path fall back to Python dispatch). s27's attention table read the Hopper forward at D = 64 and
256 at ~0.73 ms a call where the kernels take 0.2-0.5 ms.

    PYTHONPATH=. PYTHONUNBUFFERED=1 python benchmarks/dispatch_probe.py
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxfuse  # noqa: E402
from jaxfuse import AttnBlocks  # noqa: E402


def per_call_us(f, args, n: int = 300) -> float:
    jax.block_until_ready(f(*args))
    t0 = time.perf_counter()
    out = None
    for _ in range(n):
        out = f(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / n * 1e6


def flags(f, args) -> str:
    try:
        ex = f.lower(*args).compile()._executable
        call = ex.unsafe_call
        return (f"host_callbacks={getattr(call, 'has_host_callbacks', '?')} "
                f"ordered={getattr(call, 'ordered_effects', '?')} "
                f"unordered={getattr(call, 'has_unordered_effects', '?')}")
    except Exception as e:  # noqa: BLE001 - a diagnostic
        return f"flags unavailable: {type(e).__name__}: {str(e)[:80]}"


def main():
    print(f"device={jax.devices()[0].device_kind} jax={jax.__version__}")
    rows = []
    for d in (64, 128, 256):
        q = jax.random.normal(jax.random.key(d), (1, 256, 2, d), jnp.bfloat16)
        for name, kw in (("hopper", {}), ("triton", dict(block_sizes=AttnBlocks(hopper=False)))):
            rows.append((f"flash_attention D{d} causal fwd {name}", jax.jit(
                lambda q, kw=kw: jaxfuse.flash_attention(q, q, q, causal=True, **kw)), (q,)))
        rows.append((f"flash_attention D{d} causal fwd+bwd hopper", jax.jit(
            lambda q: jax.grad(lambda q: jaxfuse.flash_attention(
                q, q, q, causal=True).astype(jnp.float32).sum())(q)), (q,)))
        rows.append((f"cudnn D{d} causal fwd", jax.jit(
            lambda q: jax.nn.dot_product_attention(q, q, q, is_causal=True,
                                                   implementation="cudnn")), (q,)))
    x = jnp.ones((64, 1024), jnp.bfloat16)
    rows.append(("rms_norm (Triton)", jax.jit(lambda x: jaxfuse.rms_norm(x, x[0])), (x,)))
    rows.append(("x * 2 (XLA)", jax.jit(lambda x: x * 2), (x,)))
    if jax.default_backend() == "gpu":      # the attention table's D64 and D256 rows
        from benchmarks._profile import kernel_times
        for shp in ((8, 2048, 16, 64), (2, 4096, 16, 256)):
            q = jax.random.normal(jax.random.key(1), shp, jnp.bfloat16)
            f = jax.jit(lambda q: jaxfuse.flash_attention(q, q, q, causal=True))
            kt = kernel_times(f, (q,), reps=10)
            print(f"table shape {shp}: kernels " + ", ".join(
                f"{k[:44]} x{c} {ms * 1e3:.1f} us" for k, c, ms in kt[:4]))
            for n in (5, 50, 300):
                print(f"    pipelined x{n}: {per_call_us(f, (q,), n):9.1f} us a call", flush=True)
    for name, f, args in rows:
        try:
            print(f"{name:44s} {per_call_us(f, args):9.1f} us a call  {flags(f, args)}",
                  flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"{name:44s} failed: {type(e).__name__}: {str(e)[:160]}")


if __name__ == "__main__":
    main()
