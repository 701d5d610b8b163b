"""Dropout masks inside a kernel: `jaxfuse._philox` with the multiply that suits the regime.

In interpret mode the kernel runs as XLA on the CPU and takes `_philox.mulhi_u32`, the
references' jax.numpy product (`lax.mulhi` does not lower inside a shard_map); Pallas's Triton
lowering has no rule for `mulhi`, so a compiled kernel takes the high word of the product with
one `mul.hi.u32` instruction (what cuRAND's and Triton's own Philox do). Both are exact integer
arithmetic, so the bits, and the masks, are identical in every regime and in the reference.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.pallas import triton as pltriton

from jaxfuse import _philox


def _mulhi_ptx(a, b):
    # Through int32 (the same 32-bit registers): Pallas's Triton lowering types uint32 values
    # as signless i32 but an inline-asm result declared uint32 as ui32, which then mismatch.
    a, b = (lax.bitcast_convert_type(v, jnp.int32) for v in jnp.broadcast_arrays(
        jnp.asarray(a, jnp.uint32), jnp.asarray(b, jnp.uint32)))
    hi = pltriton.elementwise_inline_asm(
        "mul.hi.u32 $0, $1, $2;", args=[a, b], constraints="=r,r,r", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.int32)])[0]
    return lax.bitcast_convert_type(hi, jnp.uint32)


def mulhi(interpret: bool):
    # Interpreted, `_philox.mulhi_u32` (jax.numpy): `lax.mulhi` fails to lower where the
    # kernel runs inside a shard_map (an Explicit mesh's partitioning, a user's shard_map:
    # "failed to legalize operation 'mhlo.unknown' {mhlo.sharding = "{manual}"}").
    return _philox.mulhi_u32 if interpret else _mulhi_ptx


def keep(key_w, rows, cols, rate: float, interpret: bool, stream=0):
    """`_philox.keep` for absolute (rows, cols) indices of the kernel's view, in the kernel's
    regime; rows are mapped to the whole array's rows first (`global_rows`)."""
    return _philox.keep(key_w, global_rows(key_w, rows), cols, rate, stream=stream,
                        mulhi=mulhi(interpret))


def keep_tile(key_w, rows, col0, n_cols: int, rate: float, interpret: bool, stream=0):
    """The keep-mask of a [..., br, n_cols] tile: rows `rows` (int32 [..., br, 1]), columns
    col0 .. col0 + n_cols - 1 (col0 a multiple of n_cols). One Philox call per
    `_philox.GROUP` elements when the tile holds whole 32-column blocks (`_philox.keep_block`),
    else one per element (narrow tiles; the same bits)."""
    if n_cols % _philox.BLOCK == 0:
        return _philox.keep_block(key_w, global_rows(key_w, rows), col0, n_cols, rate,
                                  stream=stream, mulhi=mulhi(interpret))
    cols = col0 + lax.broadcasted_iota(jnp.int32, (1,) * (jnp.ndim(rows) - 1) + (n_cols,),
                                       jnp.ndim(rows) - 1)
    return keep(key_w, rows, cols, rate, interpret, stream)     # keep maps the rows itself


def drop_tile(x, key_w, rows, col0, rate: float, interpret: bool, stream=0):
    """where(keep, x / keep probability, 0) for x [..., br, bc] at rows `rows` [..., br, 1] and
    columns col0 .. col0 + bc - 1 (the kernels' inverted dropout). Selecting after scaling
    lets the compiled kernel move only the boolean mask, when it moves one between layouts."""
    keep = keep_tile(key_w, rows, col0, x.shape[-1], rate, interpret, stream)
    return jnp.where(keep, x * _philox.scale(rate), 0.0)


def global_rows(key_w, rows):
    """The rows of a kernel's [rows, cols] view as rows of the whole array it is a shard of.

    A mask is defined by global element indices (`jaxfuse._philox`), so a kernel that runs on
    one device's shard (`jaxfuse.sharding.blocks`) must draw the whole array's mask at its own
    rows. Its key then carries three more words (l, g, base) = `shard_rows`: local row r is
    global row (r // l) * g + r % l + base (leading axes (outer, inner...) split on the first two:
    l and g the local and global sizes of the inner ones). Two words: the array is whole."""
    if len(key_w) < 5:
        return rows
    l, g, base = key_w[2], key_w[3], key_w[4]
    r = rows.astype(jnp.uint32)
    return (r // l) * g + r % l + base


def shard_rows(key_w, local_lead, global_lead, offsets):
    """`key_w` extended with the row map of a shard (see `global_rows`): the shard's leading
    dimensions `local_lead` start at `offsets` (traced ints) in the array's `global_lead`; only
    the first two may differ from the whole (`jaxfuse.sharding.blocks` splits no other)."""
    inner = lambda dims: int(np.prod(dims[1:], dtype=np.int64)) if len(dims) > 1 else 1
    rest = int(np.prod(global_lead[2:], dtype=np.int64)) if len(global_lead) > 2 else 1
    base = offsets[0] * inner(global_lead) + (offsets[1] * rest if len(offsets) > 1 else 0)
    extra = jnp.stack([jnp.uint32(inner(local_lead)), jnp.uint32(inner(global_lead)),
                       jnp.asarray(base).astype(jnp.uint32)])
    return jnp.concatenate([key_w, extra])
