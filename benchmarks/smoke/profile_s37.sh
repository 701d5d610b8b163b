#!/usr/bin/env bash
# s37: where the 1B step goes on the current code (profiler, by kind), and the 157M with a
# token slab of 8192 beside the preset's 4096.
#   bash benchmarks/smoke/profile_s37.sh "$OUT"      (on the device machine)
set -u
out=${1:-/tmp/s37}
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout -s KILL 170 python benchmarks/model.py train1b --no-reference --profile \
    --out "$out/profile1b" > "$out/profile1b.log" 2>&1
echo "profile 1b rc=$?"
tr '\r' '\n' < "$out/profile1b.log" | grep -av "run/s\]$" | grep -a "by kind\| ms \|speedup\|kernels per call" | cut -c1-200
timeout -s KILL 110 python benchmarks/model.py train157 --no-reference --loss-token-slab 8192 \
    --out "$out/model157" > "$out/model157.log" 2>&1
echo "model 157 rc=$?"
tr '\r' '\n' < "$out/model157.log" | grep -av "run/s\]$" | grep -a " ms \|speedup" | cut -c1-200
