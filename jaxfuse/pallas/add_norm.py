"""Fused "add, then normalize" of a pre-norm block: h = residual + dropout(x), y = norm(h).

Unfused that is an add kernel (plus dropout's) writing h and a norm kernel reading it back; here a
row that fits in one tile is read once (x and residual) and written once (h and y), its statistics
taken from the tile in registers (lecture 10, sec. 4.1), the dropout mask generated in the kernel
(`jaxfuse._philox`). A longer row writes h with the `bias_dropout_add` kernel and normalizes it with
the norms' kernels (`_norm.py`: LayerNorm keeps its Welford/Chan merge of per-tile statistics).

Backward (saves h, mean, rstd): one kernel, the norms' backward with the incoming dh added and the
mask regenerated: d residual = dh + dnorm(dy), dx = dropout'(d residual), and the dweight/dbias
column sums in the same pass.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxfuse import _philox
from jaxfuse.pallas import _common as C
from jaxfuse.pallas import _dropout, _norm, _rows
from jaxfuse.pallas._rows import RowBlocks
from jaxfuse.reference import add_norm as ref
from jaxfuse.reference.layer_norm import scaled_stats


@dataclasses.dataclass(frozen=True)
class _Static:
    norm: _norm._Static
    rate: float            # 0.0: no dropout


def _forward(x2, res2, weight, bias, key_w, st: _Static):
    """(h2, y2, mean, rstd)."""
    ns = st.norm
    b = ns.fwd_blocks
    n_cols = x2.shape[1]
    if C.cdiv(n_cols, b.block_cols) > 1:
        d_st = _dropout._Static(None, st.rate, False, True, b, b, ns.interpret,
                                "add_norm_add")
        h2 = _dropout._forward(x2, None, res2, key_w, d_st)
        return (h2, *_norm._forward(h2, weight, bias, ns))

    def emit(tile):
        x, res = tile.x
        if st.rate:
            x = _dropout.drop(tile, x, st.rate, ns.interpret)
        # y normalizes h as stored (rounded to the output dtype), as the unfused ops would.
        h = (res + x).astype(x2.dtype).astype(jnp.float32)
        h = jnp.where(tile.valid, h, 0.0)
        mean, rstd = scaled_stats(_norm._tile_state(tile._replace(x=(h,)), ns.center), ns.eps)
        y = (h - mean) * rstd
        cols = iter(tile.per_col)
        if ns.has_weight:
            y = y * next(cols)
        if ns.has_bias:
            y = y + next(cols)
        return (h, y), (mean, rstd), ()

    return tuple(_rows.map_pass(
        emit, tiled=[x2, res2], fills=[0.0, 0.0],
        per_col=[p for p in (weight, bias) if p is not None], out_dtypes=(x2.dtype, x2.dtype),
        row_out_dtypes=(jnp.float32, jnp.float32), blocks=b, name=f"jaxfuse_add_{ns.name}_fwd",
        interpret=ns.interpret, key=key_w if st.rate else None))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _add_norm(x2, res2, weight, bias, key_w, st: _Static):
    return _forward(x2, res2, weight, bias, key_w, st)[:2]


def _add_norm_fwd(x2, res2, weight, bias, key_w, st):
    h2, y2, mean, rstd = _forward(x2, res2, weight, bias, key_w, st)
    return (h2, y2), (h2, weight, bias, mean, rstd, key_w)


def _grads(st, saved, cts, with_output: bool = False):
    """(dx, dresidual, dweight, dbias, key cotangent), and with `with_output` y = norm(h)
    rebuilt by the same kernel (bitwise the forward's; `jaxfuse.add_norm_linear`)."""
    h2, weight, bias, mean, rstd, key_w = saved
    dh2, dy2 = cts
    douts, sums = _norm._backward(h2, weight, mean, rstd, dy2, st.norm, dh2=dh2, rate=st.rate,
                                  key_w=key_w, bias=bias, with_output=with_output)
    dres = douts[0]
    dx = douts[1] if st.rate else dres
    sums = iter(sums)
    dw = next(sums).astype(weight.dtype) if weight is not None else None
    db = next(sums).astype(bias.dtype) if bias is not None else None
    key_ct = None if key_w is None else jnp.zeros(key_w.shape, jax.dtypes.float0)
    return (dx, dres, dw, db, key_ct) + ((douts[-1],) if with_output else ())


def _add_norm_bwd(st, saved, cts):
    return _grads(st, saved, cts)


_add_norm.defvjp(_add_norm_fwd, _add_norm_bwd)


def add_norm(x: jax.Array, residual: jax.Array, weight: jax.Array | None,
             bias: jax.Array | None = None, *, norm: str = "rms", eps: float | None = None,
             rate: float = 0.0, key=None, interpret: bool | None = None,
             block_sizes: RowBlocks | None = None):
    """Pallas `(h, norm(h))` with `h = residual + dropout(x)`; see `jaxfuse.reference.add_norm`."""
    ref.validate(x, residual, weight, bias, norm, rate, key)
    eps = ref.resolve_eps(norm, eps)
    interpret = C.resolve_interpret(interpret)
    rate = float(rate) if _philox.active(rate, key) else 0.0
    x2, res2 = _rows.as_rows(x), _rows.as_rows(residual)
    n_rows, n_cols = x2.shape
    fwd = _rows.resolve_blocks(block_sizes, n_rows, n_cols, interpret)
    bwd = _rows.resolve_blocks(block_sizes, n_rows, n_cols, interpret, accumulate_rows=True)
    ns = _norm._Static(norm == "layer", eps, weight is not None, bias is not None, fwd, bwd,
                       interpret)
    key_w = _philox.key_words(key) if rate else None
    h2, y2 = _add_norm(x2, res2, weight, bias, key_w, _Static(ns, rate))
    return h2.reshape(x.shape), y2.reshape(x.shape)
