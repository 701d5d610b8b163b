#!/usr/bin/env bash
# s38: the deterministic fused dQ in int32 fixed point (`_fixed_sum`, the default at D = 64),
# compiled: its checks and the D = 64 rows against the kernel pair, the float32 fused dQ and
# cuDNN (`attention_bwd.py fixed`), then the model race on it.
#   bash benchmarks/smoke/fixed_s38.sh "$OUT"      (on the device machine)
. "$(dirname "$0")/_lib.sh"
timeout -s KILL 220 python benchmarks/attention_bwd.py fixed "$out/fixed.json" \
    > "$out/fixed.log" 2>&1
echo "fixed rc=$?: $(grep -c 'status=ok' "$out/fixed.log") ok, $(grep -c 'FAIL\|rror' "$out/fixed.log") not"
grep -a "check\|garbage\|interleaved\|FAIL\|rror" "$out/fixed.log" | sed 's/  */ /g' | cut -c1-260
model_run model 290 train157 train1b --no-reference
