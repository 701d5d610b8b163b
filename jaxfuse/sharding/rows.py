"""Partitioning rules of the row-wise ops: softmax, LayerNorm, RMSNorm, cross-entropy.

Rows are independent, so every leading axis splits freely: each device runs the kernel on its
rows and nothing crosses devices, except the weight and bias gradients of the norms (a sum over
rows: one psum of a [D] float32 vector over the axes that split the rows). The last axis (and a
causal softmax's query axis, whose mask depends on the global row index) stays whole: a
sharding there is gathered at the op's boundary.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxfuse.pallas import _norm
from jaxfuse.pallas import cross_entropy as _p_ce
from jaxfuse.pallas import softmax as _p_sm
from jaxfuse.pallas._rows import as_rows
from jaxfuse.reference import cross_entropy as _r_ce
from jaxfuse.reference import layer_norm as _r_ln
from jaxfuse.reference import rms_norm as _r_rms
from jaxfuse.reference import softmax as _r_sm
from jaxfuse.sharding._core import Layout, lead, present, vjp_op


def _psum(x, plan, factors):
    axes = tuple(a for f in factors for a in plan.get(f, ()))
    return jax.lax.psum(x, axes) if axes else x


# ---- LayerNorm and RMSNorm -------------------------------------------------------------------

def _norm_fwd(cfg, plan, x, *params):
    st = _norm.static((x.size // x.shape[-1], x.shape[-1]), *cfg[:2], **cfg[2])
    w, b = _params(cfg, params)
    y2, mean, rstd = _norm._forward(as_rows(x), w, b, st)
    return y2.reshape(x.shape), mean.reshape(x.shape[:-1]), rstd.reshape(x.shape[:-1])


def _norm_bwd(cfg, plan, x, *rest):
    n_params = int(cfg[0]) + int(cfg[1])
    params, (_, mean, rstd, g) = rest[:n_params], rest[n_params:]
    st = _norm.static((x.size // x.shape[-1], x.shape[-1]), *cfg[:2], **cfg[2])
    w, _ = _params(cfg, params)
    dx2, sums = _norm._backward(as_rows(x), w, mean.reshape(-1), rstd.reshape(-1), as_rows(g), st)
    rows = lead(x.ndim - 1)
    sums = [_psum(s, plan, rows).astype(p.dtype) for s, p in zip(sums, params)]
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
    fwd = Layout((x, *params), (x, row, row), rows)
    bwd = Layout((x, *params, x, row, row, x), (x, *params), rows)
    return vjp_op(functools.partial(_norm_fwd, cfg), functools.partial(_norm_bwd, cfg), fwd, bwd,
                  n_out=1, diff=(True,) * (1 + len(params)))


def layer_norm(x, weight=None, bias=None, *, eps=1e-5, interpret=None, block_sizes=None):
    """`jaxfuse.pallas.layer_norm` partitioned over the leading axes of x."""
    _r_ln.validate(x, weight, bias)
    op = _norm_op(x.ndim, weight is not None, bias is not None, True, float(eps), interpret,
                  block_sizes)
    return op(*present(x, weight, bias))[0]


def rms_norm(x, weight=None, *, eps=1e-6, interpret=None, block_sizes=None):
    """`jaxfuse.pallas.rms_norm` partitioned over the leading axes of x."""
    _r_rms.validate(x, weight)
    op = _norm_op(x.ndim, weight is not None, False, False, float(eps), interpret, block_sizes)
    return op(*present(x, weight))[0]


# ---- softmax ---------------------------------------------------------------------------------

def _sm_static(cfg, x):
    return _p_sm.static(x.shape, has_mask=cfg["has_mask"], **cfg["kw"])


def _sm_fwd(cfg, plan, x, *mask):
    mask2 = as_rows(mask[0].astype(jnp.int8)) if mask else None
    return (_p_sm._forward(as_rows(x), mask2, _sm_static(cfg, x)).reshape(x.shape),)


def _sm_bwd(cfg, plan, x, *rest):
    y, dy = rest[-2:]
    return (_p_sm._backward(as_rows(y), as_rows(dy), _sm_static(cfg, x)).reshape(x.shape),)


@functools.lru_cache(maxsize=None)
def _softmax_op(ndim: int, has_mask: bool, scale: float, causal: bool, interpret, block_sizes):
    cfg = dict(has_mask=has_mask, kw=dict(scale=scale, causal=causal, interpret=interpret,
                                          block_sizes=block_sizes))
    rows = lead(ndim - 1)
    splittable = rows[:-1] if causal else rows     # causal: the query axis keeps its offsets
    x = (*rows, "k")
    masks = (x,) if has_mask else ()
    fwd = Layout((x, *masks), (x,), splittable)
    bwd = Layout((x, *masks, x, x), (x,), splittable)
    return vjp_op(functools.partial(_sm_fwd, cfg), functools.partial(_sm_bwd, cfg), fwd, bwd,
                  n_out=1, diff=(True, False)[:1 + has_mask])


def softmax(x, *, scale=1.0, mask=None, causal=False, interpret=None, block_sizes=None):
    """`jaxfuse.pallas.softmax` partitioned over the leading axes of x."""
    _r_sm.validate(x, mask, causal)
    if mask is not None:
        mask = jnp.broadcast_to(mask, x.shape)
    op = _softmax_op(x.ndim, mask is not None, float(scale), bool(causal), interpret,
                     block_sizes)
    return op(*present(x, mask))[0]


# ---- cross-entropy ---------------------------------------------------------------------------

def _ce_fwd(cfg, plan, logits, labels):
    st = _p_ce.static((labels.size, logits.shape[-1]), **cfg)
    loss, lse = _p_ce._forward(as_rows(logits), labels.reshape(-1).astype(jnp.int32), st)
    return loss.reshape(labels.shape), lse.reshape(labels.shape)


def _ce_bwd(cfg, plan, logits, labels, loss, lse, g):
    n_cls = logits.shape[-1]
    st = _p_ce.static((labels.size, n_cls), **cfg)
    labels1 = labels.reshape(-1).astype(jnp.int32)
    g1 = _r_ce.token_cotangent(g.reshape(-1), labels1, n_cls, st.ignore_index)
    return (_p_ce._backward(as_rows(logits), labels1, lse.reshape(-1), g1, st).reshape(
        logits.shape),)


@functools.lru_cache(maxsize=None)
def _ce_op(ndim: int, label_smoothing: float, ignore_index: int, interpret, block_sizes):
    cfg = dict(label_smoothing=label_smoothing, ignore_index=ignore_index, interpret=interpret,
               block_sizes=block_sizes)
    rows = lead(ndim - 1)
    logits = (*rows, "v")
    fwd = Layout((logits, rows), (rows, rows), rows)
    bwd = Layout((logits, rows, rows, rows, rows), (logits,), rows)
    return vjp_op(functools.partial(_ce_fwd, cfg), functools.partial(_ce_bwd, cfg), fwd, bwd,
                  n_out=1, diff=(True, False))


def cross_entropy(logits, labels, *, label_smoothing=0.0, ignore_index=-100, reduction="mean",
                  interpret=None, block_sizes=None):
    """`jaxfuse.pallas.cross_entropy` partitioned over the token axes; the reduction is plain
    jax.numpy, which XLA partitions itself (a psum of two scalars)."""
    _r_ce.validate(logits, labels, label_smoothing, reduction, ignore_index)
    labels = _r_ce.canonical_labels(labels, logits.shape[-1], ignore_index)
    op = _ce_op(logits.ndim, float(label_smoothing), int(ignore_index), interpret, block_sizes)
    loss = op(logits, labels)[0]
    return _r_ce.reduce_loss(loss, labels != ignore_index, reduction)
