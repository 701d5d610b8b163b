"""Reference matmul of a decoding step, with the block's norm before it and SwiGLU or the
residual add after it:

    y   = norm(x) * norm_weight (+ norm_bias)        ("rms" or "layer"; y = x when norm=None)
    z   = y @ weight.T                                weight [N, K], as torch.nn.Linear stores it
    out = silu(y @ gate_weight.T) * z                 when gate_weight is given (SwiGLU)
    out = residual + out                              when residual is given

y is rounded to x's dtype before the product (it is what an unfused block feeds its matmul);
the products accumulate in float32, the epilogue runs in float32 and `out` is returned in x's
dtype. The weights are [N, K] (each output feature's weights one contiguous row) because that
is the layout a kernel streams at the copy rate when the rows are few (`jaxfuse.pallas.
decode_linear`); `jaxfuse.model.decode_params` stores a model's weights that way once.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxfuse import _checks
from jaxfuse.reference import add_norm as _an
from jaxfuse.reference import layer_norm as _ln
from jaxfuse.reference import rms_norm as _rms


def validate(x, weight, norm, norm_weight, norm_bias, gate_weight, residual) -> None:
    _checks.check_float("x", x)
    _checks.check_ndim("x", x, min_ndim=1)
    k = x.shape[-1]
    for name, w in (("weight", weight), ("gate_weight", gate_weight)):
        if w is None:
            continue
        if w.ndim != 2 or w.shape[1] != k:
            raise ValueError(f"{name} (shape={tuple(w.shape)}) must be [N, K] with K = "
                             f"x.shape[-1] = {k} (output features first, as torch.nn.Linear "
                             f"stores them; pass w.T for a [K, N] matrix)")
        if w.dtype != x.dtype:
            raise ValueError(f"{name}.dtype={w.dtype} must match x.dtype={x.dtype}; cast it "
                             f"(e.g. {name}.astype(x.dtype))")
    if gate_weight is not None and gate_weight.shape != weight.shape:
        raise ValueError(f"gate_weight (shape={tuple(gate_weight.shape)}) must have weight's "
                         f"shape {tuple(weight.shape)}")
    if norm is None:
        if norm_weight is not None or norm_bias is not None:
            raise ValueError("norm_weight / norm_bias given with norm=None; pass norm='rms' "
                             "or 'layer'")
    else:
        if norm not in _an.DEFAULT_EPS:
            raise ValueError(f"norm={norm!r} must be None, 'rms' or 'layer'")
        _checks.check_vector("norm_weight", norm_weight, k)
        _checks.check_vector("norm_bias", norm_bias, k)
        if norm == "rms" and norm_bias is not None:
            raise ValueError("norm_bias must be None for norm='rms' (RMSNorm has no bias)")
    if residual is not None:
        want = (*x.shape[:-1], weight.shape[0])
        if tuple(residual.shape) != want or residual.dtype != x.dtype:
            raise ValueError(f"residual (shape={tuple(residual.shape)}, dtype="
                             f"{residual.dtype}) must be {want} in x.dtype={x.dtype}")


def normalized(x, norm, norm_weight, norm_bias, eps):
    """y: the input of the product, in x's dtype."""
    if norm is None:
        return x
    eps = _an.resolve_eps(norm, eps)
    if norm == "rms":
        return _rms.rms_norm(x, norm_weight, eps=eps)
    return _ln.layer_norm(x, norm_weight, norm_bias, eps=eps)


def decode_linear(x: jax.Array, weight: jax.Array, *, norm: str | None = None,
                  norm_weight: jax.Array | None = None, norm_bias: jax.Array | None = None,
                  eps: float | None = None, gate_weight: jax.Array | None = None,
                  residual: jax.Array | None = None) -> jax.Array:
    validate(x, weight, norm, norm_weight, norm_bias, gate_weight, residual)
    y = normalized(x, norm, norm_weight, norm_bias, eps)
    mm = lambda w: jnp.einsum("...k,nk->...n", y, w, preferred_element_type=jnp.float32)
    out = mm(weight)
    if gate_weight is not None:
        out = jax.nn.silu(mm(gate_weight)) * out
    if residual is not None:
        out = residual.astype(jnp.float32) + out
    return out.astype(x.dtype)
