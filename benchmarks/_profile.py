"""Where the time of one jitted call goes on the GPU: per-kernel totals from a `jax.profiler`
trace (device planes only), read back with `jax.profiler.ProfileData`. The device has no Nsight
Systems; this is the timeline the XLA runtime itself records."""
from __future__ import annotations

import collections
import glob
import re
import tempfile

import jax
from jax.profiler import ProfileData


def _gpu_planes(fn, args, reps: int):
    """The GPU planes of a `jax.profiler` trace of `reps` calls (after one untraced call)."""
    jax.block_until_ready(fn(*args))
    out_dir = tempfile.mkdtemp()
    with jax.profiler.trace(out_dir):
        for _ in range(reps):
            jax.block_until_ready(fn(*args))
    (path,) = glob.glob(f"{out_dir}/**/*.xplane.pb", recursive=True)
    return [p for p in ProfileData.from_file(path).planes if p.name.startswith("/device:GPU")]


def _hlo_op(ev) -> str:
    """The HLO instruction that launched a kernel (the runtime tags each launch with it)."""
    for name, value in ev.stats:
        if name == "hlo_op":
            return str(value)
    return "?"


def kernel_times(fn, args, reps: int = 3, ops: dict | None = None
                 ) -> list[tuple[str, int, float]]:
    """[(kernel name, launches per call, ms per call)], largest first, over `reps` calls.
    `ops`, if given, is filled with {kernel name: Counter(HLO op -> ns)}."""
    total = collections.defaultdict(float)
    count = collections.Counter()
    for plane in _gpu_planes(fn, args, reps):
        for line in plane.lines:
            # Kernel launches live on the stream lines; the "XLA Ops"/"XLA Modules" lines repeat
            # the same time grouped differently.
            if not line.name.startswith("Stream"):
                continue
            for ev in line.events:
                name = re.sub(r"\s+", " ", ev.name)[:90]
                total[name] += ev.duration_ns
                count[name] += 1
                if ops is not None:
                    ops.setdefault(name, collections.Counter())[_hlo_op(ev)] += ev.duration_ns
    rows = [(k, count[k] // reps, total[k] / reps / 1e6) for k in total]
    return sorted(rows, key=lambda r: -r[2])


# What each kernel is, for a call's breakdown (first pattern that matches the name wins): the
# products and attention are the floor that every implementation of a model pays; the rest is
# what fusion can remove (cuDNN runs only attention in these programs).
CATEGORIES = (("attention", r"flash|sdpa|fmha|attention|cudnn"),
              ("loss", r"lce|cross_entropy"),
              ("matmul", r"nvjet|gemm|cutlass|xmma|cublas|dot"),
              ("copy", r"memcpy|memset|copy"),
              ("jaxfuse rows", r"^jaxfuse_"),
              ("XLA fusions", r""))


def categories(rows) -> dict[str, float]:
    """ms per call in each of `CATEGORIES`, from `kernel_times`' rows."""
    out = dict.fromkeys((c for c, _ in CATEGORIES), 0.0)
    for name, _, ms in rows:
        out[next(c for c, pat in CATEGORIES if re.search(pat, name, re.I))] += ms
    return out


def report(section: str, workload: str, fn, args, top: int = 14, reps: int = 3,
           explain: tuple[str, ...] = ()) -> None:
    """Prints the `top` kernels by time; for kernels whose name contains one of `explain`, also
    the HLO instructions that launched them (which copy is which)."""
    ops: dict = {}
    rows = kernel_times(fn, args, reps, ops)
    busy = sum(r[2] for r in rows)
    print(f"{section:10s} {workload}: {busy:.3f} ms of kernels per call, {len(rows)} kinds")
    print(f"{'':12s}by kind: " + ", ".join(f"{c} {ms:.3f}" for c, ms in categories(rows).items()))
    for name, n, ms in rows[:top]:
        print(f"{'':12s}{ms:8.3f} ms  x{n:<5d} {name}")
    for name, n, ms in rows:
        if any(e in name for e in explain):
            print(f"{'':12s}{name}: launched by")
            for op, ns in ops[name].most_common(40):
                print(f"{'':16s}{ns / reps / 1e6:8.3f} ms  {op}")


def gaps(fn, args, reps: int = 3, top: int = 12) -> None:
    """Where the GPU idles inside one call: the device timeline of `reps` back-to-back calls,
    kernels merged across streams, idle stretches summed per (kernel before, kernel after).
    A call's time minus its kernels' time is these gaps (launch latency, host syncs of loops)."""
    events = [(ev.start_ns, ev.end_ns, re.sub(r"\s+", " ", ev.name)[:40])
              for plane in _gpu_planes(fn, args, reps)
              for line in plane.lines if line.name.startswith("Stream") for ev in line.events]
    if not events:
        print("gaps: no GPU kernels in the trace")
        return
    events.sort()
    idle = collections.defaultdict(float)
    count = collections.Counter()
    end, prev = events[0][1], events[0][2]
    for start, stop, name in events[1:]:
        if start > end:
            # Gaps longer than 5 ms are between calls (host waits), not inside one.
            if start - end < 5e6:
                idle[(prev, name)] += start - end
                count[(prev, name)] += 1
        if stop > end:
            end, prev = stop, name
    total = sum(idle.values()) / reps / 1e6
    print(f"gaps: {total:.3f} ms idle per call inside the calls")
    for key, ns in sorted(idle.items(), key=lambda kv: -kv[1])[:top]:
        print(f"{'':4s}{ns / reps / 1e6:8.3f} ms  x{count[key] // reps:<4d} {key[0]} -> {key[1]}")
