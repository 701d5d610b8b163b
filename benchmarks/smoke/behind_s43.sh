#!/usr/bin/env bash
# s43's fourth call: the fused dQ's product issued behind dK's (`HopperBwdTiles.dq_behind`),
# compiled checks and kernel times against the fused dQ formed after the step (NOTES s43).
#   bash benchmarks/smoke/behind_s43.sh "$OUT"     (on the device machine)
. "$(dirname "$0")/_lib.sh"
attn_bwd dq_behind 420
