"""Where a kernel's warps wait, per SASS instruction, from Nsight Compute's source page.

Reads the CSV that `ncu --import REP --page source --csv --print-source sass` prints (one block
a kernel; `smoke/_lib.sh`'s `ncu_sass` writes it gzipped) and prints, for each kernel, the warp
stall samples by reason and the instructions that hold most of them, with their neighbours'
opcodes, so that a stall can be placed in the kernel (an mbarrier wait is a SYNCS
instruction, a wgmma wait a WARPGROUP.DEPBAR, a named barrier a BAR).

    python benchmarks/sass_stalls.py benchmarks/results/...-ncu-sass-...csv.gz [--top 25]
"""
from __future__ import annotations

import argparse
import collections
import csv
import gzip
import io


def kernels(path):
    """{kernel name: [row dicts]} from the source page's CSV."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        text = f.read()
    out, name, lines = {}, None, []

    def flush():
        if name is not None:
            out[name] = list(csv.DictReader(io.StringIO("".join(lines))))
    for line in text.splitlines(keepends=True):
        if line.startswith('"Kernel Name"'):
            flush()
            name, lines = line.split(",")[1].strip('"'), []
        else:
            lines.append(line)
    flush()
    return out


def _int(v):
    try:
        return int(v)
    except (TypeError, ValueError):
        return 0


def report(name, rows, top):
    reasons = [k for k in rows[0] if k.startswith("stall_") and "Not Issued" not in k]
    total = sum(_int(r["Warp Stall Sampling (All Samples)"]) for r in rows)
    print(f"== {name}: {len(rows)} instructions, {total} samples")
    by = collections.Counter({k[6:]: sum(_int(r[k]) for r in rows) for k in reasons})
    print("   by reason: " + ", ".join(f"{k} {v / total:.1%}" for k, v in by.most_common(8)))
    ops = collections.Counter()
    for r in rows:          # the opcode, past a predicate (@P0, @!UP1)
        words = [w for w in r["Source"].split() if not w.startswith("@")]
        ops[words[0] if words else "?"] += _int(r["Warp Stall Sampling (All Samples)"])
    print("   by opcode: " + ", ".join(f"{k} {v / total:.1%}" for k, v in ops.most_common(10)))
    ranked = sorted(range(len(rows)), key=lambda i: -_int(
        rows[i]["Warp Stall Sampling (All Samples)"]))
    for i in ranked[:top]:
        r = rows[i]
        s = _int(r["Warp Stall Sampling (All Samples)"])
        why = sorted(((_int(r[k]), k[6:]) for k in reasons), reverse=True)[:2]
        before = " | ".join(rows[j]["Source"].strip()[:28] for j in range(max(0, i - 2), i))
        print(f"   {s / total:6.1%} #{i:<5} {r['Source'].strip()[:52]:52} "
              f"[{', '.join(f'{k} {v}' for v, k in why if v)}]  after: {before}")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    for name, rows in kernels(args.csv).items():
        report(name, rows, args.top)


if __name__ == "__main__":
    main()
