#!/usr/bin/env bash
# The current tables, owed on an H200 since s35 (BENCHMARKS.md's model table is s39-1's, on
# an H100; the attention table s34-4's): the model race with decoding and every backward row,
# then the attention table against cuDNN and tokamax (wheels carried in .peers).
#   bash benchmarks/smoke/table_s41.sh "$OUT"      (on the device machine; carry .peers)
. "$(dirname "$0")/_lib.sh"
model_run model 330 train157 train1b decode --no-reference --fixed-dq
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/peers .peers/wheels/*.whl
export PYTHONPATH=/tmp/peers:$PWD/.peers/stub:$PYTHONPATH
timeout -s KILL 200 python benchmarks/gpu_check.py attention --no-check --no-sweep \
    --out "$out/attention.json" > "$out/attention.log" 2>&1
echo "attention rc=$?"
grep -a "attention \|ceiling" "$out/attention.log" | sed 's/  */ /g' | cut -c1-160
