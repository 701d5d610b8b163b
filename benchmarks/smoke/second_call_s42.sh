#!/usr/bin/env bash
# s42's second call: why the fused dQ's kernel takes ~1.4x the pair's dK/dV kernel for 1.25x
# its products at D = 64 when its stores cost nothing (NOTES s41 item 4, s42 item 2): both
# kernels under Nsight Compute at the 1B model's shape (`ncu_bwd_d64`); then the model race
# with the defaults of s41-s42 (the fused dQ's overlapped steps, K and V in registers at D =
# 64), the fused dQ's plain steps beside them, and decoding. The attention table
# (`attn_table`, carry .peers) waits for a third call.
#   bash benchmarks/smoke/second_call_s42.sh "$OUT"      (on the device machine)
. "$(dirname "$0")/_lib.sh"
ncu_bwd_d64 170
model_run model 330 train157 train1b decode --no-reference --fixed-dq --fixed-plain --nondet-plain
