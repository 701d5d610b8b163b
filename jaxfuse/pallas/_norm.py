"""The normalization kernels behind `layer_norm` (center=True) and `rms_norm` (center=False).

Forward, per row: statistics, then y = (x - mean) * rstd * weight + bias. A row that fits in one
tile is read once and written once. A longer row is first reduced tile by tile: LayerNorm merges
each tile's exact `(count, mean, m2)` with the Welford/Chan rule (`welford_merge`, Chan, Golub and
LeVeque 1979), so it stays accurate when |mean| >> std where E[x^2] - E[x]^2 cancels
catastrophically (lecture 10, sec. 4.2); RMSNorm just sums squares. Both take their statistics
of x / s, s a power of two from the tile's largest |x| (1 unless max|x| >= 2^41: huge rows'
squares would overflow float32), and merge states at the larger s (`reference.layer_norm`).

Backward (`custom_vjp`, saves x, mean, rstd), with xhat = (x - mean) * rstd and wg = weight * g:

    dx = rstd * (wg - xhat * mean(xhat * wg) - mean(wg))       (the last term for LayerNorm only)
    dweight = sum_rows(g * xhat),   dbias = sum_rows(g).

dx and the two column sums come out of one kernel: each program walks a group of rows and keeps
its running column sums in registers, writing one float32 row per group (a few hundred rows in
all), which XLA then adds up. No [rows, cols] float32 temporary, no atomics: deterministic.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxfuse.pallas import _common as C
from jaxfuse.pallas import _dropout, _rows
from jaxfuse.pallas._rows import RowBlocks
from jaxfuse.reference.layer_norm import row_scale, scaled_merge, scaled_stats


@dataclasses.dataclass(frozen=True)
class _Static:
    center: bool          # LayerNorm (subtract the mean) or RMSNorm
    eps: float
    has_weight: bool
    has_bias: bool
    fwd_blocks: RowBlocks
    bwd_blocks: RowBlocks
    interpret: bool

    @property
    def name(self) -> str:
        return "layer_norm" if self.center else "rms_norm"


def _tile_state(tile: _rows.Tile, center: bool):
    """Exact statistics of one tile in units of its scale s: (count, mean, m2, s) for LayerNorm,
    (count, 0, sum (x/s)^2, s) for RMSNorm."""
    x, valid = tile.x[0], tile.valid       # x is 0 where not valid
    n = jnp.sum(valid.astype(jnp.float32), axis=-1, keepdims=True)
    s, inv = row_scale(jnp.max(jnp.abs(x), axis=-1, keepdims=True))
    x = x * inv
    if not center:
        return n, jnp.zeros_like(n), jnp.sum(x * x, axis=-1, keepdims=True), s
    mean = jnp.sum(x, axis=-1, keepdims=True) / jnp.maximum(n, 1.0)
    d = jnp.where(valid, x - mean, 0.0)
    return n, mean, jnp.sum(d * d, axis=-1, keepdims=True), s


def _stats_step(center: bool):
    def step(state, tile):
        t = _tile_state(tile, center)
        return t if state is None else scaled_merge(state, t)
    return step


def _forward(x2, weight, bias, st: _Static, merge=None):
    """(y, mean, rstd). `merge` (rows split across devices along the columns, `sharding.rows`)
    combines the per-row (count, mean, m2, s) states of every device's columns."""
    b = st.fwd_blocks
    n_cols = x2.shape[1]
    n_tiles = C.cdiv(n_cols, b.block_cols)
    per_col = [p for p in (weight, bias) if p is not None]
    step = _stats_step(st.center)
    stats = ()
    if n_tiles > 1 or merge is not None:
        zero = lambda _: (*(jnp.zeros((b.block_rows, 1), jnp.float32) for _ in range(3)),
                          jnp.ones((b.block_rows, 1), jnp.float32))
        if merge is None:
            finalize, n_out = (lambda s, _: scaled_stats(s, st.eps)), 2
        else:
            finalize, n_out = (lambda s, _: s), 4
        stats = tuple(_rows.reduce_pass(
            zero, step, finalize, tiled=[x2], fills=[0.0], out_dtypes=(jnp.float32,) * n_out,
            blocks=b, name=f"jaxfuse_{st.name}_stats", interpret=st.interpret))
        if merge is not None:
            stats = scaled_stats(merge(stats), st.eps)
        n_tiles = max(n_tiles, 2)       # the pass below reads the statistics

    def emit(tile):
        if n_tiles > 1:
            mean, rstd = tile.per_row
            row_outs = ()
        else:
            mean, rstd = scaled_stats(step(None, tile), st.eps)
            row_outs = (mean, rstd)
        y = (tile.x[0] - mean) * rstd
        cols = iter(tile.per_col)
        if st.has_weight:
            y = y * next(cols)
        if st.has_bias:
            y = y + next(cols)
        return (y,), row_outs, ()

    outs = _rows.map_pass(
        emit, tiled=[x2], fills=[0.0], per_row=stats, per_col=per_col, out_dtypes=(x2.dtype,),
        row_out_dtypes=(jnp.float32, jnp.float32) if n_tiles == 1 else (), blocks=b,
        name=f"jaxfuse_{st.name}_fwd", interpret=st.interpret)
    y2 = outs[0]
    mean, rstd = outs[1:] if n_tiles == 1 else stats
    return y2, mean, rstd


