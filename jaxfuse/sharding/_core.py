"""The one mechanism that runs a jaxfuse kernel per shard, whatever placed its operands.

XLA cannot partition a `pallas_call`: given sharded operands it gathers them onto every device
(jax#19748). So each public op is written as a per-shard function `local(plan, *arrays)` plus a
`Layout` that names every dimension of every operand and result by a factor (einsum style:
`x: b0 b1 d`, `weight: d`), and this module runs `local` on each device's shard:

* automatic mode (`jax.jit` over arrays placed with `NamedSharding` on an `Auto` mesh):
  `jax.experimental.custom_partitioning`. The Shardy rule comes from the layout, so the
  operands' shardings propagate through the op; at partitioning time `plan` maps each factor to
  the mesh axes it is sharded over, the operands keep those shardings (factors the op cannot
  split are gathered), and `local` runs on the shards with collectives over the plan's axes
  where the maths needs them (psum of a weight gradient, (m, l) merges across a split row).
* explicit mode (a mesh with `Explicit` axes: the avals carry their sharding): `jax.shard_map`
  with the same plan and the same `local`.
* one device, or inside a user's `shard_map`: `local` runs as is (custom_partitioning inlines).

`custom_partitioning` is not differentiable, so `vjp_op` joins a partitioned forward (which
returns the residuals) and a partitioned backward with a `jax.custom_vjp`, as JAX's RMSNorm
example does. `custom_partitioning` has no batching rule either, so under `jax.vmap` the op runs
its unpartitioned `local` through `jax.custom_batching.custom_vmap`.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Sequence

import jax
from jax.ad_checkpoint import checkpoint_name
from jax.experimental.custom_partitioning import (ArrayMapping, CompoundFactor, SdyShardingRule,
                                                  custom_partitioning)
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxfuse import _auto_axes

Dims = tuple  # one entry per dimension: a factor name, or a tuple of names (major first)
Plan = dict   # factor name -> tuple of mesh axis names it is sharded over (absent: whole),
              # and MESH_ORDER -> the mesh's axis names in its own order
# The plan's entry of the mesh's axis order, for collectives that number a group of several
# axes in that order whatever order a spec lists them in (`ring._ppermute`); no factor's name.
MESH_ORDER = "mesh order"


@dataclasses.dataclass(frozen=True)
class Layout:
    """Factor names of every operand and result dimension, the factors the op can split and
    the sizes of factors that only appear inside a compound dimension (GQA's query heads are
    `(n, g)`: KV head n major, group member g minor; only n may be split), and the factors
    whose every shard must hold a multiple of some count (`multiples`: the causal ring's two
    halves a device), which stay whole where it would not."""
    operands: tuple[Dims, ...]
    results: tuple[Dims, ...]
    splittable: tuple[str, ...]
    sizes: tuple[tuple[str, int], ...] = ()
    multiples: tuple[tuple[str, int], ...] = ()

    def sdy_rule(self) -> SdyShardingRule:
        def mapping(dims):
            return ArrayMapping(*[d if isinstance(d, str) else CompoundFactor(*d) for d in dims])
        factors = dict.fromkeys(f for dims in self.operands + self.results for d in dims
                                for f in ((d,) if isinstance(d, str) else d))
        return SdyShardingRule(       # Shardy wants the special factors in order of appearance
            tuple(mapping(d) for d in self.operands), tuple(mapping(d) for d in self.results),
            need_replication_factors=tuple(f for f in factors if f not in self.splittable),
            **dict(self.sizes))


def lead(ndim: int, prefix: str = "b") -> tuple[str, ...]:
    """Factor names for `ndim` leading (batch-like) dimensions."""
    return tuple(f"{prefix}{i}" for i in range(ndim))


def spec_axes(entry) -> tuple[str, ...]:
    """The mesh axes one partition-spec entry names (None, a name, or a tuple of names)."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def make_plan(layout: Layout, specs: Sequence[P], shapes: Sequence[tuple[int, ...]],
              axis_sizes: dict[str, int]) -> Plan:
    """Which mesh axes each factor is split over, read off the operands' partition specs: the
    first operand that shards a splittable factor decides, a mesh axis serves one factor only,
    and a factor is split only if its size divides evenly, into shards of the layout's
    `multiples` (else it stays whole)."""
    sizes = dict(layout.sizes)
    for dims, shape in zip(layout.operands, shapes):
        for d, n in zip(dims, shape):
            if isinstance(d, str):
                sizes.setdefault(d, n)
    multiples = dict(layout.multiples)
    plan: Plan = {MESH_ORDER: tuple(axis_sizes)}
    used: set[str] = set()
    for dims, spec in zip(layout.operands, specs):
        for j, d in enumerate(dims):
            factor = d if isinstance(d, str) else d[0]
            axes = spec_axes(spec[j] if j < len(spec) else None)
            if (not axes or factor in plan or factor not in layout.splittable
                    or used & set(axes) or sizes[factor] % (
                        math.prod(axis_sizes[a] for a in axes) * multiples.get(factor, 1))):
                continue
            plan[factor] = axes
            used |= set(axes)
    return plan


