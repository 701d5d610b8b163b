"""Fused LayerNorm (Welford/Chan statistics); the kernels live in `_norm.py`, shared with RMSNorm."""
from __future__ import annotations

import jax

from jaxfuse.pallas import _norm
from jaxfuse.pallas._rows import RowBlocks
from jaxfuse.reference import layer_norm as ref


def layer_norm(x: jax.Array, weight: jax.Array | None = None, bias: jax.Array | None = None, *,
               eps: float = 1e-5, interpret: bool | None = None,
               block_sizes: RowBlocks | None = None) -> jax.Array:
    """Pallas LayerNorm over the last axis; see `jaxfuse.reference.layer_norm`."""
    ref.validate(x, weight, bias, eps)
    return _norm.apply(x, weight, bias, center=True, eps=eps, interpret=interpret,
                       block_sizes=block_sizes)
