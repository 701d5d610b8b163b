"""Fused cross-entropy with label smoothing: one read of the logits forward, one read and one
write backward (lecture 10, sec. 5.2).

Forward: a single pass over each row folds, tile by tile, the online max and sum of exp (so the
log-sum-exp) and, with label smoothing, the sum of the logits; the label's logit x_y (one element
a row) is gathered before the pass. It writes the per-token loss and the row's lse, nothing of
size V:

    loss = lse - (1 - a) x_y - (a / V) sum_i x_i.

Backward (`custom_vjp`, saves logits, labels, lse): d logits = (q - p) * g with q = exp(x - lse)
and p = (1 - a) onehot(y) + a / V, written tile by tile. The per-token cotangent g is 0 at
ignored tokens and NaN at out-of-range labels, so those propagate the same way as the loss.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxfuse.pallas import _common as C
from jaxfuse.pallas import _rows
from jaxfuse.pallas._rows import RowBlocks
from jaxfuse.reference import cross_entropy as ref


@dataclasses.dataclass(frozen=True)
class _Static:
    label_smoothing: float
    ignore_index: int
    blocks: RowBlocks
    interpret: bool


def fold_logits(state, x, valid, cols, label):
    """One tile of logits x [br, bc] folded into the per-row state (m, l, sum of logits, label's
    logit), each [br, 1], for linear + cross-entropy, which meets its logits slab by slab in
    its kernels and cannot gather the label's logit beforehand (this module's own pass keeps
    lighter per-lane sums, `_stats_pass`). x must be 0 outside the array (the tiles are loaded
    with fill 0), so the sum needs no mask."""
    m, l, sum_x, picked = state
    m, l = C.online_max_sum((m, l), jnp.where(valid, x, C.NEG_INF))
    sum_x = sum_x + jnp.sum(x, axis=-1, keepdims=True)
    picked = picked + jnp.sum(jnp.where(cols == label, x, 0.0), axis=-1, keepdims=True)
    return m, l, sum_x, picked


def empty_state(rows: int):
    z = jnp.zeros((rows, 1), jnp.float32)
    return jnp.full((rows, 1), C.NEG_INF, jnp.float32), z, z, z


def _forward(logits2, labels, st: _Static, emit=None, emit_dtypes=(),
             name: str = "jaxfuse_cross_entropy_fwd"):
    """(per-token loss, lse), both [N] float32, in one pass over the logits (`row_stats`);
    with `emit`, then the arrays of `_rows.reduce_pass`'s second walk (`loss_and_grad`)."""
    n_cls = logits2.shape[1]

    def finalize(stats, per_row):
        return loss_and_lse(*stats, per_row[1], per_row[0], n_cls, st)

    return _stats_pass(logits2, st, finalize, (jnp.float32,) * 2,
                       per_row=[labels, label_logits(logits2, labels)], emit=emit,
                       emit_dtypes=emit_dtypes, name=name)


def loss_and_lse(m, l, sum_x, picked, labels, n_cls: int, st: _Static):
    """(per-token loss, lse) from a row's (max, sum of exp, sum of logits, label's logit) over
    all `n_cls` classes: in the forward's pass, or after the vocabulary-parallel merge."""
    lse = m + jnp.log(l)
    return ref.loss_from_stats(lse, picked, sum_x, labels, n_cls,
                               label_smoothing=st.label_smoothing,
                               ignore_index=st.ignore_index), lse


def row_stats(logits2, st: _Static):
    """Per-row (max, sum of exp(x - finite_shift(max)), sum of logits), each [N] float32, of
    logits2 [N, V] in one pass (the sum of logits only with label smoothing, else 0): what the
    vocabulary-parallel loss merges across the devices that split the classes
    (`sharding.rows`)."""
    return _stats_pass(logits2, st, lambda stats, _: stats, (jnp.float32,) * 3)


def label_logits(logits2, labels):
    """Each row's logit at its label, float32 [N]; 0 where the label is not one of logits2's
    classes (ignored, out of range, or on another device's slice of the vocabulary)."""
    n_cls = logits2.shape[1]
    inside = (labels >= 0) & (labels < n_cls)
    x = jnp.take_along_axis(logits2, jnp.clip(labels, 0, n_cls - 1)[:, None], axis=1)[:, 0]
    return jnp.where(inside, x.astype(jnp.float32), 0.0)


