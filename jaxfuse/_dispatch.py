"""The one rule that routes every public op: `impl="pallas"` (default) or `impl="reference"`.

Zero-size inputs are handled here, once for every op: an op with any zero-size array argument
(an empty batch, no keys, an empty cache) runs its `jax.numpy` reference, which validates the
input like the kernel (what cannot be empty raises a `ValueError` naming it) and returns the
empty result or the defined one (a query over zero keys: zeros and lse = -inf), as jnp does.
There is nothing for a kernel to do on an empty grid, and block rules divide by sizes.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable

import jax

from jaxfuse import _auto_axes, _checks


def has_zero_size(*args: Any, **kwargs: Any) -> bool:
    """Whether any array among the arguments has no elements."""
    return any(getattr(a, "size", 1) == 0 and hasattr(a, "shape")
               for a in jax.tree.leaves((args, kwargs)))


# The ops' scalar options that a kernel bakes in as constants: a traced one cannot be (the
# references take some traced: scale, eps).
STATIC_OPTIONS = ("scale", "eps", "label_smoothing", "z_loss", "logits_soft_cap", "base",
                  "rope_base", "rms_eps", "rate", "dropout_rate", "sliding_window",
                  "eos_id", "length_penalty")
# The ops' flags: Python bools on both paths (a string "False" is truthy; a traced bool cannot
# choose a branch).
BOOL_OPTIONS = ("causal", "return_lse", "partial_sums", "rope_interleaved", "interleaved")


def route(impl: str, pallas_fn: Callable, reference_fn: Callable, *args: Any,
          block_type: type, interpret: bool | None = None, block_sizes: Any = None,
          **kwargs: Any) -> Any:
    """Calls the Pallas kernel (with its tuning knobs) or the plain jax.numpy reference (also
    for zero-size inputs, see the module docstring). `block_type`: the class of the op's
    `block_sizes` (another class's tiles mean nothing to its kernels)."""
    _checks.check_impl(impl)
    if block_sizes is not None and not isinstance(block_sizes, block_type):
        raise ValueError(f"block_sizes of type {type(block_sizes).__name__}: this op takes "
                         f"a jaxfuse.{block_type.__name__} (or None for the tile rule)")
    for name in BOOL_OPTIONS:
        if name in kwargs:
            kwargs[name] = _checks.check_bool(name, kwargs[name])
    for name in STATIC_OPTIONS:
        if name in kwargs:
            kwargs[name] = _checks.python_scalar(kwargs[name])
    if has_zero_size(*args, **kwargs):
        return reference_fn(*args, **kwargs)
    # On a mesh with Explicit axes the rules reshard and shard_map by PartitionSpecs, which
    # need the mesh in context: the one set with `jax.set_mesh`, else the arguments' own.
    found = _auto_axes.explicit_mesh((args, kwargs))
    with found[1]() if found else contextlib.nullcontext():
        if impl == "reference":
            if found is None or any(isinstance(kwargs.get(n), jax.core.Tracer)
                                    for n in STATIC_OPTIONS):
                return reference_fn(*args, **kwargs)
            return _reference_on_auto_axes(pallas_fn, reference_fn, args, kwargs, interpret)
        for name in STATIC_OPTIONS:
            _checks.check_static(name, kwargs.get(name))
        return pallas_fn(*args, interpret=interpret, block_sizes=block_sizes, **kwargs)


def _reference_on_auto_axes(pallas_fn, reference_fn, args, kwargs, interpret):
    """The reference on a mesh with Explicit axes: its jax.numpy runs on Auto axes, where XLA
    partitions it as on an Auto mesh (a gather from a split table, a contraction over a split
    axis need no output sharding there; `jaxfuse._auto_axes`), and its results are typed as
    the kernel's would be (the op's partitioning rule traced abstractly, with its default
    tiles), so that both impls give the same types. (With a traced option, or inputs only the
    reference takes, the reference runs as it is.)"""
    g, arrays = _auto_axes.on_arrays(functools.partial(pallas_fn, interpret=interpret), args,
                                     kwargs)
    try:
        like = jax.eval_shape(g, *arrays)
    except ValueError:
        # inputs the kernels do not take (a head dim they have no tiles for), which the
        # reference does: it runs as it is, as it did before this path existed
        return reference_fn(*args, **kwargs)
    specs = jax.tree.map(lambda s: s.sharding.spec, like)
    return _auto_axes.call(reference_fn, specs, *args, **kwargs)
