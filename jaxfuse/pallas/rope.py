"""Fused rotary position embedding: angles computed in the kernel (no cos/sin table in memory),
one read and one write of x, the backward the same kernel turning the other way.

x [..., T, H, D] is viewed as [N, H, D] (N tokens). A program rotates a block of tokens, all
heads: it loads the pairs' two halves as two [tokens, H, D/2] tiles - strided loads at columns
0, 2, 4, ... and 1, 3, 5, ... for interleaved pairs, contiguous ones at 0 and D/2 for halves
(one body, the layout is only the (offset, stride) of the second half) - so that the two
elements of a pair meet in the same lane (16-bit interleaved pairs: one 32-bit word per pair,
loaded contiguously and split in registers). The angles depend on (token, pair) only: cos and sin
are computed once per [tokens, D/2] and broadcast over the heads (H times fewer
transcendentals than one angle per element). The two strided loads of float32 pairs read the
same cache lines, so DRAM sees each byte of x once.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jaxfuse import _checks
from jaxfuse.pallas import _common as C
from jaxfuse.pallas import _rows
from jaxfuse.pallas._rows import RowBlocks
from jaxfuse.reference import rope as ref

# Elements of x per program on the GPU. Measured on an H200 (bf16, D=64, 4 warps): 1024 per
# program rotated k [8, 2048, 4, 64] in 7.6 us against 18.9 us with 8192, q [.., 16, 64] in 22.6
# against 26.9 us; a program's strided loads and per-(token, pair) angles are latency-bound,
# so many small programs beat few large ones.
_GPU_TILE_ELEMS = 1024


@dataclasses.dataclass(frozen=True)
class _Static:
    base: float
    interleaved: bool
    tokens: int      # tokens per program
    interpret: bool
    num_warps: int


def _tokens_per_program(n: int, h: int, d: int, interpret: bool,
                        blocks: RowBlocks | None) -> tuple[int, int]:
    if blocks is not None:
        return blocks.block_rows, blocks.num_warps
    if interpret:
        return max(1, min(n, _rows._INTERPRET_TILE_ELEMS // (h * d))), 1
    per_token = C.next_pow2(h) * 2 * C.next_pow2(d // 2)
    bt = max(1, min(C.next_pow2(n), _GPU_TILE_ELEMS // per_token))
    # Few tokens (a decoding step: one per sequence) go one or a few per program, at least one
    # program per SM, so that the call takes one small program's latency, not a big one's.
    bt = min(bt, C.next_pow2(C.cdiv(n, C.num_multiprocessors())))
    return bt, 4


def _load_halves(ref, t0, full, valid, a0: int, b0: int, stride: int, half: int,
                 interpret: bool):
    """The pairs' first and second elements of tokens [t0, +bt) as two float32 [bt, H, D/2]
    tiles. On the GPU two strided loads; Pallas' interpreter has no strided loads, so there the
    whole [bt, H, D] tile is loaded (masked: it pads at the edge) and sliced."""
    bt, hp, w = full
    if interpret:
        t0, z = C.start(t0), C.start(0)     # one index type (jax_enable_x64)
        x = pltriton.load(ref.at[pl.ds(t0, bt), pl.ds(z, hp), pl.ds(z, w)], mask=valid,
                          other=None if valid is None else 0.0).astype(jnp.float32)
        pick = lambda c0: jax.lax.slice_in_dim(x, c0, c0 + stride * (half - 1) + 1, stride, -1)
        return pick(a0), pick(b0)
    load = lambda c0: pltriton.load(ref.at[pl.ds(t0, bt), pl.ds(0, hp), _cols(t0, c0, w, stride)],
                                    mask=valid, other=None if valid is None else 0.0
                                    ).astype(jnp.float32)
    return load(a0), load(b0)


def _cols(t0, c0: int, w: int, stride: int):
    """Columns c0, c0 + stride, ... (w of them). The start is traced (t0 * 0): a power-of-two
    tile of pairs may hang over the row's end (D = 6), which the masked load and store never
    touch but a static start would have refused when the ref is indexed."""
    return pl.ds(c0 + t0 * 0, w, stride)


def _store_halves(ref, t0, valid, a0: int, b0: int, stride: int, ya, yb, interpret: bool):
    """`_load_halves` backwards: ya, yb [bt, H, D/2] written to the pairs' two columns."""
    bt, hp, w = ya.shape
    if interpret:
        y = (jnp.stack([ya, yb], -1).reshape(bt, hp, 2 * w) if stride == 2
             else jnp.concatenate([ya, yb], -1))
        t0, z = C.start(t0), C.start(0)     # as in `_load_halves`
        pltriton.store(ref.at[pl.ds(t0, bt), pl.ds(z, hp), pl.ds(z, 2 * w)],
                       y.astype(ref.dtype), mask=valid)
        return
    for c0, y in ((a0, ya), (b0, yb)):
        pltriton.store(ref.at[pl.ds(t0, bt), pl.ds(0, hp), _cols(t0, c0, w, stride)],
                       y.astype(ref.dtype), mask=valid)


