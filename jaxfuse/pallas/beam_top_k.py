"""Beam top-k by hierarchical retrieval and re-ranking (HARS; LightSeq, lecture 10 sec. 6.1).

Selecting the best k of beam_size x V candidates is a large sort. HARS replaces it by a cheap
retrieval followed by an exact re-rank of the few candidates retrieved. Here the retrieval keeps
enough that the re-rank is always exact: no overflow check, so no branch on the data (a fallback
taken on overflow cost a device-to-host sync every step of beam search's decoding loop):

1. Retrieve (the Pallas kernel): split each batch row's beam_size * V flat candidates into G
   contiguous groups of `width` (one kernel tile each) and keep every group's own top k, best
   first, ties to the lower flat index.
2. Re-rank: `lax.top_k` over the G * k survivors, laid out group after group.

Exact by construction: a candidate in the global top k has fewer than k candidates ranked above
it anywhere, so fewer than k in its own group, so it survives. Survivors that tie are laid out in
flat-index order (lower group first, and within a group the passes take the lower index first),
so `lax.top_k`'s tie rule on the survivors is its tie rule on the whole row.

Both steps rank by an int32 key that orders floats as `lax.top_k` does on a CPU (a total order:
-NaN below -inf, -0 below +0, +NaN above +inf), so ties in the key are exactly ties in `lax.top_k`;
(on the GPU, XLA's TopK kernel for long rows ranks +inf above +NaN, measured on an H200: there the
reference and this kernel differ for NaN candidates only, and this kernel keeps the total order);
the returned scores are the candidates themselves, gathered at the winning flat indices. The
group's top k are k passes over the tile in registers (max, first index of the max, retire it);
a k beyond `_MAX_PASSES` would make that a slow sort of the whole row, so such a k (a static
property of the call, not of the data) takes `lax.top_k` of the row directly.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxfuse.pallas import _common as C
from jaxfuse.pallas import _rows
from jaxfuse.pallas._rows import RowBlocks
from jaxfuse.reference import beam_top_k as ref

_GPU_GROUP_COLS = 2048   # one group per tile, held in registers by one program
_MAX_SURVIVORS = 512     # per batch row: the re-rank stays a small top-k
_MAX_PASSES = 64         # beam widths are far below this; larger k are a sort anyway
_KEY_MIN = jnp.iinfo(jnp.int32).min   # below every key but -NaN with all payload bits set
_RETIRED = jnp.iinfo(jnp.int32).max   # flat index of an entry already taken by a pass


def order_key(x: jax.Array) -> jax.Array:
    """float32 -> int32, monotone in `lax.top_k`'s total order: negative floats are sign and
    magnitude, so flipping their magnitude bits makes larger magnitudes smaller integers."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def best_k(key, idx, k: int, out_w: int, values=()):
    """The k best entries of each row of a tile, best first: k passes (max key, first flat
    index of the max, retire it). key, idx int32 [br, n] (idx == _RETIRED: not a candidate);
    `values`: float32 [br, n] arrays whose winners' entries are returned too. Returns
    ([br, out_w] keys, flat indices, *values); slots past k hold (_KEY_MIN, _RETIRED, 0)."""
    slots = jax.lax.broadcasted_iota(jnp.int32, (key.shape[0], out_w), 1)

    def take_best(i, carry):
        idx, top_key, top_idx, *tops = carry
        live = idx != _RETIRED
        m = jnp.max(jnp.where(live, key, _KEY_MIN), axis=-1, keepdims=True)   # [br, 1]
        # Retired entries may share the key m (_KEY_MIN) but carry the index _RETIRED, above
        # every live one, so the first index of the max is a live entry's.
        first = jnp.min(jnp.where(key == m, idx, _RETIRED), axis=-1, keepdims=True)
        # One entry (live flat indices are distinct), or none where the tile has fewer than
        # k live entries and `first` is _RETIRED.
        hit = (idx == first) & (first != _RETIRED)
        here = slots == i
        tops = [jnp.where(here, jnp.sum(jnp.where(hit, v, 0.0), axis=-1, keepdims=True), t)
                for v, t in zip(values, tops)]
        return (jnp.where(hit, _RETIRED, idx), jnp.where(here, m, top_key),
                jnp.where(here, first, top_idx), *tops)

    init = (idx, jnp.full(slots.shape, _KEY_MIN, jnp.int32),
            jnp.full(slots.shape, _RETIRED, jnp.int32),
            *(jnp.zeros(slots.shape, jnp.float32) for _ in values))
    return tuple(C.reduce_tiles(k, take_best, init)[1:])


