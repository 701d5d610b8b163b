"""The one dropout generator: Philox-4x32-10 (Salmon, Moraes, Dror and Shaw, "Parallel random
numbers: as easy as 1, 2, 3", SC 2011), written once in uint32 arithmetic that runs unchanged in
jax.numpy (the references), in a Pallas kernel in interpret mode, and compiled through Triton.

A counter-based generator is a pure function of (key, counter): a kernel can compute the bits of
any element from its index alone, so no mask is ever stored and a backward kernel regenerates the
forward's mask (LightSeq generates its masks in-kernel with cuRAND's Philox, lecture 10 sec. 2.3).

The mask of a `[rows, cols]` view (every op flattens its leading axes into rows) is defined per
element, independently of any tiling:

    q = cdiv(cols, 4);  counter = (col mod q, row, stream, 0);  word = col // q
    bits = philox4x32_10(counter, key)[word];  keep = (bits >> 8) < round((1 - rate) * 2^24)

so one Philox call feeds four elements, a quarter of a row apart (a kernel that loads the four
quarters of a row together computes each call once; one that does not computes it per element
and keeps its word: the same bits either way). `stream` separates the masks of different tensors
under one key (attention's heads). `key` words come from `jax.random.key_data`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# Random123's constants: the multipliers and the Weyl key increments (golden ratio, sqrt(3) - 1).
M0, M1 = np.uint32(0xD2511F53), np.uint32(0xCD9E8D57)
W0, W1 = np.uint32(0x9E3779B9), np.uint32(0xBB67AE85)
ROUNDS = 10
KEEP_BITS = 24            # keep iff the top 24 bits of a word fall below the threshold


def mulhi_u32(a, b):
    """The high 32 bits of the 64-bit product of uint32 a and b, from 16-bit halves (exact, in
    uint32 arithmetic). `lax.mulhi` does it in one op, but jax 0.10.2 cannot lower it inside a
    computation XLA partitions (a sharded jit: "failed to legalize operation 'mhlo.unknown'"),
    which is where the references run on a mesh."""
    a, b = jnp.asarray(a, jnp.uint32), jnp.asarray(b, jnp.uint32)
    lo16 = np.uint32(0xFFFF)
    a_lo, a_hi, b_lo, b_hi = a & lo16, a >> 16, b & lo16, b >> 16
    hi_lo = a_hi * b_lo
    cross = ((a_lo * b_lo) >> 16) + (hi_lo & lo16) + a_lo * b_hi      # < 2^32: no overflow
    return a_hi * b_hi + (hi_lo >> 16) + (cross >> 16)


def philox4x32(ctr, key, *, rounds: int = ROUNDS, mulhi=mulhi_u32):
    """Philox-4x32-`rounds` of a 4-word counter under a 2-word key (uint32 arrays that broadcast).

    `mulhi(a, b)`: the high 32 bits of the 64-bit product; `mulhi_u32` in jax.numpy,
    `lax.mulhi` in interpret mode, a one-instruction `mul.hi.u32` in a compiled Triton kernel (`pallas._rng`).
    """
    # One shape for all four words: a constant word (the stream) must still be a tile in a kernel.
    c0, c1, c2, c3 = jnp.broadcast_arrays(*(jnp.asarray(c, jnp.uint32) for c in ctr))
    k0, k1 = (jnp.asarray(k, jnp.uint32) for k in key)
    for r in range(rounds):
        if r:
            k0, k1 = k0 + W0, k1 + W1
        hi0, lo0 = mulhi(M0, c0), M0 * c0
        hi1, lo1 = mulhi(M1, c2), M1 * c2
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def key_words(key) -> jax.Array:
    """The two uint32 Philox key words of a JAX PRNG key (typed `jax.random.key` or a legacy
    uint32 key), as a uint32 [2] array; a key of another size is hashed down to two words."""
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(key)
    data = jax.random.key_data(key).reshape(-1)
    if data.shape[0] == 2 and data.dtype == jnp.uint32:
        return data
    return jax.random.bits(key, (2,), jnp.uint32)


def threshold(rate: float) -> int:
    """keep iff (bits >> 8) < threshold: P(keep) = threshold / 2^24 = 1 - rate up to 2^-25."""
    return int(round((1.0 - float(rate)) * (1 << KEEP_BITS)))


def keep(key_w, rows, cols, n_cols: int, rate: float, *, stream=0, mulhi=mulhi_u32):
    """The keep-mask (bool) of elements (rows, cols) of a [*, n_cols] view: int32 index arrays
    that broadcast; `key_w` the two words of `key_words` (each may be a [1] array in a kernel)."""
    q = -(-n_cols // 4)
    word = cols // q
    ctr = ((cols - word * q).astype(jnp.uint32), rows.astype(jnp.uint32),
           jnp.asarray(stream).astype(jnp.uint32), np.uint32(0))
    w = philox4x32(ctr, (key_w[0], key_w[1]), mulhi=mulhi)
    return keep_bits(jnp.where(word == 0, w[0], jnp.where(word == 1, w[1],
                                                          jnp.where(word == 2, w[2], w[3]))), rate)


def keep_bits(bits, rate: float):
    """keep iff the top 24 bits of the element's Philox word fall below `threshold(rate)`."""
    return (bits >> np.uint32(32 - KEEP_BITS)).astype(jnp.int32) < threshold(rate)


def check_rate(rate) -> None:
    if not isinstance(rate, (int, float, np.integer, np.floating)) or not 0.0 <= rate < 1.0:
        raise ValueError(f"rate={rate!r} must be a Python number in [0, 1) (0 = no dropout)")


def active(rate, key) -> bool:
    """Whether dropout does anything (rate > 0 and a key given); validates `rate` first."""
    check_rate(rate)
    return key is not None and float(rate) > 0.0
