#!/usr/bin/env bash
# s37: the linear + cross-entropy checks on the GPU, with the token slabs' cases (each slab's
# loss and dz by one kernel since s37) against the float32 reference, every dtype.
#   bash benchmarks/smoke/lce_check_s37.sh "$OUT"      (on the device machine)
set -u
out=${1:-/tmp/s37}
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout -s KILL 150 python -c "
from benchmarks import lce, _timing
lce.check()
_timing.save('$out/lce_check.json')" > "$out/lce_check.log" 2>&1
echo "lce check rc=$?: $(grep -c 'status=ok' "$out/lce_check.log") ok, $(grep -c 'FAIL\|rror' "$out/lce_check.log") not"
grep "check" "$out/lce_check.log" | sed 's/  */ /g' | cut -c1-200
