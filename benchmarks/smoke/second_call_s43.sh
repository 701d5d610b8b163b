#!/usr/bin/env bash
# s43's second call: the attention table on this card against cuDNN and tokamax (the D = 64
# rows with K and V in registers in the dK/dV kernel; carry .peers).
#   bash benchmarks/smoke/second_call_s43.sh "$OUT"     (on the device machine)
. "$(dirname "$0")/_lib.sh"
attn_table 420
