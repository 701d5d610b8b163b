#!/usr/bin/env bash
# After s40-1 (H100; `smoke/first_call_s40.sh` at f539a8a): each dQ a step late lost everywhere, the fused dQ's
# overlapped steps won 4-5% in fixed point, so they are the fused dQ's default now. Its
# steps, overlapped and plain, fixed point and float32, against the pair (`attention_bwd.py
# overlap_d64`: kernel times at four D = 64 shapes, then compiled checks), then the model
# race with the fixed point's row (overlapped) and the float32 dQ's plain steps.
#   bash benchmarks/smoke/second_call_s40.sh "$OUT"      (on the device machine)
. "$(dirname "$0")/_lib.sh"
attn_bwd overlap_d64 170
model_run model 170 train157 train1b --no-reference --fixed-dq --nondet-plain
