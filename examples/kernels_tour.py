"""A tour of every jaxfuse op: run the Pallas kernel and the jax.numpy reference on random
inputs, and print a table of op, shape, dtype, max error and the time of each.

    python examples/kernels_tour.py

On a CPU the kernels run in Pallas interpret mode (slow by design: it is for learning and
testing); on an NVIDIA GPU they compile through Triton.
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxfuse


def _time(f, *args) -> tuple[jax.Array, float]:
    out = jax.block_until_ready(f(*args))  # compile
    t0 = time.perf_counter()
    out = jax.block_until_ready(f(*args))
    return out, time.perf_counter() - t0


def _cases():
    k = jax.random.split(jax.random.key(0), 12)
    x = jax.random.normal(k[0], (64, 1000), jnp.float32) * 3
    w = jax.random.normal(k[1], (1000,))
    b = jax.random.normal(k[2], (1000,))
    labels = jax.random.randint(k[3], (64,), 0, 1000)
    s = jax.random.normal(k[4], (2, 4, 100, 100), jnp.bfloat16)
    yield "softmax (causal)", s, lambda impl: jax.jit(
        lambda s: jaxfuse.softmax(s, scale=0.125, causal=True, impl=impl)), (s,)
    yield "layer_norm", x, lambda impl: jax.jit(
        lambda x, w, b: jaxfuse.layer_norm(x, w, b, impl=impl)), (x, w, b)
    yield "rms_norm", x, lambda impl: jax.jit(lambda x, w: jaxfuse.rms_norm(x, w, impl=impl)), (x, w)
    yield "cross_entropy (a=0.1)", x, lambda impl: jax.jit(
        lambda x: jaxfuse.cross_entropy(x, labels, label_smoothing=0.1, impl=impl)), (x,)
    yield from _extra_cases(k)


def _extra_cases(k):
    """Ops added by later issues; each appears once its module exists."""
    if hasattr(jaxfuse, "flash_attention"):
        q = jax.random.normal(k[5], (2, 128, 4, 64), jnp.bfloat16)
        kv = jax.random.normal(k[6], (2, 128, 2, 64), jnp.bfloat16)
        yield "flash_attention (causal, GQA)", q, lambda impl: jax.jit(
            lambda q, kk, v: jaxfuse.flash_attention(q, kk, v, causal=True, impl=impl)), (q, kv, kv)
    if hasattr(jaxfuse, "decode_attention"):
        q = jax.random.normal(k[7], (3, 8, 64), jnp.bfloat16)
        kc = jax.random.normal(k[8], (3, 300, 2, 64), jnp.bfloat16)
        lens = jnp.array([0, 17, 300], jnp.int32)
        yield "decode_attention (ragged)", q, lambda impl: jax.jit(
            lambda q, kc, lens: jaxfuse.decode_attention(q, kc, kc, lens, impl=impl)), (q, kc, lens)
    if hasattr(jaxfuse, "linear_cross_entropy"):
        h = jax.random.normal(k[9], (256, 64), jnp.float32)
        wv = jax.random.normal(k[10], (64, 5000), jnp.float32) * 0.1
        lab = jax.random.randint(k[11], (256,), 0, 5000)
        yield "linear_cross_entropy", h, lambda impl: jax.jit(
            lambda h, wv: jaxfuse.linear_cross_entropy(h, wv, lab, impl=impl)), (h, wv)
    if hasattr(jaxfuse, "beam_top_k"):
        lp = jax.nn.log_softmax(jax.random.normal(k[9], (4, 5, 1000)))
        sc = jax.random.normal(k[10], (4, 5))
        yield "beam_top_k (HARS)", lp, lambda impl: jax.jit(
            lambda lp, sc: jaxfuse.beam_top_k(lp, sc, 5, impl=impl)), (lp, sc)
    if hasattr(jaxfuse, "reorder_beams"):
        cache = jax.random.normal(k[11], (4, 5, 64, 2, 32), jnp.bfloat16)
        parent = jax.random.randint(k[9], (4, 5), 0, 5)
        start, stop = jnp.array([3, 3, 10, 0]), jnp.array([9, 20, 11, 64])
        yield "reorder_beams", cache, lambda impl: jax.jit(
            lambda c: jaxfuse.reorder_beams((c,), parent, start, stop, impl=impl)), (cache,)
    if hasattr(jaxfuse, "embedding"):
        yield from _block_cases(k)


def _block_cases(k):
    """The Transformer-block ops (issue 15); dropout masks are the same bits in both impls."""
    x = jax.random.normal(k[0], (64, 512), jnp.bfloat16)
    b = jax.random.normal(k[1], (512,), jnp.bfloat16)
    key = jax.random.key(1)
    yield "dropout (p=0.1)", x, lambda impl: jax.jit(
        lambda x: jaxfuse.dropout(x, 0.1, key, impl=impl)), (x,)
    yield "bias_dropout_add (p=0.1)", x, lambda impl: jax.jit(
        lambda x, b: jaxfuse.bias_dropout_add(x, b, x, rate=0.1, key=key, impl=impl)), (x, b)
    yield "bias_act_dropout (gelu, p=0.1)", x, lambda impl: jax.jit(
        lambda x, b: jaxfuse.bias_act_dropout(x, b, rate=0.1, key=key, impl=impl)), (x, b)
    yield "add_norm (rms)", x, lambda impl: jax.jit(
        lambda x, b: jaxfuse.add_norm(x, x, b, impl=impl)), (x, b)
    yield "swiglu", x, lambda impl: jax.jit(lambda x: jaxfuse.swiglu(x, x, impl=impl)), (x,)
    w = (jax.random.normal(k[5], (512, 128)) / 24).astype(jnp.bfloat16)
    yield "add_norm_linear (rms, 2 projections)", x, lambda impl: jax.jit(
        lambda x, b, w: jaxfuse.add_norm_linear(x, x, b, projections=(w, w), impl=impl)), (x, b, w)
    yield "swiglu_linear", x, lambda impl: jax.jit(
        lambda x, w: jaxfuse.swiglu_linear(x, x, w, impl=impl)), (x, w)
    q = jax.random.normal(k[2], (2, 64, 4, 64), jnp.bfloat16)
    pos = jnp.broadcast_to(jnp.arange(64), (2, 64))
    yield "rope (interleaved)", q, lambda impl: jax.jit(
        lambda q: jaxfuse.rope(q, pos, impl=impl)), (q,)
    table = jax.random.normal(k[3], (1000, 512), jnp.bfloat16)
    tok = jax.random.randint(k[4], (2, 32), 0, 1000)
    yield "embedding (p=0.1)", table, lambda impl: jax.jit(
        lambda t: jaxfuse.embedding(tok, t, scale=2.0, rate=0.1, key=key, impl=impl)), (table,)


def main() -> None:
    print(f"jax {jax.__version__} on {jax.default_backend()}; "
          f"{'interpret mode' if jax.default_backend() == 'cpu' else 'compiled'}")
    header = f"{'op':32s} {'shape':20s} {'dtype':9s} {'max |err|':>10s} {'pallas ms':>10s} {'ref ms':>9s}"
    print(header)
    print("-" * len(header))
    for name, x, make, args in _cases():
        out, t_p = _time(make("pallas"), *args)
        ref, t_r = _time(make("reference"), *args)
        err = max(float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))
                  for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)))
        print(f"{name:32s} {str(tuple(x.shape)):20s} {jnp.dtype(x.dtype).name:9s} {err:10.2e} "
              f"{t_p * 1e3:10.2f} {t_r * 1e3:9.2f}")


if __name__ == "__main__":
    main()
