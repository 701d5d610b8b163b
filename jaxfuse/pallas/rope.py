"""Fused rotary position embedding: angles computed in the kernel (no cos/sin table in memory),
one read and one write of x, the backward the same kernel turning the other way.

Each row of the [rows, D] view ((..., T, H) flattened) is loaded twice, as x[c] and as
x[c + s] (s = 1 for interleaved pairs, D/2 for halves; the second load hits the cache), so that
every pair (a, b) = (c, c + s) meets in the same lane without shuffling registers. The lane of
the pair's first element computes both rotated values and stores them with two masked stores,
at c and at c + s (Triton has no lane permutation that Pallas exposes; shifted loads and stores
do the same work).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxfuse.pallas import _common as C
from jaxfuse.pallas import _rows
from jaxfuse.pallas._rows import RowBlocks
from jaxfuse.reference import rope as ref


@dataclasses.dataclass(frozen=True)
class _Static:
    base: float
    interleaved: bool
    blocks: RowBlocks
    interpret: bool


def _rotate(x2, pos, st: _Static, sign: float):
    """x2 [rows, D] rotated by +theta (sign 1) or -theta (sign -1); pos int32 [rows]."""
    n_rows, d = x2.shape
    br, bc = st.blocks.block_rows, st.blocks.block_cols
    s = 1 if st.interleaved else d // 2
    freq = ref.column_freqs(d, st.base, st.interleaved).reshape(1, d)

    def kernel(x_ref, pos_ref, f_ref, o_ref):
        row0 = pl.program_id(0) * br
        # A traced offset: a static one past the row's end is refused when the ref is indexed,
        # although the masked load and store never touch those columns.
        shift = row0 * 0 + s
        xa, _, cols, valid = C.load_tile(x_ref, row0, 0, br, bc, n_rows, d)    # [br, bc]: x[c]
        # x[c + s]; the tile hangs over the row's end, so it is always masked.
        xb = C.load_tile(x_ref, row0, shift, br, bc, n_rows, d, predicate=True)[0]
        p = C.load_vec(pos_ref, row0, br, n_rows)[:, None].astype(jnp.float32)  # [br, 1]
        f = C.load_tile(f_ref, 0, 0, 1, bc, 1, d)[0]                            # [1, bc]
        theta = p * f
        cos, sin = jnp.cos(theta), sign * jnp.sin(theta)
        xa, xb = xa.astype(jnp.float32), xb.astype(jnp.float32)
        first = (cols % 2 == 0) if st.interleaved else (cols < d // 2)
        C.store_tile(o_ref, xa * cos - xb * sin, row0, 0, n_rows, d, mask=first)
        C.store_tile(o_ref, xb * cos + xa * sin, row0, shift, n_rows, d, mask=first & valid)

    return C.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x2.shape, x2.dtype),
                         grid=(C.cdiv(n_rows, br),), name="jaxfuse_rope_fwd" if sign > 0 else
                         "jaxfuse_rope_bwd", interpret=st.interpret,
                         num_warps=st.blocks.num_warps)(x2, pos, freq)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _rope(x2, pos, st: _Static):
    return _rotate(x2, pos, st, 1.0)


def _rope_fwd(x2, pos, st):
    return _rotate(x2, pos, st, 1.0), pos


def _rope_bwd(st, pos, dy2):
    return _rotate(dy2, pos, st, -1.0), jnp.zeros(pos.shape, jax.dtypes.float0)


_rope.defvjp(_rope_fwd, _rope_bwd)


def rope(x: jax.Array, positions: jax.Array, *, base: float = 10000.0, interleaved: bool = True,
         interpret: bool | None = None, block_sizes: RowBlocks | None = None) -> jax.Array:
    """Pallas rotary embedding of x [..., T, H, D]; see `jaxfuse.reference.rope`."""
    ref.validate(x, positions, base)
    interpret = C.resolve_interpret(interpret)
    d = x.shape[-1]
    x2 = _rows.as_rows(x)
    blocks = _rows.resolve_blocks(block_sizes, x2.shape[0], d, interpret)
    if blocks.block_cols < d:
        raise ValueError(f"block_cols={blocks.block_cols} must cover the head dim D={d} (a row "
                         "is rotated in one tile)")
    # One position per row of the [..., T, H] view (4 bytes per row of D values).
    pos = jnp.broadcast_to(positions[..., None], x.shape[:-1]).reshape(-1).astype(jnp.int32)
    st = _Static(float(base), bool(interleaved), blocks, interpret)
    return _rope(x2, pos, st).reshape(x.shape)
