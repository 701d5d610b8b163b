#!/bin/bash
# Session s45: jaxfuse.beam_step on the GPU. Compiled checks and kernel times
# (`decode_probe.py beam_step`), the model's decoding with it, the same decoding with the
# previous commit's package (carried as .baseline/jaxfuse) in the same lease, and beam
# search's per-step kernels (`DECODE_MODE=beam decode_flags.py profile`).
. "$(dirname "$0")/_lib.sh" "$@"
timeout -s KILL 150 python benchmarks/decode_probe.py beam_step > "$out/probe.log" 2>&1
echo "probe rc=$?"; grep -a "beam_step" "$out/probe.log" | cut -c1-200
model_run decode 200 decode --no-reference
if [ -d .baseline/jaxfuse ]; then
    baseline_pkg
    here=$PWD
    (cd /tmp/base && timeout -s KILL 200 python benchmarks/model.py decode --no-reference \
        --out "$out/decode_base" > "$out/decode_base.log" 2>&1; echo "baseline rc=$?")
    tr '\r' '\n' < "$out/decode_base.log" | grep -av "run/s\]$" | grep -a " ms " | cut -c1-200
    cd "$here"
fi
DECODE_MODE=beam DECODE_TOP=45 timeout -s KILL 120 python benchmarks/decode_flags.py profile \
    "$out" > "$out/profile_beam.log" 2>&1
echo "profile rc=$?"; head -40 "$out/profile_beam.log" | cut -c1-160
