#!/bin/bash
# Session s45, third call: beam_step with the beams' bookkeeping inside the re-rank kernel:
# compiled checks and kernel times, then beam search's per-call kernels with this package and
# the s44 one (.baseline/jaxfuse), alternating, and the model's decoding rows.
. "$(dirname "$0")/_lib.sh" "$@"
timeout -s KILL 150 python benchmarks/decode_probe.py beam_step > "$out/probe.log" 2>&1
echo "probe rc=$?"; grep -a "FAIL\|checks:\| us of" "$out/probe.log" | cut -c1-220
baseline_pkg
beam_profile new "$PWD"; beam_profile base /tmp/base; beam_profile new2 "$PWD"
model_run decode 200 decode --no-reference
