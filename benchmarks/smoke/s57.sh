#!/bin/bash
# For the sessions after s56 (any card). s58-1 ran "fix" and "ptxas" (K and V from shared
# memory mend it: since s58 the default there, `attention_hopper_bwd.regs_fault`). $2:
#   "seg" (~400 s): `seg_probe.py variants` (the rule off: the kernel with K and V in
#       registers, its switches one at a time), then `attention.py check_s56` (segment ids at
#       D = 64 without GQA, compiled with the default tiles, bf16 and f16): what s58 owes;
#   "probe" (~370 s): `seg_probe.py variants` and ptxas's report in one lease;
#   "fix" (~170 s on the H100): `seg_probe.py fix`, every one of the kernel's switches that
#       could mend it (K and V from shared memory, the plain steps, both, one launch) screened
#       with the rule off, then check_s56's problems with the first that gives right gradients;
#   "matrix" (~250 s on the H100 a head dim): `attention_bwd.py matrix64` and `matrix128`
#       (every default kernel selection of the backward x masks, MHA and GQA, both
#       `deterministic`, compiled; matrix64 ran in s58-3 before the rule, 12 of 12 ok);
#   then s56.sh's "race" and "tables" on an H200.
. "$(dirname "$0")/_lib.sh" "$@"
# seg_probe MODE LIMIT_S: `seg_probe.py MODE` ("variants": the guard lifted, the kernel's
# switches one at a time; "fix": the first switch that mends it, checked on the guarded
# problems), log $out/seg_MODE.log, rows printed.
seg_probe() {
    timeout -s KILL "$2" python benchmarks/seg_probe.py "$1" "$out/seg_$1.json" \
        > "$out/seg_$1.log" 2>&1
    echo "seg_probe $1 rc=$?"
    grep -a "seg_probe\|check\|rror" "$out/seg_$1.log" \
        | sed 's/  */ /g; s/bad_blocks=[0-9,]*//' | cut -c1-240
}

# ptxas_seg: ptxas's report of the failing kernel against its passing twins.
ptxas_seg() {
    timeout -s KILL 150 python benchmarks/hopper_ptxas.py seg > "$out/ptxas_seg.log" 2>&1
    echo "ptxas rc=$?"
    grep -a "===\|registers\|spill\|serializ\|rror" "$out/ptxas_seg.log" | cut -c1-200
}

case "${2:-seg}" in
    seg) seg_probe variants 220
        attn_cmd check_s56 170 ;;
    probe) seg_probe variants 220
        ptxas_seg ;;
    fix) seg_probe fix 400 ;;
    ptxas) ptxas_seg ;;
    matrix) attn_bwd matrix64 250
        attn_bwd matrix128 250 ;;
esac
