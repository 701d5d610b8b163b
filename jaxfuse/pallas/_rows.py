"""Row-wise kernels, written once: the tiling that softmax, the norms and cross-entropy share.

Every row-wise op here is one or two of these passes over a `[n_rows, n_cols]` view:

* `reduce_pass`: one program per block of rows walks the row in column tiles and folds each
  tile into a per-row state (online max/sum for softmax, Welford state for LayerNorm, ...). It
  writes per-row results, and, given an `emit`, walks the row a second time writing tiles that
  need them (cross-entropy's loss and gradient in one kernel). Rows longer than one tile need
  it; cross-entropy's forward is one.
* `map_pass`: program (g, j) writes column tile j of a group of rows, chunk by chunk. When the
  whole row fits in one tile the op computes its row statistics inline from that tile (one read
  of the data, lecture 10 sec. 4.1); otherwise it reads them from a preceding `reduce_pass`. It
  can also sum per-column quantities over its rows (weight and bias gradients), which it writes
  as one float32 row per group: `[groups, n_cols]`, never `[n_rows, n_cols]`.

Block sizes come from one rule, `RowBlocks.for_shape`: on the GPU, power-of-two tiles of about
4K elements (many short rows per program, one long row per program, rows beyond 16K columns
walked in tiles of 4K); in interpret mode, whole rows and as many rows as fit in a few MiB, so that the
grid is a handful of steps (an interpreted step copies its operands).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxfuse import _checks
from jaxfuse.pallas import _common as C

_GPU_MAX_TILE_COLS = 16384      # longest row held in registers at once
_GPU_TILE_ELEMS = 4096          # elements per program for short rows
_INTERPRET_TILE_ELEMS = 1 << 22  # elements per interpreted step (16 MiB of float32)


@dataclasses.dataclass(frozen=True)
class RowBlocks:
    """Tile of a row-wise kernel: `block_rows` x `block_cols` elements per load.

    `rows_per_program` only matters for passes that sum over rows (weight gradients): each
    program walks that many rows in chunks of `block_rows` and writes one partial row.
    `num_warps` is ignored in interpret mode.
    `hopper` (ops that have Hopper kernels: `swiglu`, `swiglu_linear`): None takes them on an
    sm90 GPU where the shape is whole tiles of theirs, True forces them (a shape they cannot
    take raises; on a CPU they run in Mosaic GPU's interpreter), False keeps the Triton kernels.
    """
    block_rows: int
    block_cols: int
    num_warps: int = 4
    rows_per_program: int | None = None
    hopper: bool | None = None

    def __post_init__(self):
        # Sizes become grids and slices: a float or a zero would fail deep inside Pallas.
        for name in ("block_rows", "block_cols", "num_warps", "rows_per_program"):
            v = getattr(self, name)
            if not (v is None and name == "rows_per_program") and not (
                    _checks.is_int(v) and v >= 1):
                raise ValueError(f"RowBlocks({name}={v!r}): {name} must be a positive int")

    @classmethod
    def for_shape(cls, n_rows: int, n_cols: int, *, interpret: bool,
                  accumulate_rows: bool = False, programs_per_sm: int = 2) -> "RowBlocks":
        if interpret:
            bc = n_cols
            br = max(1, min(n_rows, _INTERPRET_TILE_ELEMS // max(n_cols, 1)))
            return cls(br, bc, 1, n_rows if accumulate_rows else None)
        if n_cols > _GPU_MAX_TILE_COLS:
            # A row walked in tiles, one program per row: narrow tiles with few warps put
            # several programs on each multiprocessor, whose loads hide each other's latency
            # (run s8-1, H200: cross-entropy forward on [2048, 128256] bf16, 16384 columns x
            # 16 warps 0.335 ms, 8192 x 8 0.289, 4096 x 4 0.269; backward 0.269 -> 0.260).
            bc = _GPU_TILE_ELEMS
        else:
            bc = C.next_pow2(n_cols)
        br = max(1, min(C.next_pow2(n_rows), _GPU_TILE_ELEMS // bc))
        # About 32 bytes of a 16-bit row per thread measured best on an H200 (4 warps for 4096).
        warps = max(1, min(16, br * bc // 1024))
        rpp = None
        if accumulate_rows:
            # Enough programs to fill the GPU `programs_per_sm` times over; each sums its rows
            # in registers and writes one float32 partial row.
            groups = max(1, programs_per_sm * C.num_multiprocessors() // C.cdiv(n_cols, bc))
            rpp = br * C.cdiv(C.cdiv(n_rows, groups), br)
        return cls(br, bc, warps, rpp)

    def validate(self, interpret: bool, has_hopper: bool = False) -> None:
        """Raises ValueError for a tile the kernels cannot take. `has_hopper`: the op has
        Hopper kernels (else `hopper=True` is refused rather than ignored)."""
        if self.hopper and not has_hopper:
            raise ValueError("RowBlocks(hopper=True): this op has no Hopper kernels (swiglu and "
                             "swiglu_linear do); leave hopper=None")
        for name in ("block_rows", "block_cols"):
            v = getattr(self, name)
            if not interpret and v != C.next_pow2(v):
                raise ValueError(f"{name}={v} must be a power of two on the GPU (any positive "
                                 "size in interpret mode)")
        if self.rows_per_program is not None and self.rows_per_program % self.block_rows:
            raise ValueError(f"rows_per_program={self.rows_per_program} must be a multiple of "
                             f"block_rows={self.block_rows}")


def resolve_blocks(blocks: RowBlocks | None, n_rows: int, n_cols: int, interpret: bool,
                   accumulate_rows: bool = False, has_hopper: bool = False,
                   programs_per_sm: int = 2) -> RowBlocks:
    """`blocks`, or the rule's tile. `has_hopper`: the op has Hopper kernels (else
    `RowBlocks(hopper=True)` is refused rather than ignored). `programs_per_sm`: how many
    programs a pass that sums over rows gets per multiprocessor when `blocks` does not say."""
    if blocks is None:
        return RowBlocks.for_shape(n_rows, n_cols, interpret=interpret,
                                   accumulate_rows=accumulate_rows,
                                   programs_per_sm=programs_per_sm)
    blocks.validate(interpret, has_hopper)
    if not accumulate_rows:
        # rows_per_program is for passes that sum over rows (the docstring's contract): a
        # forward given the backward's tile keeps one chunk of rows per program.
        return dataclasses.replace(blocks, rows_per_program=None)
    if blocks.rows_per_program is None:
        target = n_rows if interpret else RowBlocks.for_shape(
            n_rows, n_cols, interpret=False, accumulate_rows=True,
            programs_per_sm=programs_per_sm).rows_per_program
        blocks = dataclasses.replace(
            blocks, rows_per_program=blocks.block_rows * C.cdiv(target, blocks.block_rows))
    return blocks


class Tile(NamedTuple):
    """What a pass hands to an op's tile function."""
    x: tuple        # float32 [br, bc] tiles of the tiled inputs (fill value outside the array)
    per_row: tuple  # [br, 1] values of the per-row inputs
    per_col: tuple  # float32 [1, bc] values of the per-column inputs
    rows: jax.Array  # int32 [br, bc] absolute row index
    cols: jax.Array  # int32 [br, bc] absolute column index
    valid: jax.Array  # bool [br, bc] inside the array (in a reduce pass's inner tiles only the
    #                   rows are checked: a constant where the row blocks tile the rows exactly)
    key: tuple = ()  # the two uint32 Philox key words (scalars) when the pass was given a key
    row0: jax.Array | int = 0  # absolute index of the tile's first row (dropout masks)
    col0: jax.Array | int = 0  # ... and of its first column


