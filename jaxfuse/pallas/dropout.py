"""Fused dropout (mask generated in the kernel, never stored); the kernel is `_dropout.py`."""
from __future__ import annotations

import jax

from jaxfuse.pallas import _dropout
from jaxfuse.pallas._rows import RowBlocks
from jaxfuse.reference import dropout as ref


def dropout(x: jax.Array, rate: float, key, *, interpret: bool | None = None,
            block_sizes: RowBlocks | None = None) -> jax.Array:
    """Pallas inverted dropout; see `jaxfuse.reference.dropout`."""
    ref.validate(x, rate, key)
    return _dropout.apply(x, None, None, activation=None, rate=rate, key=key, name="dropout",
                          interpret=interpret, block_sizes=block_sizes)
