"""Partitioning rules of the row-wise ops: softmax, LayerNorm, RMSNorm, cross-entropy.

Rows are independent, so every leading axis splits freely: each device runs the kernel on its
rows and nothing crosses devices, except the weight and bias gradients of the norms (a sum over
rows: one psum of a [D] float32 vector over the axes that split the rows).

The last axis split across devices: the norms run their statistics pass on each device's
columns and merge the per-row states across devices (LayerNorm's (count, mean, m2, s) and
RMSNorm's sums of squares with `scaled_merge`; the backward psums its two row sums);
cross-entropy merges per-row (m, l, sum of logits, label's logit) the same way (Megatron's
vocab-parallel loss), softmax its per-row (m, l) (and sum(dy y) backward). A causal softmax
keeps its query and key axes whole (the mask needs global indices): a sharding there is
gathered at the op's boundary.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxfuse.pallas import _common as C
from jaxfuse.pallas import _norm, _rows
from jaxfuse.pallas import cross_entropy as _p_ce
from jaxfuse.pallas import softmax as _p_sm
from jaxfuse.pallas._rows import as_rows
from jaxfuse.reference import cross_entropy as _r_ce
from jaxfuse.reference import layer_norm as _r_ln
from jaxfuse.reference import rms_norm as _r_rms
from jaxfuse.reference import softmax as _r_sm
from jaxfuse.sharding._core import Layout, lead, present, vjp_op


def psum_over(x, plan, factors):
    """x summed over the devices that split `factors` (a no-op where none is split)."""
    axes = tuple(a for f in factors for a in plan.get(f, ()))
    return jax.lax.psum(x, axes) if axes else x


# ---- LayerNorm and RMSNorm -------------------------------------------------------------------

def _norm_fwd(cfg, plan, x, *params):
    st = _norm.static((x.size // x.shape[-1], x.shape[-1]), *cfg[:2], **cfg[2])
    w, b = _params(cfg, params)
    axes = plan.get("d", ())
    # RMSNorm's state (count, 0, sum (x/s)^2, s) merges by the same rule (its means are 0): a
    # psum would add sums of squares in different units s.
    merge = functools.partial(_welford_across, axes) if axes else None
    y2, mean, rstd = _norm._forward(as_rows(x), w, b, st, merge=merge)
    return y2.reshape(x.shape), mean.reshape(x.shape[:-1]), rstd.reshape(x.shape[:-1])


def _welford_across(axes, state):
    """Per-row (count, mean, m2, s) of every device's columns, merged with Chan's rule."""
    parts = jax.lax.all_gather(jnp.stack(state), axes)          # [devices, 4, rows]
    merged = tuple(parts[0])
    for i in range(1, parts.shape[0]):
        merged = _r_ln.scaled_merge(merged, tuple(parts[i]))
    return merged


def _norm_bwd(cfg, plan, x, *rest):
    n_params = int(cfg[0]) + int(cfg[1])
    params, (mean, rstd, g) = rest[:n_params], rest[n_params:]
    st = _norm.static((x.size // x.shape[-1], x.shape[-1]), *cfg[:2], **cfg[2])
    w, _ = _params(cfg, params)
    axes = plan.get("d", ())
    merge = (lambda sums: jax.lax.psum(sums, axes)) if axes else None
    dx2, sums = _norm._backward(as_rows(x), w, mean.reshape(-1), rstd.reshape(-1), as_rows(g),
                                st, merge=merge, n_cols=x.shape[-1] * size(axes))
    rows = lead(x.ndim - 1)
    sums = [psum_over(s, plan, rows).astype(p.dtype) for s, p in zip(sums, params)]
    return (dx2.reshape(x.shape), *sums)


def _params(cfg, params):
    it = iter(params)
    return (next(it) if cfg[0] else None), (next(it) if cfg[1] else None)


@functools.lru_cache(maxsize=None)
def _norm_op(ndim: int, has_weight: bool, has_bias: bool, center: bool, eps: float,
             interpret, block_sizes):
    cfg = (has_weight, has_bias, dict(center=center, eps=eps, interpret=interpret,
                                      block_sizes=block_sizes))
    rows = lead(ndim - 1)
    x, row, vec = (*rows, "d"), rows, ("d",)
    params = (vec,) * (int(has_weight) + int(has_bias))
    fwd = Layout((x, *params), (x, row, row), (*rows, "d"))
    # The backward reads x, the parameters and the row statistics, not y.
    bwd = Layout((x, *params, row, row, x), (x, *params), (*rows, "d"))
    return vjp_op(functools.partial(_norm_fwd, cfg), functools.partial(_norm_bwd, cfg), fwd, bwd,
                  n_out=1, diff=(True,) * (1 + len(params)),
                  saved=(True,) * (1 + len(params)) + (False, True, True),
                  name="layer_norm" if center else "rms_norm")


def layer_norm(x, weight=None, bias=None, *, eps=1e-5, interpret=None, block_sizes=None):
    """`jaxfuse.pallas.layer_norm` partitioned over the leading axes of x."""
    _r_ln.validate(x, weight, bias, eps)
    op = _norm_op(x.ndim, weight is not None, bias is not None, True, float(eps), interpret,
                  block_sizes)
    return op(*present(x, weight, bias))[0]


def rms_norm(x, weight=None, *, eps=1e-6, interpret=None, block_sizes=None):
    """`jaxfuse.pallas.rms_norm` partitioned over the leading axes of x."""
    _r_rms.validate(x, weight, eps)
    op = _norm_op(x.ndim, weight is not None, False, False, float(eps), interpret, block_sizes)
    return op(*present(x, weight))[0]


# ---- softmax ---------------------------------------------------------------------------------

def _sm_static(cfg, x):
    return _p_sm.static(x.shape, has_mask=cfg["has_mask"], **cfg["kw"])


def _sm_fwd(cfg, plan, x, *mask):
    mask2 = as_rows(mask[0].astype(jnp.int8)) if mask else None
    axes = plan.get("k", ())
    merge = functools.partial(_merge_max_sum, axes) if axes else None
    return (_p_sm._forward(as_rows(x), mask2, _sm_static(cfg, x), merge).reshape(x.shape),)


def _merge_max_sum(axes, state):
    """Per-row online-softmax (m, l) of every device's columns: m = max m_i,
    l = sum l_i exp(m_i - m) (`_common.rescale`; rows masked everywhere keep m = -inf, l = 0,
    a +inf anywhere gives l = +inf). The softmax's and the vocabulary-parallel loss's merge."""
    m, l = state
    m_all = jax.lax.pmax(m, axes)
    return m_all, jax.lax.psum(l * C.rescale(m, C.finite_shift(m_all)), axes)


def _sm_bwd(cfg, plan, y, dy):
    axes = plan.get("k", ())
    merge = (lambda sums: jax.lax.psum(sums, axes)) if axes else None
    return (_p_sm._backward(as_rows(y), as_rows(dy), _sm_static(cfg, y), merge).reshape(
        y.shape),)


@functools.lru_cache(maxsize=None)
def _softmax_op(ndim: int, has_mask: bool, scale: float, causal: bool, interpret, block_sizes):
    cfg = dict(has_mask=has_mask, kw=dict(scale=scale, causal=causal, interpret=interpret,
                                          block_sizes=block_sizes))
    rows = lead(ndim - 1)
    # causal: the query and key axes keep their offsets (the mask needs global indices)
    splittable = rows[:-1] if causal else (*rows, "k")
    x = (*rows, "k")
    masks = (x,) if has_mask else ()
    fwd = Layout((x, *masks), (x,), splittable)
    # dx = y (dy - rowsum(dy y)): the backward reads y alone (masked entries have y = 0).
    bwd = Layout((x, x), (x,), splittable)
    return vjp_op(functools.partial(_sm_fwd, cfg), functools.partial(_sm_bwd, cfg), fwd, bwd,
                  n_out=1, diff=(True, False)[:1 + has_mask],
                  saved=(False,) * (1 + has_mask) + (True,), name="softmax")


def softmax(x, *, scale=1.0, mask=None, causal=False, interpret=None, block_sizes=None):
    """`jaxfuse.pallas.softmax` partitioned over the leading axes of x."""
    _r_sm.validate(x, mask, causal, scale)
    if mask is not None:
        mask = jnp.broadcast_to(mask, x.shape)
    op = _softmax_op(x.ndim, mask is not None, float(scale), bool(causal), interpret,
                     block_sizes)
    return op(*present(x, mask))[0]


# ---- cross-entropy ---------------------------------------------------------------------------

def _ce_fwd(cfg, plan, logits, labels):
    st = _p_ce.static((labels.size, logits.shape[-1]), **cfg)
    labels1 = labels.reshape(-1).astype(jnp.int32)
    if plan.get("v"):
        loss, lse = ce_vocab_fwd(plan["v"], as_rows(logits), labels1, st)
    else:
        loss, lse = _p_ce._forward(as_rows(logits), labels1, st)
    return loss.reshape(labels.shape), lse.reshape(labels.shape)


def _ce_bwd(cfg, plan, logits, labels, loss, lse, g):
    axes = plan.get("v", ())
    n_local = logits.shape[-1]
    n_cls = n_local * size(axes)
    st = _p_ce.static((labels.size, n_local), **cfg)
    labels1 = labels.reshape(-1).astype(jnp.int32)
    g1 = _r_ce.token_cotangent(g.reshape(-1), labels1, n_cls, st.ignore_index)
    if axes:
        dlogits = ce_vocab_bwd(axes, as_rows(logits), labels1, lse.reshape(-1), g1, st)
    else:
        dlogits = _p_ce._backward(as_rows(logits), labels1, lse.reshape(-1), g1, st)
    return (dlogits.reshape(logits.shape),)


def size(axes) -> int:
    """How many devices the mesh axes `axes` span (1 for none)."""
    return jax.lax.axis_size(axes) if axes else 1


# Vocabulary split across devices (Megatron's vocab-parallel cross-entropy): each device takes
# its slice's per-row (max, sum of exp, sum of logits) in the single-device forward's pass and
# its label logits where the label is in its slice, the four per-row scalars merge across the
# devices (never the logits), the loss follows.

def ce_vocab_fwd(axes, logits2, labels1, st):
    n_local = logits2.shape[1]
    n_cls = n_local * size(axes)
    local = labels1 - jax.lax.axis_index(axes) * n_local      # outside [0, n_local): elsewhere
    m, l, sum_x = _p_ce.row_stats(logits2, st)
    stats = merge_vocab_states(axes, (m, l, sum_x, _p_ce.label_logits(logits2, local)))
    return _p_ce.loss_and_lse(*stats, labels1, n_cls, st)


def merge_vocab_states(axes, state):
    """Per-row (m, l, sum of logits, label's logit) of every device's vocabulary slice merged
    with the online-softmax rule (`_common.rescale`): m = max m_i, l = sum l_i exp(m_i - m);
    the sums add. A +inf logit anywhere gives lse = +inf, as the reference's logsumexp."""
    m, l, sum_x, picked = state
    m, l = _merge_max_sum(axes, (m, l))
    sum_x, picked = jax.lax.psum((sum_x, picked), axes)
    return m, l, sum_x, picked


def ce_vocab_bwd(axes, logits2, labels1, lse, g, st):
    n_local = logits2.shape[1]
    n_cls = n_local * size(axes)
    local = labels1 - jax.lax.axis_index(axes) * n_local

    def emit(tile):
        label, lse_, g_ = tile.per_row
        return (_r_ce.logits_grad(tile.x[0], tile.cols, label, lse_, g_, n_cls,
                                  label_smoothing=st.label_smoothing),), (), ()

    return _rows.map_pass(emit, tiled=[logits2], fills=[0.0], per_row=[local, lse, g],
                          out_dtypes=(logits2.dtype,), blocks=st.blocks,
                          name="jaxfuse_cross_entropy_bwd", interpret=st.interpret)[0]


@functools.lru_cache(maxsize=None)
def _ce_op(ndim: int, label_smoothing: float, ignore_index: int, interpret, block_sizes):
    cfg = dict(label_smoothing=label_smoothing, ignore_index=ignore_index, interpret=interpret,
               block_sizes=block_sizes)
    rows = lead(ndim - 1)
    logits = (*rows, "v")
    fwd = Layout((logits, rows), (rows, rows), (*rows, "v"))
    bwd = Layout((logits, rows, rows, rows, rows), (logits,), (*rows, "v"))
    return vjp_op(functools.partial(_ce_fwd, cfg), functools.partial(_ce_bwd, cfg), fwd, bwd,
                  n_out=1, diff=(True, False), name="cross_entropy")


def cross_entropy(logits, labels, *, label_smoothing=0.0, ignore_index=-100, reduction="mean",
                  interpret=None, block_sizes=None):
    """`jaxfuse.pallas.cross_entropy` partitioned over the token axes and the vocabulary; the
    reduction is plain jax.numpy, which XLA partitions itself (a psum of two scalars)."""
    _r_ce.validate(logits, labels, label_smoothing, reduction, ignore_index)
    labels = _r_ce.canonical_labels(labels, logits.shape[-1], ignore_index)
    op = _ce_op(logits.ndim, float(label_smoothing), int(ignore_index), interpret, block_sizes)
    loss = op(logits, labels)[0]
    return _r_ce.reduce_loss(loss, labels != ignore_index, reduction)
