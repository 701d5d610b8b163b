"""Timing and reporting helpers shared by the GPU scripts (see ../shared/BENCHMARKING.md).

Short ops are timed the pipelined way: `reps` back-to-back calls, one block at the end, median
of several repeats, so that dispatch (tens of microseconds) overlaps device work instead of being
counted. Inputs rotate between several sets so that nothing is served from L2 by accident.
"""
from __future__ import annotations

import json
import os
import statistics
import time
import traceback
from unittest import mock

import jax
import jax.numpy as jnp

ROWS: list[dict] = []


def bench(fn, arg_sets, *, reps: int = 20, repeats: int = 5, warmup: int = 2) -> float:
    """Median seconds per call of `fn(*args)`, cycling through `arg_sets`."""
    for i in range(warmup):
        jax.block_until_ready(fn(*arg_sets[i % len(arg_sets)]))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = None
        for i in range(reps):
            out = fn(*arg_sets[i % len(arg_sets)])
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / reps)
    return statistics.median(times)


def interleaved(fns: dict, arg_sets, rounds: int, settle_s: float = 0.0, **bench_kw) -> dict:
    """{name: [seconds per call, one per round]}: every function of `fns` timed by `bench` once
    a round, in a rotating order, so that each sees the same clock (the H200's moves under its
    power cap by ~10% between back-to-back timings of one function). With `settle_s`, each
    first runs alone for that long before its timing, so that it is timed in the state its own
    load holds the GPU in, not the one the previous function left."""
    times = {name: [] for name in fns}
    order = list(fns)
    for r in range(rounds):
        # The order rotates each round: no function always runs right after the same one
        # (lce.py's runs 34-36: the one right after XLA's step read 3-4% slower).
        for name in order[r % len(order):] + order[:r % len(order)]:
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < settle_s:
                jax.block_until_ready(fns[name](*arg_sets[0]))
            times[name].append(bench(fns[name], arg_sets, **bench_kw))
    return times


def temp_bytes(fn, *args) -> int | None:
    try:
        return int(jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes)
    except Exception:  # noqa: BLE001 - a peer without memory analysis reports None
        return None


def rel_err(out, ref) -> float:
    out = jnp.asarray(out, jnp.float32)
    ref = jnp.asarray(ref, jnp.float32)
    # The floor keeps an all-but-zero reference (e.g. the gradient of a one-column RMSNorm)
    # from turning rounding noise into a "relative error" of 1.
    floor = 1e-3 * ref.size ** 0.5
    return float(jnp.linalg.norm((out - ref).ravel()) / max(float(jnp.linalg.norm(ref.ravel())),
                                                           floor))