def spec_of(dims: Dims, plan: Plan) -> P:
    entries = []
    for d in dims:
        axes = plan.get(d if isinstance(d, str) else d[0], ())
        entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return P(*entries)


def _explicit_plan(layout: Layout, args, mesh):
    """(plan, operand specs) of `layout` for explicitly typed `args` on `mesh`."""
    specs = [jax.typeof(a).sharding.spec for a in args]
    plan = make_plan(layout, specs, [a.shape for a in args], dict(mesh.shape))
    return plan, tuple(spec_of(d, plan) for d in layout.operands)


def placed_for(layout: Layout, args: Sequence[jax.Array]) -> tuple:
    """`args` resharded to the layout an op runs them in, in explicit sharding mode (else as
    they are). A differentiable op calls this before its `custom_vjp`: explicit mode types
    every value with its sharding, and a custom_vjp's backward must return cotangents typed
    like its arguments, which an argument the op cannot split as it lies (W split over its
    d_model, a dimension on the wrong axis) would not get back; resharded outside the op, the
    reshard's own transpose returns the cotangent to the caller's sharding."""
    args = tuple(args)
    found = _auto_axes.explicit_mesh(args)
    if found is None:
        return args
    mesh, enter = found
    with enter():     # the mesh set where jax.set_mesh has not (a backward runs late)
        _, in_specs = _explicit_plan(layout, args, mesh)
        return tuple(jax.sharding.reshard(a, s) for a, s in zip(args, in_specs))


def partitioned(local: Callable, layout: Layout, args: Sequence[jax.Array],
                partition: bool = True) -> tuple:
    """`local(plan, *args)` (a tuple of arrays) run per shard; see the module docstring.
    `partition=False` (kernels in Mosaic GPU's interpreter, `_common.mosaic_interpreted`):
    outside an Explicit mesh `local` runs once on the whole arrays, without
    custom_partitioning, which cannot lower their ordered IO effects under a jit."""
    args = tuple(args)
    found = _auto_axes.explicit_mesh(args)
    if found is None:
        if not partition:
            return tuple(local({}, *args))
        return _auto(local, layout)(*args)
    mesh, enter = found
    with enter():
        plan, in_specs = _explicit_plan(layout, args, mesh)
        args = [jax.sharding.reshard(a, s) for a, s in zip(args, in_specs)]
        return tuple(jax.shard_map(functools.partial(local, plan), mesh=mesh, in_specs=in_specs,
                                   out_specs=tuple(spec_of(d, plan) for d in layout.results),
                                   check_vma=False)(*args))


_NO_MESH = jax.sharding.AbstractMesh((), ())


def _per_shard(local: Callable, plan: dict, *args) -> tuple:
    """`local(plan, *args)` as custom_partitioning's partition callback traces it: under no mesh.

    XLA calls that callback while it compiles, so the mesh in context is the caller's (the
    `jax.set_mesh` around the jitted call), not the one the callback returns. On a mesh with
    Explicit axes jax (>= 0.11) would then type the kernels' new values (an interpreted
    kernel's constants, say) replicated over that mesh, while the per-shard arguments come
    untyped, and the first store of one into the other fails (a ShardingTypeError inside
    XLA's compile). The per-shard body is a one-device program, so it is traced as one."""
    with jax.sharding.use_abstract_mesh(_NO_MESH):
        return tuple(local(plan, *args))


