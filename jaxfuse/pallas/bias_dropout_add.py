"""Fused bias + dropout + residual; the kernel is `_dropout.py`."""
from __future__ import annotations

import jax

from jaxfuse.pallas import _dropout
from jaxfuse.pallas._rows import RowBlocks
from jaxfuse.reference import bias_dropout_add as ref


def bias_dropout_add(x: jax.Array, bias: jax.Array | None, residual: jax.Array, *,
                     rate: float = 0.0, key=None, interpret: bool | None = None,
                     block_sizes: RowBlocks | None = None) -> jax.Array:
    """Pallas `residual + dropout(x + bias)`; see `jaxfuse.reference.bias_dropout_add`."""
    ref.validate(x, bias, residual, rate, key)
    return _dropout.apply(x, bias, residual, activation=None, rate=rate, key=key,
                          name="bias_dropout_add", interpret=interpret, block_sizes=block_sizes)
