#!/usr/bin/env bash
# After first_call_s40.sh (NOTES s39 item 4): the same two schedules of the fused dQ (steps
# overlapped, each dQ a step late) at D = 128, where the kernel pair is the default and the
# fused dQ lost (s33-3), float32 and fixed point against the pair and cuDNN
# (`attention_bwd.py d128_schedules`), then the linear + cross-entropy checks, whose vmap case
# the 120 s limits of s37-6 and s39-1 cut.
#   bash benchmarks/smoke/second_call_s40.sh "$OUT"      (on the device machine)
. "$(dirname "$0")/_lib.sh"
attn_bwd d128_schedules 300
lce_check 240
