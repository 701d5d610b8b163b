"""Does programmatic dependent launch (PDL) reach a Pallas Triton kernel? (diagnostic, s27)

XLA launches its Triton GEMM fusions with PDL on Hopper (their HLO carries
`xla.pdl_launch="true"`): such a kernel may start while the kernel before it is still running
once every CTA of that one has executed `griddepcontrol.launch_dependents`, and waits with
`griddepcontrol.wait` before it reads what that one wrote. A decoding step is a chain of ~60
launches of a few microseconds each (NOTES s23-5: ~1.1-1.4 us a dependent launch), so a
Pallas kernel in the chain that let its successor start early (and that could itself start
early) would save most of that per launch. Pallas exposes neither instruction; here they come
as inline PTX.

A chain of n steps, each an XLA matmul [32, 1024] x [1024, 1024] (its own weight) and a tiny
Pallas kernel (x + 1), the Pallas kernel plain, or with `griddepcontrol.launch_dependents`
first, or with `griddepcontrol.wait` before its load and `launch_dependents` after it: kernel
time, wall time a step from the profiler's timeline (first start to last end), and the results
compared bitwise (a kernel that read its input before the wait would, if launched early, read
the matmul's output before it was written).

    PYTHONPATH=. PYTHONUNBUFFERED=1 python benchmarks/pdl_probe.py
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import triton as pltriton  # noqa: E402

from jaxfuse.pallas import _common as C  # noqa: E402

_N = 32 * 1024


def _ptx(asm: str, x):
    """`asm` then x unchanged (int32), as one inline-PTX statement: what follows in the
    kernel that depends on the result cannot move above it."""
    return pltriton.elementwise_inline_asm(
        asm + " mov.b32 $0, $1;", args=[x], constraints="=r,r", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.int32)])[0]


def _add_one(x, mode: str, interpret: bool):
    def kernel(x_ref, o_ref):
        zero = jnp.zeros((1,), jnp.int32)
        if mode == "wait":
            zero = _ptx("griddepcontrol.wait;", zero)
        off = zero[0] * _N            # 0, but only once the statement above has run
        v = x_ref[pl.ds(off, _N)] + 1.0
        if mode == "trigger":
            v = v + _ptx("griddepcontrol.launch_dependents;", zero)[0].astype(jnp.float32)
        elif mode == "wait":      # after the load: the statement takes the loaded values' max
            bits = jax.lax.bitcast_convert_type(jnp.broadcast_to(jnp.max(v), (1,)), jnp.int32)
            v = v + (_ptx("griddepcontrol.launch_dependents;", bits) - bits)[0].astype(
                jnp.float32)
        o_ref[...] = v
    return C.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((_N,), jnp.float32), grid=(1,),
                         name=f"probe_pdl_{mode}", interpret=interpret, num_warps=4)(x)


def chain(mode: str, n: int, interpret: bool = False):
    def f(x, ws):
        for i in range(n):
            x = (x.reshape(32, 1024).astype(jnp.bfloat16) @ ws[i]).astype(jnp.float32)
            x = _add_one(x.reshape(-1), mode, interpret)
        return x
    return jax.jit(f)


def main():
    interpret = jax.default_backend() == "cpu"
    n = 4 if interpret else 32
    print(f"device={jax.devices()[0].device_kind} jax={jax.__version__}")
    ws = jax.random.normal(jax.random.key(0), (n, 1024, 1024), jnp.bfloat16) * 0.03
    x = jax.random.normal(jax.random.key(1), (_N,), jnp.float32)
    base = None
    for mode in ("plain", "trigger", "wait"):
        f = chain(mode, n, interpret)
        try:
            out = f(x, ws)
        except Exception as e:  # noqa: BLE001 - a result, not a stop
            print(f"pdl_probe {mode:8s} failed: {type(e).__name__}: {str(e)[:300]}")
            continue
        base = out if base is None else base
        same = bool(jnp.array_equal(out, base))
        if interpret:
            print(f"pdl_probe {mode:8s} ran (interpreted), equal to plain: {same}")
            continue
        from benchmarks._profile import _gpu_planes
        events = sorted((ev.start_ns, ev.end_ns, ev.name) for plane in _gpu_planes(f, (x, ws), 5)
                        for line in plane.lines if line.name.startswith("Stream")
                        for ev in line.events)
        busy = sum(e - s for s, e, _ in events) / 5 / n / 1e3
        # wall: per call, from its first kernel's start to its last kernel's end (a gap of
        # over 20 us ends a call: host dispatch; the chain's own gaps are launch gaps)
        calls, cur = [], [events[0]]
        for ev in events[1:]:
            if ev[0] - max(e for _, e, _ in cur) > 20_000:
                calls.append(cur)
                cur = []
            cur.append(ev)
        calls.append(cur)
        walls = sorted((max(e for _, e, _ in c) - c[0][0]) / n / 1e3 for c in calls)
        overlaps = sum(1 for a, b in zip(events, events[1:]) if b[0] < a[1])
        print(f"pdl_probe {mode:8s} kernels {busy:6.2f} us a step, wall {walls[len(walls) // 2]:6.2f}"
              f" us a step (median of {len(walls)} calls), kernels starting before the previous "
              f"ended: {overlaps // 5} a call, equal to plain: {same}", flush=True)


if __name__ == "__main__":
    main()