def _load(refs, fills, per_row, per_col, row0, col0, b: RowBlocks, n_rows, n_cols, key=(),
          interior: bool = False):
    """The tile of every tiled input at (row0, col0), with the per-row and per-column values the
    caller loaded once for it (they do not change from tile to tile). `interior`: the caller
    knows the tile's columns lie inside the array (`C.load_tile(cols_inside=True)`)."""
    loads = [C.load_tile(ref, row0, col0, b.block_rows, b.block_cols, n_rows, n_cols,
                         other=fill, cols_inside=interior) for ref, fill in zip(refs, fills)]
    _, rows, cols, valid = loads[0]
    return Tile(tuple(t[0].astype(jnp.float32) for t in loads), per_row, per_col, rows, cols,
                valid, key, row0, col0)


def _per_row(refs, row0, b: RowBlocks, n_rows):
    return tuple(C.load_vec(r, row0, b.block_rows, n_rows)[:, None] for r in refs)


def _per_col(refs, col0, b: RowBlocks, n_cols):
    return tuple(C.load_tile(r, 0, col0, 1, b.block_cols, 1, n_cols)[0].astype(jnp.float32)
                 for r in refs)


def reduce_pass(init: Callable, step: Callable, finalize: Callable, *, tiled: Sequence,
                fills: Sequence, per_row: Sequence = (), per_col: Sequence = (),
                out_dtypes: Sequence, blocks: RowBlocks, name: str, interpret: bool,
                out_cols: Sequence[int | None] | None = None, emit: Callable | None = None,
                emit_dtypes: Sequence = (), in_place: bool = False):
    """Per-row results of folding every column tile of the rows.

    `init(per_row) -> state`; `step(state, tile) -> state`; `finalize(state, per_row) -> tuple
    of [br, 1] arrays`, one per entry of `out_dtypes`. Returns `[n_rows]` arrays.
    `out_cols[i] = w` makes output i a short row per row instead: finalize gives [br, w] and the
    pass returns [n_rows, w] (beam top-k's k best of each row; w a power of two on the GPU).

    `emit(tile, results) -> tuple of [br, bc] tiles` (dtypes `emit_dtypes`, arrays shaped like
    the tiled inputs, returned after the per-row results) makes the pass walk each row a second
    time, after `finalize`, writing what needs the whole row's results (cross-entropy's
    gradient beside its loss): one kernel where a reduce pass and a `map_pass` would read the
    row twice from memory. The second walk goes backwards, so that it first reads again the
    tiles the first walk read last, while L2 may still hold them; a row of one tile is loaded
    once. `in_place=True` writes the first emitted array over the first tiled input (both walks
    read a tile before it is written, in the same program).
    """
    out_cols = tuple(out_cols) if out_cols is not None else (None,) * len(out_dtypes)
    n_rows, n_cols = tiled[0].shape
    b = blocks
    n_tiles = C.cdiv(n_cols, b.block_cols)
    n_inside = n_cols // b.block_cols          # tiles wholly inside a row
    per_col = [p.reshape(1, n_cols) for p in per_col]
    n_in = (len(tiled), len(per_row), len(per_col))

    def kernel(*refs):
        t_refs, r_refs = refs[:n_in[0]], refs[n_in[0]:n_in[0] + n_in[1]]
        c_refs = refs[n_in[0] + n_in[1]:sum(n_in)]
        out_refs, e_refs = (refs[sum(n_in):sum(n_in) + len(out_dtypes)],
                            refs[sum(n_in) + len(out_dtypes):])
        row0 = pl.program_id(0) * b.block_rows
        rows_in = _per_row(r_refs, row0, b, n_rows)

        def tile_at(j, interior):
            col0 = j * b.block_cols
            return _load(t_refs, fills, rows_in, _per_col(c_refs, col0, b, n_cols), row0, col0,
                         b, n_rows, n_cols, interior=interior)

        def body(j, state, interior=True):
            return step(state, tile_at(j, interior))

        def write(tile, results, interior):
            for ref, val in zip(e_refs, emit(tile, results)):
                C.store_tile(ref, val, row0, tile.col0, n_rows, n_cols, cols_inside=interior)

        state = init(rows_in)
        if emit is not None and n_tiles == 1:
            # The whole row is one tile: fold it and emit from the same registers.
            tile = tile_at(jnp.int32(0), n_inside == 1)
            results = finalize(step(state, tile), rows_in)
            write(tile, results, n_inside == 1)
        else:
            # The tiles wholly inside the row first, without column masks (a predicated load,
            # a compare and selects per element, in a pass meant to run at the copy rate),
            # then the ragged last tile, masked.
            if n_inside:
                state = C.reduce_tiles(n_inside, body, state)
            if n_tiles > n_inside:
                state = body(jnp.int32(n_inside), state, interior=False)
            results = finalize(state, rows_in)
            if emit is not None:
                if n_tiles > n_inside:
                    write(tile_at(jnp.int32(n_inside), False), results, False)

                def back(i, carry):
                    write(tile_at(n_inside - 1 - i, True), results, True)
                    return carry

                if n_inside:
                    C.reduce_tiles(n_inside, back, jnp.int32(0))
        for ref, val, w in zip(out_refs, results, out_cols):
            if w is None:
                C.store_vec(ref, val[:, 0], row0, n_rows)
            else:
                C.store_tile(ref, val, row0, 0, n_rows, w)

    out_shape = [jax.ShapeDtypeStruct((n_rows,) if w is None else (n_rows, w), d)
                 for d, w in zip(out_dtypes, out_cols)]
    out_shape += [jax.ShapeDtypeStruct((n_rows, n_cols), d) for d in emit_dtypes]
    if in_place and (not emit_dtypes or emit_dtypes[0] != tiled[0].dtype):
        raise AssertionError("in_place needs a first emitted array of the input's dtype")
    aliases = {0: len(out_dtypes)} if in_place else None
    return C.pallas_call(kernel, out_shape=out_shape, grid=(C.cdiv(n_rows, b.block_rows),),
                         name=name, interpret=interpret, num_warps=b.num_warps,
                         input_output_aliases=aliases)(*tiled, *per_row, *per_col)


