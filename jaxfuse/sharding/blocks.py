"""Partitioning rules of the block ops: swiglu, rope, add_norm, the dropout family (dropout,
bias_dropout_add, bias_act_dropout), embedding, and beam search's beam_top_k (over the batch).

All of them are row-wise (or elementwise): their leading axes split freely and nothing crosses
devices, except the gradients of the weights shared by every row (norm weight and bias, the
dropout ops' bias, the embedding tables: a psum over the axes that split the rows).

Dropout masks are those of the whole array on one device: the mask is defined by global
element indices (`jaxfuse._philox`), so each shard's kernel gets its key words extended with
its row map (`pallas._rng.shard_rows`: the global index of its local rows) and draws exactly
the one-device mask on its rows. The map covers a split of the first two leading axes (e.g.
[batch, time] of [B, T, D] activations); with dropout on, the others and the last axis stay
whole (a sharding there is gathered at the op's boundary). Without dropout every axis but a
norm's or RoPE's last one may split (SwiGLU and the dropout family are elementwise there).

embedding: rows split freely; the table's vocabulary splits over devices (tensor parallel:
each device looks up the tokens in its slice and adds zero for the others, then one psum of the
output; the backward's table gradient stays split) when there is no position table, and its
d_model when there is no dropout.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from jaxfuse import _auto_axes, _philox
from jaxfuse.pallas import _common as C
from jaxfuse.pallas import _dropout, _norm, _rng, _rows
from jaxfuse.pallas import add_norm as _p_an
from jaxfuse.pallas import beam_step as _p_step
from jaxfuse.pallas import beam_top_k as _p_topk
from jaxfuse.pallas import embedding as _p_emb
from jaxfuse.pallas import reorder_beams as _p_reo
from jaxfuse.pallas import rope as _p_rope
from jaxfuse.pallas import rope_qkv as _p_rq
from jaxfuse.pallas import swiglu as _p_swiglu
from jaxfuse.pallas._rows import RowBlocks, as_rows
from jaxfuse.reference import add_norm as _r_an
from jaxfuse.reference import add_norm_linear as _r_anl
from jaxfuse.reference import beam_step as _r_step
from jaxfuse.reference import beam_top_k as _r_topk
from jaxfuse.reference import bias_act_dropout as _r_bad
from jaxfuse.reference import bias_dropout_add as _r_bda
from jaxfuse.reference import dropout as _r_drop
from jaxfuse.reference import embedding as _r_emb
from jaxfuse.reference import reorder_beams as _r_reo
from jaxfuse.reference import rope as _r_rope
from jaxfuse.reference import rope_qkv as _r_rq
from jaxfuse.reference import swiglu as _r_swiglu
from jaxfuse.reference import swiglu_linear as _r_swl
from jaxfuse.sharding._core import (Layout, lead, partitioned, placed_for,
                                   present, residual_name, spec_axes, vjp_op)
from jaxfuse.sharding.rows import psum_over, size

KEY = ("k",)         # Philox key words: never split


def shard_key(key_w, plan, lead_shape, rows):
    """The key words with this shard's row map when the plan splits its rows (only the first
    two leading factors are ever split with dropout on)."""
    split = [plan.get(f, ()) for f in rows]
    if not any(split):
        return key_w
    glob = tuple(d * size(a) for d, a in zip(lead_shape, split))
    offsets = [jax.lax.axis_index(a) * d if a else 0 for a, d in zip(split[:2], lead_shape[:2])]
    return _rng.shard_rows(key_w, lead_shape, glob, offsets)


def _row_splittable(rows, dropout: bool):
    return rows[:2] if dropout else rows


def _vjp_local(local, n_args: int, diff, summed=(), shape_only=()):
    """A backward pass for `local(plan, *args) -> outputs`: its own jax.vjp on the shard (the
    kernels' custom_vjp; the recomputed forward is dead code where its residuals are inputs),
    the gradients of the operands in `summed` (shared by every row) psum'd over `summed[i]`.
    Its operands are the args and the cotangents (the outputs are not saved), but for the args
    in `shape_only`: the kernels' backward reads only their shape and dtype, which are the
    first output's, so they are not kept and zeros of the first cotangent stand in."""
    def bwd(plan, *rest):
        n_saved = n_args - len(shape_only)
        saved, cts = iter(rest[:n_saved]), rest[n_saved:]
        args = [jnp.zeros_like(cts[0]) if i in shape_only else next(saved)
                for i in range(n_args)]
        idx = [i for i in range(n_args) if diff[i]]

        def f(*d):
            full = list(args)
            for i, x in zip(idx, d):
                full[i] = x
            return tuple(local(plan, *full))

        grads = jax.vjp(f, *[args[i] for i in idx])[1](tuple(cts))
        return tuple(psum_over(g, plan, summed[i]) if summed and summed[i] else g
                     for g, i in zip(grads, idx))
    return bwd


def _simple_op(name, local, operands, results, splittable, diff, summed=(), shape_only=(),
               partition=True):
    """A differentiable op whose backward is `_vjp_local` (no residuals but its inputs, less
    those in `shape_only`, which the backward reads for their shape only: see `_vjp_local`);
    `partition` as `_core.partitioned`'s."""
    n = len(operands)
    fwd = Layout(operands, results, splittable)
    kept = tuple(i not in shape_only for i in range(n))
    bwd = Layout((*(d for d, k in zip(operands, kept) if k), *results),
                 tuple(d for d, ok in zip(operands, diff) if ok), splittable)
    return vjp_op(local, _vjp_local(local, n, diff, summed, shape_only), fwd, bwd,
                  n_out=len(results), diff=diff, saved=kept + (False,) * len(results), name=name,
                  partition=partition)


# ---- swiglu ----------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _swiglu_op(ndim: int, interpret, block_sizes):
    x = (*lead(ndim - 1), "f")
    local = lambda plan, g, u: (_p_swiglu.swiglu(g, u, interpret=interpret,
                                                 block_sizes=block_sizes),)
    return _simple_op("swiglu", local, (x, x), (x,), x, (True, True),
                      partition=not C.mosaic_interpreted(interpret, block_sizes))


def swiglu(gate, up, *, interpret=None, block_sizes=None):
    """`jaxfuse.pallas.swiglu` partitioned over every axis (elementwise)."""
    _r_swiglu.validate(gate, up)
    return _swiglu_op(gate.ndim, interpret, block_sizes)(gate, up)[0]


# ---- swiglu_linear ---------------------------------------------------------------------------

def _project(s, w):
    """s @ w ([..., F] by [F, N]). In explicit sharding mode the result's sharding is named
    (rows as s's, columns as w's): with F split over devices the product is a sum of partial
    products, which JAX will not guess."""
    found = _auto_axes.explicit_mesh((s, w))
    if found is None:
        return s @ w
    rows = (tuple(jax.typeof(s).sharding.spec) + (None,) * s.ndim)[:s.ndim - 1]
    cols = (tuple(jax.typeof(w).sharding.spec) + (None,) * 2)[1]
    # A mesh axis names one dimension of a result: where w's columns are split over an axis
    # that already splits the rows, the rows keep it and the columns are whole.
    if set(spec_axes(cols)) & {a for e in rows for a in spec_axes(e)}:
        cols = None
    with found[1]():
        return jnp.matmul(s, w, out_sharding=P(*rows, cols))


def _project_input_grad(dout, w, like):
    """d(s @ w)/ds applied to dout, typed like `like` (s's shape and sharding)."""
    return jax.linear_transpose(lambda s: _project(s, w), like)(dout)[0]


def _project_weight_grad(s, dout, w):
    """d(s @ w)/dw applied to dout (summed over s's rows)."""
    return jax.linear_transpose(lambda w: _project(s, w), w)(dout)[0]


@functools.lru_cache(maxsize=None)
def _swiglu_linear_op(ndim: int, interpret, block_sizes):
    x = (*lead(ndim - 1), "f")
    kw = dict(interpret=interpret, block_sizes=block_sizes)
    product = lambda plan, g, u: (_p_swiglu.swiglu(g, u, **kw),)
    grads = lambda plan, g, u, ds: _p_swiglu.swiglu_grads(g, u, ds, **kw)
    fwd, bwd = Layout((x, x), (x,), x), Layout((x, x, x), (x, x, x), x)
    partition = not C.mosaic_interpreted(interpret, block_sizes)

    # The kernels run per shard; the projections are XLA's matmuls, which XLA partitions (a
    # split F is a split contraction: XLA sums the partial products, Megatron's row-parallel
    # down projection).
    @jax.custom_vjp
    def op(g, u, w):
        return _project(partitioned(product, fwd, (g, u), partition)[0], w)

    def op_fwd(g, u, w):
        return op(g, u, w), (g, u, w)      # not the product: the backward rebuilds it

    def op_bwd(res, dout):
        g, u, w = res
        dg, du, s = partitioned(grads, bwd, (g, u, _project_input_grad(dout, w, g)),
                                partition)
        return dg, du, _project_weight_grad(s, dout, w)

    op.defvjp(op_fwd, op_bwd)
    return op


def swiglu_linear(gate, up, weight, *, interpret=None, block_sizes=None):
    """`swiglu(gate, up) @ weight` whose backward rebuilds the product in its SwiGLU kernel."""
    _r_swl.validate(gate, up, weight)
    x = (*lead(gate.ndim - 1), "f")
    # gate and up placed as the kernels split them (explicit mode; see `placed_for`), so that
    # the cotangents the backward returns are typed like them and like the rebuilt product.
    gate, up = placed_for(Layout((x, x), (x,), x), (gate, up))
    return _swiglu_linear_op(gate.ndim, interpret, block_sizes)(gate, up, weight)


# ---- rope ------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _rope_op(ndim: int, base: float, interleaved: bool, interpret, block_sizes):
    rows = lead(ndim - 3)
    x, pos = (*rows, "t", "h", "d"), (*rows, "t")
    local = lambda plan, x, p: (_p_rope.rope(x, p, base=base, interleaved=interleaved,
                                             interpret=interpret, block_sizes=block_sizes),)

    def bwd(plan, p, dy):
        # A rotation is linear in x: its vjp is the same at every x, so the cotangent stands in
        # for the primal (whose forward is dead code) and x is not kept for the backward.
        return jax.vjp(lambda x: local(plan, x, p)[0], dy)[1](dy)

    splittable = (*rows, "t", "h")
    return vjp_op(local, bwd, Layout((x, pos), (x,), splittable),
                  Layout((pos, x), (x,), splittable), n_out=1, diff=(True, False),
                  saved=(False, True, False), name="rope")


def rope(x, positions, *, base=10000.0, interleaved=True, interpret=None, block_sizes=None):
    """`jaxfuse.pallas.rope` partitioned over batch, time and heads (positions go with their
    rows, so a time-split shard rotates by its global positions)."""
    _r_rope.validate(x, positions, base)
    positions = jnp.broadcast_to(positions, x.shape[:-2])
    return _rope_op(x.ndim, float(base), bool(interleaved), interpret, block_sizes)(
        x, positions)[0]


# ---- rope_qkv --------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _rope_qkv_op(ndim: int, groups: int, base: float, interleaved: bool, interpret, block_sizes):
    rows = lead(ndim - 4)
    kw = dict(base=base, interleaved=interleaved, interpret=interpret, block_sizes=block_sizes)
    # q's heads are (KV head, group member): they split with their KV head, as attention's do.
    qkv, pos = (*rows, "t", "h", "s", "d"), (*rows, "t")
    q, kv = (*rows, "t", ("h", "g"), "d"), (*rows, "t", "h", "d")
    local = lambda plan, x, p: _p_rq.rope_qkv(x, p, **kw)

    def bwd(plan, p, dq, dk, dv):
        # Linear in qkv: the vjp is the same at every point, so zeros stand in for the primal
        # (whose forward is dead code) and qkv is not kept for the backward.
        x = jnp.zeros((*dk.shape[:-1], groups + 2, dk.shape[-1]), dk.dtype)
        return jax.vjp(lambda x: local(plan, x, p), x)[1]((dq, dk, dv))

    splittable = (*rows, "t", "h")
    sizes = (("g", groups),)
    # Named "rope" (not "rope_qkv"): in the model `Config.remat="...+rope"` keeps what it
    # kept when q and k came from `rope`, and v too (all three are this op's outputs).
    return vjp_op(local, bwd, Layout((qkv, pos), (q, kv, kv), splittable, sizes),
                  Layout((pos, q, kv, kv), (qkv,), splittable, sizes), n_out=3,
                  diff=(True, False), saved=(False, True, False, False, False), name="rope")


def rope_qkv(qkv, positions, *, base=10000.0, interleaved=True, interpret=None,
             block_sizes=None):
    """`jaxfuse.pallas.rope_qkv` partitioned over batch, time and KV heads (each device's query
    heads are its KV heads' groups)."""
    _r_rq.validate(qkv, positions, base)
    positions = jnp.broadcast_to(positions, qkv.shape[:-3])
    return _rope_qkv_op(qkv.ndim, qkv.shape[-2] - 2, float(base), bool(interleaved), interpret,
                        block_sizes)(qkv, positions)


# ---- dropout, bias_dropout_add, bias_act_dropout ---------------------------------------------

@functools.lru_cache(maxsize=None)
def _dropout_op(ndim: int, has_bias: bool, has_res: bool, activation, rate: float, name: str,
                interpret, block_sizes):
    rows = lead(ndim - 1)
    x = (*rows, "d")
    operands = (x, *((("d",),) if has_bias else ()), *((x,) if has_res else ()),
                *((KEY,) if rate else ()))
    splittable = _row_splittable(rows, bool(rate)) + (() if rate else ("d",))

    def local(plan, x, *rest):
        it = iter(rest)
        bias = next(it) if has_bias else None
        res = next(it) if has_res else None
        key_w = shard_key(next(it), plan, x.shape[:-1], rows) if rate else None
        return (_dropout.apply(x, bias, res, activation=activation, rate=rate, key=None,
                               key_w=key_w, name=name, interpret=interpret,
                               block_sizes=block_sizes),)

    diff = (True,) * (1 + has_bias + has_res) + ((False,) if rate else ())
    summed = ((), rows if has_bias else ()) + (((),) * (len(operands) - 2))
    # Without an activation the backward regenerates the mask from the key and reads neither
    # x nor the residual (dx = dy * mask / p, d residual = dy): they are not kept from the
    # forward to the backward (a model would otherwise hold both, 2 x 134 MB a
    # bias_dropout_add at [16384, 4096] bf16, and copy them into a scan's stacked residuals).
    shape_only = () if activation else (0,) + ((1 + has_bias,) if has_res else ())
    return _simple_op(name, local, operands, (x,), splittable, diff, summed[:len(operands)],
                      shape_only)


def _dropout_family(x, bias, residual, activation, rate, key, name, interpret, block_sizes):
    rate = float(rate) if _philox.active(rate, key) else 0.0
    key_w = _philox.key_words(key) if rate else None
    op = _dropout_op(x.ndim, bias is not None, residual is not None, activation, rate, name,
                     interpret, block_sizes)
    return op(*present(x, bias, residual, key_w))[0]


def dropout(x, rate, key, *, interpret=None, block_sizes=None):
    """`jaxfuse.pallas.dropout` partitioned; the one-device mask (see the module docstring)."""
    _r_drop.validate(x, rate, key)
    return _dropout_family(x, None, None, None, rate, key, "dropout", interpret, block_sizes)


def bias_dropout_add(x, bias, residual, *, rate=0.0, key=None, interpret=None,
                     block_sizes=None):
    """`jaxfuse.pallas.bias_dropout_add` partitioned; dbias is psum'd over the split rows."""
    _r_bda.validate(x, bias, residual, rate, key)
    return _dropout_family(x, bias, residual, None, rate, key, "bias_dropout_add", interpret,
                           block_sizes)


def bias_act_dropout(x, bias, *, activation="gelu", rate=0.0, key=None, interpret=None,
                     block_sizes=None):
    """`jaxfuse.pallas.bias_act_dropout` partitioned; dbias is psum'd over the split rows."""
    _r_bad.validate(x, bias, activation, rate, key)
    return _dropout_family(x, bias, None, activation, rate, key, "bias_act_dropout", interpret,
                           block_sizes)


# ---- add_norm --------------------------------------------------------------------------------

def _an_static(cfg, x2):
    norm, eps, has_w, has_b, rate, interpret, block_sizes = cfg
    interpret = C.resolve_interpret(interpret)
    n_rows, n_cols = x2.shape
    fwd = _rows.resolve_blocks(block_sizes, n_rows, n_cols, interpret)
    bwd = _rows.resolve_blocks(block_sizes, n_rows, n_cols, interpret, accumulate_rows=True)
    return _p_an._Static(_norm._Static(norm == "layer", eps, has_w, has_b, fwd, bwd, interpret),
                         rate)


def _an_unpack(cfg, rest):
    it = iter(rest)
    w = next(it) if cfg[2] else None
    b = next(it) if cfg[3] else None
    key_w = next(it) if cfg[4] else None
    return w, b, key_w, list(it)


def _an_fwd(cfg, plan, x, res, *rest):
    w, b, key_w, _ = _an_unpack(cfg, rest)
    rows = lead(x.ndim - 1)
    key_w = shard_key(key_w, plan, x.shape[:-1], rows) if cfg[4] else None
    x2 = as_rows(x)
    h2, y2, mean, rstd = _p_an._forward(x2, as_rows(res), w, b, key_w, _an_static(cfg, x2))
    return (h2.reshape(x.shape), y2.reshape(x.shape), mean.reshape(x.shape[:-1]),
            rstd.reshape(x.shape[:-1]))


def _an_bwd(cfg, plan, *rest, with_output=False):
    # Operands: the weights and key words, then h, mean, rstd (the residuals the kernel's
    # backward reads; not x, residual or y) and the cotangents dh, dy. `with_output`: y too.
    w, b, key_w, (h, mean, rstd, dh, dy) = _an_unpack(cfg, rest)
    rows = lead(h.ndim - 1)
    key_w = shard_key(key_w, plan, h.shape[:-1], rows) if cfg[4] else None
    h2 = as_rows(h)
    dx, dres, dw, db, _, *y = _p_an._grads(
        _an_static(cfg, h2), (h2, w, b, mean.reshape(-1), rstd.reshape(-1), key_w),
        (as_rows(dh), as_rows(dy)), with_output=with_output)
    params = tuple(psum_over(g, plan, rows) for g in (dw, db) if g is not None)
    return (dx.reshape(h.shape), dres.reshape(h.shape), *params,
            *(a.reshape(h.shape) for a in y))


def _an_layouts(ndim: int, cfg):
    """(forward, backward) layouts of the add_norm kernels; the backward's results are dx,
    dresidual and the weights' gradients, then y where `with_output` rebuilds it."""
    rows = lead(ndim - 1)
    x, vec = (*rows, "d"), ("d",)
    params = (vec,) * (int(cfg[2]) + int(cfg[3]))
    keys = (KEY,) if cfg[4] else ()
    splittable = _row_splittable(rows, bool(cfg[4]))
    fwd = Layout((x, x, *params, *keys), (x, x, rows, rows), splittable)
    bwd = Layout((*params, *keys, x, rows, rows, x, x), (x, x, *params), splittable)
    return fwd, bwd


def _an_args(x, residual, weight, bias, norm, eps, rate, key, interpret, block_sizes):
    """(cfg, the kernels' operands) of an add_norm call."""
    eps = _r_an.resolve_eps(norm, eps)
    rate = float(rate) if _philox.active(rate, key) else 0.0
    cfg = (norm, float(eps), weight is not None, bias is not None, rate, interpret, block_sizes)
    key_w = _philox.key_words(key) if rate else None
    return cfg, present(x, residual, weight, bias, key_w)


@functools.lru_cache(maxsize=None)
def _add_norm_op(ndim: int, cfg):
    fwd, bwd = _an_layouts(ndim, cfg)
    n_params, n_keys = int(cfg[2]) + int(cfg[3]), int(bool(cfg[4]))
    # Saved: the weights, key words, h, mean and rstd; not x, residual (the backward needs
    # neither) or y (the next matmul keeps its own).
    saved = (False, False) + (True,) * (n_params + n_keys) + (True, False, True, True)
    return vjp_op(functools.partial(_an_fwd, cfg), functools.partial(_an_bwd, cfg), fwd, bwd,
                  n_out=2, diff=(True,) * (2 + n_params) + (False,) * n_keys, saved=saved,
                  name="add_norm")


def add_norm(x, residual, weight, bias=None, *, norm="rms", eps=None, rate=0.0, key=None,
             interpret=None, block_sizes=None):
    """`jaxfuse.pallas.add_norm` partitioned over the rows; dweight and dbias are psum'd."""
    _r_an.validate(x, residual, weight, bias, norm, rate, key)
    cfg, args = _an_args(x, residual, weight, bias, norm, eps, rate, key, interpret, block_sizes)
    h, y = _add_norm_op(x.ndim, cfg)(*args)
    return h, y


# ---- add_norm_linear -------------------------------------------------------------------------

def _batched_with(h, outs):
    """h, made batched under `jax.vmap` wherever some output in `outs` is, unchanged otherwise.

    A custom_vjp whose outputs are batched unevenly gets wrong gradients: mapped over batched
    projections with x, residual and the norm's weights shared, h comes out unbatched and the
    projections batched; JAX sums h's cotangent over the batch before the backward, whose dx
    (batched by the projections' cotangents) it then sums over the batch again, so dh counted
    batch-size times (a plain 6-line custom_vjp shows it too, jax 0.10.2). The ops of `vjp_op`
    escape it: one kernel's outputs are batched together. Here h takes the outputs' batch
    through a select on a zero-size sum of them: no arithmetic on h (its bits, NaN and -0.0
    included, pass unchanged), and without vmap XLA folds it away."""
    if not outs:
        return h
    # (A slice, not a ravel: a reshape of an array on an Explicit mesh needs its sharding.)
    zero = functools.reduce(jnp.add, (o[(slice(0, 0),) * o.ndim].sum() for o in outs))
    return jnp.where(zero == 0, h, zero.astype(h.dtype))


@functools.lru_cache(maxsize=None)
def _add_norm_linear_op(ndim: int, cfg):
    fwd, bwd = _an_layouts(ndim, cfg)
    x = fwd.operands[0]
    bwd = Layout(bwd.operands, (*bwd.results, x), bwd.splittable)    # and y, rebuilt
    n_in, n_keys = len(fwd.operands), int(bool(cfg[4]))
    tag = residual_name("add_norm")

    def forward(args):
        h, y, mean, rstd = partitioned(functools.partial(_an_fwd, cfg), fwd, args[:n_in])
        outs = tuple(_project(y, p) for p in args[n_in:])
        return _batched_with(h, outs), y, mean, rstd, outs

    # As swiglu_linear: the kernels per shard, the projections XLA's (a projection split over
    # its output columns is Megatron's column-parallel matmul, nothing to sum).
    @jax.custom_vjp
    def op(*args):
        h, _, _, _, outs = forward(args)
        return h, outs

    def op_fwd(*args):
        h, _, mean, rstd, outs = forward(args)
        h, mean, rstd = (checkpoint_name(a, tag) for a in (h, mean, rstd))
        # Saved: h and its statistics, the norm's weights, key words and the projections;
        # not y (the backward's kernel rebuilds it) and not x or residual.
        return (h, outs), (args[2:n_in], h, mean, rstd, args[n_in:])

    def op_bwd(saved, cts):
        params, h, mean, rstd, projs = saved
        dh, douts = cts
        dy = functools.reduce(jnp.add, (_project_input_grad(d, p, h)
                                        for p, d in zip(projs, douts)))
        dx, dres, *dparams, y = partitioned(
            functools.partial(_an_bwd, cfg, with_output=True), bwd,
            (*params, h, mean, rstd, dh, dy))
        dprojs = tuple(_project_weight_grad(y, d, p) for p, d in zip(projs, douts))
        return (dx, dres, *dparams, *(None,) * n_keys, *dprojs)

    op.defvjp(op_fwd, op_bwd)
    return op, fwd


def add_norm_linear(x, residual, weight, bias=None, *, projections, norm="rms", eps=None,
                    rate=0.0, key=None, interpret=None, block_sizes=None):
    """`jaxfuse.add_norm` then y @ p for each p in projections; the backward's add_norm kernel
    rebuilds y for the projections' gradients instead of keeping it."""
    _r_anl.validate(x, residual, weight, bias, projections, norm, rate, key)
    cfg, args = _an_args(x, residual, weight, bias, norm, eps, rate, key, interpret, block_sizes)
    op, layout = _add_norm_linear_op(x.ndim, cfg)
    return op(*placed_for(layout, args), *projections)


# ---- embedding -------------------------------------------------------------------------------

def _emb_static(cfg, n_rows, table, pos_table):
    scale, rate, has_pos, interpret, block_sizes = cfg
    interpret = C.resolve_interpret(interpret)
    d = table.shape[1]
    if block_sizes is None and not interpret:     # as `pallas.embedding`: one row per program
        block_sizes = RowBlocks(1, min(C.next_pow2(d), 16384), max(1, min(8, d // 512)))
    fwd = _rows.resolve_blocks(block_sizes, n_rows, d, interpret)
    bwd = _rows.resolve_blocks(block_sizes, table.shape[0], d, interpret)
    return _p_emb._Static(scale, rate, has_pos, table.shape[0],
                          0 if pos_table is None else pos_table.shape[0], fwd, bwd, interpret)


def _emb_unpack(cfg, rest):
    it = iter(rest)
    pos_table, positions = (next(it), next(it)) if cfg[2] else (None, None)
    key_w = next(it) if cfg[1] else None
    return pos_table, positions, key_w, list(it)


def _emb_local_tokens(plan, tok, table):
    """Tokens in this device's vocabulary slice (others out of its range), the offset."""
    axes = plan.get("v", ())
    tok1 = tok.reshape(-1).astype(jnp.int32)
    if not axes:
        return tok1
    return tok1 - jax.lax.axis_index(axes) * table.shape[0]


def _emb_fwd(cfg, n_vocab, plan, tok, table, *rest):
    pos_table, positions, key_w, _ = _emb_unpack(cfg, rest)
    rows = lead(tok.ndim)
    key_w = shard_key(key_w, plan, tok.shape, rows) if cfg[1] else None
    st = _emb_static(cfg, tok.size, table, pos_table)
    pos1 = None if positions is None else positions.reshape(-1).astype(jnp.int32)
    local = _emb_local_tokens(plan, tok, table)
    axes = plan.get("v", ())
    if not axes:
        out = _p_emb._forward(local, pos1, table, pos_table, key_w, st)
    else:   # vocab split (no position table): this slice's rows, zeros elsewhere, summed
        inside = (local >= 0) & (local < table.shape[0])
        out = _p_emb._forward(jnp.where(inside, local, 0), None, table, None, key_w, st)
        out = jax.lax.psum(jnp.where(inside[:, None], out, 0), axes)
        tok1 = tok.reshape(-1)
        out = jnp.where(((tok1 >= 0) & (tok1 < n_vocab))[:, None], out, jnp.nan)
    return (out.reshape(*tok.shape, table.shape[1]),)


def _emb_bwd(cfg, n_vocab, plan, tok, table, *rest):
    pos_table, positions, key_w, (_, dy) = _emb_unpack(cfg, rest)
    rows = lead(tok.ndim)
    key_w = shard_key(key_w, plan, tok.shape, rows) if cfg[1] else None
    st = _emb_static(cfg, tok.size, table, pos_table)
    pos1 = None if positions is None else positions.reshape(-1).astype(jnp.int32)
    # Tokens outside the slice are outside [0, n_local): the kernel leaves them out of the sums.
    local = _emb_local_tokens(plan, tok, table)
    grads = _p_emb._embedding_bwd(st, (local, pos1, key_w), dy.reshape(-1, dy.shape[-1]))
    return tuple(psum_over(g, plan, rows) for g in grads[2:4] if g is not None)


@functools.lru_cache(maxsize=None)
def _embedding_op(ndim: int, n_vocab: int, cfg):
    rows = lead(ndim)
    scale, rate, has_pos = cfg[:3]
    out = (*rows, "e")
    operands = (rows, ("v", "e"), *((("p", "e"), rows) if has_pos else ()),
                *((KEY,) if rate else ()))
    splittable = (_row_splittable(rows, bool(rate)) + (() if has_pos else ("v",))
                  + (() if rate else ("e",)))
    fwd = Layout(operands, (out,), splittable)
    bwd = Layout((*operands, out, out), (("v", "e"), *((("p", "e"),) if has_pos else ())),
                 splittable)
    diff = (False, True) + ((True, False) if has_pos else ()) + ((False,) if rate else ())
    return vjp_op(functools.partial(_emb_fwd, cfg, n_vocab),
                  functools.partial(_emb_bwd, cfg, n_vocab), fwd, bwd, n_out=1, diff=diff,
                  name="embedding")


def embedding(tokens, table, *, scale=1.0, pos_table=None, positions=None, rate=0.0, key=None,
              interpret=None, block_sizes=None):
    """`jaxfuse.pallas.embedding` partitioned over the tokens, the vocabulary and d_model."""
    _r_emb.validate(tokens, table, scale, pos_table, positions, rate, key)
    rate = float(rate) if _philox.active(rate, key) else 0.0
    positions = _r_emb.resolve_positions(tokens, pos_table, positions)
    if positions is not None:
        positions = jnp.broadcast_to(positions, tokens.shape).astype(jnp.int32)
    cfg = (float(scale), rate, pos_table is not None, interpret, block_sizes)
    key_w = _philox.key_words(key) if rate else None
    op = _embedding_op(tokens.ndim, table.shape[0], cfg)
    return op(*present(_r_emb.table_index(tokens, table.shape[0]), table, pos_table, positions,
                       key_w))[0]


# ---- beam_top_k ------------------------------------------------------------------------------

def beam_top_k(log_probs, beam_scores, k, *, interpret=None, block_sizes=None, capacity=None):
    """`jaxfuse.pallas.beam_top_k` partitioned over the batch (each row's beams and vocabulary
    stay whole: its top-k needs all of them). Not differentiable (a selection)."""
    _r_topk.validate(log_probs, beam_scores, k)
    local = lambda plan, lp, bs: _p_topk.beam_top_k(lp, bs, k, interpret=interpret,
                                                    block_sizes=block_sizes, capacity=capacity)
    out = ("b", "j")
    layout = Layout((("b", "n", "v"), ("b", "n")), (out, out, out), ("b",))
    return _inference_only("beam_top_k", "lax.top_k", local, layout, (log_probs, beam_scores))


# ---- beam_step -------------------------------------------------------------------------------

def beam_step(logits, raw_scores, lengths, done, *, eos_id, length_penalty=0.0, interpret=None,
              block_sizes=None):
    """`jaxfuse.pallas.beam_step` partitioned over the batch (a row's beams and vocabulary stay
    whole: its top-k needs all of them). Not differentiable (a selection)."""
    _r_step.validate(logits, raw_scores, lengths, done, eos_id, length_penalty)
    local = lambda plan, *args: _p_step.beam_step(
        *args, eos_id=eos_id, length_penalty=length_penalty, interpret=interpret,
        block_sizes=block_sizes)
    beams = ("b", "n")
    layout = Layout((("b", "n", "v"), beams, beams, beams), (beams,) * 5, ("b",))
    return _inference_only("beam_step", "log_softmax, lax.top_k and gathers", local, layout,
                           (logits, raw_scores, lengths, done))


# ---- reorder_beams ---------------------------------------------------------------------------

def reorder_beams(caches, parent, start, stop, *, interpret=None, block_sizes=None):
    """`jaxfuse.pallas.reorder_beams` partitioned over the batch and each cache's first feature
    axis (KV heads); a row's beams and positions stay whole on one device."""
    _r_reo.validate(caches, parent, start, stop)
    caches = tuple(caches)
    local = lambda plan, parent, start, stop, *cs: _p_reo.reorder_beams(
        cs, parent, start, stop, interpret=interpret, block_sizes=block_sizes)
    # Caches of one feature shape share factors (a mesh axis shards one factor of an op), as
    # a model's K and V caches of every layer do; any other shape gets its own.
    name = lambda i, c, j: f"f{j}" if c.shape[3:] == caches[0].shape[3:] else f"c{i}f{j}"
    dims = [("b", "k", "s") + tuple(name(i, c, j) for j in range(c.ndim - 3))
            for i, c in enumerate(caches)]
    layout = Layout((("b", "k"), ("b",), ("b",), *dims), tuple(dims),
                    ("b",) + tuple(dict.fromkeys(d[3] for d in dims if len(d) > 3)))
    return _inference_only("reorder_beams", "a gather", local, layout,
                           (parent, start, stop, *caches))


def _inference_only(name: str, what: str, local, layout: Layout, args):
    """`partitioned(local, layout, args)` with a gradient that fails with a ValueError naming
    the op and the fix (without it: NotImplementedError from custom_partitioning)."""
    @jax.custom_jvp
    def op(*args):
        return partitioned(local, layout, args)

    @op.defjvp
    def _no_gradient(primals, tangents):
        raise ValueError(f"{name} (impl=\"pallas\") is for inference and has no gradient; "
                         f"impl=\"reference\" ({what}) differentiates")

    return op(*args)
