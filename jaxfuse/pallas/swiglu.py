"""Fused SwiGLU gate: silu(gate) * up in one read of both and one write.

Unfused, XLA keeps silu(gate) (or sigmoid(gate)) for the backward; here the backward recomputes
the sigmoid from gate, so nothing but the inputs is saved, and writes both gradients in one pass
(Triton kernels; on an sm90 GPU Mosaic GPU ones where the shape is whole tiles of theirs, which
read a `lax.scan`'s stacked residuals in place: `swiglu_hopper.py`):

    s = sigmoid(gate),  dup = dy * gate * s,  dgate = dy * up * s * (1 + gate * (1 - s)).
"""
from __future__ import annotations

import dataclasses
import functools

import jax

from jaxfuse.pallas import _common as C
from jaxfuse.pallas import _dropout, _hopper, _rows, swiglu_hopper
from jaxfuse.pallas._rows import RowBlocks
from jaxfuse.reference import swiglu as ref


@dataclasses.dataclass(frozen=True)
class _Static:
    blocks: RowBlocks
    interpret: bool
    hopper: bool = False     # the Mosaic GPU kernels (`swiglu_hopper.py`)


def _static(blocks: RowBlocks | None, g2, interpret: bool) -> _Static:
    blocks = _rows.resolve_blocks(blocks, *g2.shape, interpret, has_hopper=True)
    hopper = blocks.hopper
    if hopper is None:
        hopper = not interpret and _hopper.available() and swiglu_hopper.fits(g2)
    elif hopper:
        _hopper.check_forced("RowBlocks(hopper=True)")
    if hopper and not swiglu_hopper.fits(g2):
        raise ValueError(f"RowBlocks(hopper=True): the Hopper SwiGLU kernels take 16-bit "
                         f"[rows, cols] with rows a multiple of {swiglu_hopper.ROWS} and cols "
                         f"of {swiglu_hopper.COLS}, got {g2.dtype} {tuple(g2.shape)}; leave "
                         f"hopper=None to pick by shape")
    return _Static(blocks, interpret, bool(hopper))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _swiglu(g2, u2, st: _Static):
    if st.hopper:
        return swiglu_hopper.swiglu(g2, u2, interpret=st.interpret)
    emit = lambda t: ((_dropout.swiglu(*t.x),), (), ())
    return _rows.map_pass(emit, tiled=[g2, u2], fills=[0.0, 0.0], out_dtypes=(g2.dtype,),
                          blocks=st.blocks, name="jaxfuse_swiglu_fwd", interpret=st.interpret)[0]


def _swiglu_fwd(g2, u2, st):
    return _swiglu(g2, u2, st), (g2, u2)


def _grads(g2, u2, dy2, st: _Static, with_product: bool = False):
    """(dgate, dup), and with `with_product` also silu(gate) * up rebuilt in the same pass: a
    caller that multiplies the product by a weight (`jaxfuse.swiglu_linear`) needs it again for
    the weight's gradient, and writing it here costs one array where keeping it from the
    forward costs holding it (under `lax.scan`: copying it into and out of the layer stack)."""
    if st.hopper:
        return swiglu_hopper.grads(g2, u2, dy2, with_product=with_product,
                                   interpret=st.interpret)

    emit = lambda t: (_dropout.swiglu_grads(*t.x, with_product), (), ())
    return tuple(_rows.map_pass(emit, tiled=[g2, u2, dy2], fills=[0.0] * 3,
                                out_dtypes=(g2.dtype,) * (2 + with_product), blocks=st.blocks,
                                name="jaxfuse_swiglu_bwd", interpret=st.interpret))


def _swiglu_bwd(st, saved, dy2):
    return _grads(*saved, dy2, st)


_swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


def swiglu(gate: jax.Array, up: jax.Array, *, interpret: bool | None = None,
           block_sizes: RowBlocks | None = None) -> jax.Array:
    """Pallas `silu(gate) * up`; see `jaxfuse.reference.swiglu`."""
    ref.validate(gate, up)
    interpret = C.resolve_interpret(interpret)
    g2, u2 = _rows.as_rows(gate), _rows.as_rows(up)
    return _swiglu(g2, u2, _static(block_sizes, g2, interpret)).reshape(gate.shape)


def swiglu_grads(gate: jax.Array, up: jax.Array, dy: jax.Array, *,
                 interpret: bool | None = None, block_sizes: RowBlocks | None = None):
    """(dgate, dup, swiglu(gate, up)) for the cotangent dy, in one pass over gate, up and dy:
    the backward of `swiglu` that also rebuilds its output (bitwise equal to the forward's)."""
    ref.validate(gate, up)
    interpret = C.resolve_interpret(interpret)
    g2, u2 = _rows.as_rows(gate), _rows.as_rows(up)
    outs = _grads(g2, u2, _rows.as_rows(dy), _static(block_sizes, g2, interpret),
                  with_product=True)
    return tuple(o.reshape(gate.shape) for o in outs)
