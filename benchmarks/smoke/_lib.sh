# Sourced by the session smoke scripts (`. "$(dirname "$0")/_lib.sh"` with the script's own
# arguments): their common start (the output folder from $1, the repository's package on the
# path, the card's name) and the model race with its rows printed.
set -u
out=${1:-/tmp/smoke}
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader

# model_run NAME LIMIT_S ARGS...: `benchmarks/model.py ARGS --out $out/NAME`, killed after
# LIMIT_S, log $out/NAME.log; prints its timed rows (and, with --profile, the kernels by kind).
model_run() {
    local name=$1 limit=$2
    shift 2
    timeout -s KILL "$limit" python benchmarks/model.py "$@" --out "$out/$name" \
        > "$out/$name.log" 2>&1
    echo "model $name rc=$?"
    tr '\r' '\n' < "$out/$name.log" | grep -av "run/s\]$" \
        | grep -a " ms \|speedup\|by kind\|kernels per call" | cut -c1-200
}

# lce_check LIMIT_S: the linear + cross-entropy checks (`benchmarks/lce.py`'s `check`, compiled
# against the float32 reference), log $out/lce_check.log, counts and rows printed.
lce_check() {
    timeout -s KILL "$1" python -c "
from benchmarks import lce, _timing
lce.check()
_timing.save('$out/lce_check.json')" > "$out/lce_check.log" 2>&1
    echo "lce check rc=$?: $(grep -c 'status=ok' "$out/lce_check.log") ok, \
$(grep -c 'FAIL\|rror' "$out/lce_check.log") not"
    grep "check" "$out/lce_check.log" | sed 's/  */ /g' | cut -c1-200
}

# block_rows LIMIT_S: the five row kernels' forwards and fwd+bwd against XLA, interleaved
# (`benchmarks/block.py`), log $out/block.log, rows printed.
block_rows() {
    timeout -s KILL "$1" python benchmarks/block.py --no-check --interleave 3 \
        --only dropout,bias_dropout_add,add_norm,rope,embedding --out "$out/block.json" \
        > "$out/block.log" 2>&1
    echo "block rc=$?"
    grep "fwd  \|interleaved" "$out/block.log" | cut -c1-150
}

# attn_cmd COMMAND LIMIT_S: `benchmarks/attention.py COMMAND $out/COMMAND.json`, killed after
# LIMIT_S, log $out/COMMAND.log; prints its checks' counts and its check, timing and error rows.
attn_cmd() {
    timeout -s KILL "$2" python benchmarks/attention.py "$1" "$out/$1.json" > "$out/$1.log" 2>&1
    echo "attention $1 rc=$?: $(grep -ac 'status=ok' "$out/$1.log") ok, \
$(grep -ac 'status=FAIL\|rror' "$out/$1.log") not"
    grep -a "check\|interleaved\|FAIL\|rror" "$out/$1.log" | sed 's/  */ /g' | cut -c1-200
}

# attn_bwd COMMAND LIMIT_S: `benchmarks/attention_bwd.py COMMAND $out/COMMAND.json`, killed
# after LIMIT_S, log $out/COMMAND.log; prints its checks, timings and kernel times.
attn_bwd() {
    timeout -s KILL "$2" python benchmarks/attention_bwd.py "$1" "$out/$1.json" \
        > "$out/$1.log" 2>&1
    echo "attention_bwd $1 rc=$?: $(grep -c 'status=ok' "$out/$1.log") ok, \
$(grep -c 'FAIL\|rror' "$out/$1.log") not"
    grep -a "check\|garbage\|interleaved\|FAIL\|rror\| ms \|by kind" "$out/$1.log" \
        | sed 's/  */ /g; s/HopperAttnTiles(.*fixed_dq=\(True\|False\)).*persistent=None)/[fixed_dq=\1]/' \
        | cut -c1-260
}

# attn_table LIMIT_S: the attention table against cuDNN and tokamax (`gpu_check.py attention
# --no-check --no-sweep`; tokamax's wheels carried in .peers), log $out/attention.log.
attn_table() {
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/peers \
        .peers/wheels/*.whl
    PYTHONPATH=/tmp/peers:$PWD/.peers/stub:$PYTHONPATH timeout -s KILL "$1" \
        python benchmarks/gpu_check.py attention --no-check --no-sweep \
        --out "$out/attention.json" > "$out/attention.log" 2>&1
    echo "attention rc=$?"
    grep -a "attention \|ceiling" "$out/attention.log" | sed 's/  */ /g' | cut -c1-160
}

