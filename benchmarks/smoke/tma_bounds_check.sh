#!/usr/bin/env bash
# The GPU checks branch s34-tma-bounds needs before it merges (benchmarks/NOTES.md s34 item 7),
# in order, each under a kill timeout (a wholly out-of-bounds TMA box that never completes its
# barrier would hang): the probe of TMA's bounds for the kernels' own copies, the Hopper
# attention cases with ragged lengths, then the backward's ragged checks and the T4000 timing.
#   bash benchmarks/smoke/tma_bounds_check.sh "$OUT"      (on the device machine)
set -u
out=${1:-/tmp/tma_bounds}
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout -s KILL 60 python benchmarks/tma_oob_probe.py > "$out/probe.log" 2>&1
echo "probe rc=$?"; tail -4 "$out/probe.log"
timeout -s KILL 200 python benchmarks/attention.py check_s32 --out "$out/check_s32.json" \
    > "$out/check_s32.log" 2>&1
echo "check_s32 rc=$?: $(grep -c 'status=ok' "$out/check_s32.log") ok, \
$(grep -c 'FAIL' "$out/check_s32.log") FAIL"
grep "FAIL\|rror" "$out/check_s32.log" | cut -c1-200 | head -5
timeout -s KILL 240 python benchmarks/attention_bwd.py ragged --out "$out/ragged.json" \
    > "$out/ragged.log" 2>&1
echo "ragged rc=$?"
grep "FAIL\|rror" "$out/ragged.log" | cut -c1-200 | head -5
grep " ms" "$out/ragged.log" | cut -c1-140
