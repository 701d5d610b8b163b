#!/bin/bash
# For the session after s53 (any card; carry .baseline = the tree before s53's exact exponents:
# `git archive 1cb49b3 jaxfuse | tar -x -C .baseline`). $2:
#   "diag" (~300 s): why exp2((u - m) c2) cost the 1B model's D = 64 forward 22% (NOTES s53):
#       ptxas's registers and spills of the D = 64 forward, today's tree and the one before
#       (`hopper_ptxas.py 64`), then Nsight Compute on both forwards at the 1B shape
#       (`ncu_probe.py attention_fwd_d64`: issue slots, pipes, stall reasons, instructions);
#   "sum_mma" (~350 s): the row sums on the tensor cores (`HopperAttnTiles(sum_mma=True)`,
#       built in s53, never run on a GPU) against the default and cuDNN at the models' D = 64
#       and issue 14's D = 128 rows, interleaved, after its compiled checks (`attention.py
#       sum_mma`). If it wins the exact exponents' cost back, make it the default there.
#   "model" (~330 s): the training race (157M and 1B against the plain model) with a row of
#       sum_mma as the forward's default (`model.py --sum-mma`) beside today's default.
. "$(dirname "$0")/_lib.sh" "$@"
case "${2:-diag}" in
    sum_mma)
        timeout -s KILL 340 python benchmarks/attention.py sum_mma "$out/sum_mma.json" \
            > "$out/sum_mma.log" 2>&1
        echo "sum_mma rc=$?: $(grep -ac 'status=ok' "$out/sum_mma.log") ok, \
$(grep -ac 'status=FAIL\|rror' "$out/sum_mma.log") not"
        grep -a "interleaved\|FAIL\|rror" "$out/sum_mma.log" | sed 's/  */ /g' | cut -c1-200 ;;
    model) model_run model 330 train157 train1b --no-reference --sum-mma ;;
    diag)
        timeout -s KILL 80 python benchmarks/hopper_ptxas.py 64 > "$out/ptxas_new.log" 2>&1
        echo "ptxas new rc=$?"
        baseline_pkg
        (cd /tmp/base && timeout -s KILL 80 python benchmarks/hopper_ptxas.py 64 \
            > "$out/ptxas_base.log" 2>&1; echo "ptxas base rc=$?")
        for f in new base; do
            echo "== $f"; grep -a "===\|registers\|spill\|serializ" "$out/ptxas_$f.log" \
                | sed 's/  */ /g' | cut -c1-160 | head -12
        done
        rename_base
        PYTHONPATH=/tmp/base:$PYTHONPATH timeout -s KILL 200 ncu --clock-control none \
            -k regex:flash.*fwd -c 2 --section SpeedOfLight --section LaunchStats \
            --section ComputeWorkloadAnalysis --section InstructionStats \
            --section WarpStateStats --metrics "gpu__time_duration.sum" \
            python benchmarks/ncu_probe.py attention_fwd_d64 > "$out/ncu_fwd_d64.txt" 2>&1
        echo "ncu rc=$?"
        grep -a "jaxfuse_flash\|duration\|Registers Per\|Issue Slots\|Executed Ipc\|Pipe\|Stall\|Executed Instructions \|Warp Cycles Per Issued" \
            "$out/ncu_fwd_d64.txt" | sed 's/  */ /g' | cut -c1-140 | head -60 ;;
esac
