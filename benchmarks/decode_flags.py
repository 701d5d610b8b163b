"""Does the decoding step pay for its launches? Greedy decoding of the 157M preset (B=32, prompt
512, 256 new tokens, bf16) compiled with XLA GPU options that change how kernels are launched
(CUDA graphs: `xla_gpu_enable_command_buffer`, its minimum graph size) or how its matmuls are
emitted (cuBLAS instead of XLA's Triton GEMMs), each against the
default in one run, with the reference's call as the issue's yardstick.

    PYTHONPATH=. PYTHONUNBUFFERED=1 python benchmarks/decode_flags.py [OUT.json]
    PYTHONPATH=. PYTHONUNBUFFERED=1 python benchmarks/decode_flags.py profile [OUT_DIR]
    PYTHONPATH=. PYTHONUNBUFFERED=1 python benchmarks/decode_flags.py ratio [OUT.json]
    PYTHONPATH=. PYTHONUNBUFFERED=1 python benchmarks/decode_flags.py sync [OUT.json]

`DECODE_VARIANTS=default,no split-K` picks variants by name (all of them by default);
`DECODE_QKV_PARTS=p` sets the step's q/k/v partial sums (`jaxfuse.model.decoding.QKV_PARTS`). `ratio`
times jaxfuse's greedy call (`DECODE_MODE=beam`: beam search, B8, 4 beams) and the reference's
interleaved, `ROUNDS` (7) rounds, and records the median of the per-round ratios: the two calls'
times move by 6-10% within a process (s23: the first ~5 s of calls ran ~8% faster), so
back-to-back medians straddled the issue's 2x. `DECODE_SETTLE_S=s`: each call runs alone for s
seconds before it is timed.

A step of ~10 launches per layer takes 3.3-3.5x its bytes floor (BENCHMARKS.md); if the gaps
between small kernels are part of that, graphs shorten the step; if the kernels' own latency
fills it, nothing here moves.
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import sys

import jax
import jax.numpy as jnp

import jaxfuse.model as M
from benchmarks import _timing
from benchmarks._timing import bench, guarded, record

VARIANTS = {
    "default": {},
    "no graphs": {"xla_gpu_enable_command_buffer": ""},
    "graphs of any size": {"xla_gpu_graph_min_graph_size": 1},
    "graphs + while/conditional": {
        "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,"
                                         "CONDITIONAL"},
    # The step's four projections are XLA Triton GEMMs on 32 rows with split-K (30-45% of
    # the copy rate, s13-4), chosen by an autotuner that times them with the weights warm in
    # L2; in the loop every weight arrives cold. cuBLAS's small-M kernels instead (s19-2:
    # 107.5 ms against 88.8; jax 0.11.2's XLA has no option to turn split-K off alone).
    "cuBLAS GEMMs": {"xla_gpu_enable_triton_gemm": False},
    # Split-K cuts a 32-row GEMM's K so that more CTAs stream the weights, and adds a launch:
    # the reduction, into which XLA fuses RoPE, SwiGLU and add + norm (~2 us each, ~60 us a
    # step in s13-4). Forced off, the epilogues fuse into the GEMM; fewer CTAs each stream a
    # longer column slab. Predicted: -1 launch per projection (~28 a step), GEMMs slower by
    # less than the reductions cost, if the per-SM stream keeps up.
    "no split-K": {"xla_gpu_experimental_force_split_k": 1},
    # No autotuning: XLA's heuristic tile per GEMM (timed warm in L2 by the autotuner, a
    # step's weights arrive cold).
    "autotune off": {"xla_gpu_autotune_level": 0},
}


def _setup(b=32, prompt=512, new=256):
    # DECODE_QKV_PARTS=p: the step's q/k/v projection as p float32 partial sums (s26).
    if os.environ.get("DECODE_QKV_PARTS"):
        from jaxfuse.model import decoding
        decoding.QKV_PARTS = int(os.environ["DECODE_QKV_PARTS"])
    cfg = M.preset("157m")
    cfg = dataclasses.replace(cfg, max_len=max(cfg.max_len, prompt + new))
    params = M.init(jax.random.key(0), cfg)
    prompts = jax.random.randint(jax.random.key(2), (b, prompt), 0, cfg.vocab_size)
    return cfg, params, prompts, jnp.full((b,), prompt, jnp.int32)


def _greedy(cfg, new: int, impl: str = "pallas", **kw):
    """The greedy call every section times: `new` tokens, eos_id=-1 (never generated, so every
    call takes all `new` steps)."""
    return lambda p, x, l: M.greedy(p, cfg, x, l, max_new_tokens=new, eos_id=-1, impl=impl,
                                    **kw)


# Batch rows of each DECODE_MODE: beam search takes 4 beams a row, so 32 rows a step either way.
_BATCH = {"greedy": 32, "beam": 8}


def _search(mode: str, cfg, new: int, impl: str = "pallas"):
    """The call of `mode` over a batch of `_BATCH[mode]`: greedy (`_greedy`) or beam search
    with 4 beams (issue 16's row)."""
    if mode != "beam":
        return _greedy(cfg, new, impl)
    return lambda p, x, l: M.beam_search(p, cfg, x, l, beam_size=4, max_new_tokens=new,
                                         eos_id=-1, impl=impl)


def profile(out_dir: str | None):
    """Kernels and idle gaps of a 32-token greedy call (prefill + 31 steps), and its optimized
    HLO (which kernels a step launches, which of them XLA put in command buffers).
    DECODE_MODE=beam: the same of beam search (B8, 4 beams: the same 32 rows a step as greedy's
    B32, so what its kernels add over greedy's is the beams' own work: top-k, cache reorder,
    bookkeeping)."""
    import gzip
    from benchmarks._profile import gaps, report
    mode = os.environ.get("DECODE_MODE", "greedy")
    cfg, params, prompts, lengths = _setup(_BATCH[mode])
    # DECODE_VARIANTS names one variant to profile (the default if unset)
    name = os.environ.get("DECODE_VARIANTS", "default").split(",")[0]
    f = jax.jit(_search(mode, cfg, 32), compiler_options=VARIANTS[name] or None)
    report("decode", f"{mode} pallas kernels (prefill + 31 steps) [{name}]", f,
           (params, prompts, lengths), top=int(os.environ.get("DECODE_TOP", 30)))
    gaps(f, (params, prompts, lengths), top=16)
    if out_dir:
        text = f.lower(params, prompts, lengths).compile().as_text()
        with gzip.open(os.path.join(out_dir, f"decode_{mode}.hlo.txt.gz"), "wt") as fh:
            fh.write(text)


def ratio(out: str | None, rounds: int = 7, settle_s: float = 0.0):
    """jaxfuse's greedy call against the reference's, interleaved (see the module doc). With
    `settle_s` (DECODE_SETTLE_S), each call first runs alone for that long before it is timed,
    so that each is timed in the state its own load holds the GPU in (s23: in a process's first
    ~5 s every call ran ~8% faster than later, at the same SM clock)."""
    mode = os.environ.get("DECODE_MODE", "greedy")   # or beam: B8, 4 beams (issue 16's row)
    b, prompt, new = _BATCH[mode], 512, 256
    cfg, params, prompts, lengths = _setup(b, prompt, new)
    fns = {impl: jax.jit(_search(mode, cfg, new, impl)) for impl in ("pallas", "reference")}
    args = (params, prompts, lengths)
    times = _timing.interleaved(fns, [args], rounds, settle_s, reps=1, repeats=3, warmup=1)
    label = f"interleaved x{rounds}" + (f", {settle_s:g} s alone first" if settle_s else "")
    mode_label = f"{mode} B{b}" + (" K4" if mode == "beam" else "")
    for impl, ts in times.items():
        record("decode", f"{mode_label} P{prompt} new{new} {label}", impl,
               statistics.median(ts), tokens_per_s=b * new / statistics.median(ts),
               spread=(max(ts) - min(ts)) / statistics.median(ts))
    ratios = [r / p for r, p in zip(times["reference"], times["pallas"])]
    record("decode", f"{mode}: jaxfuse vs reference, {label}", "pallas", None,
           speedup=statistics.median(ratios), lowest=min(ratios), highest=max(ratios))
    _timing.save(out)


def sync(out: str | None, rounds: int = 5):
    """`steps_per_sync` (decoding steps between two host checks of the early stop) for
    jaxfuse's greedy call and the reference's, interleaved: s23-1's profile showed ~0.13 ms of
    idle GPU around each check (the condition's copy to the host and the next burst's launch),
    ~10% of a jaxfuse step at 8 steps a check."""
    b, prompt, new = 32, 512, 256
    cfg, params, prompts, lengths = _setup(b, prompt, new)
    fns = {}
    for impl, counts in (("pallas", (8, 16, 32, 64)), ("reference", (8, 32))):
        for n in counts:
            fns[(impl, n)] = jax.jit(_greedy(cfg, new, impl, steps_per_sync=n))
    times = _timing.interleaved(fns, [(params, prompts, lengths)], rounds, reps=1, repeats=3,
                                warmup=1)
    med = {k: statistics.median(ts) for k, ts in times.items()}
    for (impl, n), t in med.items():
        record("decode", f"greedy B{b} P{prompt} new{new} interleaved x{rounds}",
               f"{impl} steps_per_sync={n}", t, tokens_per_s=b * new / t,
               vs_reference_at_same=(med[("reference", n)] / t
                                     if ("reference", n) in med and impl == "pallas" else None))
    _timing.save(out)


def main():
    print(f"device={jax.devices()[0].device_kind} jax={jax.__version__}")
    if sys.argv[1:2] == ["profile"]:
        profile(sys.argv[2] if len(sys.argv) > 2 else None)
        return
    if sys.argv[1:2] == ["sync"]:
        sync(sys.argv[2] if len(sys.argv) > 2 else None, int(os.environ.get("ROUNDS", 5)))
        return
    if sys.argv[1:2] == ["ratio"]:
        ratio(sys.argv[2] if len(sys.argv) > 2 else None, int(os.environ.get("ROUNDS", 7)),
              float(os.environ.get("DECODE_SETTLE_S", 0)))
        return
    picked = os.environ.get("DECODE_VARIANTS")
    variants = ({n: VARIANTS[n] for n in picked.split(",")} if picked else VARIANTS)
    b, prompt, new = 32, 512, 256
    cfg, params, prompts, lengths = _setup(b, prompt, new)
    base = {}
    for impl in ("pallas", "reference"):
        for name, opts in variants.items():
            if impl == "reference" and name != "default":
                continue

            def run(impl=impl, name=name, opts=opts):
                times = {}
                # the step time (less the prefill) for the default only: one compile each
                for n in ((new, 1) if name == "default" else (new,)):
                    f = jax.jit(_greedy(cfg, n, impl), compiler_options=opts or None)
                    times[n] = bench(f, [(params, prompts, lengths)], reps=1, repeats=5,
                                     warmup=1)
                extra = {}
                if 1 in times:
                    extra["step_ms"] = (times[new] - times[1]) / (new - 1) * 1e3
                base.setdefault(impl, times[new])
                record("decode", f"greedy B{b} P{prompt} new{new}", f"{impl} [{name}]",
                       times[new], tokens_per_s=b * new / times[new],
                       vs_default=base[impl] / times[new], **extra)
            guarded("decode", f"greedy {impl}", name, run)
    if "pallas" in base and "reference" in base:
        record("decode", "greedy: jaxfuse (default) vs reference", "pallas", None,
               speedup=base["reference"] / base["pallas"])
    _timing.save(sys.argv[1] if len(sys.argv) > 1 else None)


if __name__ == "__main__":
    main()
