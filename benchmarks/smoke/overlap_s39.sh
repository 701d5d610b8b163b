#!/usr/bin/env bash
# s39's third call: the fused dQ kernel's overlapped steps at D = 64, fixed point and float32
# (`attention_bwd.py fixed_overlap`: compiled checks, then kernel times against the pair at
# the crossover shapes), and the model race with the fixed point plain and overlapped.
#   bash benchmarks/smoke/overlap_s39.sh "$OUT"      (on the device machine)
. "$(dirname "$0")/_lib.sh"
attn_bwd fixed_overlap 190
model_run model 130 train1b --no-reference --fixed-dq --fixed-overlap
