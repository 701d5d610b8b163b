#!/usr/bin/env bash
# The ncu half of `second_call_s42.sh` alone (what ~360 s of device time holds): the pair's
# dK/dV kernel and the fused dQ's (both with K and V in registers, the default since s42-1)
# at the 1B model's attention under Nsight Compute.
#   bash benchmarks/smoke/ncu_s42.sh "$OUT"      (on the device machine)
. "$(dirname "$0")/_lib.sh"
timeout -s KILL 190 ncu --clock-control none -k regex:flash_bwd_dkv \
    --section SpeedOfLight --section MemoryWorkloadAnalysis_Tables \
    --metrics "gpu__time_duration.sum,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio,smsp__issue_active.avg.pct_of_peak_sustained_active" \
    python benchmarks/ncu_probe.py attention_bwd_d64 > "$out/ncu-bwd-d64.txt" 2>&1
echo "ncu rc=$?"
grep -a "jaxfuse_flash\|duration\|gmma\|issue_active\|Throughput\|Shared\|Bank\|stalled_\(barrier\|long\|short\|wait\|gmma\|math\|mio\|not_sel\|selected\|dispatch\|lg\)" \
    "$out/ncu-bwd-d64.txt" | sed 's/  */ /g' | cut -c1-130
