"""Partitioning rule of `linear_cross_entropy`: tokens split over data axes, the weight's
vocabulary over tensor axes (Megatron's vocab-parallel loss, with the logits never held).

Each device walks its own columns of W with the kernel's slab loop and folds them into the
per-token (m, l, sum of logits, label's logit) with labels shifted to its slice; the four
per-token scalars merge across the vocabulary axes (`rows.merge_vocab_states`), never the
logits. Backward: each device forms dz for its slice, so dW stays sharded like W (summed over
the token axes), and dx = dz W^T is psum'd over the vocabulary axes. D stays whole.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxfuse.pallas import _common as C
from jaxfuse.pallas import linear_cross_entropy as _p_lce
from jaxfuse.pallas import linear_cross_entropy_slabs as _slabs
from jaxfuse.reference import cross_entropy as _r_ce
from jaxfuse.reference import linear_cross_entropy as _r_lce
from jaxfuse.sharding._core import Layout, lead, partitioned, placed_for, residual_name, vjp_op
from jaxfuse.sharding.rows import (ce_vocab_bwd, ce_vocab_fwd, merge_vocab_states, psum_over,
                                   size)


def _setup(cfg, plan, x, w, labels):
    axes = plan.get("v", ())
    x2 = x.reshape(-1, x.shape[-1])
    st = _p_lce.static(x2, w, n_cls=w.shape[1] * size(axes) if axes else None, **cfg)
    offset = jax.lax.axis_index(axes) * w.shape[1] if axes else 0
    return axes, x2, labels.reshape(-1).astype(jnp.int32), st, offset


def _fwd(cfg, plan, x, w, labels):
    axes, x2, labels1, st, offset = _setup(cfg, plan, x, w, labels)
    merge = functools.partial(merge_vocab_states, axes) if axes else None
    loss, lse = _p_lce._forward(x2, w, labels1, st, offset, merge)
    return loss.reshape(labels.shape), lse.reshape(labels.shape)


def _bwd(cfg, plan, x, w, labels, loss, lse, g):
    axes, x2, labels1, st, offset = _setup(cfg, plan, x, w, labels)
    g1 = _r_ce.token_cotangent(g.reshape(-1), labels1, st.classes, st.ignore_index)
    dx, dw = _p_lce._backward(x2, w, labels1 - offset, lse.reshape(-1), g1, st)
    if axes:
        dx = jax.lax.psum(dx, axes)
    return dx.reshape(x.shape), psum_over(dw, plan, lead(x.ndim - 1))


@functools.lru_cache(maxsize=None)
def _op(ndim: int, label_smoothing: float, ignore_index: int, z_loss: float, logits_soft_cap,
        interpret, block_sizes):
    cfg = dict(label_smoothing=label_smoothing, ignore_index=ignore_index, z_loss=z_loss,
               logits_soft_cap=logits_soft_cap, interpret=interpret, block_sizes=block_sizes)
    rows = lead(ndim - 1)
    x, w = (*rows, "d"), ("d", "v")
    fwd = Layout((x, w, rows), (rows, rows), (*rows, "v"))
    bwd = Layout((x, w, rows, rows, rows, rows), (x, w), (*rows, "v"))
    return vjp_op(functools.partial(_fwd, cfg), functools.partial(_bwd, cfg), fwd, bwd,
                  n_out=1, diff=(True, True, False), name="linear_cross_entropy")


def linear_cross_entropy(x, weight, labels, *, label_smoothing=0.0, ignore_index=-100,
                         z_loss=0.0, logits_soft_cap=None, reduction="mean", interpret=None,
                         block_sizes=None):
    """`jaxfuse.pallas.linear_cross_entropy` partitioned over tokens and the vocabulary."""
    _r_lce.validate(x, weight, labels, label_smoothing, reduction, z_loss, logits_soft_cap,
                    ignore_index)
    labels = _r_ce.canonical_labels(labels, weight.shape[1], ignore_index)
    if block_sizes is not None and block_sizes.hopper and C.resolve_interpret(interpret):
        # Mosaic GPU's interpreter runs on ordered io callbacks, which neither
        # custom_partitioning nor custom_vmap carry: interpreted Hopper GEMMs run whole.
        return _p_lce.linear_cross_entropy(
            x, weight, labels, label_smoothing=label_smoothing, ignore_index=ignore_index,
            z_loss=z_loss, logits_soft_cap=logits_soft_cap, reduction=reduction,
            interpret=interpret, block_sizes=block_sizes)
    token_slab = getattr(block_sizes, "token_slab", None)
    if token_slab is not None and _slabs.applies(reduction, z_loss, logits_soft_cap):
        return _slab_op(x.ndim, float(label_smoothing), int(ignore_index), reduction, interpret,
                        block_sizes)(x, weight, labels)
    op = _op(x.ndim, float(label_smoothing), int(ignore_index), float(z_loss),
             None if logits_soft_cap is None else float(logits_soft_cap), interpret, block_sizes)
    loss = op(x, weight, labels)[0]
    return _r_ce.reduce_loss(loss, labels != ignore_index, reduction)


def _vocab_slab_loss(axes, st):
    """`linear_cross_entropy_slabs.slab_loss` for logits whose classes are split over the mesh
    axes `axes` (this device's slice): the vocabulary-parallel cross-entropy's kernels, the
    per-token states merged across the slices (every device gets the whole loss)."""
    def loss_and_dz(z, labels):
        loss, lse = ce_vocab_fwd(axes, z, labels, st)
        g = _r_ce.token_cotangent(jnp.ones_like(loss), labels, z.shape[1] * size(axes),
                                  st.ignore_index)
        return jnp.sum(loss), ce_vocab_bwd(axes, z, labels, lse, g, st)
    return loss_and_dz


@functools.lru_cache(maxsize=None)
def _slab_op(ndim: int, label_smoothing: float, ignore_index: int, reduction: str, interpret,
             block_sizes):
    """`LCEBlocks(token_slab=n)`: the gradient formed in the forward, n tokens at a time, on
    each device's tokens and its slice of the vocabulary
    (`jaxfuse.pallas.linear_cross_entropy_slabs`); the forward alone is the fused op's. The
    backward scales the saved float32 dx and dW by the scalar cotangent."""
    fused_op = _op(ndim, label_smoothing, ignore_index, 0.0, None, interpret, block_sizes)
    rows = lead(ndim - 1)
    x, w = (*rows, "d"), ("d", "v")
    layout = Layout((x, w, rows, ()), ((), x, w), (*rows, "v"))
    kw = dict(label_smoothing=label_smoothing, ignore_index=ignore_index,
              token_slab=block_sizes.token_slab, interpret=interpret)
    name = residual_name("linear_cross_entropy")

    def local(plan, x, w, labels, weight):
        axes = plan.get("v", ())
        vocab = {}
        if axes:      # W a slice of the classes: the slab's loss merges across its devices
            vocab = dict(slab_loss=functools.partial(_vocab_slab_loss, axes),
                         sum_dx=lambda dx: jax.lax.psum(dx, axes))
        loss, dx, dw = _slabs.loss_and_grads(x.reshape(-1, x.shape[-1]), w, labels.reshape(-1),
                                             weight, **kw, **vocab)
        return psum_over(loss, plan, rows), dx.reshape(x.shape), psum_over(dw, plan, rows)

    @jax.custom_vjp
    def op(x, w, labels, weight):
        return _r_ce.reduce_loss(fused_op(x, w, labels)[0], labels != ignore_index, reduction)

    def op_fwd(x, w, labels, weight):
        loss, dx, dw = partitioned(local, layout, (x, w, labels, weight))
        dx, dw = (checkpoint_name(r, name) for r in (dx, dw))
        # The empty arrays carry the input dtypes to the backward.
        return loss, (dx, dw, jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))

    def op_bwd(res, g):
        dx, dw, x_t, w_t = res
        return (g * dx).astype(x_t.dtype), (g * dw).astype(w_t.dtype), None, None

    op.defvjp(op_fwd, op_bwd)

    def call(x, w, labels):
        # Every token's weight in the reduced loss (1 / count, or 1), by the one reduction rule.
        weight = _r_ce.reduce_loss(jnp.float32(1.0), labels != ignore_index, reduction)
        return op(*placed_for(layout, (x, w, labels, weight)))
    return call
