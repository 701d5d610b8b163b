"""Whole-array jax.numpy code on meshes with Explicit axes, run on Auto axes.

jaxfuse's references and its model are whole-array jax.numpy programs that XLA partitions from
their operands' shardings (automatic mode). On a mesh with Explicit axes (`jax.make_mesh`'s
default in jax 0.10) every value is typed with its sharding and JAX types each op's result:
a gather from a split table, a contraction over a split axis or a scatter into a split cache
must each be given their output sharding, else a `ShardingTypeError`. `call` runs such a
function under `jax.sharding.auto_axes` instead: its arguments enter typed Auto, XLA
partitions its body as on an Auto mesh, and its results leave typed Explicit with the given
shardings (gradients take the transpose). The Pallas kernels need none of this: their rules
run through `jax.shard_map` there (`jaxfuse.sharding._core`).
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable

import jax
from jax.sharding import AxisType


def explicit_mesh(tree: Any):
    """(mesh, enter) for a call on arrays `tree` on a mesh with Explicit axes, else None.

    The mesh is the one set with `jax.set_mesh` (`enter` is then a no-op), else that of the
    explicitly sharded arguments: under a trace (jit, grad) a tracer's abstract mesh, in an
    eager call a concrete array's `Mesh`. `enter()` returns the context that sets it for the
    call alone."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is not None and not mesh.empty:
        enter = contextlib.nullcontext
    else:
        leaves = [a for a in jax.tree.leaves(tree) if isinstance(a, jax.Array)]
        tracers = [a for a in leaves if isinstance(a, jax.core.Tracer)]
        meshes = [getattr(jax.typeof(a).sharding, "mesh", None) for a in tracers] or [
            getattr(a.sharding, "mesh", None) for a in leaves]
        mesh = next((m for m in meshes if m is not None and not m.empty), None)
        enter = functools.partial(jax.sharding.use_abstract_mesh if tracers else jax.set_mesh,
                                  mesh)
    if mesh is None or AxisType.Explicit not in mesh.axis_types:
        return None
    return mesh, enter


def on_arrays(fn: Callable, args: tuple, kwargs: dict):
    """(g, arrays): `fn(*args, **kwargs)` as a function `g(*arrays)` of the jax arrays among
    the arguments alone, the rest (Python numbers, dtypes, strings, None) closed over. What
    `auto_axes` and `eval_shape` take as arguments must be arrays."""
    leaves, tree = jax.tree.flatten((args, kwargs))
    where = [i for i, a in enumerate(leaves) if isinstance(a, jax.Array)]

    def g(*arrays):
        full = list(leaves)
        for i, a in zip(where, arrays):
            full[i] = a
        a, k = jax.tree.unflatten(tree, full)
        return fn(*a, **k)

    return g, [leaves[i] for i in where]


def call(fn: Callable, out_specs: Any, *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` on Auto axes, its results typed with `out_specs` (a pytree of
    PartitionSpecs shaped like them); the mesh must be in context (`explicit_mesh`'s
    `enter()`)."""
    g, arrays = on_arrays(fn, args, kwargs)
    return jax.sharding.auto_axes(g, out_sharding=out_specs)(*arrays)
