#!/bin/bash
# Session s49, any card. $2: "model" (the race with the decoding rows, the default beside
# `--two-launches`: does s48's one launch of the backward pair move the step? ~350 s) or
# "attention" (the table against cuDNN and tokamax, ~420 s; .peers carried).
. "$(dirname "$0")/_lib.sh" "$@"
case "${2:-model}" in
    model) model_run model 570 train157 train1b decode --no-reference --two-launches ;;
    attention) attn_table 560 ;;
esac
