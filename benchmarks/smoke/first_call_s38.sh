#!/usr/bin/env bash
# The device work s37 left (benchmarks/NOTES.md s37 item 9), in one call of under 600 s, best
# on an H200 (BENCHMARKS.md's H200 model table is s35-5's, before rope_qkv and the one-kernel
# token slabs of 4096): the model and decoding on the current code, then the linear +
# cross-entropy checks' vmap case that s37-6's time limit cut, then the block rows' forwards.
#   bash benchmarks/smoke/first_call_s38.sh "$OUT"      (on the device machine)
set -u
out=${1:-/tmp/s38}
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout -s KILL 300 python benchmarks/model.py train157 train1b decode --no-reference \
    --loss-token-slab 2048 --out "$out/model" > "$out/model.log" 2>&1
echo "model rc=$?"
tr '\r' '\n' < "$out/model.log" | grep -av "run/s\]$" | grep -a " ms \|speedup" | cut -c1-190
timeout -s KILL 120 python -c "
from benchmarks import lce, _timing
lce.check()
_timing.save('$out/lce_check.json')" > "$out/lce_check.log" 2>&1
echo "lce check rc=$?: $(grep -c 'status=ok' "$out/lce_check.log") ok, \
$(grep -c 'FAIL\|rror' "$out/lce_check.log") not"
timeout -s KILL 150 python benchmarks/block.py --no-check --interleave 3 \
    --only dropout,bias_dropout_add,add_norm,rope,embedding --out "$out/block.json" \
    > "$out/block.log" 2>&1
echo "block rc=$?"
grep "fwd  \|interleaved" "$out/block.log" | cut -c1-150
