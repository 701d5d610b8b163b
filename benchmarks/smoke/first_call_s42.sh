#!/usr/bin/env bash
# s42's first call, the new lever first (NOTES s42 items 2-3: shared memory's
# bandwidth): K and V held in registers by the dK/dV kernel (`attention_bwd.py kv_regs`:
# compiled checks, then kernel times), then the
# compiled check s41-1 left out (the fused dQ on the overlapped steps with segment ids,
# `attention.py check_s41`). ncu and the model race ran in s43-1 (`first_call_s43.sh`).
# Ran as s42-1 (H100) with a third step since withdrawn with what it measured
# (`attention.py q_regs`, NOTES s42 item 5).
#   bash benchmarks/smoke/first_call_s42.sh "$OUT"      (on the device machine)
. "$(dirname "$0")/_lib.sh"
attn_bwd kv_regs 230
timeout -s KILL 120 python benchmarks/attention.py check_s41 "$out/check_s41.json" \
    > "$out/check_s41.log" 2>&1
echo "attention check_s41 rc=$?: $(grep -c 'status=ok' "$out/check_s41.log") ok, \
$(grep -c 'FAIL\|rror' "$out/check_s41.log") not"
