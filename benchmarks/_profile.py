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


def kernel_times(fn, args, reps: int = 3) -> list[tuple[str, int, float]]:
    """[(kernel name, launches per call, ms per call)], largest first, over `reps` calls."""
    jax.block_until_ready(fn(*args))
    out_dir = tempfile.mkdtemp()
    with jax.profiler.trace(out_dir):
        for _ in range(reps):
            jax.block_until_ready(fn(*args))
    (path,) = glob.glob(f"{out_dir}/**/*.xplane.pb", recursive=True)
    total = collections.defaultdict(float)
    count = collections.Counter()
    for plane in ProfileData.from_file(path).planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            # Kernel launches live on the stream lines; the "XLA Ops"/"XLA Modules" lines repeat
            # the same time grouped differently.
            if not line.name.startswith("Stream"):
                continue
            for ev in line.events:
                name = re.sub(r"\s+", " ", ev.name)[:90]
                total[name] += ev.duration_ns
                count[name] += 1
    rows = [(k, count[k] // reps, total[k] / reps / 1e6) for k in total]
    return sorted(rows, key=lambda r: -r[2])


def report(section: str, workload: str, fn, args, top: int = 14, reps: int = 3) -> None:
    rows = kernel_times(fn, args, reps)
    busy = sum(r[2] for r in rows)
    print(f"{section:10s} {workload}: {busy:.3f} ms of kernels per call, {len(rows)} kinds")
    for name, n, ms in rows[:top]:
        print(f"{'':12s}{ms:8.3f} ms  x{n:<5d} {name}")
