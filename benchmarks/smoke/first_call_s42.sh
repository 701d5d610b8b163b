#!/usr/bin/env bash
# s42's first call, what tells most first: K and V held in registers by the dK/dV kernel
# (`attention_bwd.py kv_regs`: compiled checks, then kernel times; NOTES s42 item 2's
# shared-memory count), then Nsight Compute on the pair's dK/dV kernel and the fused one at
# the 1B shape (stall reasons, tensor pipe, speed of light, shared memory), then the
# compiled check s41-1 left out (the fused dQ on the overlapped steps with segment ids,
# `attention.py check_s41`). `second_call_s42.sh` holds the model race and the table.
#   bash benchmarks/smoke/first_call_s42.sh "$OUT"      (on the device machine)
. "$(dirname "$0")/_lib.sh"
attn_bwd kv_regs 240
timeout -s KILL 170 ncu --clock-control none -k regex:flash_bwd_dkv \
    --section SpeedOfLight --section MemoryWorkloadAnalysis_Tables \
    --metrics "gpu__time_duration.sum,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio,smsp__issue_active.avg.pct_of_peak_sustained_active" \
    python benchmarks/ncu_probe.py attention_bwd_d64 > "$out/ncu-bwd-d64.txt" 2>&1
echo "ncu rc=$?"
grep -a "jaxfuse_flash\|duration\|gmma\|issue_active\|Throughput\|Shared\|Bank\|stalled_\(barrier\|long\|short\|wait\|gmma\|math\|mio\|not_sel\|selected\|dispatch\|lg\)" \
    "$out/ncu-bwd-d64.txt" | sed 's/  */ /g' | cut -c1-130
timeout -s KILL 120 python benchmarks/attention.py check_s41 --out "$out/check_s41.json" \
    > "$out/check_s41.log" 2>&1
echo "attention check_s41 rc=$?: $(grep -c 'status=ok' "$out/check_s41.log") ok, \
$(grep -c 'FAIL\|rror' "$out/check_s41.log") not"
