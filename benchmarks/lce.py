"""GPU check and benchmark of the fused linear + cross-entropy (`jaxfuse.linear_cross_entropy`).

N=8192 D=4096 V=128256 bf16 forward+backward against XLA (the reference under jit: bf16 logits
materialized, cross-entropy in float32), tokamax `linear_softmax_cross_entropy_loss`, and the
unfused x @ W + `jaxfuse.cross_entropy`: time and compiled temporary memory. Then N=32768
V=262144, which the unfused paths cannot hold comfortably. FLOPs: XLA does 3 matmuls of 2NDV, we
do 4 (recompute); the time of one logits matmul x @ W is printed as the yardstick (floor: 4 of
them for us, 3 for XLA).
"""
from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp

import jaxfuse
from jaxfuse import LCEBlocks
from benchmarks._timing import bench, guarded, record, rel_err, temp_bytes

S = "lce"


def _inputs(key, n, d, v, dtype=jnp.bfloat16):
    k = jax.random.split(key, 3)
    return (jax.random.normal(k[0], (n, d), dtype),
            (jax.random.normal(k[1], (d, v), jnp.float32) * d ** -0.5).astype(dtype),
            jax.random.randint(k[2], (n,), 0, v))


def check():
    for dtype in (jnp.bfloat16, jnp.float32):
        opts = dict(label_smoothing=0.1, z_loss=1e-4, logits_soft_cap=30.0)
        # The last two take the fused Hopper forward in bf16 (N % 128 = 0, V % 64 = 0).
        for n, d, v, kw in [(1000, 256, 5000, {}), (333, 128, 70001, opts),
                            (1024, 256, 5120, {}), (384, 192, 70016, opts)]:
            name = f"check N{n} D{d} V{v} {kw}"

            def run(n=n, d=d, v=v, kw=kw, name=name):
                x, w, labels = _inputs(jax.random.key(v), n, d, v, dtype)
                f = lambda impl, x, w: jaxfuse.linear_cross_entropy(x, w, labels, impl=impl, **kw)
                vg = lambda impl: jax.jit(jax.value_and_grad(functools.partial(f, impl),
                                                             argnums=(0, 1)))
                loss, (dx, dw) = vg("pallas")(x, w)
                with jax.default_matmul_precision("highest"):
                    loss_r, (dx_r, dw_r) = vg("reference")(x.astype(jnp.float32),
                                                           w.astype(jnp.float32))
                errs = [rel_err(loss, loss_r), rel_err(dx, dx_r), rel_err(dw, dw_r)]
                _, (dx2, dw2) = vg("pallas")(x, w)
                same = bool(jnp.array_equal(dx, dx2)) and bool(jnp.array_equal(dw, dw2))
                ok = errs[0] < 1e-3 and max(errs[1:]) < 1e-2 and same
                record(S, name, jnp.dtype(dtype).name, loss_err=errs[0], grad_err=max(errs[1:]),
                       deterministic=same, status="ok" if ok else "FAIL")
            guarded(S, name, jnp.dtype(dtype).name, run)

    # The token slabs (`LCEBlocks(token_slab=n)`, the GPU presets' loss): each slab's loss and
    # dz by one cross-entropy kernel (s37), ragged slabs, rows past the 16384-column tile
    # (walked twice), label smoothing, ignored labels, every dtype.
    for dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
        for n, d, v, slab, a in [(1000, 256, 5000, 384, 0.0), (333, 128, 70001, 128, 0.1)]:
            name = f"check token_slab={slab} N{n} D{d} V{v} smoothing {a}"

            def run_slab(n=n, d=d, v=v, slab=slab, a=a, name=name):
                x, w, labels = _inputs(jax.random.key(v + 1), n, d, v, dtype)
                labels = labels.at[::7].set(-100)
                f = lambda impl, blocks, x, w: jaxfuse.linear_cross_entropy(
                    x, w, labels, impl=impl, label_smoothing=a, block_sizes=blocks)
                vg = lambda impl, blocks=None: jax.jit(jax.value_and_grad(
                    functools.partial(f, impl, blocks), argnums=(0, 1)))
                loss, (dx, dw) = vg("pallas", LCEBlocks(token_slab=slab))(x, w)
                with jax.default_matmul_precision("highest"):
                    loss_r, (dx_r, dw_r) = vg("reference")(x.astype(jnp.float32),
                                                           w.astype(jnp.float32))
                errs = [rel_err(loss, loss_r), rel_err(dx, dx_r), rel_err(dw, dw_r)]
                _, (dx2, dw2) = vg("pallas", LCEBlocks(token_slab=slab))(x, w)
                same = bool(jnp.array_equal(dx, dx2)) and bool(jnp.array_equal(dw, dw2))
                # (float32 products run as TF32 on the GPU by default, as the fused op's checks)
                ok = errs[0] < 1e-3 and max(errs[1:]) < 1e-2 and same
                record(S, name, jnp.dtype(dtype).name, loss_err=errs[0], grad_err=max(errs[1:]),
                       deterministic=same, status="ok" if ok else "FAIL")
            guarded(S, name, jnp.dtype(dtype).name, run_slab)

    def run_vmap():
        # vmap over examples with a shared weight: the Hopper forward under pallas_call batching,
        # its backward (D = 256) one example after another (custom_vmap).
        x, w, labels = _inputs(jax.random.key(5), 2 * 256, 256, 1088)
        x, labels = x.reshape(2, 256, 256), labels.reshape(2, 256)
        f = jax.value_and_grad(lambda x, w, y: jaxfuse.linear_cross_entropy(x, w, y),
                               argnums=(0, 1))
        batched = jax.jit(jax.vmap(f, in_axes=(0, None, 0)))(x, w, labels)
        one_by_one = [jax.jit(f)(x[i], w, labels[i]) for i in range(2)]
        err = max(rel_err(a, jnp.stack(b)) for a, b in zip(
            jax.tree.leaves(batched), zip(*[jax.tree.leaves(o) for o in one_by_one])))
        record(S, "check vmap N2x256 D256 V1088 value+grad", "bfloat16", rel_err=err,
               status="ok" if err < 1e-6 else "FAIL")
    guarded(S, "check vmap N2x256 D256 V1088 value+grad", "bfloat16", run_vmap)


