"""Speed-ratio charts from the GPU scripts' results (the JSON that `_timing.save` writes):
for every workload of a run, each peer's time over jaxfuse's time measured in the same run
(above 1: jaxfuse faster), one bar per peer, one group per workload.

    python benchmarks/charts.py OUT.png RUN.json [RUN.json ...] [--peers cudnn,tokamax_mosaic]
        [--ours jaxfuse] [--title "..."]

Each file is one run: ratios are never taken across files (the H200's clock moves 5% between
runs, BENCHMARKS.md). Workloads whose rows lack jaxfuse's time or every peer's are left out.
Runs on a CPU (matplotlib only), so the charts BENCHMARKS.md shows are redrawn from the logs.
"""
from __future__ import annotations

import argparse
import json
import os


def ratios(rows: list[dict], ours: str, peers: list[str]) -> list[tuple[str, dict]]:
    """[(workload, {peer: peer_ms / ours_ms})] in the run's order."""
    times: dict[str, dict[str, float]] = {}
    for r in rows:
        if r.get("ms"):
            times.setdefault(r["workload"], {})[r["impl"]] = r["ms"]
    out = []
    for wl, t in times.items():
        if ours in t and any(p in t for p in peers):
            out.append((wl, {p: t[p] / t[ours] for p in peers if p in t}))
    return out


def draw(path: str, groups: list[tuple[str, dict]], peers: list[str], title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    n, w = len(groups), 0.8 / max(len(peers), 1)
    # Wide enough for the longest workload label beside the bars (7-point text).
    width = max(8.0, 4.5 + 0.062 * max((len(wl) for wl, _ in groups), default=0))
    fig, ax = plt.subplots(figsize=(width, 0.45 * n * max(len(peers), 1) + 1.5))
    for i, peer in enumerate(peers):
        ys = [g - 0.4 + (i + 0.5) * w for g in range(n)]
        vals = [r.get(peer, 0.0) for _, r in groups]
        bars = ax.barh(ys, vals, height=w, label=f"{peer} time / jaxfuse time")
        for bar, v in zip(bars, vals):
            if v:
                ax.text(v, bar.get_y() + bar.get_height() / 2, f" {v:.2f}x", va="center",
                        fontsize=7)
    ax.axvline(1.0, color="k", lw=0.8)
    top = max((v for _, r in groups for v in r.values()), default=1.0)
    ax.set_xlim(0, max(top, 1.0) * 1.15)      # room for the labels
    ax.set_yticks(range(n), [wl for wl, _ in groups], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("speed ratio (above 1: jaxfuse faster; same run)")
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"chart: {path}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--peers", default="cudnn,tokamax_mosaic")
    ap.add_argument("--ours", default="jaxfuse")
    ap.add_argument("--title", default=None)
    args = ap.parse_args(argv)
    peers = args.peers.split(",")
    groups, heads = [], []
    many = len(args.runs) > 1          # workloads then carry their run's tag
    for path in args.runs:
        with open(path) as fh:
            run = json.load(fh)
        tag = os.path.basename(path).rsplit(".", 1)[0]
        heads.append(f"{run.get('device', '?')}, jax {run.get('jax', '?')}, {run.get('date', '?')}")
        groups += [(f"{wl} [{tag.rsplit('-', 1)[-1]}]" if many else wl, r)
                   for wl, r in ratios(run["rows"], args.ours, peers)]
    if not groups:
        raise SystemExit(f"no workload of {args.runs} has {args.ours} and one of {peers}")
    draw(args.out, groups, peers, args.title or "; ".join(sorted(set(heads))))


if __name__ == "__main__":
    main()
