#!/bin/bash
# Session s50, any card, one short call (the session's device budget was nearly spent on
# machines that did not come): the D128 forward without a mask at 31/32/33 heads, the default
# (split last round) against the unsplit walk and cuDNN, interleaved (`attention.py
# perf_split_tail`, no compiled checks: s49-1 ran those), then ptxas's report of the backward
# pair in one launch and in two (`hopper_ptxas.py one`: why one launch loses without groups).
. "$(dirname "$0")/_lib.sh" "$@"
timeout -s KILL 200 python benchmarks/attention.py perf_split_tail "$out/split.json" \
    > "$out/split.log" 2>&1
echo "split rc=$?"
grep -a "interleaved\|FAIL\|rror" "$out/split.log" | sed 's/  */ /g' | cut -c1-220
timeout -s KILL 150 python benchmarks/hopper_ptxas.py one > "$out/ptxas-one.log" 2>&1
echo "ptxas rc=$?"
grep -a "===\|registers\|spill\|serializ" "$out/ptxas-one.log" | cut -c1-200
