"""Reference linear + cross-entropy: the composition that materializes the logits.

For tokens x [N, D], weight [D, V] and labels [N]:

    z = x @ weight                      (in x's dtype, as jnp rounds it; then float32 and
                                         c * tanh(z / c) with logits_soft_cap=c)
    loss = cross_entropy(z, labels, label_smoothing, ignore_index) + z_loss * lse(z)^2

per token (the z-loss of PaLM keeps lse near 0), reduced as `jaxfuse.cross_entropy` does.
Leading batch axes of x and labels are flattened.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxfuse import _checks
from jaxfuse.reference.cross_entropy import canonical_labels, reduce_loss, token_losses


def validate(x, weight, labels, label_smoothing, reduction, z_loss, logits_soft_cap,
             ignore_index=-100) -> None:
    _checks.check_float("x", x)
    _checks.check_float("weight", weight)
    _checks.check_ndim("x", x, min_ndim=1)
    _checks.check_ndim("weight", weight, 2)
    if x.dtype != weight.dtype:
        raise ValueError(f"x.dtype={x.dtype} and weight.dtype={weight.dtype} must match")
    if x.shape[-1] != weight.shape[0]:
        raise ValueError(f"x.shape[-1]={x.shape[-1]} must equal weight.shape[0]="
                         f"{weight.shape[0]} (weight is [D, V])")
    if weight.shape[1] == 0:
        raise ValueError(f"weight.shape={tuple(weight.shape)}: the vocabulary (weight.shape[1]) "
                         "is empty; there must be at least one class")
    if x.shape[-1] == 0:
        raise ValueError(f"x.shape={tuple(x.shape)}: the feature axis (last) is empty")
    _checks.check_labels(labels, x.shape[:-1], "x", label_smoothing, reduction, ignore_index)
    _checks.check_finite("z_loss", z_loss, minimum=0.0)
    _checks.check_static("z_loss", z_loss)
    _checks.check_positive("logits_soft_cap", logits_soft_cap)


def linear_cross_entropy(x: jax.Array, weight: jax.Array, labels: jax.Array, *,
                         label_smoothing: float = 0.0, ignore_index: int = -100,
                         z_loss: float = 0.0, logits_soft_cap: float | None = None,
                         reduction: str = "mean") -> jax.Array:
    """Cross-entropy of x @ weight against labels; float32 result."""
    validate(x, weight, labels, label_smoothing, reduction, z_loss, logits_soft_cap,
             ignore_index)
    labels = canonical_labels(labels, weight.shape[1], ignore_index)
    z = jnp.dot(x.reshape(-1, x.shape[-1]), weight).astype(jnp.float32)
    if logits_soft_cap is not None:
        z = logits_soft_cap * jnp.tanh(z / logits_soft_cap)
    loss, valid = token_losses(z, labels.reshape(-1), label_smoothing=label_smoothing,
                               ignore_index=ignore_index, z_loss=float(z_loss))
    return reduce_loss(loss.reshape(labels.shape), valid.reshape(labels.shape), reduction)
