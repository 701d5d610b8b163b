#!/bin/bash
# For the session after s54 (any card, no carry). $2:
#   "overlap" (~150 s): the intra-warpgroup overlap (`HopperAttnTiles(overlap=True)`) against
#       today's default and cuDNN, forward, interleaved (`attention.py perf_overlap`: D128 full
#       and the causal rows, the models' D = 64 among them). s54-3's profile found the D = 64
#       forward bound by the latency of its softmax chain, which s53's exact exponents
#       lengthened; the overlap lost 3-7% at D = 64 in s15-4 with the shorter chain;
#   "checks" (~450 s): the 6 attention checks not yet run on s53's fixed kernels
#       (`gpu_check.py attention --no-perf --resume 51`), then `attention_bwd.py checks`;
#   "sass" (~150 s): where the 1B model's D = 64 forward waits, per SASS instruction (Nsight
#       Compute's stall sampling, `ncu_sass`), with every pipe's utilization and the stall
#       reasons per issue: s54-3 found the tensor and MUFU pipes each ~43% busy and issue 45%,
#       so no unit is the bound; the samples say which wait (a wgmma, the MUFU queue, a ring
#       barrier, a dependency) holds the softmax chain;
#   "trace" (~80 s): the on-device trace of the same forward's scopes (`attention_trace.py
#       OUT fwd 1B`): cycles a step in wait_k, qk, softmax, wait_v, pv for each consumer, since
#       s9-1's (2530 cycles a step, softmax 1085) were taken on the one-FMA kernel.
#   "model" (~250 s): the 1B preset's training race with the forward's new default at D = 64
#       past 4096 keys (overlap="issue", s55) and a row of the steps before (`--no-issue`);
#   "probe" (~400 s): overlap, sass and trace in one call (one start of the machine).
. "$(dirname "$0")/_lib.sh" "$@"
if [ "${2:-}" = probe ]; then
    for mode in overlap sass trace; do bash "$0" "$out" "$mode"; done
    exit 0
fi
case "${2:-overlap}" in
    overlap)
        timeout -s KILL 280 python benchmarks/attention.py perf_overlap "$out/overlap.json" \
            > "$out/overlap.log" 2>&1
        echo "overlap rc=$?"
        grep -a "interleaved\|rror" "$out/overlap.log" | sed 's/  */ /g' | cut -c1-200 ;;
    sass) ncu_sass 200 flash_fwd attention_fwd_d64 fwd-d64 1 ;;
    trace)
        timeout -s KILL 150 python benchmarks/attention_trace.py "$out/trace.json" fwd 1B \
            > "$out/trace.log" 2>&1
        echo "trace rc=$?"
        grep -av "^ *$" "$out/trace.log" | tail -40 | cut -c1-200 ;;
    model) model_run model 225 train1b --no-reference --no-issue ;;
    checks) bash "$(dirname "$0")/s51.sh" "$out" 280 150 "attention --resume 51" ;;
esac