def _with_tiles(tiles):
    """The LCE with the Hopper GEMMs on `tiles` (a `Tiles` or `HopperTiles`)."""
    return lambda x, w, y: jaxfuse.linear_cross_entropy(
        x, w, y, block_sizes=LCEBlocks(hopper=tiles))


def _fns(sweep: bool):
    fns = {
        "jaxfuse": lambda x, w, y: jaxfuse.linear_cross_entropy(x, w, y),
        "xla_reference": lambda x, w, y: jaxfuse.linear_cross_entropy(x, w, y, impl="reference"),
        "unfused_logits+jaxfuse.cross_entropy": lambda x, w, y: jaxfuse.cross_entropy(
            jnp.dot(x, w), y),
        "jaxfuse[hopper=False]": lambda x, w, y: jaxfuse.linear_cross_entropy(
            x, w, y, block_sizes=LCEBlocks(hopper=False)),
    }
    try:
        import tokamax
        fns["tokamax"] = lambda x, w, y: tokamax.linear_softmax_cross_entropy_loss(
            x, y, w, reduction="mean")
    except Exception as e:  # noqa: BLE001
        record(S, "peer import", "tokamax", error=str(e)[:100])
    if sweep:
        for slab in (2048, 8192, 16384):
            fns[f"jaxfuse[slab={slab}]"] = functools.partial(
                lambda x, w, y, blk: jaxfuse.linear_cross_entropy(x, w, y, block_sizes=blk),
                blk=LCEBlocks(slab))
    return fns


