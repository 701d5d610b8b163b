#!/usr/bin/env bash
# s39's second call: is there a length past which the deterministic backward's fixed-point dQ
# beats the kernel pair (`attention_bwd.py fixed_crossover`: both schemes' kernels at 1024-4096
# keys a row)? Then the model race with the fixed point beside the default pair. (s39-2 ran a
# default that took the fixed point from 2048 keys a row, with a `--pair-dq` row; the
# measurement put the default back to the pair, NOTES s39.)
#   bash benchmarks/smoke/crossover_s39.sh "$OUT"      (on the device machine)
. "$(dirname "$0")/_lib.sh"
attn_bwd fixed_crossover 200
model_run model 300 train157 train1b --no-reference --fixed-dq
