#!/usr/bin/env bash
# What s40 could not run (its device time went to failed starts after s40-1): the fused
# dQ's overlapped steps at D = 64 without the deferral (removed), float32 and fixed point:
# compiled checks, the model race, then kernel times against their plain steps and the kernel
# pair (`attention_bwd.py overlap_d64`, in two parts so that a short call still holds the
# checks); and what the fused dQ's reducing stores cost at D = 64 (`dq_stores_cost`). s41
# ran its checks and kernel times (`checks_s41.sh`, NOTES s41) and made the overlapped steps
# the default; the model rows now name the plain steps (`--fixed-plain`, `--nondet-plain`).
#   bash benchmarks/smoke/first_call_s41.sh "$OUT"      (on the device machine)
. "$(dirname "$0")/_lib.sh"
attn_bwd overlap_checks 170
model_run model 190 train157 train1b --no-reference --fixed-dq --fixed-plain --nondet-plain
attn_bwd dq_stores_cost 120
attn_bwd overlap_profiles 150
