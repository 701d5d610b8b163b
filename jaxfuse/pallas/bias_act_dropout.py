"""Fused bias + activation + dropout; the kernel is `_dropout.py`."""
from __future__ import annotations

import jax

from jaxfuse.pallas import _dropout
from jaxfuse.pallas._rows import RowBlocks
from jaxfuse.reference import bias_act_dropout as ref


def bias_act_dropout(x: jax.Array, bias: jax.Array | None, *, activation: str = "gelu",
                     rate: float = 0.0, key=None, interpret: bool | None = None,
                     block_sizes: RowBlocks | None = None) -> jax.Array:
    """Pallas `dropout(act(x + bias))`; see `jaxfuse.reference.bias_act_dropout`."""
    ref.validate(x, bias, activation, rate, key)
    return _dropout.apply(x, bias, None, activation=activation, rate=rate, key=key,
                          name="bias_act_dropout", interpret=interpret, block_sizes=block_sizes)