def _load_pairs(ref, t0, full, valid, dtype):
    """Interleaved pairs of a 16-bit x whose pairs are uint32 words (x viewed as [N, H, D/2]
    words): one contiguous load of [bt, H, D/2] words, each split in registers into the pair's
    first element (the low half-word: the arrays are little-endian) and its second."""
    bt, hp, w = full
    u = pltriton.load(ref.at[pl.ds(t0, bt), pl.ds(0, hp), _cols(t0, 0, w, 1)], mask=valid,
                      other=None if valid is None else 0)
    element = lambda bits: jax.lax.bitcast_convert_type(bits.astype(jnp.uint16),
                                                        dtype).astype(jnp.float32)
    return element(u & 0xFFFF), element(u >> 16)


def _store_pairs(ref, t0, valid, ya, yb, dtype):
    """`_load_pairs` backwards: each pair (ya, yb) packed into one word."""
    bt, hp, w = ya.shape
    bits = lambda y: jax.lax.bitcast_convert_type(y.astype(dtype), jnp.uint16).astype(jnp.uint32)
    pltriton.store(ref.at[pl.ds(t0, bt), pl.ds(0, hp), _cols(t0, 0, w, 1)],
                   bits(ya) | (bits(yb) << 16), mask=valid)


def _rotate(x3, pos, st: _Static, sign: float):
    """x3 [N, H, D] rotated by +theta (sign 1) or -theta (sign -1); pos [N] int32 or float32
    (`kernel_positions`)."""
    n, h, d = x3.shape
    half = d // 2
    bt, hp, dh = st.tokens, C.next_pow2(h), C.next_pow2(half)
    if st.interpret:   # interpret mode: any size, the array's own
        hp, dh = h, half
    # Column of the first element of pair i, and how far its partner lies.
    a0, b0, stride = (0, 1, 2) if st.interleaved else (0, half, 1)
    freq = ref.column_freqs(d, st.base, st.interleaved)[a0::stride][:half].reshape(1, half)
    exact = n % bt == 0 and hp == h and dh == half
    # Interleaved pairs of 16-bit elements are read as one 32-bit word each: a contiguous,
    # vectorized load where two loads at stride 2 move 2 bytes per lane (run s3-4: 59% of the
    # copy rate). Float32 pairs keep the strided loads, as do halves (already contiguous).
    packed = st.interleaved and x3.dtype.itemsize == 2
    operand = (jax.lax.bitcast_convert_type(x3.reshape(n, h, half, 2), jnp.uint32) if packed
               else x3)
    # A tile's last dim (words if packed) and how much of it lies inside the array.
    width, inside = (dh, half) if packed or not st.interpret else (d, d)

    def kernel(x_ref, pos_ref, f_ref, o_ref):
        t0 = pl.program_id(0) * bt
        full = (bt, hp, width)
        tok = t0 + jax.lax.broadcasted_iota(jnp.int32, full, 0)
        head = jax.lax.broadcasted_iota(jnp.int32, full, 1)
        col = jax.lax.broadcasted_iota(jnp.int32, full, 2)
        valid = None if exact else (tok < n) & (head < h) & (col < inside)
        if packed:
            xa, xb = _load_pairs(x_ref, t0, full, valid, x3.dtype)
        else:
            xa, xb = _load_halves(x_ref, t0, full, valid, a0, b0, stride, half, st.interpret)
        p = C.load_vec(pos_ref, t0, bt, n).astype(jnp.float32)                 # [bt]
        f = C.load_tile(f_ref, 0, 0, 1, xa.shape[-1], 1, half)[0]             # [1, dh]
        theta = p[:, None] * f                                                 # [bt, dh]
        cos, sin = jnp.cos(theta)[:, None, :], sign * jnp.sin(theta)[:, None, :]
        ya, yb = xa * cos - xb * sin, xb * cos + xa * sin
        if packed:
            _store_pairs(o_ref, t0, valid, ya, yb, x3.dtype)
        else:
            _store_halves(o_ref, t0, valid, a0, b0, stride, ya, yb, st.interpret)

    out = C.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(operand.shape, operand.dtype),
                        grid=(C.cdiv(n, bt),), name="jaxfuse_rope_fwd" if sign > 0 else
                        "jaxfuse_rope_bwd", interpret=st.interpret,
                        num_warps=st.num_warps)(operand, pos, freq)
    return jax.lax.bitcast_convert_type(out, x3.dtype).reshape(n, h, d) if packed else out


