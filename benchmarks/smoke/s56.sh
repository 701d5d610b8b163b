#!/bin/bash
# For the session after s55 (any card; "race" and "tables" want .peers carried for tokamax). $2:
#   "checks" (~300 s): the D = 64 forward past 4096 keys, "issue" by default since s55, compiled
#       against the float32 reference (`attention.py check_s55`: 3 cases, bf16 and f16: ragged
#       GQA, window + soft cap, segment ids), then `attention_bwd.py checks` (150 s of it);
#   "race" (~300 s): the training race (157M and 1B) and decoding on today's tree, with a row
#       of the forward's steps before s55 (`--no-issue`: it differs at the 1B preset only,
#       whose T8192 walks a CTA a tile);
#   "tables": s53.sh's tables (attention against cuDNN and tokamax, the row kernels).
. "$(dirname "$0")/_lib.sh" "$@"
case "${2:-checks}" in
    checks) attn_cmd check_s55 300
        attn_bwd checks 150 ;;
    race) model_run model 300 train157 train1b decode --no-reference --no-issue ;;
    tables) bash "$(dirname "$0")/s53.sh" "$out" tables ;;
esac
