"""The model's sharding rules, in one place: which mesh axis splits which dimension.

Mesh axes (any subset may be present; a missing axis counts as size 1):

* `data`   data parallel: the batch splits, every device holds every parameter.
* `fsdp`   fully sharded data parallel (ZeRO-3): the batch splits over `data` x `fsdp` and the
           parameters (and with them AdamW's moments) split their d_model dimension over `fsdp`;
           the scan over layers gathers one layer's weights at a time (`gather_layer`), and the
           backward reduces their gradients back to the shards (the transpose of that gather).
           Without `Config.remat` the scan keeps each layer's gathered weights for the backward
           (its residuals); with remat the backward recomputes the layer, gather included.
* `tensor` Megatron tensor parallel: wq/wk/wv/w1/w3 split their output columns (whole heads,
           slices of d_ff), wo/w2 their input rows, the embedding and unembedding the
           vocabulary; attention runs on each device's heads, the loss is the vocab-parallel
           `linear_cross_entropy` (per-token scalars cross devices, never the logits; with
           `Config.loss_token_slab`, each device's slabs of its slice of the vocabulary).
* `seq`    sequence parallel: the tokens' time axis splits; causal attention becomes ring
           attention (`jaxfuse.sharding.ring`), every row-wise op runs on its rows.

Logical names of dimensions map to mesh axes through `RULES`; `param_specs` names every
parameter's dimensions, `constrain` pins an activation's sharding inside the model (a no-op
without a mesh, so the one-device model is unchanged). The jaxfuse ops' own partitioning rules
(`jaxfuse.sharding`) then run one kernel per shard. JAX's engine does everything else: `Mesh`,
`NamedSharding`, `jax.jit` with in/out shardings, `with_sharding_constraint`. On a mesh of
Explicit axes each public model function runs its body on Auto axes (`on_auto_axes`).

    mesh = jax.make_mesh((2, 4), ("data", "tensor"))    # Explicit axes or Auto: both run
    step = jaxfuse.model.sharded_train_step(cfg, opt, mesh)
    params, opt_state = shard_train_state(params, opt_state, cfg, opt, mesh)
    params, opt_state, loss = step(params, opt_state, *shard_batch((tokens, targets), mesh))
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import math

import jax
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxfuse import _auto_axes
from jaxfuse.model.config import Config

AXES = ("data", "fsdp", "tensor", "seq")

# logical dimension -> mesh axes that split it (in this order, major first)
RULES = {
    "batch": ("data", "fsdp"),
    "seq": ("seq",),
    "heads": ("tensor",),        # query heads (whole heads: column blocks of wq, rows of wo)
    "kv_heads": ("tensor",),     # key/value heads (a query head's KV head on the same device)
    "ff": ("tensor",),           # d_ff
    "vocab": ("tensor",),
    "embed": ("fsdp",),          # d_model of a parameter (FSDP); activations keep it whole
}

# Every parameter's dimensions by logical name (None: never split); "layers" is the stack axis.
_BLOCK = {
    "wq": ("embed", "heads"), "wk": ("embed", "kv_heads"), "wv": ("embed", "kv_heads"),
    "wo": ("heads", "embed"),
    "w1": ("embed", "ff"), "w3": ("embed", "ff"), "w2": ("ff", "embed"),
}


def axis_sizes(mesh) -> dict[str, int]:
    """Size of each of `AXES` on the mesh (1 where the mesh lacks it); other axis names are
    refused so that a typo does not silently mean "not split"."""
    shape = dict(mesh.shape)
    unknown = set(shape) - set(AXES)
    if unknown:
        raise ValueError(f"mesh axes {sorted(unknown)} are not model axes; name them from {AXES}")
    return {a: shape.get(a, 1) for a in AXES}


def _mesh_axes(logical, sizes: dict[str, int]) -> tuple[str, ...]:
    """The mesh axes of size > 1 that split a logical dimension."""
    return tuple(a for a in RULES.get(logical, ()) if sizes.get(a, 1) > 1) if logical else ()


def _entry(axes):
    return None if not axes else axes[0] if len(axes) == 1 else axes


def logical_spec(names, sizes: dict[str, int]) -> P:
    return P(*(_entry(_mesh_axes(n, sizes)) for n in names))


def check(cfg: Config, mesh, batch: int | None = None, seq_len: int | None = None) -> None:
    """ValueError naming the mesh axis, its size and the dimension it does not divide."""
    sizes = axis_sizes(mesh)
    need = [("tensor", "n_heads", cfg.n_heads), ("tensor", "n_kv_heads", cfg.n_kv_heads),
            ("tensor", "d_ff", cfg.d_ff), ("tensor", "vocab_size", cfg.vocab_size),
            ("fsdp", "d_model", cfg.d_model)]
    if batch is not None:
        need.append((("data", "fsdp"), "the batch", batch))
    for axes, what, n in need:
        axes = (axes,) if isinstance(axes, str) else axes
        k = math.prod(sizes[a] for a in axes)
        if k > 1 and n % k:
            name = " x ".join(f"{a}={sizes[a]}" for a in axes)
            raise ValueError(f"mesh axis {name} (size {k}) does not divide {what} = {n}: "
                             f"pick a mesh whose {'/'.join(axes)} size divides it")
    # causal ring attention cuts the sequence into 2 x seq chunks (zigzag balance)
    if seq_len is not None and sizes["seq"] > 1 and seq_len % (2 * sizes["seq"]):
        raise ValueError(f"mesh axis seq={sizes['seq']} needs the sequence length {seq_len} to "
                         f"be a multiple of 2 x {sizes['seq']} (causal ring attention): pad "
                         "the sequence (targets -100) or pick another seq size")


def param_specs(cfg: Config, mesh) -> dict:
    """The PartitionSpec of every parameter (the pytree of `jaxfuse.model.init(key, cfg)`)."""
    check(cfg, mesh)
    sizes = axis_sizes(mesh)
    spec = lambda *names: logical_spec(names, sizes)
    norm = lambda *lead: ({"weight": spec(*lead, None)}
                          | ({"bias": spec(*lead, None)} if cfg.norm == "layer" else {}))
    blocks = {name: spec("layers", *dims) for name, dims in _BLOCK.items()}
    blocks |= {"attn_norm": norm("layers"), "mlp_norm": norm("layers")}
    specs = {"embed": spec("vocab", "embed"), "blocks": blocks, "final_norm": norm()}
    if not cfg.tie_embeddings:
        specs["unembed"] = spec("embed", "vocab")
    return specs


def named(mesh, specs):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                        is_leaf=lambda x: isinstance(x, P))


def param_shardings(cfg: Config, mesh) -> dict:
    return named(mesh, param_specs(cfg, mesh))


def opt_state_specs(opt: optax.GradientTransformation, cfg: Config, mesh, params) -> object:
    """AdamW's moments split like the parameters (FSDP shards them too); counts replicated."""
    shapes = jax.eval_shape(opt.init, params)
    return optax.tree_map_params(opt, lambda _, s: s, shapes, param_specs(cfg, mesh),
                                 transform_non_params=lambda _: P(),
                                 is_leaf=lambda x: isinstance(x, P))