def kernel_positions(positions: jax.Array) -> jax.Array:
    """Positions as the kernel reads them before its float32 conversion: int32 where their type
    fits in it (exact), else (int64, uint32, uint64) float32, the value the reference's angles
    start from; as int32 a position past its range would wrap to another angle."""
    if _checks.fits_int32(positions.dtype):
        return positions.astype(jnp.int32)
    return positions.astype(jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _rope(x2, pos, st: _Static):
    return _rotate(x2, pos, st, 1.0)


def _rope_fwd(x2, pos, st):
    return _rotate(x2, pos, st, 1.0), pos


def _rope_bwd(st, pos, dy2):
    no_ct = (jnp.zeros(pos.shape, jax.dtypes.float0) if jnp.issubdtype(pos.dtype, jnp.integer)
             else jnp.zeros_like(pos))
    return _rotate(dy2, pos, st, -1.0), no_ct


_rope.defvjp(_rope_fwd, _rope_bwd)


def rope(x: jax.Array, positions: jax.Array, *, base: float = 10000.0, interleaved: bool = True,
         interpret: bool | None = None, block_sizes: RowBlocks | None = None) -> jax.Array:
    """Pallas rotary embedding of x [..., T, H, D]; see `jaxfuse.reference.rope`.
    `block_sizes=RowBlocks(block_rows=tokens per program, block_cols >= D, num_warps)`."""
    ref.validate(x, positions, base)
    interpret = C.resolve_interpret(interpret)
    *_, h, d = x.shape
    if block_sizes is not None:
        block_sizes.validate(interpret)
        if block_sizes.block_cols < d:
            raise ValueError(f"block_cols={block_sizes.block_cols} must cover the head dim D={d} "
                             "(a program rotates whole heads; block_rows counts tokens)")
    x3 = x.reshape(-1, h, d)
    bt, warps = _tokens_per_program(x3.shape[0], h, d, interpret, block_sizes)
    pos = kernel_positions(positions.reshape(-1))          # one position per token
    st = _Static(float(base), bool(interleaved), bt, interpret, warps)
    return _rope(x3, pos, st).reshape(x.shape)