def _auto(local: Callable, layout: Layout):
    whole = functools.partial(local, {})

    @custom_partitioning
    def op(*args):
        return tuple(whole(*args))

    def partition(mesh, arg_shapes, result_shape):
        specs = [s.sharding.spec if isinstance(s.sharding, NamedSharding) else P()
                 for s in arg_shapes]
        plan = make_plan(layout, specs, [s.shape for s in arg_shapes], dict(mesh.shape))
        shard = lambda dims: NamedSharding(mesh, spec_of(dims, plan))
        return (mesh, functools.partial(_per_shard, local, plan),
                tuple(shard(d) for d in layout.results), tuple(shard(d) for d in layout.operands))

    def infer(mesh, arg_shapes, result_shape):       # GSPMD (jax_use_shardy_partitioner=False)
        specs = [s.sharding.spec if isinstance(s.sharding, NamedSharding) else P()
                 for s in arg_shapes]
        plan = make_plan(layout, specs, [s.shape for s in arg_shapes], dict(mesh.shape))
        return tuple(NamedSharding(mesh, spec_of(d, plan)) for d in layout.results)

    op.def_partition(partition, infer_sharding_from_operands=infer,
                     sharding_rule=layout.sdy_rule())

    @jax.custom_batching.custom_vmap
    def batchable(*args):
        return op(*args)

    @batchable.def_vmap
    def _vmapped(axis_size, in_batched, *args):
        outs = jax.vmap(lambda *a: tuple(whole(*a)),
                        in_axes=[0 if b else None for b in in_batched])(*args)
        return outs, tuple(True for _ in outs)

    return batchable


def vjp_op(fwd: Callable, bwd: Callable, fwd_layout: Layout, bwd_layout: Layout,
           n_out: int, diff: Sequence[bool], saved: Sequence[bool] | None = None, *,
           name: str, partition: bool = True) -> Callable:
    """A differentiable op of which both passes run per shard.

    `fwd(plan, *args)` returns its `n_out` outputs followed by extra residuals; the backward's
    operands are `args + outputs + extras + cotangents` (bwd_layout.operands in that order) and
    `bwd(plan, ...)` returns one gradient per differentiable argument (`diff[i]`); the others
    (integer labels, segment ids) get no cotangent.

    `saved` (one flag per arg, output and extra; default all) keeps only the flagged ones as
    residuals, and the backward's operands are then those, in order, then the cotangents. Keep
    only what the backward reads: every residual is held from the forward to the backward, and
    under `lax.scan` over layers it is also copied into and out of a stacked [layers, ...]
    buffer (a kernel's output cannot be written into the stack in place).

    Every output (the returned ones and the extra residuals) is tagged `residual_name(name)`
    ("jaxfuse.<name>") with `jax.ad_checkpoint.checkpoint_name`, so that a `jax.checkpoint`
    policy can keep them by name (`save_only_these_names("jaxfuse.attention")`): a policy sees
    only primitives, and without a name it recomputes the op's whole forward (kernels included)
    in the backward pass to get them back. The returned outputs are the named values, so their
    other consumers (the matmul after attention keeps o for its own backward) read the saved
    array too. Arguments are not named: a name makes a new value, and an argument that is a
    slice of a `lax.scan`'s inputs (a layer's weight) would then get its own stacked copy; name
    them where they are made where they are worth keeping (the model names attention's q, k, v).

    `partition`: as `partitioned`'s, for both passes.
    """
    tag = residual_name(name)

    @jax.custom_vjp
    def op(*args):
        return partitioned(fwd, fwd_layout, args, partition)[:n_out]

    def op_fwd(*args):
        outs = tuple(checkpoint_name(o, tag)
                     for o in partitioned(fwd, fwd_layout, args, partition))
        res = (*args, *outs)
        keep = (True,) * len(res) if saved is None else tuple(saved)
        if len(keep) != len(res):
            raise ValueError(f"saved has {len(keep)} flags for {len(res)} args and outputs")
        return outs[:n_out], tuple(r for r, k in zip(res, keep) if k)

    def op_bwd(res, cts):
        grads = iter(partitioned(bwd, bwd_layout, (*res, *cts), partition))
        return tuple(next(grads) if d else None for d in diff)

    op.defvjp(op_fwd, op_bwd)
    return lambda *args: op(*placed_for(fwd_layout, args))


def residual_name(op: str) -> str:
    """The `checkpoint_name` of the arrays jaxfuse op `op` keeps for its backward ("attention",
    "add_norm", ...; the partitioned `impl="pallas"` path; `jaxfuse.model.config.NAMED_OPS` says
    which arrays each name covers in the model): under
    `jax.checkpoint_policies.save_only_these_names(residual_name("attention"))` a block keeps
    attention's o and its softmax statistics and does not rerun the attention forward."""
    return f"jaxfuse.{op}"


def present(*arrays: Any) -> tuple:
    """The operands that are not None (optional weights, masks, segment ids)."""
    return tuple(a for a in arrays if a is not None)
