#!/bin/bash
# Session s46: the H200 reruns owed since s35 (BENCHMARKS.md's model and attention tables ran
# on H100s in s36-s45). First argument: $OUT; second: "model" (the race, ~250 s) or
# "attention" (the table against cuDNN and tokamax, ~420 s; .peers carried). On any other
# card it stops at once: those rows have three H100 runs already (s43-s45).
. "$(dirname "$0")/_lib.sh" "$@"
if ! nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
    echo "not an H200: nothing run"; exit 3
fi
case "${2:-model}" in
    model) model_run model 480 train157 train1b decode --no-reference --fixed-dq --nondet-plain ;;
    attention) attn_table 520 ;;
esac
