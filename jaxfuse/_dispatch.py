"""The one rule that routes every public op: `impl="pallas"` (default) or `impl="reference"`."""
from __future__ import annotations

from typing import Any, Callable

from jaxfuse import _checks


def route(impl: str, pallas_fn: Callable, reference_fn: Callable, *args: Any,
          interpret: bool | None = None, block_sizes: Any = None, **kwargs: Any) -> Any:
    """Calls the Pallas kernel (with its tuning knobs) or the plain jax.numpy reference."""
    _checks.check_impl(impl)
    if impl == "reference":
        return reference_fn(*args, **kwargs)
    return pallas_fn(*args, interpret=interpret, block_sizes=block_sizes, **kwargs)
