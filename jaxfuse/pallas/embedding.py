"""Fused embedding: out[n] = dropout(scale * table[tokens[n]] + pos_table[positions[n]]).

Forward (LightSeq's embedding kernel, lecture 10 sec. 5.1): one kernel gathers the token's row
and the position's row, scales, adds, drops (mask generated in the kernel) and writes the output
row: unfused that is five kernels and four stored intermediates. Each program walks its rows one
by one (a gather is a row load at a data-dependent offset); one of several rows issues the
next row's gather (the token, then its row) before it computes and writes the current one, so
a gather stays in flight under the dropout and the store (the GPU rule gives a program one
row; `benchmarks/embedding_tiles.py fwd` times the multi-row tiles).

Backward: d table[v] = sum over n with tokens[n] = v of scale * dropout'(d out[n]). LightSeq
adds each row into the table's gradient with atomics, whose order (and so whose rounding) changes
from run to run. Here the tokens are sorted once (a stable sort, by XLA) and `searchsorted` gives
each vocabulary row the range [start, end) of its occurrences; a program owns a block of table
rows, sums each row's occurrences in that (stable) order and writes its block once: no atomics,
bitwise identical across runs, and a row no token uses is written as zeros. d pos_table is the
same kernel over the positions.
Rows whose token or position is out of range (NaN outputs) are left out of both sums.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxfuse import _philox
from jaxfuse.pallas import _common as C
from jaxfuse.pallas import _rng, _rows
from jaxfuse.pallas._rows import RowBlocks
from jaxfuse.reference import embedding as ref


# The backward's tile on the GPU, (table rows, columns, warps) of one program: most rows of a
# large vocabulary receive no token, so the backward is a store of V x d zeros with a few sums
# in it; a [16, 512] tile takes one pair of `bounds` loads per 16 rows and 64 registers a
# thread for its float32 sums.
_BWD_TILE = (16, 512, 4)


@dataclasses.dataclass(frozen=True)
class _Static:
    scale: float
    rate: float          # 0.0: no dropout
    has_pos: bool
    n_vocab: int
    n_pos: int           # rows of pos_table (0 without one)
    fwd_blocks: RowBlocks
    bwd_blocks: RowBlocks
    interpret: bool


def _drop_row(x, key_w, n, col0, st: _Static):
    """Inverted dropout of x [1, bc], columns col0 .. col0 + bc - 1 of output row n."""
    return _rng.drop_tile(x, key_w, jnp.full((1, 1), n, jnp.int32), col0, st.rate, st.interpret)


def _key(refs, st: _Static):
    """(key words or (), remaining refs): the key, when there is one, is the first input."""
    n = refs[0].shape[0] if st.rate else 0
    return (tuple(refs[0][i] for i in range(n)), refs[1:]) if st.rate else ((), refs)


def _forward(tok, pos, table, pos_table, key_w, st: _Static):
    n_rows, (n_vocab, d) = tok.shape[0], table.shape
    br, bc = st.fwd_blocks.block_rows, st.fwd_blocks.block_cols

    def kernel(*refs):
        key, refs = _key(refs, st)
        tok_ref, pos_ref, t_ref, p_ref, o_ref = refs if st.has_pos else (refs[0], None, refs[1],
                                                                         None, refs[2])
        # program ids read outside the loops (interpret mode cannot read them inside one)
        col0, row0 = pl.program_id(1) * bc, pl.program_id(0) * br

        def fetch(r):
            """Row r's gathered operands: (in range, its table row [1, bc], its position's
            row or None)."""
            n_in = jnp.minimum(row0 + r, n_rows - 1)        # rows past the end: read row N-1
            v = tok_ref[n_in]
            ok = (v >= 0) & (v < n_vocab)
            e = C.load_tile(t_ref, jnp.clip(v, 0, n_vocab - 1), col0, 1, bc, n_vocab, d)[0]
            pe = None
            if st.has_pos:
                p = pos_ref[n_in]
                n_pos = pos_table.shape[0]
                ok = ok & (p >= 0) & (p < n_pos)
                pe = C.load_tile(p_ref, jnp.clip(p, 0, n_pos - 1), col0, 1, bc, n_pos, d)[0]
            return ok, e, pe

        cols = col0 + jax.lax.broadcasted_iota(jnp.int32, (1, bc), 1)

        def write(r, fetched):
            ok, e, pe = fetched
            n = row0 + r
            val = e.astype(jnp.float32) * st.scale                              # [1, bc]
            if st.has_pos:
                val = val + pe.astype(jnp.float32)
            if st.rate:
                val = _drop_row(val, key, n, col0, st)
            val = jnp.where(ok, val, jnp.nan)
            C.store_tile(o_ref, val, n, col0, n_rows, d, mask=cols < d)

        if br == 1:                 # nothing to fetch ahead (the loop would load it twice)
            write(0, fetch(0))
            return

        def row(r, fetched):
            # A program of several rows loads row r + 1 (token, then its row: two dependent
            # loads) before it computes and stores row r, so a load is in flight under every
            # row's dropout and store (the last row fetches itself again: a cached re-read).
            ahead = fetch(jnp.minimum(r + 1, br - 1))
            write(r, fetched)
            return ahead

        jax.lax.fori_loop(0, br, row, fetch(0))

    args = [tok] + ([pos] if st.has_pos else []) + [table] + ([pos_table] if st.has_pos else [])
    return C.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((n_rows, d), table.dtype),
                         grid=(C.cdiv(n_rows, br), C.cdiv(d, bc)), name="jaxfuse_embedding_fwd",
                         interpret=st.interpret, num_warps=st.fwd_blocks.num_warps)(
        *([key_w] if st.rate else []), *args)


def _segments(idx, ok, n_table: int):
    """The stable order of the rows by index, the indices in that order, and each table row's
    range in it: (order [N], sorted [N], bounds [n_table + 1]). Rows with `ok` False sort
    before every range (index -1) and belong to none."""
    keyed = jnp.where(ok, idx, -1)
    order = jnp.argsort(keyed, stable=True).astype(jnp.int32)
    ordered = keyed[order]
    # Unrolled binary search: one fusion. The default ("scan") is a while loop of log2(N)
    # steps (15 at 16384 tokens) of four small kernels each (H200: 0.07 ms of kernels plus
    # their launch gaps).
    bounds = jnp.searchsorted(ordered, jnp.arange(n_table + 1, dtype=jnp.int32), side="left",
                              method="scan_unrolled").astype(jnp.int32)
    return order, ordered, bounds


def _segment_sum(order, ordered, bounds, dy2, key_w, factor: float, n_table: int, dtype,
                 st: _Static):
    """out[v] = factor * sum_{i in [bounds[v], bounds[v+1])} dropout'(dy2[order[i]]), in order.

    A program owns bv table rows: it walks the rows of dy whose index falls among them (one
    contiguous range of the sorted order, so two loads of `bounds` per program rather than two
    dependent loads per table row) adding each into its row of a [bv, bc] tile, and stores the
    tile once. Most rows of a large vocabulary receive nothing: the store is the work."""
    n_rows, d = dy2.shape
    bv, bc = st.bwd_blocks.block_rows, st.bwd_blocks.block_cols

    def kernel(*refs):
        key, (order_ref, ordered_ref, bounds_ref, dy_ref, o_ref) = _key(refs, st)
        col0, v0 = pl.program_id(1) * bc, pl.program_id(0) * bv
        row = jax.lax.broadcasted_iota(jnp.int32, (bv, bc), 0)

        def add(i, acc):
            n = order_ref[i]
            g, *_ = C.load_tile(dy_ref, n, col0, 1, bc, n_rows, d)
            g = g.astype(jnp.float32)
            if st.rate:
                g = _drop_row(g, key, n, col0, st)
            # Only the row of index ordered[i] changes: acc + 0.0 elsewhere is exact.
            return acc + jnp.where(row == ordered_ref[i] - v0, g * factor, 0.0)

        acc = jax.lax.fori_loop(bounds_ref[jnp.minimum(v0, n_table)],
                                bounds_ref[jnp.minimum(v0 + bv, n_table)], add,
                                jnp.zeros((bv, bc), jnp.float32))
        C.store_tile(o_ref, acc, v0, col0, n_table, d)

    return C.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((n_table, d), dtype),
                         grid=(C.cdiv(n_table, bv), C.cdiv(d, bc)),
                         name="jaxfuse_embedding_bwd", interpret=st.interpret,
                         num_warps=st.bwd_blocks.num_warps)(
        *([key_w] if st.rate else []), order, ordered, bounds, dy2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _embedding(tok, pos, table, pos_table, key_w, st: _Static):
    return _forward(tok, pos, table, pos_table, key_w, st)


def _embedding_fwd(tok, pos, table, pos_table, key_w, st):
    return _forward(tok, pos, table, pos_table, key_w, st), (tok, pos, key_w)


def _embedding_bwd(st, saved, dy2):
    tok, pos, key_w = saved
    n_vocab, n_pos, dtype = st.n_vocab, st.n_pos, dy2.dtype
    ok = (tok >= 0) & (tok < n_vocab)
    if st.has_pos:
        ok = ok & (pos >= 0) & (pos < n_pos)
    dtable = _segment_sum(*_segments(tok, ok, n_vocab), dy2, key_w, st.scale, n_vocab, dtype,
                          st)
    dpos = None
    if st.has_pos:
        dpos = _segment_sum(*_segments(pos, ok, n_pos), dy2, key_w, 1.0, n_pos, dtype, st)
    float0 = lambda a: None if a is None else jnp.zeros(a.shape, jax.dtypes.float0)
    return float0(tok), float0(pos), dtable, dpos, float0(key_w)


_embedding.defvjp(_embedding_fwd, _embedding_bwd)


def embedding(tokens: jax.Array, table: jax.Array, *, scale: float = 1.0,
              pos_table: jax.Array | None = None, positions: jax.Array | None = None,
              rate: float = 0.0, key=None, interpret: bool | None = None,
              block_sizes: RowBlocks | None = None) -> jax.Array:
    """Pallas fused embedding; see `jaxfuse.reference.embedding`. `block_sizes.block_rows` is
    the rows (tokens forward, table rows backward) one program walks."""
    ref.validate(tokens, table, scale, pos_table, positions, rate, key)
    interpret = C.resolve_interpret(interpret)
    rate = float(rate) if _philox.active(rate, key) else 0.0
    positions = ref.resolve_positions(tokens, pos_table, positions)
    tok = ref.table_index(tokens, table.shape[0]).reshape(-1)
    pos = None if positions is None else positions.reshape(-1)
    n_rows, d = tok.shape[0], table.shape[1]
    fwd_blocks = bwd_blocks = block_sizes
    if block_sizes is None and not interpret:
        # Forward: one token row per program (a gathered row is the unit of work; N programs
        # fill the GPU many times over). Backward: `_BWD_TILE`.
        fwd_blocks = RowBlocks(1, min(C.next_pow2(d), 16384), max(1, min(8, d // 512)))
        rows, cols, warps = _BWD_TILE
        bwd_blocks = RowBlocks(rows, min(C.next_pow2(d), cols), warps)
    fwd = _rows.resolve_blocks(fwd_blocks, n_rows, d, interpret)
    bwd = _rows.resolve_blocks(bwd_blocks, table.shape[0], d, interpret)
    st = _Static(float(scale), rate, pos_table is not None, table.shape[0],
                 0 if pos_table is None else pos_table.shape[0], fwd, bwd, interpret)
    key_w = _philox.key_words(key) if rate else None
    out = _embedding(tok, pos, table, pos_table, key_w, st)
    return out.reshape(*tokens.shape, d)