def batch_spec(mesh, ndim: int = 2) -> P:
    """[B, T, ...] tokens: batch over data x fsdp, time over seq."""
    return logical_spec(("batch", "seq", *(None,) * (ndim - 2))[:ndim], axis_sizes(mesh))


def shard_batch(arrays, mesh):
    """Places [B, T] (or [B]) arrays by `batch_spec`; checks the axes divide them."""
    sizes = axis_sizes(mesh)
    out = []
    for a in arrays:
        b, t = a.shape[0], (a.shape[1] if a.ndim > 1 else None)
        k = sizes["data"] * sizes["fsdp"]
        if b % k:
            raise ValueError(f"mesh axes data={sizes['data']} x fsdp={sizes['fsdp']} (size {k}) "
                             f"do not divide the batch {b}: pick a batch that is a multiple")
        if t is not None and t % (2 * sizes["seq"]) and sizes["seq"] > 1:
            raise ValueError(f"mesh axis seq={sizes['seq']} needs the sequence length {t} to be "
                             f"a multiple of 2 x {sizes['seq']} (causal ring attention): pad "
                             "the sequence (targets -100) or pick another seq size")
        out.append(jax.device_put(a, NamedSharding(mesh, batch_spec(mesh, a.ndim))))
    return tuple(out)