def _stats_pass(logits2, st: _Static, finalize, out_dtypes, per_row=(), emit=None,
                emit_dtypes=(), name: str = "jaxfuse_cross_entropy_fwd"):
    """The forward's one pass over logits2 [N, V]: `finalize((m, l, sum of logits) as [br, 1]
    each, per_row)` gives its outputs.

    The pass should run at the copy rate, so it does as little per element as it can: the
    label's logit (one element a row) is gathered by XLA beforehand (`label_logits`) instead
    of found by comparing every column with the label; the sum of logits is only formed with
    label smoothing; and the running sums are per-lane vectors ([rows, tile] wide) reduced once
    at the row's end, leaving one cross-lane reduction per tile (the max). Run s8-4 (H200,
    [2048, 128256] bf16): 0.268 -> 0.193 ms, BENCHMARKS.md. `emit`, `emit_dtypes`:
    `_rows.reduce_pass`'s second walk, written over the logits (`loss_and_grad`)."""
    b, a = st.blocks, st.label_smoothing

    def init(_):
        lanes = jnp.zeros((b.block_rows, b.block_cols), jnp.float32)
        return jnp.full((b.block_rows, 1), C.NEG_INF, jnp.float32), lanes, lanes

    def step(state, tile):
        m, l, sum_x = state
        x = tile.x[0]
        m_new = jnp.maximum(m, jnp.max(jnp.where(tile.valid, x, C.NEG_INF), axis=-1,
                                       keepdims=True))
        # As the reference's logsumexp (`C.online_max_sum`): a max of +inf gives lse = +inf,
        # not NaN. exp(-inf) = 0 drops what lies outside the array; the old lanes are rescaled
        # by one exponential per row.
        shift = C.finite_shift(m_new)
        l = l * C.rescale(m, shift) + jnp.where(tile.valid, jnp.exp(x - shift), 0.0)
        return m_new, l, (sum_x + x) if a else sum_x     # x is 0 outside (fill 0)

    def totals(state, per_row):
        m, l, sum_x = state
        return finalize((m, jnp.sum(l, axis=-1, keepdims=True),
                         jnp.sum(sum_x, axis=-1, keepdims=True)), per_row)

    return _rows.reduce_pass(init, step, totals, tiled=[logits2], fills=[0.0],
                             per_row=list(per_row), out_dtypes=out_dtypes, blocks=b,
                             name=name, interpret=st.interpret, emit=emit,
                             emit_dtypes=emit_dtypes, in_place=emit is not None)


def _backward(logits2, labels, lse, g, st: _Static):
    n_cls = logits2.shape[1]
    a = st.label_smoothing

    def emit(tile):
        label, lse_, g_ = tile.per_row
        return (ref.logits_grad(tile.x[0], tile.cols, label, lse_, g_, n_cls,
                                label_smoothing=a),), (), ()

    (dlogits,) = _rows.map_pass(emit, tiled=[logits2], fills=[0.0], per_row=[labels, lse, g],
                                out_dtypes=(logits2.dtype,), blocks=st.blocks,
                                name="jaxfuse_cross_entropy_bwd", interpret=st.interpret)
    return dlogits


def loss_and_grad(logits2, labels, st: _Static):
    """(per-token loss [N] float32, the gradient of the summed loss d sum(loss) / d logits2
    [N, V] in the logits' dtype) in one kernel, for a caller that knows its cotangent is 1
    before it has the loss (the linear + cross-entropy slabs, `linear_cross_entropy_slabs`).

    `token_loss` and its backward read the logits twice from memory (the forward's pass for
    lse, the backward's for q - p) in two kernels; here each program walks its row for lse,
    then walks it again (backwards, from L2 where it can) writing q - p over the logits, or,
    where a row is one tile, writes it from the registers it was loaded into. The logits'
    buffer becomes dz's: a caller that still holds the logits makes XLA copy them first (the
    memory traffic this kernel exists to save). The same tile sums and the same per-element
    formula as the pair: with the same tiles the results are bitwise those of `jax.vjp` of
    `token_loss`."""
    n_cls = logits2.shape[1]

    def emit(tile, results):
        label = tile.per_row[0]
        g = ref.token_cotangent(jnp.float32(1.0), label, n_cls, st.ignore_index)
        return (ref.logits_grad(tile.x[0], tile.cols, label, results[1], g, n_cls,
                                label_smoothing=st.label_smoothing),)

    loss, _, dlogits = _forward(logits2, labels, st, emit=emit, emit_dtypes=(logits2.dtype,),
                                name="jaxfuse_cross_entropy_loss_grad")
    return loss, dlogits


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def token_loss(logits2, labels, st: _Static):
    """Per-token loss [N] of logits [N, V] (0 at ignored tokens, NaN at out-of-range labels)."""
    return _forward(logits2, labels, st)[0]


def _token_loss_fwd(logits2, labels, st):
    loss, lse = _forward(logits2, labels, st)
    return loss, (logits2, labels, lse)


def _token_loss_bwd(st, res, g):
    logits2, labels, lse = res
    g = ref.token_cotangent(g, labels, logits2.shape[1], st.ignore_index)
    return (_backward(logits2, labels, lse, g, st),
            jnp.zeros(labels.shape, jax.dtypes.float0))


token_loss.defvjp(_token_loss_fwd, _token_loss_bwd)


def cross_entropy(logits: jax.Array, labels: jax.Array, *, label_smoothing: float = 0.0,
                  ignore_index: int = -100, reduction: str = "mean",
                  interpret: bool | None = None, block_sizes: RowBlocks | None = None) -> jax.Array:
    """Pallas cross-entropy; see `jaxfuse.reference.cross_entropy` for the exact semantics."""
    ref.validate(logits, labels, label_smoothing, reduction, ignore_index)
    logits2 = _rows.as_rows(logits)
    labels = ref.canonical_labels(labels, logits.shape[-1], ignore_index)
    labels1 = labels.reshape(-1)
    st = static(logits2.shape, label_smoothing=label_smoothing, ignore_index=ignore_index,
                interpret=interpret, block_sizes=block_sizes)
    loss = token_loss(logits2, labels1, st).reshape(labels.shape)
    return ref.reduce_loss(loss, labels != ignore_index, reduction)


def static(shape2, *, label_smoothing: float, ignore_index: int, interpret: bool | None,
           block_sizes: RowBlocks | None) -> _Static:
    """The kernels' settings for [n_tokens, V] logits (also used per shard by `sharding`)."""
    interpret = C.resolve_interpret(interpret)
    blocks = _rows.resolve_blocks(block_sizes, *shape2, interpret)
    return _Static(float(label_smoothing), int(ignore_index), blocks, interpret)
