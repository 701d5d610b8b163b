#!/usr/bin/env bash
# s37: the token-slab loss's one cross-entropy kernel (loss and dz) against the pair, by kernel
# time and tile (benchmarks/ce_rows.py), then the model with and without it (model.py --ce-pair).
#   bash benchmarks/smoke/ce_s37.sh "$OUT"      (on the device machine)
set -u
out=${1:-/tmp/s37}
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout -s KILL 200 python benchmarks/ce_rows.py "$out/ce_rows.json" > "$out/ce_rows.log" 2>&1
echo "ce_rows rc=$?"
grep "ms=\|rror" "$out/ce_rows.log" | sed 's/  */ /g' | cut -c1-230
timeout -s KILL 330 python benchmarks/model.py train157 train1b --no-reference --ce-pair \
    --out "$out/model" > "$out/model.log" 2>&1
echo "model rc=$?"
tr '\r' '\n' < "$out/model.log" | grep -av "run/s\]$" | grep -a " ms \|speedup" | cut -c1-200
