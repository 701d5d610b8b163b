#!/usr/bin/env bash
# s37: the loss's token slab (Config.loss_token_slab, the presets' 2048) at 4096 and 8192 now
# that a slab's dz is written over its logits (one [slab, V] buffer, not two).
#   bash benchmarks/smoke/slab_s37.sh "$OUT"      (on the device machine)
set -u
out=${1:-/tmp/s37}
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout -s KILL 280 python benchmarks/model.py train157 train1b --no-reference \
    --loss-token-slab 4096 --out "$out/model4096" > "$out/model4096.log" 2>&1
echo "model 4096 rc=$?"
tr '\r' '\n' < "$out/model4096.log" | grep -av "run/s\]$" | grep -a " ms \|speedup" | cut -c1-200
timeout -s KILL 200 python benchmarks/model.py train1b --no-reference \
    --loss-token-slab 8192 --out "$out/model8192" > "$out/model8192.log" 2>&1
echo "model 8192 rc=$?"
tr '\r' '\n' < "$out/model8192.log" | grep -av "run/s\]$" | grep -a " ms \|speedup" | cut -c1-200
