#!/usr/bin/env bash
# s38's calls: the deterministic fused dQ in int32 fixed point (`_fixed_sum`), compiled.
#   bash benchmarks/smoke/fixed_s38.sh "$OUT" [fixed|diag|quick|model]   (on the device machine)
# fixed (the default): `attention_bwd.py fixed` (its kernels' times, its checks, the D = 64
# rows against the kernel pair, the float32 fused dQ and cuDNN), then the model race; diag:
# `fixed_diag`; quick: `fixed_quick`; model: `fixed_profiles`, then the model race.
. "$(dirname "$0")/_lib.sh"
case "${2:-fixed}" in
    fixed) attn_bwd fixed 235; model_run model 320 train157 train1b --no-reference ;;
    diag) attn_bwd fixed_diag 200 ;;
    quick) attn_bwd fixed_quick 200 ;;
    model) attn_bwd fixed_profiles 100; model_run model 250 train157 train1b --no-reference ;;
esac
