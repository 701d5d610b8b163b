#!/usr/bin/env bash
# s38: the deterministic fused dQ in int32 fixed point (`_fixed_sum`, the default at D = 64),
# compiled: its kernels' times, its checks and the D = 64 rows against the kernel pair, the
# float32 fused dQ and cuDNN (`attention_bwd.py fixed`), then the model race; with "model",
# the kernel profiles and the model race alone, with "quick" `fixed_quick`, with "diag" `attention_bwd.py fixed_diag` alone.
#   bash benchmarks/smoke/fixed_s38.sh "$OUT" [model]      (on the device machine)
. "$(dirname "$0")/_lib.sh"
if [ "${2:-}" = diag ]; then
    timeout -s KILL 200 python benchmarks/attention_bwd.py fixed_diag "$out/diag.json" \
        > "$out/diag.log" 2>&1
    echo "diag rc=$?"
    grep -a " ms \|by kind\|rror" "$out/diag.log" | sed 's/  */ /g' | cut -c1-200
    exit
fi
if [ "${2:-}" = quick ]; then
    timeout -s KILL 200 python benchmarks/attention_bwd.py fixed_quick "$out/quick.json" \
        > "$out/quick.log" 2>&1
    echo "quick rc=$?"
    grep -a " ms \|by kind\|check\|rror" "$out/quick.log" | sed 's/  */ /g' | cut -c1-330
    exit
fi
if [ "${2:-}" = model ]; then
    timeout -s KILL 100 python benchmarks/attention_bwd.py fixed_profiles "$out/prof.json" \
        > "$out/prof.log" 2>&1
    grep -a " ms \|by kind\|rror" "$out/prof.log" | sed 's/  */ /g' | cut -c1-200
    model_run model 250 train157 train1b --no-reference
    exit
fi
timeout -s KILL 235 python benchmarks/attention_bwd.py fixed "$out/fixed.json" \
    > "$out/fixed.log" 2>&1
echo "fixed rc=$?: $(grep -c 'status=ok' "$out/fixed.log") ok, $(grep -c 'FAIL\|rror' "$out/fixed.log") not"
grep -a "check\|garbage\|interleaved\|FAIL\|rror\|profile\| ms \|by kind" "$out/fixed.log" \
    | grep -av "HopperAttnTiles" | sed 's/  */ /g' | cut -c1-230
model_run model 320 train157 train1b --no-reference
