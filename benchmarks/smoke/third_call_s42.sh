#!/usr/bin/env bash
# s42's last call (~480 s of device time left after s42-1): the model race with the dK/dV
# kernel's K and V in registers, the default at D = 64 since s42-1 (NOTES s42 item 5).
#   bash benchmarks/smoke/third_call_s42.sh "$OUT"      (on the device machine)
. "$(dirname "$0")/_lib.sh"
model_run model 330 train157 train1b --no-reference
