"""Fused rotary position embedding: angles computed in the kernel (no cos/sin table in memory),
one read and one write of x, the backward the same kernel turning the other way.

x [..., T, H, D] is viewed as [N, 1, H, D] (N tokens; the kernel, `_move`, takes any
[tokens, groups, slots, D] views and moves pieces of slots between them, which `rope_qkv` uses
to split a grouped q/k/v projection). A program rotates a block of tokens, all heads, one piece
at a time: it loads the pairs' two halves as two [tokens, groups, slots, D/2] tiles - strided
loads at columns 0, 2, 4, ... and 1, 3, 5, ... for interleaved pairs, contiguous ones at 0 and
D/2 for halves (one body, the layout is only the (offset, stride) of the second half) - so that
the two elements of a pair meet in the same lane (16-bit interleaved pairs: one 32-bit word per
pair, loaded contiguously and split in registers). The angles depend on (token, pair) only: cos
and sin are computed once per [tokens, D/2] and broadcast over the heads (H times fewer
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
class Piece:
    """Slots [src_slot, +n) of input `src` go to slots [dst_slot, +n) of output `dst`, turned
    by RoPE (`turn`) or copied as they are. Every operand of a kernel is viewed as
    [tokens, groups, slots, D]: `rope` moves one piece (x [N, 1, H, D], all heads turned),
    `rope_qkv` splits the grouped q/k/v projection [N, Hkv, G + 2, D] into three (q's G slots
    and k's turned, v's copied) and its backward packs the three gradients back."""
    src: int
    src_slot: int
    dst: int
    dst_slot: int
    n: int
    turn: bool = True


@dataclasses.dataclass(frozen=True)
class _Static:
    base: float
    interleaved: bool
    tokens: int      # tokens per program
    interpret: bool
    num_warps: int
    pieces: tuple[Piece, ...]
    out_slots: tuple[int, ...]   # slots of each output
    name: str        # the kernels' name: jaxfuse_<name>_fwd / _bwd


def _tokens_per_program(n: int, per_token: int, interpret: bool, blocks: RowBlocks | None,
                        warps: int = 4) -> tuple[int, int]:
    """(tokens a program moves, warps); `per_token`: elements of a token's largest piece;
    `warps`: the op's own on the GPU (RoPE's 4, measured in s3)."""
    if blocks is not None:
        return blocks.block_rows, blocks.num_warps
    if interpret:
        return max(1, min(n, _rows._INTERPRET_TILE_ELEMS // per_token)), 1
    bt = max(1, min(C.next_pow2(n), _GPU_TILE_ELEMS // per_token))
    # Few tokens (a decoding step: one per sequence) go one or a few per program, at least one
    # program per SM, so that the call takes one small program's latency, not a big one's.
    bt = min(bt, C.next_pow2(C.cdiv(n, C.num_multiprocessors())))
    return bt, warps


def _padded(groups: int, slots: int, d: int) -> int:
    """Elements a token's [groups, slots, D] tile takes on the GPU (power-of-two sides)."""
    return C.next_pow2(groups) * C.next_pow2(slots) * 2 * C.next_pow2(d // 2)


def _index(t0, bt: int, gp: int, s0: int, sp: int, cols, interpret: bool):
    """`ref.at[...]` index of tokens [t0, +bt), groups [0, gp), slots [s0, +sp), `cols`. The
    group and slot starts are traced (t0 * 0) on the GPU: a power-of-two tile may hang over
    the array's end, which the masked load and store never touch but a static start would have
    refused when the ref is indexed (`_cols`)."""
    if interpret:   # one index type (jax_enable_x64)
        return (pl.ds(C.start(t0), bt), pl.ds(C.start(0), gp), pl.ds(C.start(s0), sp), cols)
    return pl.ds(t0, bt), pl.ds(t0 * 0, gp), pl.ds(s0 + t0 * 0, sp), cols


def _load_halves(ref, at, full, valid, a0: int, b0: int, stride: int, half: int,
                 interpret: bool):
    """The pairs' first and second elements of a [bt, gp, sp] block of tokens, groups and
    slots (`at(cols)` its index) as two float32 [bt, gp, sp, D/2] tiles. On the GPU two
    strided loads; Pallas' interpreter has no strided loads, so there the whole tile is loaded
    (masked: it pads at the edge) and sliced."""
    w = full[-1]
    other = None if valid is None else 0.0
    if interpret:
        x = pltriton.load(ref.at[at(pl.ds(C.start(0), w))], mask=valid,
                          other=other).astype(jnp.float32)
        pick = lambda c0: jax.lax.slice_in_dim(x, c0, c0 + stride * (half - 1) + 1, stride, -1)
        return pick(a0), pick(b0)
    load = lambda c0: pltriton.load(ref.at[at(_cols(c0, w, stride))], mask=valid,
                                    other=other).astype(jnp.float32)
    return load(a0), load(b0)


def _cols(c0: int, w: int, stride: int):
    """Columns c0, c0 + stride, ... (w of them). The start is traced (program id * 0): a
    power-of-two tile of pairs may hang over the row's end (D = 6), which the masked load and
    store never touch but a static start would have refused when the ref is indexed."""
    return pl.ds(c0 + pl.program_id(0) * 0, w, stride)


def _store_halves(ref, at, valid, a0: int, b0: int, stride: int, ya, yb, interpret: bool):
    """`_load_halves` backwards: ya, yb [bt, gp, sp, D/2] written to the pairs' two columns."""
    w = ya.shape[-1]
    if interpret:
        y = (jnp.stack([ya, yb], -1).reshape(*ya.shape[:-1], 2 * w) if stride == 2
             else jnp.concatenate([ya, yb], -1))
        pltriton.store(ref.at[at(pl.ds(C.start(0), 2 * w))], y.astype(ref.dtype), mask=valid)
        return
    for c0, y in ((a0, ya), (b0, yb)):
        pltriton.store(ref.at[at(_cols(c0, w, stride))], y.astype(ref.dtype), mask=valid)


def _words_at(at, w: int, interpret: bool):
    """The index of a tile's whole rows of w 32-bit words (16-bit pairs)."""
    return at(pl.ds(C.start(0), w) if interpret else _cols(0, w, 1))


def _split_pairs(u, dtype):
    """Interleaved 16-bit pairs held as uint32 words, each split in registers into the pair's
    first element (the low half-word: the arrays are little-endian) and its second, float32."""
    element = lambda bits: jax.lax.bitcast_convert_type(bits.astype(jnp.uint16),
                                                        dtype).astype(jnp.float32)
    return element(u & 0xFFFF), element(u >> 16)


def _join_pairs(ya, yb, dtype):
    """`_split_pairs` backwards: each pair (ya, yb) packed into one word."""
    bits = lambda y: jax.lax.bitcast_convert_type(y.astype(dtype), jnp.uint16).astype(jnp.uint32)
    return bits(ya) | (bits(yb) << 16)


def _move(ins: tuple, pos, st: _Static, sign: float) -> tuple:
    """Outputs [N, groups, st.out_slots[i], D] filled from inputs [N, groups, slots, D] piece by
    piece (`Piece`), turned by +theta (sign 1) or -theta (sign -1) where a piece turns; pos [N]
    int32 or float32 (`kernel_positions`). A program moves a block of tokens, all groups."""
    n, groups, _, d = ins[0].shape
    dtype = ins[0].dtype
    half = d // 2
    bt = st.tokens
    gp, dh = (groups, half) if st.interpret else (C.next_pow2(groups), C.next_pow2(half))
    # Column of the first element of pair i, and how far its partner lies.
    a0, b0, stride = (0, 1, 2) if st.interleaved else (0, half, 1)
    freq = ref.column_freqs(d, st.base, st.interleaved)[a0::stride][:half].reshape(1, half)
    # Interleaved pairs of 16-bit elements are read as one 32-bit word each: a contiguous,
    # vectorized load where two loads at stride 2 move 2 bytes per lane (run s3-4: 59% of the
    # copy rate). Float32 pairs keep the strided loads, as do halves (already contiguous).
    packed = st.interleaved and dtype.itemsize == 2
    as_operand = ((lambda x: jax.lax.bitcast_convert_type(
        x.reshape(*x.shape[:-1], half, 2), jnp.uint32)) if packed else (lambda x: x))
    # A tile's last dim (words if packed) and how much of it lies inside the array.
    width, inside = (dh, half) if packed or not st.interpret else (d, d)

    def kernel(*refs):
        in_refs, (pos_ref, f_ref), out_refs = (refs[:len(ins)], refs[len(ins):len(ins) + 2],
                                               refs[len(ins) + 2:])
        t0 = pl.program_id(0) * bt
        p = C.load_vec(pos_ref, t0, bt, n).astype(jnp.float32)                 # [bt]
        f = C.load_tile(f_ref, 0, 0, 1, dh, 1, half)[0]                      # [1, dh]
        theta = p[:, None] * f                                                 # [bt, dh]
        cos = jnp.cos(theta)[:, None, None, :]
        sin = sign * jnp.sin(theta)[:, None, None, :]
        for pc in st.pieces:
            sp = pc.n if st.interpret else C.next_pow2(pc.n)
            full = (bt, gp, sp, width)
            exact = n % bt == 0 and (gp, sp) == (groups, pc.n) and width == inside
            valid = None
            if not exact:
                iota = lambda axis: jax.lax.broadcasted_iota(jnp.int32, full, axis)
                valid = ((t0 + iota(0) < n) & (iota(1) < groups) & (iota(2) < pc.n)
                         & (iota(3) < inside))
            src = functools.partial(_index, t0, bt, gp, pc.src_slot, sp, interpret=st.interpret)
            dst = functools.partial(_index, t0, bt, gp, pc.dst_slot, sp, interpret=st.interpret)
            x_ref, o_ref = in_refs[pc.src], out_refs[pc.dst]
            if packed:
                u = pltriton.load(x_ref.at[_words_at(src, width, st.interpret)], mask=valid,
                                  other=None if valid is None else 0)
                if pc.turn:
                    xa, xb = _split_pairs(u, dtype)
                    u = _join_pairs(xa * cos - xb * sin, xb * cos + xa * sin, dtype)
                pltriton.store(o_ref.at[_words_at(dst, width, st.interpret)], u, mask=valid)
                continue
            xa, xb = _load_halves(x_ref, src, full, valid, a0, b0, stride, half, st.interpret)
            if pc.turn:
                xa, xb = xa * cos - xb * sin, xb * cos + xa * sin
            _store_halves(o_ref, dst, valid, a0, b0, stride, xa, xb, st.interpret)

    operands = [as_operand(x) for x in ins]
    last = operands[0].shape[-1]
    outs = C.pallas_call(
        kernel, out_shape=[jax.ShapeDtypeStruct((n, groups, s, last), operands[0].dtype)
                           for s in st.out_slots],
        grid=(C.cdiv(n, bt),), name=f"jaxfuse_{st.name}_{'fwd' if sign > 0 else 'bwd'}",
        interpret=st.interpret,
        num_warps=st.num_warps)(*operands, pos, freq)
    if packed:
        outs = [jax.lax.bitcast_convert_type(o, dtype).reshape(*o.shape[:-1], d) for o in outs]
    return tuple(outs)


def kernel_positions(positions: jax.Array) -> jax.Array:
    """Positions as the kernel reads them before its float32 conversion: int32 where their type
    fits in it (exact), else (int64, uint32, uint64) float32, the value the reference's angles
    start from; as int32 a position past its range would wrap to another angle."""
    if _checks.fits_int32(positions.dtype):
        return positions.astype(jnp.int32)
    return positions.astype(jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def moved(x4, pos, fwd: _Static, bwd: _Static) -> tuple:
    """`_move` of x4 [N, groups, slots, D] by `fwd`'s pieces, turning by +theta; its gradient
    is `bwd`'s pieces moving the cotangents back into one [N, groups, slots, D] array, turning
    by -theta (a rotation's inverse). `rope` and `rope_qkv` are this with their pieces."""
    return _move((x4,), pos, fwd, 1.0)


def _moved_fwd(x4, pos, fwd, bwd):
    return moved(x4, pos, fwd, bwd), pos


def _moved_bwd(fwd, bwd, pos, cts):
    no_ct = (jnp.zeros(pos.shape, jax.dtypes.float0) if jnp.issubdtype(pos.dtype, jnp.integer)
             else jnp.zeros_like(pos))
    return _move(tuple(cts), pos, bwd, -1.0)[0], no_ct


moved.defvjp(_moved_fwd, _moved_bwd)


def check_blocks(block_sizes: RowBlocks | None, d: int, interpret: bool) -> None:
    """`block_sizes` valid for a kernel that moves whole heads of D (RoPE's and rope_qkv's)."""
    if block_sizes is None:
        return
    block_sizes.validate(interpret)
    if block_sizes.block_cols < d:
        raise ValueError(f"block_cols={block_sizes.block_cols} must cover the head dim D={d} "
                         "(a program moves whole heads; block_rows counts tokens)")


def rope(x: jax.Array, positions: jax.Array, *, base: float = 10000.0, interleaved: bool = True,
         interpret: bool | None = None, block_sizes: RowBlocks | None = None) -> jax.Array:
    """Pallas rotary embedding of x [..., T, H, D]; see `jaxfuse.reference.rope`.
    `block_sizes=RowBlocks(block_rows=tokens per program, block_cols >= D, num_warps)`."""
    ref.validate(x, positions, base)
    interpret = C.resolve_interpret(interpret)
    *_, h, d = x.shape
    check_blocks(block_sizes, d, interpret)
    x4 = x.reshape(-1, 1, h, d)
    per_token = h * d if interpret else _padded(1, h, d)
    bt, warps = _tokens_per_program(x4.shape[0], per_token, interpret, block_sizes)
    pos = kernel_positions(positions.reshape(-1))          # one position per token
    st = _Static(float(base), bool(interleaved), bt, interpret, warps, (Piece(0, 0, 0, 0, h),),
                 (h,), "rope")
    return moved(x4, pos, st, st)[0].reshape(x.shape)
