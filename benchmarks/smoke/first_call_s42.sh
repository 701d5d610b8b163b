#!/usr/bin/env bash
# What s41 could not run (its device time went to failed starts; NOTES s41 item 1). First the
# compiled check s41-1 left out: the fused dQ on the overlapped steps with segment ids
# (`attention.py check_s41`); then the model race with the fused dQ's overlapped steps now the
# default (deterministic=False at D = 64, and the fixed point's), their plain steps beside
# them, and decoding. `second_call_s42.sh` holds the rest.
#   bash benchmarks/smoke/first_call_s42.sh "$OUT"      (on the device machine)
. "$(dirname "$0")/_lib.sh"
timeout -s KILL 150 python benchmarks/attention.py check_s41 --out "$out/check_s41.json" \
    > "$out/check_s41.log" 2>&1
echo "attention check_s41 rc=$?: $(grep -c 'status=ok' "$out/check_s41.log") ok, \
$(grep -c 'FAIL\|rror' "$out/check_s41.log") not"
model_run model 330 train157 train1b decode --no-reference --fixed-dq --fixed-plain --nondet-plain