def layouts(n=8192, d=4096, v=128256):
    """The per-slab matmuls of the slab design, timed alone in each operand layout, projected to
    the whole vocabulary (x v / slab): which layout cuBLAS runs fastest, and what the weight
    slab copy and the dW cast cost."""
    k = jax.random.split(jax.random.key(3), 4)
    x = jax.random.normal(k[0], (n, d), jnp.bfloat16)
    w = jax.random.normal(k[1], (d, v), jnp.bfloat16)
    dx = jax.random.normal(k[2], (n, d), jnp.float32)
    f32 = jnp.float32
    for slab in (4096, 8192):
        ws = w[:, :slab]
        wst = ws.T.copy()
        dz = jax.random.normal(k[3], (n, slab), jnp.bfloat16)
        variants = {
            "slice copy W[:, s] -> [D,S]": (lambda w: jax.lax.dynamic_slice_in_dim(
                w, 2 * slab, slab, axis=1), (w,)),
            "slice copy W[:, s] -> [S,D]": (lambda w: jax.lax.dynamic_slice_in_dim(
                w, 2 * slab, slab, axis=1).T, (w,)),
            "z = x @ Ws [D,S]": (lambda x, a: jnp.dot(x, a), (x, ws)),
            "z = x @ WsT.T [S,D]": (lambda x, a: jnp.dot(x, a.T), (x, wst)),
            "z = x @ slice(W) fused?": (lambda x, w: jnp.dot(x, jax.lax.dynamic_slice_in_dim(
                w, 2 * slab, slab, axis=1)), (x, w)),
            "dx += dz @ Ws.T": (lambda dx, dz, a: dx + jnp.einsum(
                "nv,dv->nd", dz, a, preferred_element_type=f32), (dx, dz, ws)),
            "dx += dz @ WsT": (lambda dx, dz, a: dx + jnp.einsum(
                "nv,vd->nd", dz, a, preferred_element_type=f32), (dx, dz, wst)),
            "dx_s = dz @ Ws.T (no acc, f32)": (lambda dz, a: jnp.einsum(
                "nv,dv->nd", dz, a, preferred_element_type=f32), (dz, ws)),
            "dWs = x.T @ dz f32 -> bf16": (lambda x, dz: jnp.einsum(
                "nd,nv->dv", x, dz, preferred_element_type=f32).astype(jnp.bfloat16), (x, dz)),
            "dWs = x.T @ dz bf16 out": (lambda x, dz: jnp.einsum("nd,nv->dv", x, dz), (x, dz)),
            "dWsT = dz.T @ x bf16 out": (lambda x, dz: jnp.einsum("nd,nv->vd", x, dz), (x, dz)),
        }
        for name, (f, a) in variants.items():
            def run(f=f, a=a, name=name):
                t = bench(jax.jit(f), [a], reps=10, repeats=3, warmup=1)
                record(S, f"layout slab={slab}", name, t, x_vocab_ms=t * 1e3 * v / slab)
            guarded(S, f"layout slab={slab}", name, run)


def perf(copy_bw: float, sweep: bool = True):
    if sweep:
        layouts()
    del copy_bw
    n, d, v = 8192, 4096, 128256
    args = _inputs(jax.random.key(0), n, d, v)
    flops_ours = 4 * 2 * n * d * v
    t_mm = bench(jax.jit(lambda x, w, y: jnp.dot(x, w)), [args], reps=5, repeats=3, warmup=1)
    record(S, f"N{n} D{d} V{v} one logits matmul", "xla", t_mm,
           TFLOPs=2 * n * d * v / t_mm / 1e12, floor_4x_ms=4e3 * t_mm, floor_3x_ms=3e3 * t_mm)
    for impl, f in _fns(sweep).items():
        def run(f=f, impl=impl, args=args):
            step = jax.value_and_grad(f, argnums=(0, 1))
            t = bench(jax.jit(step), [args], reps=3, repeats=3, warmup=1)
            record(S, f"N{n} D{d} V{v} fwd+bwd", impl, t,
                   temp_GB=(temp_bytes(step, *args) or 0) / 1e9,
                   TFLOPs_4matmul=flops_ours / t / 1e12)
        guarded(S, f"N{n} D{d} V{v} fwd+bwd", impl, run)
    # Forward alone (the logits-never-held kernel by itself).
    for impl in ("jaxfuse", "jaxfuse[hopper=False]", "xla_reference"):
        f = _fns(False)[impl]

        def run_fwd(f=f, impl=impl, args=args):
            t = bench(jax.jit(f), [args], reps=5, repeats=3, warmup=1)
            record(S, f"N{n} D{d} V{v} fwd", impl, t, TFLOPs=2 * n * d * v / t / 1e12)
        guarded(S, f"N{n} D{d} V{v} fwd", impl, run_fwd)
    del args
    if os.environ.get("JAXFUSE_BENCH_SKIP_BIG"):
        return
    n, v = 32768, 262144
    big = [jax.ShapeDtypeStruct((n, d), jnp.bfloat16), jax.ShapeDtypeStruct((d, v), jnp.bfloat16),
           jax.ShapeDtypeStruct((n,), jnp.int32)]
    for impl in ("jaxfuse", "xla_reference", "unfused_logits+jaxfuse.cross_entropy"):
        f = _fns(False)[impl]
        step = jax.value_and_grad(f, argnums=(0, 1))
        guarded(S, f"N{n} D{d} V{v} fwd+bwd temp", impl, lambda step=step, impl=impl: record(
            S, f"N{n} D{d} V{v} fwd+bwd temp", impl,
            temp_GB=(temp_bytes(step, *big) or -1e9) / 1e9))

    def run_big():
        x, w, y = _inputs(jax.random.key(1), n, d, v)
        step = jax.jit(jax.value_and_grad(_fns(False)["jaxfuse"], argnums=(0, 1)))
        t = bench(step, [(x, w, y)], reps=1, repeats=1, warmup=1)
        stats = jax.devices()[0].memory_stats() or {}
        record(S, f"N{n} D{d} V{v} fwd+bwd", "jaxfuse", t,
               peak_GB=stats.get("peak_bytes_in_use", 0) / 1e9)
    guarded(S, f"N{n} D{d} V{v} fwd+bwd", "jaxfuse", run_big)


