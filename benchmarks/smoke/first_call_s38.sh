#!/usr/bin/env bash
# The device work s37 left (benchmarks/NOTES.md s37 item 9), in one call of under 600 s, best
# on an H200 (BENCHMARKS.md's H200 model table is s35-5's, before rope_qkv and the one-kernel
# token slabs of 4096): the model and decoding on the current code, then the linear +
# cross-entropy checks' vmap case that s37-6's time limit cut, then the block rows' forwards.
#   bash benchmarks/smoke/first_call_s38.sh "$OUT"      (on the device machine)
. "$(dirname "$0")/_lib.sh"
model_run model 300 train157 train1b decode --no-reference --loss-token-slab 2048
lce_check 120
block_rows 150
