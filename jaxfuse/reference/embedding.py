"""Reference fused embedding (LightSeq's embedding layer, lecture 10 sec. 5.1):

    out[n] = dropout(scale * table[tokens[n]] + pos_table[positions[n]])

tokens int [...], table [V, D] -> out [..., D] in table's dtype. `pos_table` [P, D] is optional;
its `positions` (int, tokens' shape) default to 0..T-1 along tokens' last axis. A token outside
[0, V) (or a position outside [0, P)) gives a row of NaN, as `cross_entropy` does for a bad
label, and its gradient reaches no row of either table: never a silent read of another row.
The mask is `jaxfuse.reference.dropout`'s over the [tokens.size, D] view.

Gradients: d table[v] = sum over n with tokens[n] = v of scale * d out[n] * dropout'; the
autodiff of this reference is XLA's scatter-add (not deterministic on a GPU); the kernel's is.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxfuse import _checks, _philox
from jaxfuse.reference import dropout as _dropout


def validate(tokens, table, scale, pos_table, positions, rate, key) -> None:
    _checks.check_int("tokens", tokens)
    _checks.check_float("table", table)
    _checks.check_ndim("table", table, 2)
    if not isinstance(scale, (int, float, np.integer, np.floating)) or isinstance(scale, bool):
        raise ValueError(f"scale={scale!r} must be a Python (or NumPy) number")
    _checks.check_finite("scale", scale)
    if table.shape[0] == 0:
        raise ValueError(f"table.shape={tuple(table.shape)}: the table must have rows (a token "
                         "indexes one)")
    if pos_table is not None:
        if pos_table.ndim != 2 or pos_table.shape[1] != table.shape[1] or \
                pos_table.dtype != table.dtype:
            raise ValueError(f"pos_table (shape={tuple(pos_table.shape)}, dtype={pos_table.dtype})"
                             f" must be [P, {table.shape[1]}] of table's dtype {table.dtype}")
        if pos_table.shape[0] == 0:
            raise ValueError(f"pos_table.shape={tuple(pos_table.shape)}: the position table must "
                             "have rows (a position indexes one)")
    if positions is not None:
        if pos_table is None:
            raise ValueError("positions were given without a pos_table")
        _checks.check_int("positions", positions)
        if tuple(positions.shape) != tuple(tokens.shape):
            raise ValueError(f"positions.shape={tuple(positions.shape)} must equal tokens.shape="
                             f"{tuple(tokens.shape)}")
    _philox.check_rate(rate)
    _dropout.check_key(key)


def table_index(idx, n: int):
    """int32 row indices into a table of n rows: those in [0, n) as they are, every other value
    -1 (a row of none). A wider type (int64 under jax_enable_x64, uint32, uint64) is judged
    before its cast, where a value past int32's range would wrap to another row."""
    if _checks.fits_int32(idx.dtype):
        return idx.astype(jnp.int32)
    return jnp.where((idx >= 0) & (idx < n), idx, -1).astype(jnp.int32)


def resolve_positions(tokens, pos_table, positions):
    """int32 positions shaped like tokens (0..T-1 along the last axis by default; 0 for a 0-d
    token), out-of-range ones -1 (`table_index`), or None."""
    if pos_table is None:
        return None
    if positions is None:
        positions = (jnp.broadcast_to(jnp.arange(tokens.shape[-1]), tokens.shape) if tokens.ndim
                     else jnp.zeros((), jnp.int32))
    return table_index(positions, pos_table.shape[0])


def _rows_of(table, idx):
    """float32 table[idx] and whether idx was in range (an out-of-range row reads row 0, masked)."""
    ok = (idx >= 0) & (idx < table.shape[0])
    return table.astype(jnp.float32)[jnp.where(ok, idx, 0)], ok


def embedding(tokens: jax.Array, table: jax.Array, *, scale: float = 1.0,
              pos_table: jax.Array | None = None, positions: jax.Array | None = None,
              rate: float = 0.0, key=None) -> jax.Array:
    validate(tokens, table, scale, pos_table, positions, rate, key)
    positions = resolve_positions(tokens, pos_table, positions)
    e, ok = _rows_of(table, table_index(tokens, table.shape[0]))
    v = e * jnp.float32(scale)
    if pos_table is not None:
        p, ok_p = _rows_of(pos_table, positions)
        v, ok = v + p, ok & ok_p
    v = _dropout.apply(v, rate, key)
    return jnp.where(ok[..., None], v, jnp.nan).astype(table.dtype)
