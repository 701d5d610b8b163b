#!/usr/bin/env bash
# s42's first call, the two new levers first (NOTES s42 items 2-4: shared memory's
# bandwidth): K and V held in registers by the dK/dV kernel (`attention_bwd.py kv_regs`:
# compiled checks, then kernel times), Q held in registers by the forward (`attention.py
# q_regs`: checks, then the forward interleaved against the default and cuDNN); then the
# compiled check s41-1 left out (the fused dQ on the overlapped steps with segment ids,
# `attention.py check_s41`). `second_call_s42.sh` holds ncu and the model race.
#   bash benchmarks/smoke/first_call_s42.sh "$OUT"      (on the device machine)
. "$(dirname "$0")/_lib.sh"
attn_bwd kv_regs 230
timeout -s KILL 170 python benchmarks/attention.py q_regs "$out/q_regs.json" \
    > "$out/q_regs.log" 2>&1
echo "attention q_regs rc=$?: $(grep -c 'status=ok' "$out/q_regs.log") ok, \
$(grep -c 'FAIL\|rror' "$out/q_regs.log") not"
grep -a "interleaved\|FAIL\|rror" "$out/q_regs.log" | sed 's/  */ /g' | cut -c1-200
timeout -s KILL 120 python benchmarks/attention.py check_s41 "$out/check_s41.json" \
    > "$out/check_s41.log" 2>&1
echo "attention check_s41 rc=$?: $(grep -c 'status=ok' "$out/check_s41.log") ok, \
$(grep -c 'FAIL\|rror' "$out/check_s41.log") not"
