#!/bin/bash
# Session s45, third call: beam_step with the beams' bookkeeping inside the re-rank kernel:
# compiled checks and kernel times, then beam search's per-call kernels with this package and
# the s44 one (.baseline/jaxfuse), alternating, and the model's decoding rows.
. "$(dirname "$0")/_lib.sh" "$@"
timeout -s KILL 150 python benchmarks/decode_probe.py beam_step > "$out/probe.log" 2>&1
echo "probe rc=$?"; grep -a "FAIL\|checks:\| us of" "$out/probe.log" | cut -c1-220
prof() {   # prof NAME DIR: beam search's per-call kernels (32-token call) from package DIR
    (cd "$2" && DECODE_MODE=beam DECODE_TOP=60 timeout -s KILL 150 python \
        benchmarks/decode_flags.py profile > "$out/profile_$1.log" 2>&1; echo "profile $1 rc=$?")
    grep -a "kernels per call\|by kind" "$out/profile_$1.log" | cut -c1-200
}
rm -rf /tmp/base && mkdir -p /tmp/base && cp -r .baseline/jaxfuse /tmp/base/
ln -s "$PWD/benchmarks" /tmp/base/benchmarks
prof new "$PWD"; prof base /tmp/base; prof new2 "$PWD"
model_run decode 200 decode --no-reference
