#!/bin/bash
# Session s49, any card. $2:
#   "model" (the first call; ~560 s): "split" with a 250 s limit, then the race's training rows
#       (no decoding) beside `--two-launches` (does s48's one launch of the backward pair move
#       the step?), 330 s limit;
#   "split": `HopperAttnTiles(split_tail=True)` (new in s49): compiled checks on SPLIT_CASES,
#       then the forward at B4 T4096 D128 full, 31/32/33 heads, default / split / cuDNN
#       interleaved (`attention.py split_tail`);
#   "race": the race with the decoding rows beside `--two-launches` (~350 s);
#   "attention": the table against cuDNN and tokamax (~420 s; .peers carried);
#   "ptxas": ptxas's report (registers, spills) of the backward pair in one launch and in two,
#       without groups, D 64 and 128, causal or not (NOTES s48: why one launch loses; ~60 s).
. "$(dirname "$0")/_lib.sh" "$@"
split() {
    timeout -s KILL "$1" python benchmarks/attention.py split_tail "$out/split.json" \
        > "$out/split.log" 2>&1
    echo "split rc=$?: $(grep -c 'status=ok' "$out/split.log") ok, \
$(grep -c 'FAIL\|rror' "$out/split.log") not"
    grep -a "check\|interleaved\|FAIL\|rror" "$out/split.log" | sed 's/  */ /g' | cut -c1-220
}
case "${2:-model}" in
    model) split 250; model_run model 330 train157 train1b --no-reference --two-launches ;;
    split) split 480 ;;
    race) model_run model 570 train157 train1b decode --no-reference --two-launches ;;
    attention) attn_table 560 ;;
    ptxas)
        timeout -s KILL 200 python benchmarks/hopper_ptxas.py one > "$out/ptxas-one.log" 2>&1
        echo "ptxas rc=$?"
        grep -a "===\|registers\|spill\|serializ" "$out/ptxas-one.log" | cut -c1-200 ;;
esac
