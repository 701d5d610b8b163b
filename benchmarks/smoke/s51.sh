#!/bin/bash
# Session s51, any card: every section's compiled checks against the float32 reference, no
# timings (`gpu_check.py --no-perf`), the sections most changed since their last full check
# first (the Hopper attention and block kernels, s45-s50), then `attention_bwd.py checks`.
# Prints the count of ok and failed checks per section and every row that is not ok. s51-4 (an
# H100) got through 27 of the attention section's 57 checks in 370 s (all ok): a whole pass
# needs several calls, one or two sections each (`s51.sh OUT LIMIT BWD_LIMIT "block lce"`;
# BWD_LIMIT 0 skips the backward's checks).
. "$(dirname "$0")/_lib.sh" "$@"
sections=${4:-attention block lce rope_qkv decode rows hardening}
timeout -s KILL "${2:-420}" python benchmarks/gpu_check.py $sections --no-perf \
    --out "$out/checks.json" > "$out/checks.log" 2>&1
echo "checks rc=$?: $(grep -ac 'status=ok\|ok=True' "$out/checks.log") ok, \
$(grep -ac 'status=FAIL\|ok=False\|rror' "$out/checks.log") not"
for s in $sections; do
    echo "  $s: $(grep -a "^$s " "$out/checks.log" | grep -ac "status=ok\|ok=True") ok"
done
grep -a "check\|status" "$out/checks.log" | grep -av "status=ok\|ok=True\|(--resume)" | sed 's/  */ /g' \
    | cut -c1-220 | head -40
tail -3 "$out/checks.log" | cut -c1-200
[ "${3:-150}" = 0 ] && exit 0
timeout -s KILL "${3:-150}" python benchmarks/attention_bwd.py checks "$out/bwd_check.json" \
    > "$out/bwd_check.log" 2>&1
echo "attention_bwd check rc=$?: $(grep -ac 'status=ok' "$out/bwd_check.log") ok, \
$(grep -ac 'status=FAIL\|rror' "$out/bwd_check.log") not"
grep -a "status" "$out/bwd_check.log" | grep -av "status=ok" | sed 's/  */ /g' | cut -c1-220
