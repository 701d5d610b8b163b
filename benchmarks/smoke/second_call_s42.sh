#!/usr/bin/env bash
# The attention table against cuDNN and tokamax, owed on an H200 since s34-4; then why the
# fused dQ's kernel takes ~1.4x the pair's dK/dV kernel for 1.25x its products at D = 64 when
# its stores cost nothing (NOTES s41 item 4): both kernels' stall reasons and tensor-pipe use
# under Nsight Compute (`ncu_probe.py attention_bwd_d64`, the 1B model's shape), with the
# speed-of-light and shared-memory tables (NOTES s42 item 2: is it shared memory's bandwidth?).
#   bash benchmarks/smoke/second_call_s42.sh "$OUT"      (on the device machine; carry .peers)
. "$(dirname "$0")/_lib.sh"
attn_table 200
timeout -s KILL 240 ncu --clock-control none -k regex:flash_bwd_dkv \
    --section SpeedOfLight --section MemoryWorkloadAnalysis_Tables \
    --metrics "gpu__time_duration.sum,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio,smsp__issue_active.avg.pct_of_peak_sustained_active" \
    python benchmarks/ncu_probe.py attention_bwd_d64 > "$out/ncu-bwd-d64.txt" 2>&1
echo "ncu rc=$?"
grep -a "jaxfuse_flash\|duration\|gmma\|issue_active\|Throughput\|Shared\|Bank\|stalled_\(barrier\|long\|short\|wait\|gmma\|math\|mio\|not_sel\|selected\|dispatch\|lg\)" \
    "$out/ncu-bwd-d64.txt" | sed 's/  */ /g' | cut -c1-130
