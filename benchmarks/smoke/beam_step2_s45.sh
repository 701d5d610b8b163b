#!/bin/bash
# Session s45, second call: beam_step's compiled checks with the per-beam values behind a
# barrier and NaN cases against the total order, its tiles, and beam search's kernels per
# call with this package and with the previous commit's (.baseline/jaxfuse), same lease.
. "$(dirname "$0")/_lib.sh" "$@"
timeout -s KILL 200 python benchmarks/decode_probe.py beam_step > "$out/probe.log" 2>&1
echo "probe rc=$?"; grep -a "FAIL\|checks:\| us of\|tiles" "$out/probe.log" | cut -c1-220
prof() {   # prof NAME DIR: beam search's per-call kernels (32-token call) from package DIR
    (cd "$2" && DECODE_MODE=beam DECODE_TOP=60 timeout -s KILL 150 python \
        benchmarks/decode_flags.py profile > "$out/profile_$1.log" 2>&1; echo "profile $1 rc=$?")
    grep -a "kernels per call\|by kind" "$out/profile_$1.log" | cut -c1-200
}
rm -rf /tmp/base && mkdir -p /tmp/base && cp -r .baseline/jaxfuse /tmp/base/
ln -s "$PWD/benchmarks" /tmp/base/benchmarks
prof new "$PWD"; prof base /tmp/base; prof new2 "$PWD"; prof base2 /tmp/base