def segment_thirds(b: int, tq: int, tk: int) -> dict:
    """flash_attention's q_segment_ids and kv_segment_ids for b sequences of three documents
    each (position * 3 // length: boundaries off the tiles), as the checks pass them."""
    ids = lambda t: (jnp.arange(t) * 3 // t)[None].repeat(b, 0)       # noqa: E731
    return dict(q_segment_ids=ids(tq), kv_segment_ids=ids(tk))


def record(section: str, workload: str, impl: str, seconds: float | None = None, **extra):
    row = {"section": section, "workload": workload, "impl": impl,
           "ms": None if seconds is None else seconds * 1e3, **extra}
    ROWS.append(row)
    parts = [f"{section:10s} {workload:44s} {impl:28s}"]
    if seconds is not None:
        parts.append(f"{seconds * 1e3:9.3f} ms")
    for k, v in extra.items():
        parts.append(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}")
    print("  ".join(parts), flush=True)


# `gpu_check.py --resume N`: the first N guarded calls of the process are skipped, so that a
# correctness pass cut by a device call's time limit goes on where it stopped.
RESUME = {"skip": 0}


def guarded(section: str, workload: str, impl: str, thunk):
    """Runs `thunk()`; a failure is recorded as a row (with the error), never a crash."""
    if RESUME["skip"] > 0:
        RESUME["skip"] -= 1
        print(f"{section} {workload} {impl} skipped (--resume)")
        return None
    try:
        return thunk()
    except Exception as e:  # noqa: BLE001
        msg = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        record(section, workload, impl, error=msg)
        if os.environ.get("JAXFUSE_BENCH_TRACE"):
            traceback.print_exc()
        return None


def peers(section: str, **builders) -> dict:
    """Peer implementations by name; a builder that fails (peer not installed) is recorded as a
    row and skipped. Each builder returns a dict of name -> function."""
    out = {}
    for name, build in builders.items():
        try:
            out.update(build())
        except Exception as e:  # noqa: BLE001
            record(section, "peer import", name, error=f"{type(e).__name__}: {str(e)[:100]}")
    return out


def copy_ceiling() -> float:
    """Bytes/s of a large device copy (elementwise scale of 1 GiB float32: read + write)."""
    x = jax.random.normal(jax.random.key(0), (1 << 28,), jnp.float32)
    f = jax.jit(lambda a: a * 1.0001)
    t = bench(f, [(x,)], reps=20)
    return 2 * x.nbytes / t


def matmul_ceiling() -> float:
    a = jax.random.normal(jax.random.key(1), (8192, 8192), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(2), (8192, 8192), jnp.bfloat16)
    f = jax.jit(lambda a, b: a @ b)
    t = bench(f, [(a, b)], reps=10)
    return 2 * 8192 ** 3 / t


def save(path: str | None):
    if not path:
        return
    with open(path, "w") as fh:
        json.dump({"jax": jax.__version__, "device": str(jax.devices()[0].device_kind),
                   "date": time.strftime("%Y-%m-%d"), "rows": ROWS}, fh, indent=1)


def script(main) -> None:
    """A probe script's `__main__`: print the device, run `main()`, save the rows to the JSON
    path given as the first argument (if any)."""
    import sys
    print(f"device={jax.devices()[0].device_kind} jax={jax.__version__}")
    main()
    save(sys.argv[1] if len(sys.argv) > 1 else None)


def commands(table: dict) -> None:
    """A script's `__main__` with subcommands, `python SCRIPT NAME [OUT.json]`: print the
    device, run table[NAME] (given the ROUNDS environment variable as its `rounds` where it
    takes one and ROUNDS is set; else its own default), save the rows to OUT.json if given."""
    import inspect
    import os
    import sys
    name = sys.argv[1] if len(sys.argv) > 1 else None
    if name not in table:
        raise SystemExit(f"usage: {sys.argv[0]} {{{'|'.join(table)}}} [OUT.json]")
    print(f"device={jax.devices()[0].device_kind} jax={jax.__version__}")
    fn = table[name]
    kw = {}
    if "ROUNDS" in os.environ and "rounds" in inspect.signature(fn).parameters:
        kw["rounds"] = int(os.environ["ROUNDS"])
    fn(**kw)
    save(sys.argv[2] if len(sys.argv) > 2 else None)


def unguarded_attention():
    """A context in which the Hopper attention kernels take no guard against masked keys'
    garbage (`_attn.hides_keys` False: the forward's producer cleans no edge tiles, the backward
    gets no XLA pass): a diagnostic for the guard's cost. Hold it over the whole lowering: a
    custom_vjp's backward is traced after the forward returns."""
    from jaxfuse.pallas import _attn
    return mock.patch.object(_attn, "hides_keys", lambda spec: False)


def no_auto_barriers():
    """A context in which the Hopper forward compiles without Mosaic GPU's automatic barriers
    around shared-memory accesses and TMA issues (`attention_hopper._AUTO_BARRIERS`, tokamax's
    `unsafe_no_auto_barriers`): a diagnostic."""
    from jaxfuse.pallas import attention_hopper
    return mock.patch.object(attention_hopper, "_AUTO_BARRIERS", False)


def mbarrier_pingpong():
    """A context in which the Hopper forward's two consumers take turns on an mbarrier
    rendezvous (arrive, then a polling wait) instead of a hardware named barrier (`bar.sync`,
    the default since s17: `attention_hopper._NAMED_PINGPONG`)."""
    from jaxfuse.pallas import attention_hopper
    return mock.patch.object(attention_hopper, "_NAMED_PINGPONG", False)


def l2_share(n_bytes: int):
    """A context in which the persistent Hopper forward groups heads by `n_bytes` of K and V
    (`attention_hopper._L2_SHARE`, read when a call is traced)."""
    from jaxfuse.pallas import attention_hopper
    return mock.patch.object(attention_hopper, "_L2_SHARE", n_bytes)


def bwd_head_groups(n_bytes: int | None):
    """A context in which the Hopper backward's grids launch heads in groups of `n_bytes` of
    shared operands (`attention_hopper_bwd._BWD_GROUP_BYTES`; 16 MiB the default; None: every
    head one group; 1: one head a group, each head's sawtooth in turn)."""
    from jaxfuse.pallas import attention_hopper_bwd as AHB
    return mock.patch.object(AHB, "_BWD_GROUP_BYTES", n_bytes)


def fwd_head_groups(n_bytes: int | None):
    """A context in which the Hopper forward's CTA-a-tile grid launches heads in groups of
    `n_bytes` of K and V (`attention_hopper._FWD_GROUP_BYTES`; 16 MiB the default; 0: one head
    a group; None: every head one group)."""
    from jaxfuse.pallas import attention_hopper
    return mock.patch.object(attention_hopper, "_FWD_GROUP_BYTES", n_bytes)


def guard_always_writes():
    """A context in which the Hopper forward's producer rewrites every edge tile instead of
    only those holding a non-finite value (`_hopper_ring._COUNT_FIRST`): a diagnostic."""
    from jaxfuse.pallas import _hopper_ring
    return mock.patch.object(_hopper_ring, "_COUNT_FIRST", False)
