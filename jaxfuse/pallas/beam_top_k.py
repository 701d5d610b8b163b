"""Beam top-k by hierarchical retrieval and re-ranking (HARS; LightSeq, lecture 10 sec. 6.1).

Selecting the best k of beam_size x V candidates is a large sort. HARS replaces it by:

1. Retrieve (the Pallas kernel): split each beam's V candidates into k groups and take each
   group's maximum; R_beam = min of the k group maxima is a rough k-th largest of that beam, since
   that beam alone has k candidates >= R_beam. The global k-th largest is therefore >= R =
   max over beams of R_beam: every candidate that can make the top k is >= R, so none is missed.
2. Re-rank: keep the candidates >= R (usually a few times k) and sort only those exactly.

The group maxima are a row-wise max over [B * beam_size * k, V / k], computed with the shared
row-reduction pass (`_rows.reduce_pass`). Compaction keeps candidates in flat-index order, so the
exact sort breaks ties by the lower flat index like `lax.top_k`; if ties push more than the
buffer's capacity over R, the op falls back to a full `lax.top_k`, so the result is always exact.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxfuse.pallas import _common as C
from jaxfuse.pallas import _rows
from jaxfuse.pallas._rows import RowBlocks
from jaxfuse.reference import beam_top_k as ref


def group_maxima(total: jax.Array, k: int, *, interpret: bool,
                 block_sizes: RowBlocks | None = None) -> jax.Array:
    """Maxima of k equal groups of each beam's candidates: total [B, K, V] -> [B, K, k]."""
    b, n_beams, v = total.shape
    size = C.cdiv(v, k)
    padded = jnp.pad(total, ((0, 0), (0, 0), (0, k * size - v)), constant_values=-jnp.inf)
    groups = padded.reshape(b * n_beams * k, size)
    blocks = _rows.resolve_blocks(block_sizes, *groups.shape, interpret)

    def step(m, tile):
        return jnp.maximum(m, jnp.max(jnp.where(tile.valid, tile.x[0], C.NEG_INF), axis=-1,
                                      keepdims=True))

    init = lambda _: jnp.full((blocks.block_rows, 1), C.NEG_INF, jnp.float32)
    (m,) = _rows.reduce_pass(init, step, lambda m, _: (m,), tiled=[groups], fills=[C.NEG_INF],
                             out_dtypes=(jnp.float32,), blocks=blocks,
                             name="jaxfuse_beam_group_max", interpret=interpret)
    return m.reshape(b, n_beams, k)


def beam_top_k(log_probs: jax.Array, beam_scores: jax.Array, k: int, *,
               interpret: bool | None = None, block_sizes: RowBlocks | None = None,
               capacity: int | None = None):
    """Pallas HARS beam top-k; identical results to `jaxfuse.reference.beam_top_k`.

    `capacity`: candidates kept for the exact sort (default 4 k, at least 2 beam_size)."""
    ref.validate(log_probs, beam_scores, k)
    interpret = C.resolve_interpret(interpret)
    b, n_beams, v = log_probs.shape
    flat = ref.candidates(log_probs, beam_scores)                           # [B, K * V]
    # lax.top_k orders NaN too: +NaN above +inf, -NaN below -inf. The retrieval ranks by a key
    # that maps them to +-inf (monotone in that order, so the threshold argument holds), and
    # the exact sort below sees the candidates themselves: NaN comes out where lax.top_k puts
    # it instead of poisoning the group maxima and the threshold of its row.
    key = jnp.where(jnp.isnan(flat), jnp.where(jnp.signbit(flat), -jnp.inf, jnp.inf), flat)
    # 1. Retrieve: rough threshold per batch row.
    m = group_maxima(key.reshape(b, n_beams, v), k, interpret=interpret,
                     block_sizes=block_sizes)
    threshold = jnp.max(jnp.min(m, axis=-1), axis=-1)                      # [B]
    keep = key >= threshold[:, None]
    cap = min(n_beams * v, capacity or max(4 * k, 2 * n_beams))

    # 2. Re-rank the few: compact in flat-index order, then an exact (stable) sort of `cap`.
    def rerank(_):
        def one(row, keep_row):
            (idx,) = jnp.nonzero(keep_row, size=cap, fill_value=0)
            vals = jnp.where(jnp.arange(cap) < jnp.sum(keep_row), row[idx], -jnp.inf)
            s, pos = jax.lax.top_k(vals, k)
            return s, idx[pos]
        return jax.vmap(one)(flat, keep)

    def full_sort(_):
        return tuple(jax.lax.top_k(flat, k))

    fits = jnp.all(jnp.sum(keep, axis=-1) <= cap)
    scores, idx = jax.lax.cond(fits, rerank, full_sort, None)
    return scores, (idx // v).astype(jnp.int32), (idx % v).astype(jnp.int32)
