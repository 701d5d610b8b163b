"""The small ops of a decoding step on the GPU (diagnostic), timed as kernel time from the
profiler: jaxfuse.rope at decoding shapes (B=32 tokens, one position each) and at the training
shapes, across tiles, against the same rotation written in jax.numpy under jax.jit; and
beam_top_k (HARS) against lax.top_k at beam search's shapes: time, and bitwise agreement on
random, tied and NaN input (with how lax.top_k orders NaN, +-inf and +-0 on this backend).

    PYTHONPATH=. python benchmarks/decode_probe.py
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxfuse  # noqa: E402
from jaxfuse.pallas._rows import RowBlocks  # noqa: E402


def beam_top_k():
    for b, k, v in ((8, 4, 32768), (8, 4, 128256), (32, 8, 50257)):
        lp = jax.nn.log_softmax(jax.random.normal(jax.random.key(1), (b, k, v)) * 3, -1)
        sc = jax.random.normal(jax.random.key(2), (b, k))
        ties = jnp.round(lp * 2) / 2
        nan = lp.at[:, :, ::97].set(jnp.nan).at[:, :, 5::101].set(jnp.inf).at[:, 0, 7].set(-0.0)
        ours = jax.jit(lambda x, s: jaxfuse.beam_top_k(x, s, k))
        ref = jax.jit(lambda x, s: jaxfuse.beam_top_k(x, s, k, impl="reference"))
        for name, x in (("random", lp), ("ties", ties), ("nan/inf", nan)):
            a, r = ours(x, sc), ref(x, sc)
            same = all(bool(jnp.array_equal(p, q, equal_nan=True)) for p, q in zip(a, r))
            print(f"beam_top_k B{b} K{k} V{v} {name:8s} bitwise equal to lax.top_k: {same}")
            if not same:
                row = int(jnp.argmax(jnp.any(a[2] != r[2], axis=1) | jnp.any(a[1] != r[1], 1)))
                print("   first row that differs:", row, "ours", a[0][row], a[1][row], a[2][row],
                      "lax.top_k", r[0][row], r[1][row], r[2][row])
        for name, f in (("pallas", ours), ("lax.top_k", ref)):
            print(f"beam_top_k B{b} K{k} V{v} {name:10s} {kernel_us(f, (lp, sc)):8.2f} us "
                  "of kernels")


def kernel_us(f, args) -> float:
    """GPU kernel time of one call (profiler trace), in microseconds: small kernels hide under
    the ~35 us a jitted call costs on the host, so wall-clock timing cannot rank them."""
    from benchmarks._profile import kernel_times
    return sum(ms for _, _, ms in kernel_times(f, args, reps=20)) * 1e3


def top_k_order():
    """How lax.top_k orders the special values on this backend."""
    vals = jnp.array([1.0, jnp.nan, -jnp.nan, jnp.inf, -jnp.inf, -0.0, 0.0, -1.0], jnp.float32)
    s, i = jax.jit(lambda x: jax.lax.top_k(x, 8))(vals)
    bits = jax.lax.bitcast_convert_type(s, jnp.uint32)
    print("lax.top_k order of [1, nan, -nan, inf, -inf, -0, 0, -1]:", [int(j) for j in i],
          [hex(int(b)) for b in bits])


def rope_kernels():
    for shape in ((32, 1, 16, 64), (32, 1, 4, 64), (8, 2048, 16, 64), (8, 2048, 4, 64)):
        x = jax.random.normal(jax.random.key(0), shape, jnp.bfloat16)
        pos = 600 + jnp.broadcast_to(jnp.arange(shape[1]), shape[:2]).astype(jnp.int32)
        rows = [("xla", jax.jit(lambda x, p: jaxfuse.rope(x, p, impl="reference"))),
                ("pallas default", jax.jit(lambda x, p: jaxfuse.rope(x, p)))]
        for br, nw in ((1, 1), (1, 4), (4, 4), (8, 4), (32, 4)):
            if br <= shape[0] * shape[1]:
                blk = RowBlocks(block_rows=br, block_cols=shape[-1], num_warps=nw)
                rows.append((f"pallas rows={br} warps={nw}", jax.jit(
                    lambda x, p, blk=blk: jaxfuse.rope(x, p, block_sizes=blk))))
        for name, f in rows:
            print(f"rope {str(shape):18s} {name:26s} {kernel_us(f, (x, pos)):8.2f} us of kernels")


def main():
    print(f"device={jax.devices()[0].device_kind} jax={jax.__version__}")
    top_k_order()
    beam_top_k()
    rope_kernels()


if __name__ == "__main__":
    main()
