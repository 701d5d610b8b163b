"""GPU check of issue 19's hardening: the extreme-value and NaN cases, compiled.

The regressions of tests/test_hardening.py run in interpret mode on a CPU; this section runs the
same kinds of inputs through the compiled (Triton) kernels, whose compiler may contract,
reorder or approximate differently: -inf logits, unsigned labels, logits near 1e9 (forward) and
up to 3e9 with one visible key (P = 1 exactly: o = v, dv = do), softmax's scaled scores near
1e12, 1e4-sized inputs through the backward, a NaN in one row of each op, lengths past 2^31, a
query over zero keys. Each case is one row, status "ok" or "FAIL" (no timings: `perf` records
nothing).

    PYTHONPATH=. PYTHONUNBUFFERED=1 python benchmarks/gpu_check.py hardening --out hardening.json
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import jaxfuse
from benchmarks._timing import guarded, record, rel_err

S = "hardening"


def _case(name: str, dtype, thunk):
    """Runs `thunk() -> (ok, extra)` and records it; an exception is a FAIL row too."""
    def run():
        ok, extra = thunk()
        record(S, name, jnp.dtype(dtype).name, status="ok" if ok else "FAIL", **extra)
    guarded(S, name, jnp.dtype(dtype).name, run)


def _normal(seed, shape, dtype=jnp.float32, scale=1.0):
    return (jax.random.normal(jax.random.key(seed), shape, jnp.float32) * scale).astype(dtype)


def _same_nan(a, b) -> bool:
    return bool(jnp.array_equal(jnp.isnan(a), jnp.isnan(b)))


def _losses():
    # Class 1: a -inf logit without smoothing gives the finite loss; with smoothing +inf.
    def minus_inf():
        x = jnp.full((64, 1000), -jnp.inf).at[:, :3].set(_normal(1, (64, 3)))
        labels = jnp.arange(64) % 3
        f = jax.jit(lambda x, a: jax.value_and_grad(lambda x: jaxfuse.cross_entropy(
            x, labels, label_smoothing=a, reduction="sum"))(x), static_argnums=1)
        (loss, g), (loss_r, g_r) = f(x, 0.0), jax.jit(lambda x: jax.value_and_grad(
            lambda x: jaxfuse.cross_entropy(x, labels, reduction="sum", impl="reference"))(x))(x)
        smoothed = f(x, 0.1)[0]
        err = max(rel_err(loss, loss_r), rel_err(g, g_r))
        ok = bool(jnp.isfinite(loss)) and err < 1e-5 and float(smoothed) == np.inf
        return ok, dict(max_rel_err=err)
    _case("cross_entropy -inf logits", jnp.float32, minus_inf)

    # Class 6: uint8 label 156 with ignore_index=-100 and V = 200 is a label like any other
    # (counted in the mean); -100 does not wrap to 156. A label >= V is NaN, not ignored.
    def uint8_labels():
        x = _normal(2, (33, 200), jnp.bfloat16)
        lab = (jnp.arange(33) * 7 % 200).astype(jnp.uint8).at[0].set(156).at[1].set(230)
        got = jaxfuse.cross_entropy(x, lab, reduction="none")
        want = jaxfuse.cross_entropy(x, lab.astype(jnp.int32), reduction="none",
                                     impl="reference")
        mean = jaxfuse.cross_entropy(x.at[1].set(0), lab.at[1].set(3))
        per = jaxfuse.cross_entropy(x.at[1].set(0), lab.at[1].set(3), reduction="none")
        ok = (bool(jnp.isfinite(got[0])) and bool(jnp.isnan(got[1])) and _same_nan(got, want)
              and rel_err(jnp.nan_to_num(got), jnp.nan_to_num(want)) < 1e-5
              and abs(float(mean) - float(jnp.sum(per)) / 33) < 1e-4)
        return ok, {}
    _case("cross_entropy uint8 labels", jnp.bfloat16, uint8_labels)


def _attention():
    # Class 3: logits near 4e9 (q, k ~ 1e4, D = 256, scale 1): finite lse and o.
    for dtype in (jnp.float32, jnp.bfloat16):
        def large(dtype=dtype):
            q = _normal(3, (2, 200, 4, 256), dtype, 1e4)
            k = _normal(4, (2, 300, 2, 256), dtype, 1e4)
            v = _normal(5, (2, 300, 2, 256), dtype)
            f = lambda impl: jax.jit(lambda q, k, v: jaxfuse.flash_attention(
                q, k, v, scale=1.0, return_lse=True, impl=impl))(q, k, v)
            (o, lse), (o_r, lse_r) = f("pallas"), f("reference")
            fin = bool(jnp.all(jnp.isfinite(lse))) and bool(jnp.all(jnp.isfinite(o)))
            errs = [rel_err(o, o_r), rel_err(lse, lse_r)]
            return fin and max(errs) < 2e-2, dict(max_rel_err=max(errs))
        _case("flash_attention logits ~4e9", dtype, large)

    # Class 4: one visible key, logits 1e5 .. 3e9: o = v and dv = do exactly (P = 1). float32
    # under float32 matmul precision: the kernels follow JAX's matmul precision, TF32 by default
    # on a GPU, which rounds v in P @ V to 10 mantissa bits (o != v by ~2e-4, as XLA's would).
    for dtype in (jnp.float32, jnp.bfloat16):
        @jax.default_matmul_precision("float32" if dtype == jnp.float32 else "bfloat16")
        def one_key(dtype=dtype):
            worst, o_exact, dv_exact = 0.0, True, True
            for logit in (1e5, 1e7, 3e8, 3e9):
                s = float(np.sqrt(logit))
                q, k = _normal(6, (4, 64, 8, 128), dtype, s), _normal(7, (4, 1, 8, 128), dtype, s)
                v, do = _normal(8, (4, 1, 8, 128), dtype), _normal(9, (4, 64, 8, 128), dtype)
                # Tq = 64 queries all on key 0 (dv sums them), and a single query (dv = do).
                # Exact only if the backward's q.k rounds as the forward's did (same matmul
                # per element): a 1-ulp difference moves P by |s| * 1e-7 in the exponent.
                # (q, k are arguments: closed-over constants could be folded by XLA on one
                # side only, with a matmul that rounds differently.)
                o, vjp = jax.vjp(jax.jit(jaxfuse.flash_attention), q, k, v)
                dv = vjp(do)[2]
                o_exact &= bool(jnp.array_equal(o, jnp.broadcast_to(v, o.shape)))
                want = jnp.sum(do.astype(jnp.float32), axis=1, keepdims=True)
                worst = max(worst, rel_err(dv, want))
                o1, vjp1 = jax.vjp(jax.jit(jaxfuse.flash_attention), q[:, :1], k, v)
                dv_exact &= bool(jnp.array_equal(vjp1(do[:, :1])[2], do[:, :1]))
                o_exact &= bool(jnp.array_equal(o1, v))
            ok = o_exact and dv_exact and worst < (1e-2 if dtype == jnp.bfloat16 else 1e-6)
            return ok, dict(o_exact=o_exact, dv_exact=dv_exact, dv_sum_rel_err=worst)
        _case("flash_attention one visible key, logits to 3e9", dtype, one_key)

    # Class 4: 1e4-sized inputs through the backward: finite, bounded, dv = the reference's.
    def large_grads():
        q, k = _normal(10, (1, 256, 4, 64), jnp.float32, 1e4), _normal(11, (1, 256, 2, 64),
                                                                        jnp.float32, 1e4)
        v, do = _normal(12, (1, 256, 2, 64)), _normal(13, (1, 256, 4, 64))
        g = {impl: jax.jit(lambda q, k, v, impl=impl: jax.vjp(
            lambda q, k, v: jaxfuse.flash_attention(q, k, v, causal=True, impl=impl),
            q, k, v)[1](do))(q, k, v) for impl in ("pallas", "reference")}
        fin = all(bool(jnp.all(jnp.isfinite(a))) for a in g["pallas"])
        bounded = all(float(jnp.max(jnp.abs(a))) <= 10 * (float(jnp.max(jnp.abs(r))) + 1e4)
                      for a, r in zip(g["pallas"], g["reference"]))
        err = rel_err(g["pallas"][2], g["reference"][2])
        return fin and bounded and err < 1e-3, dict(dv_rel_err=err)
    _case("flash_attention grads, inputs ~1e4", jnp.float32, large_grads)


def _large_scaled_softmax():
    # Class 3 for softmax with a scale: scores scale * x near 1e12 (f32) and 1e30 (bf16 x).
    # A compiler that contracts s - m, s = x * scale, into one FMA subtracts the rounded max
    # from the exact product (the Hopper attention's bug, s53): exp of half an ulp of 1e12 is
    # inf. Rows of one tile and of several (the statistics pass); finite, as the reference.
    for dtype, mag in ((jnp.float32, 1e12), (jnp.bfloat16, 1e30)):
        def large(dtype=dtype, mag=mag):
            out, worst = {}, 0.0
            for cols in (1000, 70000):
                x = _normal(21, (8, cols), dtype, mag)
                got = jax.jit(lambda x: jaxfuse.softmax(x, scale=0.7))(x)
                want = jax.jit(lambda x: jaxfuse.softmax(x, scale=0.7, impl="reference"))(x)
                fin = all(bool(jnp.all(jnp.isfinite(a.astype(jnp.float32))))
                          for a in (got, want))
                err = rel_err(got, want)
                worst = max(worst, err if err == err else float("inf"))   # NaN: a failure
                out[f"cols{cols}"] = "ok" if fin else "FAIL"
            return all(v == "ok" for v in out.values()) and worst < 1e-2, dict(
                max_rel_err=worst, **out)
        _case(f"softmax scale 0.7, scores ~{mag:.0e}", dtype, large)


def _nan_rows():
    # Class 8: a NaN in the data gives NaN in its row, in every op, and nowhere else.
    x = _normal(14, (8, 4096), jnp.bfloat16).at[3, 1000].set(jnp.nan)
    rows = jnp.arange(8) == 3

    def row_ops():
        out = {}
        for name, f in {"softmax": lambda x, impl: jaxfuse.softmax(x, impl=impl),
                        "layer_norm": lambda x, impl: jaxfuse.layer_norm(x, impl=impl),
                        "rms_norm": lambda x, impl: jaxfuse.rms_norm(x, impl=impl),
                        "cross_entropy": lambda x, impl: jaxfuse.cross_entropy(
                            x, jnp.arange(8), reduction="none", impl=impl)[:, None]}.items():
            got = jax.jit(functools.partial(f, impl="pallas"))(x)
            want = jax.jit(functools.partial(f, impl="reference"))(x)
            nan_rows = jnp.isnan(got).any(-1)
            out[name] = (bool(jnp.array_equal(nan_rows, rows)) and _same_nan(got, want)
                         and bool(jnp.all(jnp.isnan(got[3]))))
        return all(out.values()), {k: ("ok" if v else "FAIL") for k, v in out.items()}
    _case("NaN row: softmax, norms, cross_entropy", jnp.bfloat16, row_ops)

    def attention_nan():
        q = _normal(15, (2, 100, 4, 64), jnp.bfloat16).at[1, 17, 2, 5].set(jnp.nan)
        k, v = _normal(16, (2, 100, 2, 64), jnp.bfloat16), _normal(17, (2, 100, 2, 64),
                                                                    jnp.bfloat16)
        o, lse = jax.jit(lambda q: jaxfuse.flash_attention(q, k, v, return_lse=True))(q)
        want = np.zeros((2, 100, 4), bool)
        want[1, 17, 2] = True
        ok = bool(np.array_equal(np.isnan(np.asarray(o, np.float32)).any(-1), want))
        ok &= bool(np.array_equal(np.isnan(np.asarray(lse)).transpose(0, 2, 1), want))
        od, lsed = jax.jit(lambda q: jaxfuse.decode_attention(
            q, k, v, jnp.array([100, 50]), return_lse=True))(q[:, 17])
        ok &= bool(np.array_equal(np.isnan(np.asarray(lsed)), want[:, 17]))
        ok &= bool(np.array_equal(np.isnan(np.asarray(od, np.float32)).any(-1), want[:, 17]))
        return ok, {}
    _case("NaN in one query: flash and decode attention", jnp.bfloat16, attention_nan)

    # Class 5: NaN candidates in beam_top_k, in the total order (+NaN above +inf, -NaN below
    # -inf, ties to the lower flat index), checked against numpy. XLA's GPU TopK kernel for long
    # rows does not rank NaN that way (measured: it returns +inf above +NaN), so `impl=
    # "reference"` (lax.top_k) is reported beside it, not used as the truth.
    def beam_nan():
        lp = jax.nn.log_softmax(_normal(18, (16, 4, 32000)), axis=-1)
        lp = lp.at[3, 1, 77].set(jnp.nan).at[5, 0, 5].set(-jnp.nan).at[7].set(jnp.nan)
        sc = _normal(19, (16, 4))
        got = jax.jit(lambda a, b: jaxfuse.beam_top_k(a, b, 4))(lp, sc)
        # The candidates as this backend adds them (a GPU's add returns its canonical NaN:
        # -NaN + x is +NaN there), ranked by numpy in the total order.
        from jaxfuse.reference.beam_top_k import candidates
        flat = np.asarray(jax.jit(candidates)(lp, sc))
        bits = flat.view(np.int32)
        key = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).astype(np.int64)
        top = np.stack([np.lexsort((np.arange(flat.shape[1]), -row))[:4] for row in key])
        want = (np.take_along_axis(flat, top, 1), top // 32000, top % 32000)
        ok = all(np.array_equal(np.asarray(a), b, equal_nan=True) for a, b in zip(got, want))
        ref = jax.jit(lambda a, b: jaxfuse.beam_top_k(a, b, 4, impl="reference"))(lp, sc)
        return ok, {"lax_top_k_agrees": all(bool(jnp.array_equal(a, b, equal_nan=True))
                                            for a, b in zip(got, ref))}
    _case("beam_top_k with NaN", jnp.float32, beam_nan)


def _decode_and_empty():
    # Class 7: uint32 lengths >= 2^31 clip to S; class 2: a cache of S = 0 gives zeros.
    def lengths():
        q = _normal(20, (3, 8, 128), jnp.bfloat16)
        kc, vc = _normal(21, (3, 1000, 2, 128), jnp.bfloat16), _normal(22, (3, 1000, 2, 128),
                                                                        jnp.bfloat16)
        got = jaxfuse.decode_attention(q, kc, vc, jnp.array([2 ** 31 + 5, 7, 0], jnp.uint32))
        want = jaxfuse.decode_attention(q, kc, vc, jnp.array([1000, 7, 0]), impl="reference")
        empty = jaxfuse.decode_attention(q, kc[:, :0], vc[:, :0], jnp.array([3, 0, 1]))
        err = rel_err(got, want)
        return err < 2e-2 and bool(jnp.all(empty == 0)), dict(max_rel_err=err)
    _case("decode uint32 lengths, empty cache", jnp.bfloat16, lengths)


def check():
    _losses()
    _attention()
    _large_scaled_softmax()
    _nan_rows()
    _decode_and_empty()


def perf(copy_bw: float, sweep: bool = True):
    """Nothing to time: this section only checks."""
