#!/usr/bin/env bash
# The device work s36 left (benchmarks/NOTES.md s36 item 10), in one call of under 600 s:
# rope_qkv compiled again (s36 mended its code after its GPU runs: one custom_vjp with RoPE,
# the warps rule by tile size; same kernels at the measured shapes), then, on an H200, the model
# on the current code for BENCHMARKS.md's table and the row kernels' forwards.
#   bash benchmarks/smoke/first_call_s37.sh "$OUT"      (on the device machine)
. "$(dirname "$0")/_lib.sh"
timeout -s KILL 150 python benchmarks/gpu_check.py rope_qkv --out "$out/rope_qkv.json" \
    > "$out/rope_qkv.log" 2>&1
echo "rope_qkv rc=$?: $(grep -c 'ok=True' "$out/rope_qkv.log") ok, \
$(grep -c 'ok=False' "$out/rope_qkv.log") not"
grep " ms" "$out/rope_qkv.log" | grep -v "tokens" | cut -c1-140
model_run model 260 train157 train1b decode --no-reference
block_rows 160
