"""Beam-search step from the logits: log-softmax, finished beams, length penalty and the top-k
in two small kernels (HARS, as `beam_top_k`; lecture 10 sec. 6.1).

Written in XLA, a step of beam search over [B, K, V] logits makes and reads several
[B, K * V] float32 arrays (log-probs, the finished beams' eos-only rows, the candidates, a
padded copy for the groups) and sorts the survivors: about ten launches of 1-3 us each, ~14 us
a step beside the top-k kernel and the sort at the 157M model's decoding shape (32 beams,
V = 32768; H100, benchmarks/NOTES.md s44-3). Here:

1. XLA computes each beam's log-softmax statistics (`reference.beam_step.row_stats`: the
   row's max, then the log of the shifted sum: two small reductions).
2. Retrieve (kernel 1): program (row block, group) reads a [rows, width] tile of the logits,
   forms the candidates in registers (`reference.beam_step.candidate`: log-prob, the finished
   beams' eos-only row, the raw score and the length penalty) and keeps the group's k best
   with their log-probs (`beam_top_k.best_k`). Groups lie inside one beam's row: no padded
   copy of the logits, the ragged last group is masked.
3. Re-rank (kernel 2): each batch row's k best of its K * G * k survivors, the same passes,
   made the next beams there: the parents' raw scores, lengths and done flags gathered, the
   winners' log-probs added (what `reference.beam_step.finish` does in XLA).

On the GPU a group's list has next_pow2(k) slots (Triton's tiles), the last ones empty
(key _KEY_MIN, index _RETIRED: never a winner); more survivors than one program holds (a wide
beam over a huge vocabulary) are re-ranked by XLA's top_k of their keys instead.

Exact by construction, as `beam_top_k`: a candidate in a row's top k has fewer than k
candidates above it, so fewer than k in its group, so it survives; both steps rank by
`order_key` and take the lowest flat index among equal keys, which is `lax.top_k`'s order. The
kernel evaluates the reference's own `candidate` on the same float32 inputs, so the two paths
select the same beams and return the same bits.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxfuse.pallas import _common as C
from jaxfuse.pallas import _rows
from jaxfuse.pallas._rows import RowBlocks
from jaxfuse.pallas.beam_top_k import _KEY_MIN, _MAX_PASSES, _RETIRED, best_k, group_width, \
    order_key
from jaxfuse.reference import beam_step as ref


def _retrieve(x, per_row, norm, k: int, eos_id: int, width: int, blocks: RowBlocks,
               interpret: bool):
    """Every group's k best of logits x [R = B * K, V] (K = k beams a batch row), with the
    beams' (m, ls, raw, done) and norm (or None), each [R]: (keys, flat indices i * V + j,
    log-probs), each [R, G * out_w], group after group, each group's list best first."""
    r, v = x.shape
    n_groups = C.cdiv(v, width)
    out_w = k if interpret else C.next_pow2(k)   # Triton tiles are powers of two
    br = blocks.block_rows
    has_norm = norm is not None
    per_row = list(per_row) + ([norm] if has_norm else [])

    def kernel(x_ref, *refs):
        row_refs, (key_ref, idx_ref, lp_ref) = refs[:len(per_row)], refs[len(per_row):]
        row0, col0 = pl.program_id(0) * br, pl.program_id(1) * width
        tile, rows, cols, valid = C.load_tile(x_ref, row0, col0, br, width, r, v)
        m, ls, raw, done, *norm = (C.load_vec(ref_, row0, br, r)[:, None] for ref_ in row_refs)
        cand, logp = ref.candidate(tile.astype(jnp.float32), m, ls, raw,
                                   norm[0] if has_norm else None, done != 0, cols, eos_id)
        key = jnp.where(valid, order_key(cand), _KEY_MIN)
        idx = jnp.where(valid, (rows % k) * v + cols, _RETIRED)
        out_col = pl.program_id(1) * out_w
        for ref_, val in zip((key_ref, idx_ref, lp_ref), best_k(key, idx, k, out_w, (logp,))):
            C.store_tile(ref_, val, row0, out_col, r, n_groups * out_w)

    shape = (r, n_groups * out_w)
    return C.pallas_call(
        kernel, out_shape=[jax.ShapeDtypeStruct(shape, d)
                           for d in (jnp.int32, jnp.int32, jnp.float32)],
        grid=(C.cdiv(r, br), n_groups), name="jaxfuse_beam_step_retrieve", interpret=interpret,
        num_warps=blocks.num_warps)(x, *per_row)


# 4 warps, not the row rule's 2 (8 rows of 256 survivors): 2.8 against 3.8 us on an H100 at
# the 157M model's beam search (B8 K4 V32768; 1 warp 4.0; s45-2). The retrieval's tile is the
# rule's (2 rows x 2048, 4 warps: 5.0 us; 1 row 4.8-4.9, 8 warps 5.2-5.9).
_RERANK_WARPS = 4


def _rerank_max_cols(interpret: bool) -> int | None:
    """Most survivors a re-rank program holds (None: any; interpreted, a step is the row)."""
    return None if interpret else _rows._GPU_MAX_TILE_COLS


