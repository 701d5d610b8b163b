#!/bin/bash
# Session s49, any card. $2: "model" (the race with the decoding rows, the default beside
# `--two-launches`: does s48's one launch of the backward pair move the step? ~350 s) or
# "attention" (the table against cuDNN and tokamax, ~420 s; .peers carried); "ptxas" and
# "split" below.
. "$(dirname "$0")/_lib.sh" "$@"
case "${2:-model}" in
    model) model_run model 570 train157 train1b decode --no-reference --two-launches ;;
    attention) attn_table 560 ;;
esac
# "ptxas": ptxas's report (registers, spills) of the backward pair in one launch and in two,
# without groups, D 64 and 128, causal or not (NOTES s48: why one launch loses there; ~60 s).
if [ "${2:-}" = ptxas ]; then
    timeout -s KILL 200 python benchmarks/hopper_ptxas.py one > "$out/ptxas-one.log" 2>&1
    echo "ptxas rc=$?"
    grep -a "===\|registers\|spill\|serializ" "$out/ptxas-one.log" | cut -c1-200
fi
# "split": `HopperAttnTiles(split_tail=True)` (new in s49): compiled checks on SPLIT_CASES,
# then the forward at B4 T4096 D128 full, 31/32/33 heads, default / split / cuDNN interleaved
# (`attention.py split_tail`, ~250 s).
if [ "${2:-}" = split ]; then
    timeout -s KILL 480 python benchmarks/attention.py split_tail "$out/split.json" \
        > "$out/split.log" 2>&1
    echo "split rc=$?: $(grep -c 'status=ok' "$out/split.log") ok, \
$(grep -c 'FAIL\|rror' "$out/split.log") not"
    grep -a "check\|interleaved\|FAIL\|rror" "$out/split.log" | sed 's/  */ /g' | cut -c1-220
fi
