"""Fused RMSNorm; the kernels live in `_norm.py`, shared with LayerNorm (center=False)."""
from __future__ import annotations

import jax

from jaxfuse.pallas import _norm
from jaxfuse.pallas._rows import RowBlocks
from jaxfuse.reference import rms_norm as ref


def rms_norm(x: jax.Array, weight: jax.Array | None = None, *, eps: float = 1e-6,
             interpret: bool | None = None, block_sizes: RowBlocks | None = None) -> jax.Array:
    """Pallas RMSNorm over the last axis; see `jaxfuse.reference.rms_norm`."""
    ref.validate(x, weight, eps)
    return _norm.apply(x, weight, None, center=False, eps=eps, interpret=interpret,
                       block_sizes=block_sizes)
