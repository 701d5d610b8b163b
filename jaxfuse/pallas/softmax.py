"""Fused softmax: scale, boolean mask, causal mask and the softmax in one read and one write.

Unfused, scale -> mask -> max -> exp -> sum -> divide is five kernels and about 8.75 passes over
the scores (lecture 10, sec. 4.1); fused it is one read of x and one write of y when a row fits
in one tile. A longer row is walked twice: first the online (m, l) statistics (Milakov and
Gimelshein 2018; lecture 5, sec. 4.3), merged tile by tile, then the normalized output.
The causal mask is computed from indices, never read from memory.

Backward (`custom_vjp`, saves only y): dx = scale * y * (dy - sum(dy * y)), one kernel (plus a
reduction pass for rows longer than a tile).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxfuse.pallas import _common as C
from jaxfuse.pallas import _rows
from jaxfuse.pallas._rows import RowBlocks
from jaxfuse.reference import softmax as ref


@dataclasses.dataclass(frozen=True)
class _Static:
    scale: float
    causal: bool
    has_mask: bool
    n_q: int     # queries per [n_q, n_k] slab (causal only)
    n_k: int     # row length
    blocks: RowBlocks
    interpret: bool


def _scores(tile: _rows.Tile, st: _Static):
    """Scaled scores, -inf wherever the entry is masked."""
    keep = tile.valid
    if st.has_mask:
        keep = keep & (tile.x[1] != 0)
    if st.causal:
        keep = keep & C.keep_mask(tile.rows % st.n_q, tile.cols, n_q=st.n_q, n_k=st.n_k,
                                  causal=True)
    return jnp.where(keep, tile.x[0] * st.scale, C.NEG_INF)


def _forward(x2, mask2, st: _Static, merge=None):
    """y. `merge` (rows split across devices along the columns, `sharding.rows`) combines the
    per-row (m, l) of every device's columns."""
    b = st.blocks
    tiled, fills = [x2], [0.0]
    if st.has_mask:
        tiled, fills = [x2, mask2], [0.0, 0]
    n_tiles = C.cdiv(st.n_k, b.block_cols)
    if merge is not None:
        n_tiles = max(n_tiles, 2)       # the statistics come from their own pass, then merge
    per_row = ()
    if n_tiles > 1:
        br = b.block_rows
        init = lambda _: (jnp.full((br, 1), C.NEG_INF, jnp.float32),
                          jnp.zeros((br, 1), jnp.float32))
        per_row = tuple(_rows.reduce_pass(
            init, lambda state, tile: C.online_max_sum(state, _scores(tile, st)),
            lambda state, _: state, tiled=tiled, fills=fills,
            out_dtypes=(jnp.float32, jnp.float32), blocks=b, name="jaxfuse_softmax_stats",
            interpret=st.interpret))
        if merge is not None:
            per_row = tuple(merge(per_row))

    def emit(tile):
        s = _scores(tile, st)
        if n_tiles > 1:
            m, l = tile.per_row
            e = jnp.exp(s - C.finite_shift(m))
        else:   # the whole row is this tile: its statistics come from the same exponentials
            e = jnp.exp(s - C.finite_shift(jnp.max(s, axis=-1, keepdims=True)))
            l = jnp.sum(e, axis=-1, keepdims=True)
        # Only an empty row (l == 0) gives zeros; a NaN anywhere in the row stays NaN.
        return (e * jnp.where(l == 0, 0.0, 1.0 / jnp.where(l == 0, 1.0, l)),), (), ()

    (y2,) = _rows.map_pass(emit, tiled=tiled, fills=fills, per_row=per_row,
                           out_dtypes=(x2.dtype,), blocks=b, name="jaxfuse_softmax_fwd",
                           interpret=st.interpret)
    return y2


def _backward(y2, dy2, st: _Static, merge=None):
    """dx. `merge` sums the per-row sum(dy * y) over every device's columns."""
    b = st.blocks
    tiled, fills = [y2, dy2], [0.0, 0.0]
    n_tiles = C.cdiv(st.n_k, b.block_cols)
    if merge is not None:
        n_tiles = max(n_tiles, 2)

    def step(acc, tile):
        return acc + jnp.sum(tile.x[0] * tile.x[1], axis=-1, keepdims=True)

    zero = lambda _: jnp.zeros((b.block_rows, 1), jnp.float32)
    per_row = ()
    if n_tiles > 1:
        per_row = tuple(_rows.reduce_pass(
            zero, step, lambda acc, _: (acc,), tiled=tiled, fills=fills,
            out_dtypes=(jnp.float32,), blocks=b, name="jaxfuse_softmax_bwd_stats",
            interpret=st.interpret))
        if merge is not None:
            per_row = tuple(merge(per_row))

    def emit(tile):
        y, dy = tile.x
        c = tile.per_row[0] if n_tiles > 1 else step(zero(None), tile)
        return (st.scale * y * (dy - c),), (), ()

    (dx2,) = _rows.map_pass(emit, tiled=tiled, fills=fills, per_row=per_row,
                            out_dtypes=(dy2.dtype,), blocks=b, name="jaxfuse_softmax_bwd",
                            interpret=st.interpret)
    return dx2


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _softmax(x2, mask2, st):
    return _forward(x2, mask2, st)


def _softmax_fwd(x2, mask2, st):
    y2 = _forward(x2, mask2, st)
    return y2, (y2, mask2)


def _softmax_bwd(st, res, dy2):
    y2, mask2 = res
    mask_ct = None if mask2 is None else jnp.zeros(mask2.shape, jax.dtypes.float0)
    return _backward(y2, dy2, st), mask_ct


_softmax.defvjp(_softmax_fwd, _softmax_bwd)


def softmax(x: jax.Array, *, scale: float = 1.0, mask: jax.Array | None = None,
            causal: bool = False, interpret: bool | None = None,
            block_sizes: RowBlocks | None = None) -> jax.Array:
    """Pallas softmax over the last axis of `scale * x`; see `jaxfuse.reference.softmax`."""
    ref.validate(x, mask, causal, scale)
    x2 = _rows.as_rows(x)
    mask2 = None
    if mask is not None:
        mask2 = _rows.as_rows(jnp.broadcast_to(mask, x.shape).astype(jnp.int8))
    st = static(x.shape, scale=scale, causal=causal, has_mask=mask is not None,
                interpret=interpret, block_sizes=block_sizes)
    return _softmax(x2, mask2, st).reshape(x.shape)


def static(shape, *, scale: float, causal: bool, has_mask: bool, interpret: bool | None,
           block_sizes: RowBlocks | None) -> _Static:
    """The kernels' settings for x of this shape (also used per shard by `sharding`)."""
    interpret = C.resolve_interpret(interpret)
    n_k = shape[-1]
    blocks = _rows.resolve_blocks(block_sizes, max(1, int(np.prod(shape[:-1]))), n_k, interpret)
    return _Static(float(scale), bool(causal), has_mask, shape[-2] if causal else 1, n_k, blocks,
                   interpret)
