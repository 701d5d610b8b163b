#!/bin/bash
# Session s48: does a last, nearly empty round of CTAs cost our attention kernels (and
# cuDNN's) at B4 T4096 D128 without a mask, and does the kernel pair in one launch
# (`HopperBwdTiles(one_launch=True)`) take it back? Any card. $2: "waves" (kernel times at
# 31, 32 and 33 heads, both launches; ~150 s), "one" (`attention_bwd.py one_launch`: compiled
# checks, bitwise equality with two launches, kernel times, fwd+bwd interleaved on the
# issue's rows; ~300 s) or "both".
. "$(dirname "$0")/_lib.sh" "$@"
case "${2:-both}" in
    waves) attn_bwd waves 280 ;;
    one) attn_bwd one_launch 540 ;;
    both) attn_bwd waves 200; attn_bwd one_launch 380 ;;
esac
# "model": the race's training rows, the default (one launch with GQA) beside two launches
# (~300 s).
if [ "${2:-}" = model ]; then
    model_run model 560 train157 train1b --no-reference --two-launches
fi
