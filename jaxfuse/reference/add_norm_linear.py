"""Reference "add, normalize, project": h = residual + dropout(x), y = norm(h), and y @ p for
each projection p (a pre-norm block's q/k/v or gate/up matmuls)."""
from __future__ import annotations

from typing import Sequence

import jax

from jaxfuse.reference import add_norm as _an


def validate(x, residual, weight, bias, projections, norm, rate, key) -> None:
    _an.validate(x, residual, weight, bias, norm, rate, key)
    if isinstance(projections, jax.Array) or not isinstance(projections, (tuple, list)) \
            or not projections:
        raise ValueError(f"projections must be a non-empty tuple or list of [D, N] matrices, "
                         f"got {type(projections).__name__}; pass (w,) for a single one")
    for i, p in enumerate(projections):
        if p.ndim != 2 or p.shape[0] != x.shape[-1]:
            raise ValueError(f"projections[{i}] (shape={tuple(p.shape)}) must be [D, N] with "
                             f"D = x.shape[-1] = {x.shape[-1]}")
        if p.dtype != x.dtype:
            raise ValueError(f"projections[{i}].dtype={p.dtype} must match x.dtype={x.dtype}; "
                             f"cast it (e.g. p.astype(x.dtype))")


def add_norm_linear(x: jax.Array, residual: jax.Array, weight: jax.Array | None,
                    bias: jax.Array | None = None, *, projections: Sequence[jax.Array],
                    norm: str = "rms", eps: float | None = None, rate: float = 0.0, key=None):
    validate(x, residual, weight, bias, projections, norm, rate, key)
    h, y = _an.add_norm(x, residual, weight, bias, norm=norm, eps=eps, rate=rate, key=key)
    return h, tuple(y @ p for p in projections)
