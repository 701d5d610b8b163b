#!/usr/bin/env bash
# s37: the linear + cross-entropy checks on the GPU, with the token slabs' cases (each slab's
# loss and dz by one kernel since s37) against the float32 reference, every dtype.
#   bash benchmarks/smoke/lce_check_s37.sh "$OUT"      (on the device machine)
. "$(dirname "$0")/_lib.sh"
lce_check 150
