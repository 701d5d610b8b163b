#!/bin/bash
# Session s47: the jax 0.11/0.12 compatibility changes on the GPU (device jax 0.11.2). Static
# tile starts that run past a ref's end became `program_id * 0` in `_common._at`, which the
# Triton compile should fold away: the decode and row kernels compiled and checked against
# the reference, then timed with this package and with the session's starting one
# (.baseline/jaxfuse, commit c39947e), alternating, same lease.
. "$(dirname "$0")/_lib.sh" "$@"
python -c "import jax; print('jax', jax.__version__)"
timeout -s KILL 240 python benchmarks/gpu_check.py decode rows --no-sweep \
    --out "$out/check_new.json" > "$out/check_new.log" 2>&1
echo "check rc=$?: $(grep -c 'status=ok' "$out/check_new.log") ok, \
$(grep -c 'FAIL\|rror' "$out/check_new.log") not"
baseline_pkg
for run in base new base2 new2; do
    dir=$PWD; [ "${run#base}" != "$run" ] && dir=/tmp/base
    (cd "$dir" && timeout -s KILL 100 python benchmarks/gpu_check.py decode rows --no-check \
        --no-sweep --out "/tmp/perf_$run.json" > "$out/perf_$run.log" 2>&1; echo "perf $run rc=$?")
done