def map_pass(emit: Callable, *, tiled: Sequence, fills: Sequence, per_row: Sequence = (),
             per_col: Sequence = (), out_dtypes: Sequence, row_out_dtypes: Sequence = (),
             n_col_sums: int = 0, blocks: RowBlocks, name: str, interpret: bool,
             in_place: bool = False, key: jax.Array | None = None):
    """Tiles written from tiles: `emit(tile) -> (out_tiles, row_outs, col_sums)`.

    `in_place=True` writes the first output over the first tiled input (same shape and dtype;
    each tile is read before it is written, by the same program), saving one [n_rows, n_cols]
    buffer.
    `out_tiles`: [br, bc] values for outputs shaped like the input (dtypes `out_dtypes`).
    `row_outs`: [br, 1] per-row values (only when a row is one tile), dtypes `row_out_dtypes`.
    `col_sums`: [1, bc] float32 values summed over the program's rows into `[groups, n_cols]`.
    `key`: a uint32 [2] array (Philox key words, `jaxfuse._philox`) handed to `emit` as
    `tile.key`, read once per program, so that dropout masks are generated in the kernel.
    """
    n_rows, n_cols = tiled[0].shape
    b = blocks
    n_tiles = C.cdiv(n_cols, b.block_cols)
    if row_out_dtypes and n_tiles != 1:
        raise AssertionError("per-row outputs need whole rows in one tile")
    per_col = [p.reshape(1, n_cols) for p in per_col]
    rpp = b.rows_per_program or b.block_rows
    n_groups = C.cdiv(n_rows, rpp)
    n_chunks = rpp // b.block_rows
    n_in = (len(tiled), len(per_row), len(per_col))
    n_out = (len(out_dtypes), len(row_out_dtypes))
    has_key = key is not None

    def kernel(*refs):
        key_w = tuple(refs[0][i] for i in range(key.shape[0])) if has_key else ()
        refs = refs[1:] if has_key else refs
        t_refs, r_refs = refs[:n_in[0]], refs[n_in[0]:n_in[0] + n_in[1]]
        c_refs = refs[n_in[0] + n_in[1]:sum(n_in)]
        outs = refs[sum(n_in):]
        o_refs, ro_refs = outs[:n_out[0]], outs[n_out[0]:sum(n_out)]
        cs_refs = outs[sum(n_out):]
        group, j = pl.program_id(0), pl.program_id(1)
        col0 = j * b.block_cols
        cols_in = _per_col(c_refs, col0, b, n_cols)   # the same for every chunk of rows

        def chunk(c, sums):
            row0 = group * rpp + c * b.block_rows
            tile = _load(t_refs, fills, _per_row(r_refs, row0, b, n_rows), cols_in, row0, col0,
                         b, n_rows, n_cols, key_w)
            out_tiles, row_outs, col_sums = emit(tile)
            for ref, val in zip(o_refs, out_tiles):
                C.store_tile(ref, val, row0, col0, n_rows, n_cols)
            for ref, val in zip(ro_refs, row_outs):
                C.store_vec(ref, val[:, 0], row0, n_rows)
            # Rows past the end were loaded as fills; zero their contribution explicitly
            # (where the groups tile the rows exactly there are none).
            if n_groups * rpp != n_rows:
                col_sums = [jnp.where(tile.rows < n_rows, v, 0.0) for v in col_sums]
            return tuple(s + jnp.sum(v, axis=0, keepdims=True) for s, v in zip(sums, col_sums))

        init = tuple(jnp.zeros((1, b.block_cols), jnp.float32) for _ in range(n_col_sums))
        # (Loading chunk c + 1 before computing chunk c was no faster: H200, s28-2, fwd+bwd
        # bias_dropout_add 0.311 against 0.275 ms, bias_act_dropout 0.294 / 0.277, add_norm
        # 0.410 / 0.404; 144 registers a thread against 115. benchmarks/NOTES.md s28.)
        sums = C.reduce_tiles(n_chunks, chunk, init)
        for ref, val in zip(cs_refs, sums):
            C.store_tile(ref, val, group, col0, n_groups, n_cols)

    out_shape = ([jax.ShapeDtypeStruct((n_rows, n_cols), d) for d in out_dtypes]
                 + [jax.ShapeDtypeStruct((n_rows,), d) for d in row_out_dtypes]
                 + [jax.ShapeDtypeStruct((n_groups, n_cols), jnp.float32)] * n_col_sums)
    return C.pallas_call(kernel, out_shape=out_shape, grid=(n_groups, n_tiles), name=name,
                         interpret=interpret, num_warps=b.num_warps,
                         input_output_aliases={int(has_key): 0} if in_place else None)(
        *([key] if has_key else []), *tiled, *per_row, *per_col)


def as_rows(x: jax.Array) -> jax.Array:
    """[..., n] -> [rows, n] (a free reshape of a contiguous array)."""
    return x.reshape(-1, x.shape[-1]) if x.ndim != 2 else x
