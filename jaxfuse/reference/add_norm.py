"""Reference "add, then normalize" of a pre-norm block:

    h = residual + dropout(x),   y = norm(h) * weight (+ bias),   returns (h, y)

`norm="rms"` (RMSNorm, bias must be None) or `"layer"` (LayerNorm). h is rounded to x's dtype
(it is the residual stream the next block adds to) and y is the norm of that rounded h, exactly
as the unfused composition computes it. The mask is `jaxfuse.reference.dropout`'s.
"""
from __future__ import annotations

import jax

from jaxfuse import _checks
from jaxfuse.reference import bias_dropout_add as _bda
from jaxfuse.reference import layer_norm as _ln
from jaxfuse.reference import rms_norm as _rms

DEFAULT_EPS = {"rms": 1e-6, "layer": 1e-5}


def validate(x, residual, weight, bias, norm, rate, key) -> None:
    _bda.validate(x, None, residual, rate, key)
    if norm not in DEFAULT_EPS:
        raise ValueError(f"norm={norm!r} must be 'rms' or 'layer'")
    _checks.check_vector("weight", weight, x.shape[-1])
    _checks.check_vector("bias", bias, x.shape[-1])
    if norm == "rms" and bias is not None:
        raise ValueError("bias must be None for norm='rms' (RMSNorm has no bias); use "
                         "norm='layer' for a LayerNorm with bias")


def resolve_eps(norm: str, eps: float | None) -> float:
    eps = DEFAULT_EPS[norm] if eps is None else eps
    _checks.check_positive("eps", eps)
    return float(eps)


def add_norm(x: jax.Array, residual: jax.Array, weight: jax.Array | None,
             bias: jax.Array | None = None, *, norm: str = "rms", eps: float | None = None,
             rate: float = 0.0, key=None):
    validate(x, residual, weight, bias, norm, rate, key)
    eps = resolve_eps(norm, eps)
    h = _bda.bias_dropout_add(x, None, residual, rate=rate, key=key)
    y = _rms.rms_norm(h, weight, eps=eps) if norm == "rms" else _ln.layer_norm(h, weight, bias,
                                                                               eps=eps)
    return h, y
