#!/usr/bin/env bash
# The ncu half of `second_call_s42.sh` alone (what ~360 s of device time holds): the pair's
# dK/dV kernel and the fused dQ's (both with K and V in registers, the default since s42-1)
# at the 1B model's attention under Nsight Compute.
#   bash benchmarks/smoke/ncu_s42.sh "$OUT"      (on the device machine)
. "$(dirname "$0")/_lib.sh"
ncu_bwd_d64 190
