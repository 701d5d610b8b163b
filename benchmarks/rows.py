"""GPU check and benchmark of the row-wise kernels: softmax, LayerNorm, RMSNorm, cross-entropy.

Checks each kernel, compiled, against the float32 reference on random awkward shapes, then times
the 32768 x 4096 bf16 targets of the foundation issue against XLA (the reference under jit), JAX's
Pallas ops, tokamax (if importable) and the copy ceiling, all in one process.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import jaxfuse
from jaxfuse import RowBlocks
from benchmarks._timing import bench, guarded, peers, record, rel_err, temp_bytes

S = "rows"
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2, jnp.float16: 2e-3}


def _vjp_all(f, args, ct):
    y, vjp = jax.vjp(f, *args)
    return y, vjp(ct)


def check():
    key = jax.random.key(0)
    shapes = [(1, 1), (7, 131), (1000, 4096), (3, 262144), (33, 1000)]
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
        for shape in shapes:
            k = jax.random.split(key, 6)
            x = (jax.random.normal(k[0], shape) * 3).astype(dtype)
            w = jax.random.normal(k[1], shape[-1:]).astype(dtype)
            b = jax.random.normal(k[2], shape[-1:]).astype(dtype)
            ct = jax.random.normal(k[3], shape).astype(dtype)
            labels = jax.random.randint(k[4], shape[:-1], 0, shape[-1])
            mask = jax.random.bernoulli(k[5], 0.8, shape)
            cases = {
                "softmax": (lambda x, impl: jaxfuse.softmax(x, scale=0.5, impl=impl), (x,)),
                "softmax_mask_causal": (lambda x, impl: jaxfuse.softmax(
                    x, mask=mask, causal=True, impl=impl), (x,)),
                "layer_norm": (lambda x, w, b, impl: jaxfuse.layer_norm(x, w, b, impl=impl),
                               (x, w, b)),
                "rms_norm": (lambda x, w, impl: jaxfuse.rms_norm(x, w, impl=impl), (x, w)),
            }
            for name, (f, args) in cases.items():
                def run(f=f, args=args, name=name):
                    fp = jax.jit(lambda *a: _vjp_all(functools.partial(f, impl="pallas"), a, ct))
                    f32 = [a.astype(jnp.float32) for a in args]
                    fr = jax.jit(lambda *a: _vjp_all(functools.partial(f, impl="reference"), a,
                                                     ct.astype(jnp.float32)))
                    (y, g), (yr, gr) = fp(*args), fr(*f32)
                    errs = [rel_err(y, yr)] + [rel_err(a, r) for a, r in zip(g, gr)]
                    ok = all(e <= TOL[dtype] * 3 for e in errs)
                    record(S, f"check {name} {shape}", jnp.dtype(dtype).name,
                           max_rel_err=max(errs), status="ok" if ok else "FAIL")
                guarded(S, f"check {name} {shape}", jnp.dtype(dtype).name, run)

            def run_ce():
                ce = lambda x, impl: jaxfuse.cross_entropy(x, labels, label_smoothing=0.1,
                                                           impl=impl)
                (y, g) = jax.jit(jax.value_and_grad(functools.partial(ce, impl="pallas")))(x)
                (yr, gr) = jax.jit(jax.value_and_grad(functools.partial(ce, impl="reference")))(
                    x.astype(jnp.float32))
                errs = [rel_err(y, yr), rel_err(g, gr)]
                ok = all(e <= TOL[dtype] * 3 for e in errs)
                record(S, f"check cross_entropy {shape}", jnp.dtype(dtype).name,
                       max_rel_err=max(errs), status="ok" if ok else "FAIL")
            guarded(S, f"check cross_entropy {shape}", jnp.dtype(dtype).name, run_ce)


def _peers_norm(center: bool):
    def jax_pallas():
        from jax.experimental.pallas.ops.gpu import layer_norm as jln, rms_norm as jrms
        fn = jln.layer_norm if center else jrms.rms_norm
        # JAX's ops vmap over two leading axes: give them [B, T, D].
        return {"jax_pallas": lambda x, w, b: fn(x.reshape(32, -1, x.shape[-1]), w, b).reshape(
            x.shape)}

    def tokamax_peers():
        import tokamax
        return {f"tokamax_{impl}": functools.partial(
            lambda x, w, b, impl: tokamax.layer_norm(
                x, w, b if center else None, epsilon=1e-5, subtract_mean=center,
                implementation=impl), impl=impl) for impl in ("triton", "xla")}
    return peers(S, jax_pallas=jax_pallas, tokamax=tokamax_peers)


def perf(copy_bw: float, sweep: bool = True):
    R, D = 32768, 4096
    key = jax.random.key(1)
    sets = []
    for i in range(3):
        k = jax.random.split(jax.random.fold_in(key, i), 4)
        sets.append((jax.random.normal(k[0], (R, D), jnp.bfloat16),
                     jax.random.normal(k[1], (D,), jnp.bfloat16),
                     jax.random.normal(k[2], (D,), jnp.bfloat16),
                     jax.random.normal(k[3], (R, D), jnp.bfloat16)))
    nbytes = 2 * R * D * 2  # read x, write y

    def fwd_row(name, fns, argsel):
        for impl, f in fns.items():
            def run(f=f, impl=impl):
                jf = jax.jit(f)
                t = bench(jf, [argsel(s) for s in sets])
                record(S, f"{name} fwd {R}x{D} bf16", impl, t,
                       TBps=nbytes / t / 1e12, frac_copy=nbytes / t / copy_bw)
                return t
            guarded(S, f"{name} fwd", impl, run)

    def fb_row(name, fns, argsel):
        for impl, f in fns.items():
            def run(f=f, impl=impl):
                def step(*a):
                    *args, g = a
                    y, vjp = jax.vjp(f, *args)
                    return y, vjp(g)
                t = bench(jax.jit(step), [argsel(s) for s in sets])
                record(S, f"{name} fwd+bwd {R}x{D} bf16", impl, t)
            guarded(S, f"{name} fwd+bwd", impl, run)

    # Softmax.
    sm = {"jaxfuse": lambda x: jaxfuse.softmax(x),
          "xla": lambda x: jaxfuse.softmax(x, impl="reference"),
          "xla_jax.nn": lambda x: jax.nn.softmax(x, axis=-1)}
    try:
        from jax.experimental.pallas.ops.gpu import softmax as jsm
        sm["jax_pallas"] = lambda x: jsm.softmax(x)
    except Exception:  # noqa: BLE001
        pass
    if sweep:
        for br, bc, nw, rpp in [(1, 4096, 4, None), (1, 4096, 8, None), (2, 4096, 8, None),
                                (1, 4096, 4, 4), (1, 4096, 4, 16), (1, 4096, 8, 8),
                                (2, 4096, 8, 16)]:
            sm[f"jaxfuse[{br}x{bc},w{nw},rpp{rpp}]"] = functools.partial(
                lambda x, b: jaxfuse.softmax(x, block_sizes=b), b=RowBlocks(br, bc, nw, rpp))
    fwd_row("softmax", sm, lambda s: (s[0],))
    fb_row("softmax", {k: v for k, v in sm.items() if not k.startswith("jaxfuse[")},
           lambda s: (s[0], s[3]))

    # Norms.
    for name, center in (("layer_norm", True), ("rms_norm", False)):
        if center:
            ours = {"jaxfuse": lambda x, w, b: jaxfuse.layer_norm(x, w, b),
                    "xla": lambda x, w, b: jaxfuse.layer_norm(x, w, b, impl="reference")}
        else:
            ours = {"jaxfuse": lambda x, w, b: jaxfuse.rms_norm(x, w),
                    "xla": lambda x, w, b: jaxfuse.rms_norm(x, w, impl="reference")}
        fns = {**ours, **_peers_norm(center)}
        if sweep:
            for br, bc, nw, rpp in [(1, 4096, 4, None), (2, 4096, 8, None), (1, 4096, 4, 8),
                                    (1, 4096, 4, 32), (2, 4096, 8, 16)]:
                blk = RowBlocks(br, bc, nw, rpp)
                fns[f"jaxfuse[{br}x{bc},w{nw},rpp{rpp}]"] = functools.partial(
                    lambda x, w, b, blk: (jaxfuse.layer_norm(x, w, b, block_sizes=blk) if center
                                          else jaxfuse.rms_norm(x, w, block_sizes=blk)), blk=blk)
        fwd_row(name, fns, lambda s: s[:3])
        fb = {k: v for k, v in fns.items() if not k.startswith("jaxfuse[")}
        if sweep:
            for br, nw, rpp in [(1, 8, 64), (2, 8, 128), (4, 16, 256), (1, 4, 128)]:
                blk = RowBlocks(br, 4096, nw, rpp)
                fb[f"jaxfuse[{br}x4096,w{nw},rpp{rpp}]"] = functools.partial(
                    lambda x, w, b, blk: (jaxfuse.layer_norm(x, w, b, block_sizes=blk) if center
                                          else jaxfuse.rms_norm(x, w, block_sizes=blk)), blk=blk)
        fb_row(name, fb, lambda s: s)

    # Cross-entropy on [8192, 128256] logits.
    N, V = 8192, 128256
    k = jax.random.split(jax.random.key(2), 4)
    ce_sets = [(jax.random.normal(jax.random.fold_in(k[0], i), (N, V), jnp.bfloat16) * 2,
                jax.random.randint(jax.random.fold_in(k[1], i), (N,), 0, V)) for i in range(2)]
    for impl in ("jaxfuse", "xla"):
        def run(impl=impl):
            f = lambda x, y: jaxfuse.cross_entropy(x, y, label_smoothing=0.1,
                                                   impl="pallas" if impl == "jaxfuse" else "reference")
            step = jax.jit(jax.value_and_grad(f))
            t = bench(step, ce_sets, reps=10)
            record(S, f"cross_entropy fwd+bwd {N}x{V} bf16", impl, t,
                   temp_MB=(temp_bytes(jax.value_and_grad(f), *ce_sets[0]) or 0) / 1e6,
                   TBps=3 * N * V * 2 / t / 1e12)
        guarded(S, "cross_entropy fwd+bwd", impl, run)
