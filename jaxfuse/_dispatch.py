"""The one rule that routes every public op: `impl="pallas"` (default) or `impl="reference"`.

Zero-size inputs are handled here, once for every op: an op with any zero-size array argument
(an empty batch, no keys, an empty cache) runs its `jax.numpy` reference, which validates the
input like the kernel (what cannot be empty raises a `ValueError` naming it) and returns the
empty result or the defined one (a query over zero keys: zeros and lse = -inf), as jnp does.
There is nothing for a kernel to do on an empty grid, and block rules divide by sizes.

An eager call of a kernel (every array argument concrete) runs through a `jax.jit` cached per
op and static options, so that a second call with the same shapes reuses the compiled program:
called op by op, the kernel's `pallas_call` was traced afresh each time and jax compiled it
again (a 64 x 100 softmax in interpret mode: 85-130 ms every call, where the cached program
takes well under a millisecond after the first).
"""
from __future__ import annotations

import contextlib
import functools
import math
from typing import Any, Callable

import jax
import numpy as np

from jaxfuse import _auto_axes, _checks
from jaxfuse.pallas._common import resolve_interpret


def has_zero_size(*args: Any, **kwargs: Any) -> bool:
    """Whether any array among the arguments has no elements."""
    return any(getattr(a, "size", 1) == 0 and hasattr(a, "shape")
               for a in jax.tree.leaves((args, kwargs)))


# The ops' scalar options that a kernel bakes in as constants: a traced one cannot be (the
# references take some traced: scale, eps).
STATIC_OPTIONS = ("scale", "eps", "label_smoothing", "z_loss", "logits_soft_cap", "base",
                  "rope_base", "rms_eps", "rate", "dropout_rate", "sliding_window",
                  "eos_id", "length_penalty", "ignore_index")
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
        return _call_kernel(pallas_fn, args, dict(kwargs, interpret=interpret,
                                                  block_sizes=block_sizes))


def _call_kernel(pallas_fn: Callable, args: tuple, kwargs: dict) -> Any:
    """`pallas_fn(*args, **kwargs)`; eagerly (no tracer among the arguments) through a jit
    cached by the op, the arguments' structure and every non-array argument (module
    docstring). Under a transformation, with a 0-d array argument (an option a rule may need
    as a Python number, which a jit would turn into a tracer) or an unhashable option, the
    call is made as it is. Like any jit, the cache takes a kernel to be a function of its
    arguments and options: module state patched between two calls of the same key is not
    seen (`_jitted.cache_clear()` forgets every program)."""
    # Resolved here, so that the key holds the mode (JAXFUSE_INTERPRET read at each call).
    kwargs = dict(kwargs, interpret=resolve_interpret(kwargs.get("interpret")))
    leaves, tree = jax.tree.flatten((args, kwargs))
    if any(isinstance(x, jax.core.Tracer) for x in leaves):
        return pallas_fn(*args, **kwargs)
    is_array = tuple(isinstance(x, (jax.Array, np.ndarray)) for x in leaves)
    if any(a and x.ndim == 0 for x, a in zip(leaves, is_array)):
        return pallas_fn(*args, **kwargs)
    # Keyed by type and value, and a float by its sign too: 1 and 1.0, 0.0 and -0.0 compare
    # equal but are different options (a NaN never equals itself and never hits: compiled anew).
    statics = tuple(None if a else (type(x), x, math.copysign(1.0, x))
                    if isinstance(x, float) else (type(x), x)
                    for x, a in zip(leaves, is_array))
    # An op that binds an option with functools.partial makes a new partial each call: it is
    # keyed by what it binds.
    fn = ((pallas_fn.func, pallas_fn.args, tuple(sorted(pallas_fn.keywords.items())))
          if isinstance(pallas_fn, functools.partial) else pallas_fn)
    try:
        run = _jitted(fn, tree, statics, is_array)
    except TypeError:                                   # an unhashable option
        return pallas_fn(*args, **kwargs)
    return run(*(x for x, a in zip(leaves, is_array) if a))


@functools.lru_cache(maxsize=256)
def _jitted(fn, tree, statics: tuple, is_array: tuple) -> Callable:
    pallas_fn = (functools.partial(fn[0], *fn[1], **dict(fn[2])) if isinstance(fn, tuple)
                 else fn)

    def run(*arrays):
        it = iter(arrays)
        leaves = [next(it) if a else s[1] for s, a in zip(statics, is_array)]
        args, kwargs = jax.tree.unflatten(tree, leaves)
        return pallas_fn(*args, **kwargs)
    return jax.jit(run)


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
