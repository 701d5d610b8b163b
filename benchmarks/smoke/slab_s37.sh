#!/usr/bin/env bash
# s37: the loss's token slab (Config.loss_token_slab, the presets' 2048) at 4096 and 8192 now
# that a slab's dz is written over its logits (one [slab, V] buffer, not two).
#   bash benchmarks/smoke/slab_s37.sh "$OUT"      (on the device machine)
. "$(dirname "$0")/_lib.sh"
model_run model4096 280 train157 train1b --no-reference --loss-token-slab 4096
model_run model8192 200 train1b --no-reference --loss-token-slab 8192