# ncu_bwd_d64 LIMIT_S: the pair's dK/dV kernel and the fused dQ's at the 1B model's attention
# under Nsight Compute (`ncu_probe.py attention_bwd_d64`: stall reasons, tensor pipe, speed of
# light, shared memory; NOTES s41 item 4, s42 item 2), log $out/ncu-bwd-d64.txt, rows printed.
ncu_bwd_d64() {
    timeout -s KILL "$1" ncu --clock-control none -k regex:flash_bwd_dkv \
        --section SpeedOfLight --section MemoryWorkloadAnalysis_Tables \
        --metrics "gpu__time_duration.sum,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio,smsp__issue_active.avg.pct_of_peak_sustained_active" \
        python benchmarks/ncu_probe.py attention_bwd_d64 > "$out/ncu-bwd-d64.txt" 2>&1
    echo "ncu rc=$?"
    grep -a "jaxfuse_flash\|duration\|gmma\|issue_active\|Throughput\|Shared\|Bank\|stalled_\(barrier\|long\|short\|wait\|gmma\|math\|mio\|not_sel\|selected\|dispatch\|lg\)" \
        "$out/ncu-bwd-d64.txt" | sed 's/  */ /g' | cut -c1-130
}

# ncu_sass LIMIT_S [KERNEL_REGEX PROBE NAME COUNT]: warp-stall sampling per SASS instruction
# (SourceCounters) of the kernels matching KERNEL_REGEX in `ncu_probe.py PROBE`, printed per
# kernel as CSV: $out/ncu-sass-NAME.csv.gz, summed by `benchmarks/sass_stalls.py` (which
# instruction the consumers wait at: the other consumer's dS^T, a wgmma, a ring slot, the MUFU).
# Defaults: the two kernels of `ncu_bwd_d64` (s43-3).
ncu_sass() {
    local re=${2:-flash_bwd_dkv} probe=${3:-attention_bwd_d64} name=${4:-bwd-d64}
    timeout -s KILL "$1" ncu --clock-control none -k "regex:$re" -c "${5:-2}" \
        --section WarpStateStats --section SourceCounters --section ComputeWorkloadAnalysis \
        --metrics "gpu__time_duration.sum,regex:sm__inst_executed_pipe_.*.avg.pct_of_peak_sustained_active,regex:sm__pipe_.*_cycles_active.avg.pct_of_peak_sustained_active,regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio" \
        -o "$out/$name" -f python benchmarks/ncu_probe.py "$probe" > "$out/ncu-sass-$name.log" 2>&1
    echo "ncu sass rc=$?"
    ncu --import "$out/$name.ncu-rep" --page details 2>> "$out/ncu-sass-$name.log" \
        > "$out/ncu-details-$name.txt"
    ncu --import "$out/$name.ncu-rep" --page source --csv --print-source sass \
        2>> "$out/ncu-sass-$name.log" | gzip > "$out/ncu-sass-$name.csv.gz"
    echo "sass csv: $(zcat "$out/ncu-sass-$name.csv.gz" | wc -l) lines"
    tail -3 "$out/ncu-sass-$name.log"
    python benchmarks/sass_stalls.py "$out/ncu-sass-$name.csv.gz" --top 30 \
        > "$out/sass-stalls-$name.txt" 2>&1
    head -40 "$out/sass-stalls-$name.txt" | cut -c1-200
}

# baseline_pkg: the previous package (carried as .baseline/jaxfuse, git-excluded) in
# /tmp/base beside a link to this tree's benchmarks/, for a baseline in the same lease.
baseline_pkg() {
    rm -rf /tmp/base && mkdir -p /tmp/base && cp -r .baseline/jaxfuse /tmp/base/
    ln -s "$PWD/benchmarks" /tmp/base/benchmarks
}

# beam_profile NAME DIR: beam search's kernels per 32-token call (`DECODE_MODE=beam
# decode_flags.py profile`) run from the package in DIR, log $out/profile_NAME.log.
beam_profile() {
    (cd "$2" && DECODE_MODE=beam DECODE_TOP=60 timeout -s KILL 150 python \
        benchmarks/decode_flags.py profile > "$out/profile_$1.log" 2>&1; echo "profile $1 rc=$?")
    grep -a "kernels per call\|by kind" "$out/profile_$1.log" | cut -c1-200
}

# rename_base: the tree before a change (carried as .baseline/jaxfuse, git-excluded) as
# /tmp/base/jaxfuse_base, every `jaxfuse` in it renamed, so that both import in one process.
rename_base() {
    rm -rf /tmp/base && mkdir -p /tmp/base && cp -r .baseline/jaxfuse /tmp/base/jaxfuse_base
    find /tmp/base -name '*.py' -exec sed -i 's/\bjaxfuse\b/jaxfuse_base/g' {} +
}

# renamed_base LIMIT_S GROUP: `benchmarks/change_cost.py GROUP` against `rename_base`'s tree;
# log $out/cost_GROUP.log, rows printed.
renamed_base() {
    rename_base
    PYTHONPATH=/tmp/base:$PYTHONPATH timeout -s KILL "$1" python benchmarks/change_cost.py "$2" \
        "$out/cost_$2.json" > "$out/cost_$2.log" 2>&1
    echo "change_cost $2 rc=$?"; grep -a "_cost\|rror" "$out/cost_$2.log" | sed 's/  */ /g' \
        | cut -c1-230
}
