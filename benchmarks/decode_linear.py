"""`jaxfuse.decode_linear` on the GPU: a decoding step's matmuls (32 rows) with their norm,
SwiGLU and residual add fused, against the same composition under `jax.jit` (XLA: split-K GEMMs
and their reduction fusions).

    PYTHONPATH=. python benchmarks/decode_linear.py {check|layers|sweep|all} [OUT.json]

check: compiled kernels against the float32 reference (bf16/f16/f32, awkward shapes).
layers: the 157M model's 8 layers of a decoding step without attention (per layer: rms + qkv,
o + residual, rms + gate/up + SwiGLU, down + residual; each layer its own weights, 300 MB in
all: cold, as a step's are), ours against XLA, per call and per kernel (profiler); and the
final norm + unembedding (67 MB). sweep: the layer chain at other tiles.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxfuse  # noqa: E402
from benchmarks import _timing as T  # noqa: E402
from jaxfuse.pallas.decode_linear import LinearBlocks  # noqa: E402

# the 157M preset: d 1024, 16 heads + 2 x 4 KV heads of 64, d_ff 2816, vocab 32768; B = 32
B, D, QKV, F, V, LAYERS = 32, 1024, (16 + 8) * 64, 2816, 32768, 8


def _randn(key, shape, dtype, scale=1.0):
    return (jax.random.normal(jax.random.key(key), shape, jnp.float32) * scale).astype(dtype)


def check():
    cases = [  # (m, k, n, kwargs builder)
        (32, 1024, 1536, "rms"), (32, 1024, 2816, "rms+gate"), (32, 1024, 1024, "residual"),
        (32, 2816, 1024, "residual"), (7, 333, 101, "layer+gate"), (1, 17, 5, "rms+residual"),
        (64, 1024, 4096, "none"), (100, 520, 300, "layer+gate+residual"),
    ]
    for dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
        for m, k, n, kind in cases:
            x = _randn(1, (m, k), dtype) + 0.5
            kw = dict(gate_weight=_randn(3, (n, k), dtype, k ** -0.5) if "gate" in kind
                      else None,
                      residual=_randn(4, (m, n), dtype) if "residual" in kind else None)
            if kind.startswith(("rms", "layer")):
                kw.update(norm=kind.split("+")[0], norm_weight=_randn(5, (k,), dtype) + 1.0)
                if kind.startswith("layer"):
                    kw["norm_bias"] = _randn(6, (k,), dtype)
            w = _randn(2, (n, k), dtype, k ** -0.5)
            arrays = {a: v for a, v in kw.items() if hasattr(v, "dtype")}
            statics = {a: v for a, v in kw.items() if a not in arrays}
            got = jax.jit(lambda x, w, kw: jaxfuse.decode_linear(x, w, **kw, **statics))(
                x, w, arrays)
            f32 = lambda a: None if a is None else a.astype(jnp.float32)
            want = jaxfuse.decode_linear(f32(x), f32(w), impl="reference",
                                         **{a: (f32(v) if hasattr(v, "dtype") else v)
                                            for a, v in kw.items()})
            err = T.rel_err(got, want)
            tol = {jnp.bfloat16: 1.5e-2, jnp.float16: 2e-3, jnp.float32: 2e-3}[dtype]
            T.record("check", f"{jnp.dtype(dtype).name} [{m},{k}]x[{n},{k}] {kind}", "pallas",
                     rel_err=err, ok=bool(err < tol))


def _layer_weights(dtype=jnp.bfloat16):
    ws = []
    for i in range(LAYERS):
        s = 100 * i
        ws.append(dict(n1=_randn(s + 1, (D,), dtype) + 1.0, qkv=_randn(s + 2, (QKV, D), dtype,
                                                                       D ** -0.5),
                       o=_randn(s + 3, (D, D), dtype, D ** -0.5),
                       n2=_randn(s + 4, (D,), dtype) + 1.0,
                       w1=_randn(s + 5, (F, D), dtype, D ** -0.5),
                       w3=_randn(s + 6, (F, D), dtype, D ** -0.5),
                       w2=_randn(s + 7, (D, F), dtype, F ** -0.5)))
    return ws


def _chain(impl, blocks=None):
    """The layers' matmuls as a decoding step chains them (attention's output stands in as
    the first 1024 of q/k/v's columns)."""
    lin = lambda *a, **kw: jaxfuse.decode_linear(*a, impl=impl, block_sizes=blocks, **kw)

    def run(h, ws):
        for w in ws:
            qkv = lin(h, w["qkv"], norm="rms", norm_weight=w["n1"])
            h = lin(qkv[:, :D], w["o"], residual=h)
            act = lin(h, w["w3"], norm="rms", norm_weight=w["n2"], gate_weight=w["w1"])
            h = lin(act, w["w2"], residual=h)
        return h
    return jax.jit(run)


def _unembed(impl, blocks=None):
    return jax.jit(lambda h, n, e: jaxfuse.decode_linear(h, e, norm="rms", norm_weight=n,
                                                         impl=impl, block_sizes=blocks))


def _time(name, fn, args, kernels=True):
    from benchmarks._profile import kernel_times
    t = T.bench(fn, [args], reps=50, repeats=7, warmup=3)
    ks = kernel_times(fn, args, reps=10) if kernels else []
    T.record("layers", name, "", t, kernels_us=sum(ms for _, _, ms in ks) * 1e3)
    for kname, n, ms in ks[:8]:
        print(f"      {ms * 1e3:8.2f} us  x{n:3d}  {kname}")
    return t


def layers():
    h = _randn(7, (B, D), jnp.bfloat16)
    ws = _layer_weights()
    out = {impl: _chain(impl)(h, ws) for impl in ("pallas", "reference")}
    T.record("layers", "8 layers, ours vs XLA", "agreement", rel_err=T.rel_err(out["pallas"],
                                                                              out["reference"]))
    for impl in ("pallas", "reference"):
        _time(f"8 layers x 4 matmuls, {impl}", _chain(impl), (h, ws))
    n, e = _randn(8, (D,), jnp.bfloat16) + 1.0, _randn(9, (V, D), jnp.bfloat16)
    for impl in ("pallas", "reference"):
        _time(f"final rms + unembedding V={V}, {impl}", _unembed(impl), (h, n, e))


def sweep():
    h = _randn(7, (B, D), jnp.bfloat16)
    ws = _layer_weights()
    for bn in (32, 64):
        for bk in (128, 256):
            for fill in (2, 4, 8):        # programs per multiprocessor the splits aim at
                for warps in (2, 4):
                    blk = LinearBlocks(block_n=bn, block_k=bk, num_warps=warps,
                                       programs_per_sm=fill)
                    T.guarded("layers", "sweep", str(blk), lambda: T.record(
                        "layers", f"bn={bn} bk={bk} fill={fill} warps={warps}", "pallas",
                        T.bench(_chain("pallas", blk), [(h, ws)], reps=50, repeats=5,
                                warmup=2)))
    n, e = _randn(8, (D,), jnp.bfloat16) + 1.0, _randn(9, (V, D), jnp.bfloat16)
    for bn in (32, 128):
        for bk in (128, 256):
            blk = LinearBlocks(block_n=bn, block_k=bk, k_splits=1)
            T.guarded("layers", "unembed sweep", str(blk), lambda: T.record(
                "layers", f"unembed bn={bn} bk={bk}", "pallas",
                T.bench(_unembed("pallas", blk), [(h, n, e)], reps=50, repeats=5, warmup=2)))


def all_():
    check()
    layers()
    sweep()


if __name__ == "__main__":
    T.commands({"check": check, "layers": layers, "sweep": sweep, "all": all_})
