#!/usr/bin/env bash
# s37's last call: the model on the current code (the presets' token slab of 4096, each slab's
# loss and dz by one kernel), with the slab of 2048 as a row beside it, and decoding.
#   bash benchmarks/smoke/final_s37.sh "$OUT"      (on the device machine)
. "$(dirname "$0")/_lib.sh"
model_run model 400 train157 train1b decode --no-reference --loss-token-slab 2048
