#!/usr/bin/env bash
# After s40-1 (H100; `smoke/first_call_s40.sh` at f539a8a): each dQ a step late lost everywhere, the fused dQ's
# overlapped steps won 4-5% in fixed point, so they are the fused dQ's default now. Its
# steps, overlapped and plain, fixed point and float32, against the pair (`attention_bwd.py
# overlap_d64`: compiled checks, then kernel times at four D = 64 shapes). (The model race
# with them, `model.py train157 train1b --no-reference --fixed-dq --nondet-plain`, waits:
# failed starts left this session's device time short.)
#   bash benchmarks/smoke/second_call_s40.sh "$OUT"      (on the device machine)
. "$(dirname "$0")/_lib.sh"
attn_bwd overlap_d64 ${LIMIT:-270}
