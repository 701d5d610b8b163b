#!/bin/bash
# Session s53, for an H200 when one comes (no H200 table since s35: issue 14-16's targets are
# H200 targets). $2:
#   "race" (~500 s): the model race with decoding (`model.py train157 train1b decode`), then the
#       block kernels' whole table against XLA (`block.py --no-check --interleave 3`);
#   "tables" (~520 s, .peers carried): the attention table against cuDNN and tokamax, then the
#       row kernels' timings (`gpu_check.py rows --no-check --no-sweep`);
#   "cost" (~400 s, .baseline carried: `git archive 1cb49b3 jaxfuse | tar -x -C .baseline`):
#       what the Hopper kernels' exact exponents cost (`change_cost.py attention`), then the
#       hardening section's compiled checks (the two it failed in s53-1);
#   "model" (~400 s, .baseline carried): the training race (157M and 1B presets against the
#       plain model) of today's tree, then of the tree before the exact exponents.
. "$(dirname "$0")/_lib.sh" "$@"
case "${2:-race}" in
    race) model_run model 260 train157 train1b decode --no-reference --two-launches
        timeout -s KILL 220 python benchmarks/block.py --no-check --interleave 3 \
            --out "$out/block.json" > "$out/block.log" 2>&1
        echo "block rc=$?"
        grep -a "fwd  \|interleaved\|ceiling" "$out/block.log" | cut -c1-150 ;;
    tables) attn_table 300
        timeout -s KILL 200 python benchmarks/gpu_check.py rows --no-check --no-sweep \
            --out "$out/rows.json" > "$out/rows.log" 2>&1
        echo "rows rc=$?"
        grep -a "rows \|ceiling" "$out/rows.log" | sed 's/  */ /g' | cut -c1-160 ;;
    model) model_run model 230 train157 train1b --no-reference
        baseline_pkg
        (cd /tmp/base && model_run model_base 230 train157 train1b --no-reference) ;;
    cost) renamed_base 330 attention
        bash "$(dirname "$0")/s51.sh" "$out" 150 0 hardening ;;
esac