def _backward(x2, weight, mean, rstd, g2, st: _Static, dh2=None, rate: float = 0.0,
              key_w=None, merge=None, n_cols=None, bias=None, with_output: bool = False):
    """(dx, [dweight, dbias] column sums). With `dh2` (add_norm: the norm's input h also had a
    cotangent of its own) the same kernel returns (d residual = dh + dx, dropout'(d residual)
    when `rate`) instead of dx: no extra pass over the rows. `merge` sums the per-row sums over
    every device's columns and `n_cols` is the whole row's length (columns split across
    devices). `with_output` (add_norm only) appends the forward's output y = xhat * weight +
    bias, rebuilt from the same saved statistics in the same order (bitwise the forward's), for
    a caller that needs y again and did not keep it (`jaxfuse.add_norm_linear`)."""
    b = st.bwd_blocks
    n_tiles = C.cdiv(x2.shape[1], b.block_cols)
    if merge is not None:
        n_tiles = max(n_tiles, 2)       # the row sums come from their own pass, then merge
    n_cols = x2.shape[1] if n_cols is None else n_cols
    rebuild_bias = with_output and st.has_bias
    per_col = ([weight] if st.has_weight else []) + ([bias] if rebuild_bias else [])

    def terms(tile, mean_, rstd_):
        x, g = tile.x[:2]
        xhat = jnp.where(tile.valid, (x - mean_) * rstd_, 0.0)
        wg = g * tile.per_col[0] if st.has_weight else g
        return xhat, wg

    # Row sums the dx formula needs: sum(xhat * wg), and sum(wg) for LayerNorm only.
    n_stats = 2 if st.center else 1

    def c_step(acc, tile):
        mean_, rstd_ = tile.per_row[:2]
        xhat, wg = terms(tile, mean_, rstd_)
        new = (xhat * wg, wg)[:n_stats]
        return tuple(a + jnp.sum(t, axis=-1, keepdims=True) for a, t in zip(acc, new))

    zero = lambda _: (jnp.zeros((b.block_rows, 1), jnp.float32),) * n_stats
    per_row = (mean, rstd)
    if n_tiles > 1:
        sums = tuple(_rows.reduce_pass(
            zero, c_step, lambda acc, _: acc, tiled=[x2, g2], fills=[0.0, 0.0],
            per_row=(mean, rstd), per_col=per_col, out_dtypes=(jnp.float32,) * n_stats,
            blocks=b, name=f"jaxfuse_{st.name}_bwd_stats", interpret=st.interpret))
        per_row += tuple(sums if merge is None else merge(sums))

    def emit(tile):
        mean_, rstd_ = tile.per_row[:2]
        xhat, wg = terms(tile, mean_, rstd_)
        sums = tile.per_row[2:] if n_tiles > 1 else c_step(zero(None), tile)
        dx = wg - xhat * (sums[0] / n_cols)
        if st.center:
            dx = dx - sums[1] / n_cols
        g = tile.x[1]
        col_sums = ((g * xhat,) if st.has_weight else ()) + ((g,) if st.has_bias else ())
        dx = dx * rstd_
        if dh2 is None:
            return (dx,), (), col_sums
        dres = dx + tile.x[2]
        outs = (dres,)
        if rate:
            outs += (_dropout.drop(tile, dres, rate, st.interpret),)
        if with_output:
            cols = iter(tile.per_col)
            y = xhat * next(cols) if st.has_weight else xhat
            outs += (y + next(cols) if rebuild_bias else y,)
        return outs, (), col_sums

    if with_output and dh2 is None:
        raise AssertionError("with_output is add_norm's (dh2 given)")
    tiled = [x2, g2] + ([] if dh2 is None else [dh2])
    n_out = 1 if dh2 is None else 1 + int(bool(rate)) + int(with_output)
    *dxs, = _rows.map_pass(
        emit, tiled=tiled, fills=[0.0] * len(tiled), per_row=per_row, per_col=per_col,
        out_dtypes=(g2.dtype,) * n_out, n_col_sums=int(st.has_weight) + int(st.has_bias),
        blocks=b, name=f"jaxfuse_{st.name}_bwd" if dh2 is None else f"jaxfuse_add_{st.name}_bwd",
        interpret=st.interpret, key=key_w if rate else None)
    sums = [jnp.sum(s, axis=0) for s in dxs[n_out:]]
    if dh2 is None:
        return dxs[0], sums
    return tuple(dxs[:n_out]), sums


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def norm(x2, weight, bias, st: _Static):
    return _forward(x2, weight, bias, st)[0]