def kernels(n=8192, d=4096, v=128256, slab=4096, interpret=False, variants=None):
    """The Hopper GEMMs one by one against cuBLAS on the shapes the LCE runs them at: the forward
    with each tile option; per slab of `slab` columns the dz GEMM (W read in place, a bf16 tile
    stored), dW = x^T dz (x transposed in the kernel, stored in place into a [D, V] buffer at
    the slab's offset) and dx += dz W_slab^T (W transposed in the kernel, float32 added in
    place), each checked against XLA's result.

        PYTHONPATH=. python -c "from benchmarks.lce import kernels; kernels()"
    """
    import dataclasses

    import jax.experimental.pallas.mosaic_gpu as plgpu

    from jaxfuse.pallas import _hopper
    from jaxfuse.pallas import _hopper_gemm as H
    x, w, y = _inputs(jax.random.key(0), n, d, v)
    base = H.Tiles()
    variants = variants or {"cooperative": base,
                            "pingpong": dataclasses.replace(base, schedule="pingpong", stages=4)}
    for name, tiles in variants.items():
        def run(tiles=tiles, name=name):
            f = jax.jit(_with_tiles(tiles))
            t = bench(f, [(x, w, y)], reps=5, repeats=3, warmup=1)
            record(S, "fwd hopper tiles", name, t, TFLOPs=2 * n * d * v / t / 1e12)
        guarded(S, "fwd hopper tiles", name, run)

    off = 3 * slab
    flops = 2 * n * d * slab
    dz = jax.random.normal(jax.random.key(1), (n, slab), x.dtype)
    w_s = w[:, off:off + slab]
    f32 = jnp.float32
    ref = {"z": lambda: jnp.dot(x, w_s, preferred_element_type=f32),
           "dW": lambda: jnp.einsum("nd,nv->dv", x, dz, preferred_element_type=f32),
           "dx": lambda: 1.0 + jnp.einsum("nv,dv->nd", dz, w_s, preferred_element_type=f32)}
    cublas = {"z": (lambda x, w_s: jnp.dot(x, w_s), (x, w_s)),
              "dW": (lambda x, dz: jnp.einsum("nd,nv->dv", x, dz), (x, dz)),
              "dx": (lambda acc, dz, w_s: acc + jnp.einsum("nv,dv->nd", dz, w_s,
                                                          preferred_element_type=f32),
                     (jnp.ones((n, d), f32), dz, w_s))}

    def store(z, rows, ctx, col0):
        H.store_tile(z.astype(x.dtype), ctx.scratch.at[ctx.wg], ctx.outs[0], ctx.row,
                     col0(ctx) + ctx.col)

    def add(z, rows, ctx):
        H.add_tile(z, ctx.scratch.at[ctx.wg], ctx.outs[0], ctx.row, ctx.col, interpret)

    def mosaic(kind, t):
        kw = dict(tiles=t, interpret=interpret, name=f"probe_{kind}")
        if kind == "z":
            return jax.jit(lambda x, w: H.matmul_epilogue(
                x, w, off, b_window=slab, epilogue=functools.partial(store, col0=lambda c: 0),
                out_types=jax.ShapeDtypeStruct((n, slab), x.dtype),
                scratch_types=H.tile_smem(x.dtype, t), **kw)), (x, w)

        def in_place(init, call):
            def f(*args):
                r = jax.new_ref(init(), memory_space=plgpu.GMEM)
                call(r, *args)
                return r[...]
            return jax.jit(f)
        if kind == "dW":
            return in_place(lambda: _hopper.uninitialized((d, off + slab), x.dtype, interpret),
                            lambda r, x, dz: H.matmul_epilogue(
                x, dz, off, a_t=True, refs=(r,), scratch_types=H.tile_smem(x.dtype, t),
                epilogue=functools.partial(store, col0=lambda c: c.off), **kw)), (x, dz)
        return in_place(lambda: jnp.ones((n, d), f32), lambda r, dz, w: H.matmul_epilogue(
            dz, w, off, b_t=True, b_window=slab, refs=(r,), epilogue=add,
            scratch_types=H.tile_smem(f32, t), **kw)), (dz, w)

    for kind in ("z", "dW", "dx"):
        label = f"{kind} N{n} D{d} slab {slab}"
        f, args = cublas[kind]
        guarded(S, label, "cuBLAS", lambda f=f, args=args, label=label: record(
            S, label, "cuBLAS", t := bench(jax.jit(f), [args], reps=10, repeats=3, warmup=1),
            TFLOPs=flops / t / 1e12))
        for tname, t in variants.items():
            def run(kind=kind, t=t, tname=tname, label=label):
                g, args = mosaic(kind, t)
                out = g(*args)
                if kind == "dW":
                    out = out[:, off:off + slab]
                err = rel_err(out, ref[kind]())
                tm = bench(g, [args], reps=10, repeats=3, warmup=1)
                record(S, label, f"mosaic {tname}", tm, TFLOPs=flops / tm / 1e12, rel_err=err,
                       status="ok" if err < 1e-2 else "FAIL")
            guarded(S, label, f"mosaic {tname}", run)


