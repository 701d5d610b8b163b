#!/usr/bin/env bash
# s37: where the 1B step goes on the current code (profiler, by kind), and the 157M with a
# token slab of 8192 beside the preset's 4096.
#   bash benchmarks/smoke/profile_s37.sh "$OUT"      (on the device machine)
. "$(dirname "$0")/_lib.sh"
model_run profile1b 170 train1b --no-reference --profile
model_run model157 110 train157 --no-reference --loss-token-slab 8192