def _norm_fwd(x2, weight, bias, st):
    y2, mean, rstd = _forward(x2, weight, bias, st)
    return y2, (x2, weight, bias, mean, rstd)


def _norm_bwd(st, res, g2):
    x2, weight, bias, mean, rstd = res
    dx2, sums = _backward(x2, weight, mean, rstd, g2, st)
    sums = iter(sums)
    dw = next(sums).astype(weight.dtype) if st.has_weight else None
    db = next(sums).astype(bias.dtype) if st.has_bias else None
    return dx2, dw, db


norm.defvjp(_norm_fwd, _norm_bwd)


def apply(x, weight, bias, *, center: bool, eps: float, interpret: bool | None,
          block_sizes: RowBlocks | None):
    """Shared wrapper: flatten to rows, pick blocks, run, restore the shape."""
    x2 = _rows.as_rows(x)
    st = static(x2.shape, weight is not None, bias is not None, center=center, eps=eps,
                interpret=interpret, block_sizes=block_sizes)
    return norm(x2, weight, bias, st).reshape(x.shape)


def static(shape2, has_weight: bool, has_bias: bool, *, center: bool, eps: float,
           interpret: bool | None, block_sizes: RowBlocks | None) -> _Static:
    """The kernels' settings for a [n_rows, n_cols] view (also used per shard by `sharding`)."""
    interpret = C.resolve_interpret(interpret)
    n_rows, n_cols = shape2
    fwd = _rows.resolve_blocks(block_sizes, n_rows, n_cols, interpret)
    bwd = _rows.resolve_blocks(block_sizes, n_rows, n_cols, interpret, accumulate_rows=True)
    return _Static(center, float(eps), has_weight, has_bias, fwd, bwd, interpret)
