"""GPU check and benchmark of split-KV decoding attention (`jaxfuse.decode_attention`).

Effective bandwidth = bytes of K and V that must be read (the tokens present) / time.
Peers: XLA (the reference under jit, and a plain einsum-softmax without ragged masking) and JAX's
Pallas `decode_attention.gqa`. Also times half-full ragged caches against full ones.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import jaxfuse
from jaxfuse import DecodeBlocks
from benchmarks._timing import bench, guarded, record, rel_err

S = "decode"


def _inputs(key, b, s, hq, hkv, d, dtype=jnp.bfloat16):
    k = jax.random.split(key, 3)
    return (jax.random.normal(k[0], (b, hq, d), dtype),
            jax.random.normal(k[1], (b, s, hkv, d), dtype),
            jax.random.normal(k[2], (b, s, hkv, d), dtype))


def check():
    for dtype in (jnp.bfloat16, jnp.float32):
        for (b, s, hq, hkv, d) in [(4, 1000, 32, 32, 128), (3, 4097, 32, 8, 128),
                                   (2, 777, 16, 1, 64), (5, 300, 8, 2, 80)]:
            for ns in (None, 1, 3, 7):
                name = f"check B{b} S{s} Hq{hq} Hkv{hkv} D{d} splits={ns}"

                def run(b=b, s=s, hq=hq, hkv=hkv, d=d, ns=ns, name=name):
                    q, kc, vc = _inputs(jax.random.key(s), b, s, hq, hkv, d, dtype)
                    lengths = jax.random.randint(jax.random.key(1), (b,), 0, s + 1).at[0].set(0)
                    lengths = lengths.at[-1].set(s)
                    beyond = jnp.arange(s)[None, :, None, None] >= lengths[:, None, None, None]
                    kc = jnp.where(beyond, jnp.nan, kc)
                    vc = jnp.where(beyond, jnp.inf, vc)
                    o = jax.jit(lambda *a: jaxfuse.decode_attention(*a, num_splits=ns))(
                        q, kc, vc, lengths)
                    with jax.default_matmul_precision("highest"):
                        ref = jax.jit(lambda *a: jaxfuse.decode_attention(*a, impl="reference"))(
                            *[x.astype(jnp.float32) for x in (q, kc, vc)], lengths)
                    err = rel_err(o, ref)
                    ok = err < (2e-2 if dtype == jnp.bfloat16 else 2e-3) and \
                        not bool(jnp.isnan(o.astype(jnp.float32)).any())
                    record(S, name, jnp.dtype(dtype).name, max_rel_err=err,
                           status="ok" if ok else "FAIL")
                guarded(S, name, jnp.dtype(dtype).name, run)


def _plain_xla(q, kc, vc, lengths):
    b, hq, d = q.shape
    hkv = kc.shape[2]
    qg = q.reshape(b, hkv, hq // hkv, d)
    s = jnp.einsum("bhgd,bshd->bhgs", qg, kc, preferred_element_type=jnp.float32) * d ** -0.5
    s = jnp.where(jnp.arange(kc.shape[1])[None, None, None] < lengths[:, None, None, None], s,
                  -jnp.inf)
    p = jax.nn.softmax(s, axis=-1).astype(q.dtype)
    return jnp.einsum("bhgs,bshd->bhgd", p, vc).reshape(b, hq, d)


def perf(copy_bw: float, sweep: bool = True):
    rows = [("MHA B8 H32 S32768 D128", (8, 32768, 32, 32, 128)),
            ("GQA B8 Hq32 Hkv8 S32768 D128", (8, 32768, 32, 8, 128)),
            ("GQA B1 Hq32 Hkv8 S131072 D128", (1, 131072, 32, 8, 128))]
    for label, (b, s, hq, hkv, d) in rows:
        sets = [_inputs(jax.random.key(10 + i), b, s, hq, hkv, d) for i in range(2)]
        for fill in ("full", "half"):
            lengths = jnp.full((b,), s if fill == "full" else s // 2, jnp.int32)
            nbytes = 2 * b * int(lengths[0]) * hkv * d * 2
            fns = {"jaxfuse": lambda q, kc, vc, n: jaxfuse.decode_attention(q, kc, vc, n)}
            if fill == "full":
                fns["xla_reference"] = lambda q, kc, vc, n: jaxfuse.decode_attention(
                    q, kc, vc, n, impl="reference")
                fns["xla_plain"] = _plain_xla
                try:
                    from jax.experimental.pallas.ops.gpu import decode_attention as jdec
                    fns["jax_pallas_gqa"] = lambda q, kc, vc, n: jdec.gqa(q, kc, vc, kv_seq_len=n)
                except Exception as e:  # noqa: BLE001
                    record(S, "peer import", "jax_pallas_gqa", error=str(e)[:100])
                if sweep:
                    for bk, w, st in [(64, 4, 3), (128, 4, 4), (128, 8, 3), (256, 8, 3),
                                      (64, 4, 5)]:
                        blk = DecodeBlocks(block_k=bk, num_warps=w, num_stages=st)
                        fns[f"jaxfuse[k{bk},w{w},s{st}]"] = functools.partial(
                            lambda q, kc, vc, n, blk: jaxfuse.decode_attention(
                                q, kc, vc, n, block_sizes=blk), blk=blk)
            for impl, f in fns.items():
                def run(f=f, impl=impl):
                    t = bench(jax.jit(f), [(*x, lengths) for x in sets], reps=20)
                    record(S, f"{label} {fill}", impl, t, TBps=nbytes / t / 1e12,
                           frac_copy=nbytes / t / copy_bw)
                guarded(S, f"{label} {fill}", impl, run)
