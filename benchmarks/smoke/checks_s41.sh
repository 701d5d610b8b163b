#!/usr/bin/env bash
# s41's first call (since removed) cut to what a short call holds (the failed starts of s41
# left ~500 s of device time): the overlapped fused dQ's compiled checks at D = 64 (they passed in s41-1 and
# made it the default; since then they check the default), then what the fused dQ's reducing
# stores cost (`attention_bwd.py dq_stores_cost`).
#   bash benchmarks/smoke/checks_s41.sh "$OUT"      (on the device machine)
. "$(dirname "$0")/_lib.sh"
attn_bwd overlap_checks 170
attn_bwd dq_stores_cost 120