def group_width(n: int, k: int, *, interpret: bool, block_sizes: RowBlocks | None) -> int:
    """Columns per group: the tile's. In interpret mode one group is the whole row (a step costs
    its operands, so one big step is cheapest); on the GPU 2048 columns, wider (up to the
    longest tile a program holds) where that many groups would leave more than _MAX_SURVIVORS
    survivors, and never fewer than k: a group must hold k entries for its top k to be real
    candidates."""
    if block_sizes is not None:
        if block_sizes.block_cols < k:
            raise ValueError(f"block_sizes.block_cols={block_sizes.block_cols} is the group "
                             f"width and must be >= k={k}")
        return block_sizes.block_cols
    if interpret:
        return n
    width = min(max(_GPU_GROUP_COLS, C.next_pow2(C.cdiv(n * k, _MAX_SURVIVORS))),
                _rows._GPU_MAX_TILE_COLS)
    return max(min(C.next_pow2(n), width), C.next_pow2(k))


def group_top_k(flat: jax.Array, k: int, *, interpret: bool,
                block_sizes: RowBlocks | None = None) -> tuple[jax.Array, jax.Array]:
    """Every group's k best: flat [B, n] float32 -> (keys, flat indices), both int32 [B, G * k],
    group after group, each group's list best first."""
    b, n = flat.shape
    width = group_width(n, k, interpret=interpret, block_sizes=block_sizes)
    n_groups = C.cdiv(n, width)
    # Padding sits only at the end of a batch row: past every real candidate in flat order, so
    # a padded survivor (key _KEY_MIN, like the lowest real key) loses every tie it could enter.
    groups = jnp.pad(flat, ((0, 0), (0, n_groups * width - n))).reshape(b * n_groups, width)
    blocks = _rows.resolve_blocks(block_sizes, *groups.shape, interpret)
    out_w = k if interpret else C.next_pow2(k)   # Triton tiles are powers of two

    def init(_):
        return (jnp.full((blocks.block_rows, out_w), _KEY_MIN, jnp.int32),
                jnp.full((blocks.block_rows, out_w), _RETIRED, jnp.int32))

    def step(state, tile):
        # A group is one tile, so the fold over tiles is this one step.
        idx = (tile.rows % n_groups) * width + tile.cols                   # [br, width]
        key = jnp.where(idx < n, order_key(tile.x[0]), _KEY_MIN)            # [br, width]
        return best_k(key, idx, k, out_w)

    top_key, top_idx = _rows.reduce_pass(
        init, step, lambda s, _: s, tiled=[groups], fills=[0.0], out_dtypes=(jnp.int32,) * 2,
        out_cols=(out_w, out_w), blocks=blocks, name="jaxfuse_beam_group_top_k",
        interpret=interpret)
    return (top_key[:, :k].reshape(b, n_groups * k), top_idx[:, :k].reshape(b, n_groups * k))


def beam_top_k(log_probs: jax.Array, beam_scores: jax.Array, k: int, *,
               interpret: bool | None = None, block_sizes: RowBlocks | None = None,
               capacity: int | None = None):
    """Pallas HARS beam top-k; identical results to `jaxfuse.reference.beam_top_k`, NaN
    candidates included where `lax.top_k` keeps its total order (a CPU; on a GPU XLA's TopK for
    long rows puts +inf above +NaN, and this kernel keeps the total order: module docstring).

    `block_sizes.block_cols` is the group width (at least k). `capacity` is ignored: it sized
    the re-rank buffer of an earlier scheme whose overflow needed a fallback; the survivors now
    always fit. It is still accepted so that callers passing it keep working."""
    del capacity
    ref.validate(log_probs, beam_scores, k)
    interpret = C.resolve_interpret(interpret)
    v = log_probs.shape[-1]
    flat = ref.candidates(log_probs, beam_scores)                           # [B, K * V]
    if k > _MAX_PASSES:
        scores, idx = jax.lax.top_k(flat, k)
    else:
        keys, survivors = group_top_k(flat, k, interpret=interpret, block_sizes=block_sizes)
        _, pos = jax.lax.top_k(keys, k)                                     # [B, k]
        idx = jnp.take_along_axis(survivors, pos, axis=-1)
        scores = jnp.take_along_axis(flat, idx, axis=-1)
    return scores, (idx // v).astype(jnp.int32), (idx % v).astype(jnp.int32)
