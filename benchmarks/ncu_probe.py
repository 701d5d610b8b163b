"""Workloads for Nsight Compute (diagnostic, GPU): each section runs one kernel a few times so
that `ncu` can read its hardware counters (the device's Firecracker runtime lets it; the jax
profiler gives durations only). XLA's command buffers are off so every launch is a plain kernel
launch that ncu can replay; ncu flushes the caches before each replay, so the counters are those
of a cold call, as in a decoding step (the cache and weights do not stay in L2). JAX's memory
preallocation is off: ncu saves and restores every allocated byte around each replay, and with
the default 75% of the GPU's memory allocated one kernel's 34 passes took over a minute.

    ncu --clock-control none -k regex:decode_attention --section SpeedOfLight ... \\
        python benchmarks/ncu_probe.py decode_attention

Sections: decode_attention (the 157M model's decoding shape: B32, 528 of 768 cached keys, 16
query and 4 KV heads of 64, bf16; plain, then with the model's packed append), dropout (the
forward at [16384, 4096] bf16, rate 0.1), attention (the Hopper forward, B4 H32 T4096 D128
bf16, full), block (bias_act_dropout with gelu, add_norm, bias_dropout_add and embedding at issue
15's shapes, forward and backward), attention_bwd_d64 (the 1B model's attention backward: the
kernel pair's dK/dV kernel and the fused dQ's), attention_fwd_d64 (the 1B model's attention
forward, today's and the tree's before a change).
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_gpu_enable_command_buffer=").strip()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxfuse  # noqa: E402


def decode_attention(reps: int = 3):
    b, s, n, hq, hkv, d = 32, 768, 528, 16, 4, 64
    ks = jax.random.split(jax.random.key(3), 4)
    q = jax.random.normal(ks[0], (b, hq + 2 * hkv, d), jnp.bfloat16)
    kc = jax.random.normal(ks[1], (b, s, hkv, d), jnp.bfloat16)
    vc = jax.random.normal(ks[2], (b, s, hkv, d), jnp.bfloat16)
    lengths = jnp.full((b,), n, jnp.int32)
    plain = jax.jit(lambda q, k, v, n: jaxfuse.decode_attention(q[:, :hq], k, v, n))
    packed = jax.jit(lambda q, k, v, n: jaxfuse.decode_attention(q, k, v, n, packed_qkv=True),
                     donate_argnums=(1, 2))
    for _ in range(reps):
        jax.block_until_ready(plain(q, kc, vc, lengths))
    for _ in range(reps):
        o, kc, vc = packed(q, kc, vc, lengths)
        jax.block_until_ready(o)


def attention(reps: int = 2):
    ks = jax.random.split(jax.random.key(5), 3)
    q, k, v = (jax.random.normal(kk, (4, 4096, 32, 128), jnp.bfloat16) for kk in ks)
    f = jax.jit(jaxfuse.flash_attention)
    for _ in range(reps):
        jax.block_until_ready(f(q, k, v))


def dropout(reps: int = 3):
    x = jax.random.normal(jax.random.key(0), (16384, 4096), jnp.bfloat16)
    f = jax.jit(lambda x, k: jaxfuse.dropout(x, 0.1, k))
    for i in range(reps):
        jax.block_until_ready(f(x, jax.random.key(i)))


def block(reps: int = 2):
    """The other block kernels at issue 15's shapes, forward and backward (dropout 0.1)."""
    ks = jax.random.split(jax.random.key(1), 4)
    x, r = (jax.random.normal(k, (16384, 4096), jnp.bfloat16) for k in ks[:2])
    b = jax.random.normal(ks[2], (4096,), jnp.bfloat16)
    tok = jax.random.randint(ks[3], (8, 2048), 0, 128256)
    table = jax.random.normal(ks[3], (128256, 4096), jnp.bfloat16)
    kw = dict(rate=0.1, key=jax.random.key(7))
    grad = lambda f: jax.jit(jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)),
                                      argnums=(0, 1)))
    fs = [(grad(lambda x, _: jaxfuse.bias_act_dropout(x, b, activation="gelu", **kw)), (x, r)),
          (grad(lambda x, r: jaxfuse.add_norm(x, r, b, **kw)[1]), (x, r)),
          (grad(lambda x, r: jaxfuse.bias_dropout_add(x, b, r, **kw)), (x, r)),
          (grad(lambda t, _: jaxfuse.embedding(tok, t, scale=64.0, **kw)), (table, b))]
    for f, args in fs:
        for _ in range(reps):
            jax.block_until_ready(f(*args))


def attention_bwd_d64(reps: int = 1):
    """The 1B model's attention backward (B2 Hq32 Hkv8 T8192 D64 causal, bf16): the kernel
    pair's dK/dV kernel (deterministic) and the fused dQ's kernel (deterministic=False), whose
    5 products take ~1.4x the time of the pair's 4 although its reducing stores cost nothing
    measurable (NOTES s41 item 4): their stall reasons and tensor-pipe use side by side."""
    ks = jax.random.split(jax.random.key(2), 4)
    q, do = (jax.random.normal(kk, (2, 8192, 32, 64), jnp.bfloat16) for kk in ks[:2])
    k, v = (jax.random.normal(kk, (2, 8192, 8, 64), jnp.bfloat16) for kk in ks[2:])
    for det in (True, False):
        def fwd_bwd(q, k, v, do, det=det):
            f = lambda q, k, v: jaxfuse.flash_attention(q, k, v, causal=True,  # noqa: E731
                                                        deterministic=det)
            return jax.vjp(f, q, k, v)[1](do)
        step = jax.jit(fwd_bwd)
        for _ in range(reps):
            jax.block_until_ready(step(q, k, v, do))


def attention_fwd_d64(reps: int = 1):
    """The 1B model's attention forward (B2 Hq32 Hkv8 T8192 D64 causal, bf16), today's kernel
    and then, where the tree before a change is importable as `jaxfuse_base` (`smoke/_lib.sh`
    `renamed_base`), its kernel: the two launches in that order, under the same kernel name.
    s53: exp2((u - m) c2) in place of one FMA cost this forward 22% (NOTES s53 item 5); which
    pipe, which stall, how many registers."""
    ks = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(ks[0], (2, 8192, 32, 64), jnp.bfloat16)
    k, v = (jax.random.normal(kk, (2, 8192, 8, 64), jnp.bfloat16) for kk in ks[1:])
    libs = [jaxfuse]
    try:
        import jaxfuse_base
        libs.append(jaxfuse_base)
    except ImportError:
        pass
    for lib in libs:
        f = jax.jit(lambda q, k, v, lib=lib: lib.flash_attention(q, k, v, causal=True))
        for _ in range(reps):
            jax.block_until_ready(f(q, k, v))


SECTIONS = {"decode_attention": decode_attention, "dropout": dropout, "attention": attention,
            "block": block, "attention_bwd_d64": attention_bwd_d64,
            "attention_fwd_d64": attention_fwd_d64}

if __name__ == "__main__":
    print("device", jax.devices()[0].device_kind, "jax", jax.__version__, flush=True)
    for name in sys.argv[1:] or list(SECTIONS):
        SECTIONS[name]()
