#!/usr/bin/env bash
# The device work s39 could not run (no machine was lent after its second call; NOTES s39
# items 3-4), in one call of under 600 s: the fused dQ kernel's schedules at D = 64, in fixed
# point and float32 (`attention_bwd.py fixed_overlap`: plain, overlapped, each dQ a step late,
# both; kernel times at four D = 64 shapes against the kernel pair, then compiled checks),
# then the model race with the fixed point's rows (plain; deferred; overlapped and deferred)
# beside the default pair.
#   bash benchmarks/smoke/first_call_s40.sh "$OUT"      (on the device machine)
. "$(dirname "$0")/_lib.sh"
attn_bwd fixed_overlap 250
model_run model 300 train157 train1b --no-reference --fixed-dq --fixed-defer --fixed-overlap
