#!/bin/bash
# For the session after s54 (any card, no carry). $2:
#   "overlap" (~150 s): the intra-warpgroup overlap (`HopperAttnTiles(overlap=True)`) against
#       today's default and cuDNN, forward, interleaved (`attention.py perf_overlap`: D128 full
#       and the causal rows, the models' D = 64 among them). s54-3's profile found the D = 64
#       forward bound by the latency of its softmax chain, which s53's exact exponents
#       lengthened; the overlap lost 3-7% at D = 64 in s15-4 with the shorter chain;
#   "checks" (~450 s): the 6 attention checks not yet run on s53's fixed kernels
#       (`gpu_check.py attention --no-perf --resume 51`), then `attention_bwd.py checks`.
. "$(dirname "$0")/_lib.sh" "$@"
case "${2:-overlap}" in
    overlap)
        timeout -s KILL 280 python benchmarks/attention.py perf_overlap "$out/overlap.json" \
            > "$out/overlap.log" 2>&1
        echo "overlap rc=$?"
        grep -a "interleaved\|rror" "$out/overlap.log" | sed 's/  */ /g' | cut -c1-200 ;;
    checks) bash "$(dirname "$0")/s51.sh" "$out" 280 150 "attention --resume 51" ;;
esac