def _rerank(keys, idx, logp, parents, v: int, eos_id: int, interpret: bool):
    """Each row's k best survivors made the next beams: (parent, token, raw, lengths, done),
    each [B, k], from `parents` = (raw, length with this step's token, done as int32), each
    [B, k]."""
    b, n = keys.shape
    k = parents[0].shape[1]
    limit = _rerank_max_cols(interpret)
    if limit is not None and n > limit:
        # More survivors than a program holds (a wide beam over a huge vocabulary): XLA's
        # top_k of the keys, whose ties go to the lower position, i.e. the lower flat index
        # (groups lie in flat order, and a group's list in index order among equal keys; an
        # empty slot's key _KEY_MIN ties only with a -NaN whose payload bits are all set).
        _, pos = jax.lax.top_k(keys, k)
        take = lambda a: jnp.take_along_axis(a, pos, axis=1)
        raw, length, done = parents
        return ref.finish(take(idx), take(logp), raw, length, done != 0, v, eos_id)
    out_w = k if interpret else C.next_pow2(k)
    blocks = _rows.RowBlocks.for_shape(b, n, interpret=interpret)
    br, bc = blocks.block_rows, blocks.block_cols
    # The parents' raw scores, lengths and flags as int32 bits: an integer sum of one nonzero
    # term is that term exactly (a float sum would turn -0.0 into +0.0).
    raw, length, done = parents
    bits = (jax.lax.bitcast_convert_type(raw, jnp.int32), length, done)

    def kernel(key_ref, idx_ref, lp_ref, raw_ref, len_ref, done_ref, *out_refs):
        row0 = pl.program_id(0) * br
        load = lambda ref_, fill, w, n_: C.load_tile(ref_, row0, 0, br, w, b, n_, other=fill)[0]
        _, flat, lp = best_k(load(key_ref, _KEY_MIN, bc, n), load(idx_ref, _RETIRED, bc, n),
                             k, out_w, (load(lp_ref, 0.0, bc, n),))
        parent, token = flat // v, flat % v                                  # [br, out_w]
        beam = jax.lax.broadcasted_iota(jnp.int32, (br, out_w), 1)

        def of_parent(ref_):     # [br, out_w]: the parent's entry of a [B, k] int32 array
            vals = load(ref_, 0, out_w, k)
            out = jnp.zeros_like(parent)
            for i in range(k):   # k is small (<= _MAX_PASSES) and static
                # dtype: under jax_enable_x64 an int32 sum is int64, which the bitcast to
                # float32 below would split in two.
                vi = jnp.sum(jnp.where(beam == i, vals, 0), axis=-1, keepdims=True,
                             dtype=jnp.int32)
                out = jnp.where(parent == i, vi, out)
            return out

        new_raw = jax.lax.bitcast_convert_type(of_parent(raw_ref), jnp.float32) + lp
        new_done = (of_parent(done_ref) != 0) | (token == eos_id)
        for ref_, val in zip(out_refs, (parent, token, new_raw, of_parent(len_ref),
                                        new_done.astype(jnp.int32))):
            C.store_tile(ref_, val, row0, 0, b, out_w)

    dtypes = (jnp.int32, jnp.int32, jnp.float32, jnp.int32, jnp.int32)
    outs = C.pallas_call(
        kernel, out_shape=[jax.ShapeDtypeStruct((b, out_w), d) for d in dtypes],
        grid=(C.cdiv(b, br),), name="jaxfuse_beam_step_rerank", interpret=interpret,
        num_warps=_RERANK_WARPS)(keys, idx, logp, *bits)
    parent, token, raw, length, done = (o[:, :k] for o in outs)
    return parent, token, raw, length, done != 0


def beam_step(logits: jax.Array, raw_scores: jax.Array, lengths: jax.Array, done: jax.Array,
              *, eos_id: int, length_penalty: float = 0.0, interpret: bool | None = None,
              block_sizes: RowBlocks | None = None):
    """Pallas beam-search step; the same results as `jaxfuse.reference.beam_step`, bit for bit.
    `block_sizes`: rows and columns of the retrieval's tile (`block_cols`, the group width,
    at least the beam count K)."""
    ref.validate(logits, raw_scores, lengths, done, eos_id, length_penalty)
    interpret = C.resolve_interpret(interpret)
    b, k, v = logits.shape
    if k > _MAX_PASSES:          # k passes would be a slow sort: the reference's top_k
        return ref.beam_step(logits, raw_scores, lengths, done, eos_id=eos_id,
                             length_penalty=length_penalty)
    eos_id = ref.eos_index(eos_id, v)
    m, ls, raw, length, norm = ref.beam_values(logits, raw_scores, lengths, done,
                                               length_penalty)
    # Groups inside a beam's row, as wide as `beam_top_k`'s over the flat row would be.
    width = min(group_width(k * v, k, interpret=interpret, block_sizes=block_sizes),
                max(v if interpret else C.next_pow2(v), k if interpret else C.next_pow2(k)))
    blocks = _rows.resolve_blocks(block_sizes, b * k, width, interpret)
    done = done.astype(jnp.int32)           # both kernels read the flags as int32
    flat = lambda a: None if a is None else a.reshape(b * k)
    keys, idx, logp = _retrieve(logits.reshape(b * k, v), [flat(a) for a in (m, ls, raw, done)],
                                flat(norm), k, eos_id, width, blocks, interpret)
    return _rerank(*(a.reshape(b, -1) for a in (keys, idx, logp)), (raw, length, done), v,
                   eos_id, interpret)
