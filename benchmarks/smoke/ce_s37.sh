#!/usr/bin/env bash
# s37: the token-slab loss's one cross-entropy kernel (loss and dz) against the pair, by kernel
# time and tile (benchmarks/ce_rows.py), then the model with and without it (model.py --ce-pair).
#   bash benchmarks/smoke/ce_s37.sh "$OUT"      (on the device machine)
. "$(dirname "$0")/_lib.sh"
timeout -s KILL 200 python benchmarks/ce_rows.py "$out/ce_rows.json" > "$out/ce_rows.log" 2>&1
echo "ce_rows rc=$?"
grep "ms=\|rror" "$out/ce_rows.log" | sed 's/  */ /g' | cut -c1-230
model_run model 330 train157 train1b --no-reference --ce-pair