def schedules(n=8192, d=4096, v=128256, variants=None, rounds=4):
    """One fwd+bwd step per choice of Hopper tiles (`Tiles`, or per GEMM through
    `HopperTiles`), XLA beside them, all in one process: each variant's results checked against
    the first variant's (the same tiles in the same order: equal up to float32 sum order) and
    its temporaries; then step and kernel times in `rounds` interleaved rounds (`_interleaved`:
    the lent GPU's clock drifts by several % between one variant's measurement and the next,
    benchmarks/NOTES.md runs 27, 30, 34-36, so only medians over interleaved rounds compare);
    then the forward alone."""
    import statistics

    from jaxfuse.pallas import _hopper_gemm as H
    from jaxfuse.pallas.linear_cross_entropy import HopperTiles
    pp4 = H.Tiles(schedule="pingpong", stages=4)
    args = _inputs(jax.random.key(0), n, d, v)
    variants = variants or {"default": HopperTiles(),
                            "all cooperative": H.Tiles(),
                            "dz cooperative": HopperTiles(dz=H.Tiles()),
                            "all pingpong": pp4}
    fns = {"xla_reference": _fns(False)["xla_reference"]}
    fns.update({name: _with_tiles(t) for name, t in variants.items()})
    label = f"N{n} D{d} V{v} fwd+bwd variant"
    steps, ref = {}, None
    for name, f in fns.items():
        def run(f=f, name=name):
            nonlocal ref
            vg = jax.value_and_grad(f, argnums=(0, 1))
            step = jax.jit(vg)
            out = step(*args)
            err = 0.0
            if name != "xla_reference":
                ref = out if ref is None else ref
                err = max(rel_err(a, b) for a, b in zip(jax.tree.leaves(out),
                                                        jax.tree.leaves(ref)))
            record(S, label, name, temp_GB=(temp_bytes(vg, *args) or 0) / 1e9,
                   rel_err_vs_first=err, status="ok" if err < 1e-3 else "FAIL")
            steps[name] = step
        guarded(S, label, name, run)
    times, kernels = _interleaved({name: (step, args) for name, step in steps.items()}, rounds)
    for name, ts in times.items():
        fwd = None if name == "xla_reference" else bench(jax.jit(fns[name]), [args], reps=5,
                                                         repeats=3, warmup=1) * 1e3
        record(S, f"N{n} D{d} V{v} fwd+bwd step", name, statistics.median(ts),
               rounds_ms=[round(t * 1e3, 2) for t in ts], fwd_ms=fwd, **kernels[name])


