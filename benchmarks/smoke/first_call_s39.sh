#!/usr/bin/env bash
# The device work s38 left (benchmarks/NOTES.md s38 item 9), in one call of under 600 s, best
# on an H200 (BENCHMARKS.md's H200 model table is s35-5's): the model race on the current
# code with the fixed-point dQ's row beside the default (decide its default: it must beat the
# kernel pair in the same run), the attention kernels of the three dQ schemes, then the
# linear + cross-entropy checks (their vmap case was cut in s37-6).
#   bash benchmarks/smoke/first_call_s39.sh "$OUT"      (on the device machine)
. "$(dirname "$0")/_lib.sh"
model_run model 330 train157 train1b decode --no-reference --fixed-dq
attn_bwd fixed_profiles 90
lce_check 120