def shard_params(params, cfg: Config, mesh):
    return jax.device_put(params, param_shardings(cfg, mesh))


def shard_train_state(params, opt_state, cfg: Config, opt, mesh):
    """(params, opt_state) placed by the rules."""
    specs = opt_state_specs(opt, cfg, mesh, params)
    return shard_params(params, cfg, mesh), jax.device_put(opt_state, named(mesh, specs))


# ---- inside the model ------------------------------------------------------------------------

def _current_sizes():
    """Axis sizes of the mesh set with `jax.set_mesh` (None without one)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or not set(mesh.axis_names) & set(AXES):
        return None
    return {a: dict(mesh.shape).get(a, 1) for a in AXES}


def spec_for(shape, names, sizes: dict[str, int]) -> P:
    """The PartitionSpec of an array of `shape` in the logical layout `names` (one per
    dimension): a mesh axis that does not divide its dimension (a decoding batch of 1; a time
    axis that causal ring attention cannot cut into 2 x seq chunks) leaves it whole."""
    entries = []
    for n, d in zip(names, shape):
        axes = _mesh_axes(n, sizes)
        k = math.prod(sizes[a] for a in axes) * (2 if n == "seq" else 1)
        entries.append(_entry(axes) if axes and d % k == 0 else None)
    return P(*entries)


def constrain(x: jax.Array, *names) -> jax.Array:
    """x pinned to the logical layout `names` (one per dimension, `spec_for`) on the current
    mesh. A no-op without a mesh, so the one-device model is unchanged."""
    sizes = _current_sizes()
    if sizes is None:
        return x
    return jax.lax.with_sharding_constraint(x, spec_for(x.shape, names, sizes))


@dataclasses.dataclass(frozen=True)
class Out:
    """A model function's result as `on_auto_axes` lays it out: its shape and the logical name
    of each dimension (a pytree leaf)."""
    shape: tuple
    names: tuple


def on_auto_axes(out_layout):
    """Runs a model function on Auto axes when its mesh has Explicit ones (`jaxfuse._auto_axes`).

    The model is partitioned by XLA from its sharding constraints (`constrain`), JAX's
    automatic mode; on Explicit axes (`jax.make_mesh`'s default since jax 0.10) a sharding
    constraint only asserts the layout a value already has, and each XLA matmul that contracts
    a split axis would need its output sharding spelled out. So the body runs on Auto axes and
    its results leave typed by `out_layout(**arguments)` (the call's arguments by name,
    defaults included; a pytree of `Out` shaped like the result). Without a mesh or on Auto
    axes it is a plain call."""
    def wrap(fn):
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            found = _auto_axes.explicit_mesh((args, kwargs))
            if found is None:
                return fn(*args, **kwargs)
            sizes = {a: dict(found[0].shape).get(a, 1) for a in AXES}
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            specs = jax.tree.map(lambda o: spec_for(o.shape, o.names, sizes),
                                 out_layout(**bound.arguments))
            with found[1]():
                return _auto_axes.call(fn, specs, *args, **kwargs)
        return call
    return wrap


def gather_layer(blk: dict) -> dict:
    """One layer's parameters inside the scan, gathered over `fsdp` (FSDP: only this layer's
    weights are whole at a time) and still split over `tensor`. A no-op without fsdp."""
    sizes = _current_sizes()
    if sizes is None or sizes["fsdp"] == 1:
        return blk
    no_fsdp = dict(sizes, fsdp=1)
    out = {}
    for name, x in blk.items():
        if name in _BLOCK:
            out[name] = jax.lax.with_sharding_constraint(x, logical_spec(_BLOCK[name], no_fsdp))
        else:
            out[name] = x
    return out
