#!/usr/bin/env bash
# s43's first call: the model race with the defaults of s41-s42 (the fused dQ's overlapped
# steps, K and V in registers in the D = 64 dK/dV kernel), the fused dQ's variants beside
# them, and decoding; then the pair's dK/dV kernel and the fused dQ's under Nsight Compute
# at the 1B model's attention (why 5 products take 1.5x the time of 4: NOTES s41 item 4,
# s42 item 2). The H200 attention table waits for `second_call_s43.sh`.
#   bash benchmarks/smoke/first_call_s43.sh "$OUT"      (on the device machine)
. "$(dirname "$0")/_lib.sh"
model_run model 330 train157 train1b decode --no-reference --fixed-dq --fixed-plain --nondet-plain
ncu_bwd_d64 170
