#!/usr/bin/env bash
# s37's last call: the model on the current code (the presets' token slab of 4096, each slab's
# loss and dz by one kernel), with the slab of 2048 as a row beside it, and decoding.
#   bash benchmarks/smoke/final_s37.sh "$OUT"      (on the device machine)
set -u
out=${1:-/tmp/s37}
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout -s KILL 400 python benchmarks/model.py train157 train1b decode --no-reference \
    --loss-token-slab 2048 --out "$out/model" > "$out/model.log" 2>&1
echo "model rc=$?"
tr '\r' '\n' < "$out/model.log" | grep -av "run/s\]$" | grep -a " ms \|speedup" | cut -c1-200
