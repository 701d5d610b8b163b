#!/usr/bin/env bash
# s43's third call: where the consumers of the D = 64 dK/dV kernel (pair) and of the fused
# dQ's kernel stall, per SASS instruction (s43-1's counters: long-scoreboard stalls 1.61 ->
# 2.55 per issue, barrier 0.53 -> 0.96, issue active 49% -> 42%).
#   bash benchmarks/smoke/sass_s43.sh "$OUT"     (on the device machine)
. "$(dirname "$0")/_lib.sh"
ncu_sass 240
