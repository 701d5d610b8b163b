"""The one dropout generator: Philox-4x32-10 (Salmon, Moraes, Dror and Shaw, "Parallel random
numbers: as easy as 1, 2, 3", SC 2011), written once in uint32 arithmetic that runs unchanged in
jax.numpy (the references), in a Pallas kernel in interpret mode, and compiled through Triton.

A counter-based generator is a pure function of (key, counter): a kernel can compute the bits of
any element from its index alone, so no mask is ever stored and a backward kernel regenerates the
forward's mask (LightSeq generates its masks in-kernel with cuRAND's Philox, lecture 10 sec. 2.3).

The mask of a `[rows, cols]` view (every op flattens its leading axes into rows) is defined per
element, independently of any tiling: one Philox call feeds GROUP = 8 elements of a row, each
taking 16 of the call's 128 bits. In every block of 32 columns, call p (p < 4) feeds the column
pairs (2p, 2p + 1) of the four 8-column slices, word k the pair of slice k, the low half the even
column:

    counter = (4 * (col // 32) + (col % 8) // 2, row, stream, 0);  words = philox4x32_10(counter, key)
    u = (words[(col % 32) // 8] >> (16 * (col % 2))) & 0xFFFF
    keep = u < t,   t = round((1 - rate) * 2^16)

This odd-looking order is the register layout of a tensor-core matmul's result: mma.sync (m16n8)
and wgmma both give a thread 2 adjacent columns of every 8-column slice, so a thread holding its
columns of 32 computes exactly its own calls, and attention drops P where P lives (a mask in plain
column order had to cross to that layout through shared memory: 16 KiB more per 128 x 128 tile,
and more instructions than the generator). A kernel that holds whole 32-column blocks makes one
call per 8 elements and moves its words into column order with joins and a transpose
(`keep_block`); one that does not computes the call per element and keeps its half (`keep`):
the same bits either way.
Per element that is 1/8 of a Philox call (~10 integer instructions) instead of a whole one (~80):
on an H200, a whole call per element of attention's P cost 2.5x the attention itself.

A kept element is scaled by 2^16 / t, the inverse of the keep probability actually used, so
dropout stays unbiased (E[out] = x exactly) although the keep probability t / 2^16 is 1 - rate
rounded to a multiple of 2^-16 (off by at most 2^-17; a rate that rounds to keep probability 0
raises ValueError). FlashAttention-2 draws 8-bit slices (16 elements per call, the rate quantized
to 1/256); 16 bits keep the quantization far below what a test of 10^6 elements can see
(5 sigma ~ 1.5e-3 at rate 0.1, against 1.6e-3 for 8 bits at that rate). `stream` separates the
masks of different tensors under one key. `key` words come from `jax.random.key_data`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# Random123's constants: the multipliers and the Weyl key increments (golden ratio, sqrt(3) - 1).
M0, M1 = np.uint32(0xD2511F53), np.uint32(0xCD9E8D57)
W0, W1 = np.uint32(0x9E3779B9), np.uint32(0xBB67AE85)
ROUNDS = 10
KEEP_BITS = 16            # bits per element: a Philox call's 128 bits feed GROUP elements
GROUP = 128 // KEEP_BITS  # elements of a row that share one call
BLOCK = 4 * GROUP         # columns over which a call's elements are spread (pairs, 8 apart)


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
    `lax.mulhi` in interpret mode, a one-instruction `mul.hi.u32` in a compiled Triton kernel
    (`pallas._rng`).
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
    """keep iff an element's 16 bits are < threshold: P(keep) = threshold / 2^16, the nearest
    multiple of 2^-16 to 1 - rate."""
    return int(round((1.0 - float(rate)) * (1 << KEEP_BITS)))


def keep_prob(rate: float) -> float:
    """The keep probability the mask has: 1 - rate rounded to a multiple of 2^-16."""
    return threshold(rate) / float(1 << KEEP_BITS)


def scale(rate: float) -> float:
    """What a kept element is multiplied by: 1 / keep_prob(rate) (unbiased inverted dropout)."""
    return float(1 << KEEP_BITS) / threshold(rate)


def keep(key_w, rows, cols, rate: float, *, stream=0, mulhi=mulhi_u32):
    """The keep-mask (bool) of elements (rows, cols), any int32 index arrays that broadcast
    (one Philox call per element, keeping its 16 bits); `key_w` the two words of `key_words`."""
    rows, cols = jnp.broadcast_arrays(jnp.asarray(rows, jnp.int32), jnp.asarray(cols, jnp.int32))
    call = 4 * (cols // BLOCK) + (cols % 8) // 2
    ctr = (call.astype(jnp.uint32), rows.astype(jnp.uint32),
           jnp.asarray(stream).astype(jnp.uint32), np.uint32(0))
    words = philox4x32(ctr, (key_w[0], key_w[1]), mulhi=mulhi)
    k = (cols % BLOCK) // 8
    w = jnp.where(k < 2, jnp.where(k == 0, words[0], words[1]),
                  jnp.where(k == 2, words[2], words[3]))
    u = (w >> (np.uint32(KEEP_BITS) * (cols % 2).astype(jnp.uint32))) & np.uint32(0xFFFF)
    return u.astype(jnp.int32) < threshold(rate)


def join_last(a, b):
    """[..., n] x 2 -> [..., n, 2] (`tt.join` in Pallas's Triton lowering)."""
    return jnp.concatenate([a.reshape(a.shape + (1,)), b.reshape(b.shape + (1,))], axis=-1)


def keep_block(key_w, rows, col0, n_cols: int, rate: float, *, stream=0, mulhi=mulhi_u32):
    """The keep-mask (bool [..., br, n_cols]) of columns col0 .. col0 + n_cols - 1 of rows `rows`
    (int32 [..., br, 1]), one Philox call per GROUP elements. `col0` (int, maybe traced) and
    `n_cols` (static) must be multiples of BLOCK; the same bits as `keep`."""
    assert n_cols % BLOCK == 0, n_cols
    rows = jnp.asarray(rows, jnp.int32)
    lead, n = rows.shape[:-1], n_cols // GROUP        # n calls, 4 per block of 32 columns
    shape = lead + (n,)
    calls = col0 // GROUP + lax.broadcasted_iota(jnp.int32, shape, len(shape) - 1)
    ctr = (calls.astype(jnp.uint32), jnp.broadcast_to(rows, shape).astype(jnp.uint32),
           jnp.asarray(stream).astype(jnp.uint32), np.uint32(0))
    words = philox4x32(ctr, (key_w[0], key_w[1]), mulhi=mulhi)
    # The words move into column order as 32-bit words, before any comparison: joined, [...,
    # n, b, a] with word k = 2a + b, then [..., blocks, a, b, p] (call 4 * block + p) is
    # column 32 block + 8k + 2p + h for the two halves h (a trailing axis, compared in
    # place). A compiled row kernel holds 8 contiguous columns a thread, so the four calls of a
    # block meet there in one exchange of words through shared memory; moving the eight
    # booleans of each call instead (comparisons first, then joins and the transpose) took
    # Triton five byte-wise exchanges, and the row kernels were bound by the integer ALU (ncu
    # on an H200, dropout's forward: ALU 79% busy; its SASS 736 instructions, 544 now).
    w = join_last(join_last(words[0], words[1]),
                  join_last(words[2], words[3]))                        # [..., n, b, a]
    nd = len(lead)
    w = jnp.transpose(w.reshape(lead + (n // 4, 4, 2, 2)),                 # [..., blocks, p, b, a]
                      tuple(range(nd + 1)) + (nd + 3, nd + 2, nd + 1))     # [..., blocks, a, b, p]
    lo, hi = _keep_halves(w.reshape(lead + (n // 4, 4, 4, 1)), threshold(rate))
    half = lax.broadcasted_iota(jnp.int32, (1,) * (nd + 3) + (2,), nd + 3)
    return jnp.where(half == 0, lo, hi).reshape(lead + (n_cols,))


def _keep_halves(w, t: int):
    """(low half < t, high half < t) of uint32 words; the high half compares the whole word
    against t * 2^16, one instruction fewer than shifting it down."""
    lo = (w & np.uint32(0xFFFF)).astype(jnp.int32) < t
    if t >= 1 << KEEP_BITS:
        return lo, jnp.full(w.shape, True)
    return lo, w < np.uint32(t << KEEP_BITS)


def check_rate(rate) -> None:
    if not isinstance(rate, (int, float, np.integer, np.floating)) or not 0.0 <= rate < 1.0:
        raise ValueError(f"rate={rate!r} must be a Python number in [0, 1) (0 = no dropout)")
    if rate and threshold(rate) == 0:
        raise ValueError(f"rate={rate!r} rounds to keep probability 0 at the mask's resolution "
                         f"of 2^-{KEEP_BITS}: use a rate <= 1 - 2^-{KEEP_BITS}")


def active(rate, key) -> bool:
    """Whether dropout does anything (rate > 0 and a key given); validates `rate` first."""
    check_rate(rate)
    return key is not None and float(rate) > 0.0
