#!/bin/bash
# Session s48: does a last, nearly empty round of CTAs cost our attention kernels (and
# cuDNN's) at B4 T4096 D128 without a mask? Kernel times at 31, 32 and 33 heads
# (`attention_bwd.py waves`); any card.
. "$(dirname "$0")/_lib.sh" "$@"
attn_bwd waves 400
