#!/bin/bash
# Session s45, second call: beam_step's compiled checks with the per-beam values behind a
# barrier and NaN cases against the total order, its tiles, and beam search's kernels per
# call with this package and with the previous commit's (.baseline/jaxfuse), same lease.
. "$(dirname "$0")/_lib.sh" "$@"
timeout -s KILL 200 python benchmarks/decode_probe.py beam_step > "$out/probe.log" 2>&1
echo "probe rc=$?"; grep -a "FAIL\|checks:\| us of\|tiles" "$out/probe.log" | cut -c1-220
baseline_pkg
beam_profile new "$PWD"; beam_profile base /tmp/base; beam_profile new2 "$PWD"
beam_profile base2 /tmp/base
