#!/bin/bash
# Session s52, any card (an H200 when one comes: no H200 table since s35). $2:
#   "race" (~450 s): the direct-store probe (NOTES s51 item 6), the model race with decoding,
#       and the attention table against cuDNN and tokamax (.peers carried);
#   "first": ran "direct" below in s52-1; now "race";
#   "checks SECTIONS": s51.sh's correctness pass for SECTIONS (420 s, no backward checks);
#   "direct" (~550 s, run s52-1): the probe, then `attention.py direct_o` (O and lse from
#       registers, and 192-key tiles with it: interleaved against the default and cuDNN, then
#       compiled checks), then "norms" below. The option and the command were removed after
#       that run (slower: NOTES s52); they live in commits f500a73, e0e46e8 and cff382b.
. "$(dirname "$0")/_lib.sh" "$@"
probe() {
    timeout -s KILL 60 python benchmarks/probe_direct_store.py > "$out/probe.log" 2>&1
    echo "probe rc=$?"; tail -3 "$out/probe.log" | cut -c1-300
}
case "${2:-first}" in
    race|first) probe; model_run model 250 train157 train1b decode --no-reference --two-launches
           attn_table 230 ;;
    checks) bash "$(dirname "$0")/s51.sh" "$out" 420 0 "$3" ;;
    direct) probe
        timeout -s KILL 380 python benchmarks/attention.py direct_o "$out/direct_o.json" \
            > "$out/direct_o.log" 2>&1
        echo "direct_o rc=$?: $(grep -ac 'status=ok' "$out/direct_o.log") ok, \
$(grep -ac 'status=FAIL\|rror' "$out/direct_o.log") not"
        grep -a "check\|interleaved\|FAIL\|rror" "$out/direct_o.log" | grep -av "status=ok" \
            | sed 's/  */ /g' | cut -c1-200
        set -- "$1" norms 110 ;;
esac
# "norms": `change_cost.py norms` (s52's norm_cost.py) against the tree before the norms'
#   overflow guard (carry .baseline: `git archive e1f18c8 jaxfuse | tar -x -C .baseline`),
#   renamed jaxfuse_base.
if [ "${2:-}" = norms ]; then
    renamed_base "${3:-300}" norms
fi
