#!/usr/bin/env bash
# s42's second call: why the fused dQ's kernel takes ~1.4x the pair's dK/dV kernel for 1.25x
# its products at D = 64 when its stores cost nothing (NOTES s41 item 4, s42 item 2): both
# kernels under Nsight Compute at the 1B model's shape (stall reasons, tensor pipe, speed of
# light, shared memory); then the model race with the fused dQ's overlapped steps the default
# since s41, their plain steps beside them, and decoding. The attention table (`attn_table`,
# carry .peers) waits for a third call.
#   bash benchmarks/smoke/second_call_s42.sh "$OUT"      (on the device machine)
. "$(dirname "$0")/_lib.sh"
timeout -s KILL 170 ncu --clock-control none -k regex:flash_bwd_dkv \
    --section SpeedOfLight --section MemoryWorkloadAnalysis_Tables \
    --metrics "gpu__time_duration.sum,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio,smsp__issue_active.avg.pct_of_peak_sustained_active" \
    python benchmarks/ncu_probe.py attention_bwd_d64 > "$out/ncu-bwd-d64.txt" 2>&1
echo "ncu rc=$?"
grep -a "jaxfuse_flash\|duration\|gmma\|issue_active\|Throughput\|Shared\|Bank\|stalled_\(barrier\|long\|short\|wait\|gmma\|math\|mio\|not_sel\|selected\|dispatch\|lg\)" \
    "$out/ncu-bwd-d64.txt" | sed 's/  */ /g' | cut -c1-130
model_run model 330 train157 train1b decode --no-reference --fixed-dq --fixed-plain --nondet-plain
