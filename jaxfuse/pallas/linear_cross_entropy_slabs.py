"""Linear + cross-entropy with its gradient formed in the forward pass, one slab of tokens at a
time (`LCEBlocks(token_slab=n)`; Liger-Kernel's scheme).

The fused op (`linear_cross_entropy`) never holds the logits, so its backward computes them
again: four [N, D] x [D, V] products where a loss that keeps its logits does three. A loss
reduced to one number ("mean" or "sum") gets one scalar cotangent g, and every token's weight in
it (1 / count, or 1) is known in the forward. So the forward can form the whole gradient for
g = 1, slab by slab of tokens, while each slab's logits exist:

    per slab of `token_slab` tokens:  z = x_s W             (XLA's matmul, logits in x's dtype)
                                      loss_s, dz_s          (one cross-entropy kernel: lse,
                                                             then dz = q - p over z)
                                      dx_s = dz_s W^T,  dW += x_s^T dz_s   (float32)

with dx and dW scaled by the weight once at the end (in float32: 1 / count folded into a 16-bit
dz would push float16 entries under the smallest normal), and the backward only multiplies dx
and dW by g. Three products, one [token_slab, V] logits
slab and its dz alive at a time, plus dx and dW in float32 from the forward to the backward.
Measured on an H200 as the same composition written out (`benchmarks/lce_paths.py`, run s7-7,
before this op existed; profiler kernel time of loss + dx + dW, bf16):
at the 1B preset's loss (N 16384, D 2048, V 128256) 42.1 ms against the fused op's 51.7, with
1.59 GB of temporaries against 0.27 (holding the logits: 41.2 ms, 8.4 GB); at the 157M's (N
16384, D 1024, V 32768) 6.00 against 6.20 ms.

Taken only where it applies: under differentiation (`jax.grad` of the loss; a forward alone runs
the fused op, so the two losses agree to rounding, not bitwise), with reduction "mean" or "sum"
(a per-token loss has a per-token cotangent), and without z_loss or a soft cap (the
cross-entropy kernel has neither); otherwise the fused op runs. Gradients are deterministic (a
fixed slab order, float32 sums). On a mesh (`jaxfuse.sharding.linear_cross_entropy`) each
device walks its own tokens and dW is summed once over them; a W whose vocabulary is split
stays split: each device forms its slice's logits, the slab's per-token (m, l, ...) merge
across the vocabulary's devices (as the fused op's do), dx is summed over them and dW keeps
W's layout. Both gradients are formed even when only one is asked for (a frozen W still costs
its dW product).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxfuse.pallas import cross_entropy as _ce


def applies(reduction: str, z_loss: float, logits_soft_cap) -> bool:
    """Whether a loss with these settings can take this path (see the module docstring)."""
    return reduction != "none" and not z_loss and logits_soft_cap is None


def slab_loss(st):
    """(summed loss, dz) of one slab's logits z [n, V] and canonical labels [n] (cotangent 1)
    by `jaxfuse.cross_entropy`'s one-kernel loss and gradient with settings `st` (dz written
    over z)."""
    def loss_and_dz(z, labels):
        loss, dz = _ce.loss_and_grad(z, labels, st)
        return jnp.sum(loss), dz
    return loss_and_dz


def loss_and_grads(x2, w, labels1, weight, *, label_smoothing: float, ignore_index: int,
                   token_slab: int, interpret, slab_loss=slab_loss, sum_dx=None):
    """(summed loss times `weight`, dx [N, D] float32, dW [D, V] float32) of x2 [N, D] and
    labels1 [N] (canonical) for cotangent 1, `weight` (float32 scalar) being every token's
    weight in the reduced loss: 1 / count for a mean (the whole batch's count), 1 for a sum.
    One device's tokens; the caller sums loss and dW over the devices that split them.
    `slab_loss(st)` gives a slab's (summed loss, dz) and `sum_dx` sums dx's partial products:
    `jaxfuse.sharding` passes the vocabulary-parallel pair where W is a slice of the classes."""
    n, d = x2.shape
    slab = min(token_slab, n)         # a slab past the tokens would only pad
    pad = (-n) % slab                 # padded tokens are ignored: no loss, no gradient
    xp = jnp.pad(x2, ((0, pad), (0, 0)))
    lp = jnp.pad(labels1, (0, pad), constant_values=ignore_index)
    # The cross-entropy kernels' settings, once; the labels are canonical already.
    st = _ce.static((slab, w.shape[1]), label_smoothing=label_smoothing,
                    ignore_index=ignore_index, interpret=interpret, block_sizes=None)

    loss_and_dz = slab_loss(st)

    def step(dw, xs_ls):
        xs, ls = xs_ls
        # dz unweighted, in the logits' dtype; the weight is applied to dx and dW in float32.
        loss, dz = loss_and_dz(xs @ w, ls)
        dx = jnp.dot(dz, w.T, preferred_element_type=jnp.float32)
        return dw + jnp.dot(xs.T, dz, preferred_element_type=jnp.float32), (loss, dx)

    dw, (losses, dx) = jax.lax.scan(step, jnp.zeros(w.shape, jnp.float32),
                                    (xp.reshape(-1, slab, d), lp.reshape(-1, slab)))
    dx = dx.reshape(-1, d)[:n]
    if sum_dx is not None:      # one collective for every slab's partial products
        dx = sum_dx(dx)
    return jnp.sum(losses) * weight, dx * weight, dw * weight


def check_token_slab(token_slab, name: str = "LCEBlocks.token_slab") -> None:
    if token_slab is not None and (isinstance(token_slab, bool) or not (
            isinstance(token_slab, int) and token_slab >= 1)):
        raise ValueError(f"{name}={token_slab!r} must be None (the fused op's backward) or a "
                         f"positive number of tokens per slab")
