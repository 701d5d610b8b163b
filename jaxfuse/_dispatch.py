"""The one rule that routes every public op: `impl="pallas"` (default) or `impl="reference"`.

Zero-size inputs are handled here, once for every op: an op with any zero-size array argument
(an empty batch, no keys, an empty cache) runs its `jax.numpy` reference, which validates the
input like the kernel (what cannot be empty raises a `ValueError` naming it) and returns the
empty result or the defined one (a query over zero keys: zeros and lse = -inf), as jnp does.
There is nothing for a kernel to do on an empty grid, and block rules divide by sizes.
"""
from __future__ import annotations

from typing import Any, Callable

import jax

from jaxfuse import _checks


def has_zero_size(*args: Any, **kwargs: Any) -> bool:
    """Whether any array among the arguments has no elements."""
    return any(getattr(a, "size", 1) == 0 and hasattr(a, "shape")
               for a in jax.tree.leaves((args, kwargs)))


# The ops' scalar options that a kernel bakes in as constants: a traced one cannot be (the
# references take some traced: scale, eps).
STATIC_OPTIONS = ("scale", "eps", "label_smoothing", "z_loss", "logits_soft_cap", "base",
                  "rope_base", "rms_eps", "rate", "dropout_rate", "sliding_window")


def route(impl: str, pallas_fn: Callable, reference_fn: Callable, *args: Any,
          interpret: bool | None = None, block_sizes: Any = None, **kwargs: Any) -> Any:
    """Calls the Pallas kernel (with its tuning knobs) or the plain jax.numpy reference (also
    for zero-size inputs, see the module docstring)."""
    _checks.check_impl(impl)
    if impl == "reference" or has_zero_size(*args, **kwargs):
        return reference_fn(*args, **kwargs)
    for name in STATIC_OPTIONS:
        _checks.check_static(name, kwargs.get(name))
    return pallas_fn(*args, interpret=interpret, block_sizes=block_sizes, **kwargs)
