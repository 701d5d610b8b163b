"""Reference cross-entropy with label smoothing (PyTorch's convention).

For logits x over V classes, q = softmax(x) and the smoothed target p = (1 - a) onehot(y) + a / V:

    loss = -sum_i p_i log q_i = lse(x) - (1 - a) x_y - (a / V) sum_i x_i,

and d loss / d x = q - p (lecture 10, sec. 5.2). Tokens whose label equals `ignore_index`
contribute 0 and are left out of the mean; a label outside [0, V) that is not `ignore_index`
gives a NaN loss for that token, so a data bug is loud rather than a plausible number.
The loss is float32 whatever the logits' dtype.

Labels of any integer dtype follow one rule (`canonical_labels`): they are compared with
`ignore_index` and with [0, V) as integers of unbounded range, so an unsigned label never
equals a negative `ignore_index` (uint8 156 is a label out of range, not -100 wrapped).

A logit of -inf (a masked vocabulary entry) is allowed: it adds nothing to lse. Without
smoothing the loss stays finite (terms whose coefficient is 0 are left out, not 0 * -inf);
with a > 0 the smoothing term (a / V) sum_i x_i makes the loss +inf, as the formula says.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxfuse import _checks


def validate(logits, labels, label_smoothing, reduction, ignore_index=-100) -> None:
    _checks.check_float("logits", logits)
    _checks.check_ndim("logits", logits, min_ndim=1)
    _checks.check_labels(labels, logits.shape[:-1], "logits", label_smoothing, reduction,
                         ignore_index)


def canonical_labels(labels, n_cls: int, ignore_index: int) -> jax.Array:
    """int32 labels that mean what `labels` mean under the integer rule: ignored tokens carry
    `ignore_index`, labels in [0, V) themselves, every other label a value outside [0, V) that
    is not `ignore_index` (so it gives NaN). The comparisons happen in the labels' own dtype
    with constants that fit it, never through a wrapping cast: uint8 156 is not -100."""
    info = jnp.iinfo(labels.dtype)
    ignored = (labels == jnp.asarray(ignore_index, labels.dtype)
               if info.min <= ignore_index <= info.max else jnp.zeros(labels.shape, bool))
    in_range = labels >= 0 if info.min < 0 else jnp.ones(labels.shape, bool)
    if n_cls <= info.max:
        in_range = in_range & (labels < jnp.asarray(n_cls, labels.dtype))
    bad = -1 if ignore_index != -1 else -2
    return jnp.where(ignored, ignore_index,
                     jnp.where(in_range, labels.astype(jnp.int32), bad)).astype(jnp.int32)


def reduce_loss(per_token: jax.Array, valid: jax.Array, reduction: str) -> jax.Array:
    """Shared by every implementation: 'none' keeps per-token values, 'sum' adds them, 'mean'
    divides by the number of non-ignored tokens (0 when all are ignored, rather than 0/0)."""
    if reduction == "none":
        return per_token
    total = jnp.sum(per_token)
    if reduction == "sum":
        return total
    return total / jnp.maximum(jnp.sum(valid), 1).astype(jnp.float32)


def loss_from_stats(lse, picked, sum_logits, labels, n_cls: int, *, label_smoothing: float,
                    ignore_index: int, z_loss: float = 0.0):
    """Per-token loss from what one pass over a row gathers (its lse, the label's logit and the
    sum of logits): lse - (1 - a) x_y - (a / V) sum x + z_loss lse^2; 0 at ignored tokens, NaN at
    out-of-range labels. Shared by the references and the kernels."""
    a = float(label_smoothing)
    # Terms whose coefficient is statically 0 are left out rather than multiplied by 0: the
    # label's logit or the sum of logits may be -inf (masked entries), and 0 * -inf = NaN.
    loss = lse
    if a != 1.0:
        loss = loss - (1.0 - a) * picked
    if a:
        loss = loss - (a / n_cls) * sum_logits
    if z_loss:
        loss = loss + z_loss * lse * lse
    bad = (labels < 0) | (labels >= n_cls)
    return jnp.where(labels == ignore_index, 0.0, jnp.where(bad, jnp.nan, loss))


def logits_grad(z, cols, labels, lse, g, n_cls: int, *, label_smoothing: float,
                z_loss: float = 0.0):
    """d loss / d z = (q (1 + 2 z_loss lse) - p) * g for logits z at class indices `cols`, with
    q = exp(z - lse), p the smoothed target and g the per-token cotangent."""
    a = float(label_smoothing)
    q = jnp.exp(z - lse)
    # Terms whose coefficient is statically 0 are left out: this runs once per logit in the
    # kernels, which are close to memory-bound.
    if z_loss:
        q = q * (1.0 + 2.0 * z_loss * lse)
    dz = q - jnp.where(cols == labels, 1.0 - a, 0.0)
    if a:
        dz = dz - a / n_cls
    return dz * g


def token_cotangent(g, labels, n_cls: int, ignore_index: int):
    """The per-token cotangent as the kernels use it: 0 at ignored tokens, NaN at out-of-range
    labels (so a bad label poisons its gradient the way it poisons its loss)."""
    bad = ((labels < 0) | (labels >= n_cls)) & (labels != ignore_index)
    return jnp.where(labels == ignore_index, 0.0, jnp.where(bad, jnp.nan, g)).astype(jnp.float32)


def token_losses(logits, labels, *, label_smoothing: float, ignore_index: int,
                 z_loss: float = 0.0):
    """Per-token losses (0 at ignored tokens, NaN at out-of-range labels) and the valid mask."""
    x = logits.astype(jnp.float32)
    n_classes = x.shape[-1]
    picked = jnp.take_along_axis(x, jnp.clip(labels, 0, n_classes - 1)[..., None], axis=-1)[..., 0]
    loss = loss_from_stats(jax.nn.logsumexp(x, axis=-1), picked, jnp.sum(x, axis=-1), labels,
                           n_classes, label_smoothing=label_smoothing, ignore_index=ignore_index,
                           z_loss=z_loss)
    return loss, labels != ignore_index


def cross_entropy(logits: jax.Array, labels: jax.Array, *, label_smoothing: float = 0.0,
                  ignore_index: int = -100, reduction: str = "mean") -> jax.Array:
    """Cross-entropy of logits [..., V] against integer labels [...]."""
    validate(logits, labels, label_smoothing, reduction, ignore_index)
    labels = canonical_labels(labels, logits.shape[-1], ignore_index)
    loss, valid = token_losses(logits, labels, label_smoothing=label_smoothing,
                               ignore_index=ignore_index)
    return reduce_loss(loss, valid, reduction)
