#!/usr/bin/env bash
# s42's second call: the model race with the fused dQ's overlapped steps the default since
# s41 (deterministic=False at D = 64, and the fixed point's), their plain steps beside them,
# and decoding; then the attention table against cuDNN and tokamax, owed on an H200 since
# s34-4.
#   bash benchmarks/smoke/second_call_s42.sh "$OUT"      (on the device machine; carry .peers)
. "$(dirname "$0")/_lib.sh"
model_run model 330 train157 train1b decode --no-reference --fixed-dq --fixed-plain --nondet-plain
attn_table 200