def _interleaved(fns, rounds: int):
    """Times every `fns[name] = (f, args)` in `rounds` interleaved rounds (5 calls each) and
    reads its GPU kernel times from the profiler in the same turn (3 calls). Rounds rotate and
    reverse every other time, so that no function always follows the same one: the one
    measured right after XLA's step showed 3-4% more time in every kernel, unchanged ones
    included (benchmarks/NOTES.md runs 34-36). Returns ({name: [seconds per round]}, {name:
    record fields: kernel totals per round and the median per kernel, largest first})."""
    import collections
    import statistics

    from benchmarks._profile import kernel_times
    times = collections.defaultdict(list)
    kernels = collections.defaultdict(lambda: collections.defaultdict(list))
    order = list(fns)
    for r in range(rounds):
        turn = order[r % len(order):] + order[:r % len(order)]
        for name in (turn if r % 2 == 0 else turn[::-1]):
            f, args = fns[name]
            times[name].append(bench(f, [args], reps=5, repeats=1, warmup=1))
            by_kernel = collections.defaultdict(float)
            for kname, _, ms in kernel_times(f, args):
                by_kernel[kname[:26]] += ms
            kernels[name]["total"].append(sum(by_kernel.values()))
            for kname, ms in by_kernel.items():
                kernels[name][kname].append(ms)
    fields = {}
    for name, ks in kernels.items():
        med = {k: round(statistics.median(v), 3) for k, v in ks.items()}
        fields[name] = dict(kernels_total_ms=[round(t, 2) for t in ks["total"]],
                            kernel_medians=dict(sorted(med.items(), key=lambda kv: -kv[1])[:6]))
    return times, fields


def floor(n=8192, d=4096, v=128256, rounds=4):
    """The time floor of any design that recomputes the logits, measured: a function made of
    nothing but the four cuBLAS matmuls such a design runs (the logits twice, dx = dz W^T,
    dW = x^T dz; dz a random input, no softmax, no epilogue, nothing else), beside three of
    them (XLA's count), XLA's whole step and ours, step and kernel times in interleaved rounds
    (`_interleaved`; run 38: four bare matmuls 1.22x XLA's step, ours 1.27x)."""
    import statistics

    x, w, y = _inputs(jax.random.key(0), n, d, v)
    dz = jax.random.normal(jax.random.key(1), (n, v), x.dtype)

    def gemms(count):
        def f(x, w, dz):
            z = jnp.dot(x, w)
            outs = [z, jnp.einsum("nv,dv->nd", dz, w), jnp.einsum("nd,nv->dv", x, dz)]
            if count == 4:      # the recompute; the barrier keeps XLA from reusing z
                x2, _ = jax.lax.optimization_barrier((x, z))
                outs.append(jnp.dot(x2, w))
            return outs
        return jax.jit(f)

    step = {impl: jax.jit(jax.value_and_grad(f, argnums=(0, 1)))
            for impl, f in _fns(False).items() if impl in ("xla_reference", "jaxfuse")}
    fns = {"xla_reference step": (step["xla_reference"], (x, w, y)),
           "jaxfuse step": (step["jaxfuse"], (x, w, y)),
           "3 cuBLAS matmuls": (gemms(3), (x, w, dz)), "4 cuBLAS matmuls": (gemms(4), (x, w, dz))}
    times, kernels = _interleaved(fns, rounds)
    base = statistics.median(times["xla_reference step"])
    base_k = statistics.median(kernels["xla_reference step"]["kernels_total_ms"])
    for name, ts in times.items():
        k = statistics.median(kernels[name]["kernels_total_ms"])
        record(S, f"N{n} D{d} V{v} floor", name, statistics.median(ts),
               rounds_ms=[round(t * 1e3, 2) for t in ts], vs_xla_step=statistics.median(ts) / base,
               kernels_ms=round(k, 3), kernels_vs_xla=k / base_k if base_k else None,
               **kernels[name])


def profile(n=8192, d=4096, v=128256):
    """Per-kernel GPU time of one fwd+bwd step: where the time over 4 matmuls goes."""
    from benchmarks._profile import report
    args = _inputs(jax.random.key(0), n, d, v)
    fns = _fns(False)
    for impl in ("jaxfuse", "jaxfuse[hopper=False]", "xla_reference"):
        step = jax.jit(jax.value_and_grad(fns[impl], argnums=(0, 1)))
        guarded(S, "profile", impl, lambda step=step, impl=impl: report(
            S, f"N{n} D{d} V{v} fwd+bwd {impl}", step, args))


if __name__ == "__main__":
    profile()
