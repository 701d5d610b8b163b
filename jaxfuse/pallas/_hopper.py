"""Pieces of jaxfuse's Hopper (sm90) kernels in Pallas Mosaic GPU that every one of them uses:
whether the GPU is one (`available`), the shared-memory layout TMA and wgmma want
(`_tma_transforms`) and the depth of a ring in it (`ring_depth`), compiler parameters (with
Mosaic GPU's on-device trace, `traced`), the kernel wrapper (`kernel`, compiled or
interpreted), the launch orders of persistent and CTA-a-tile grids (`cta_share`,
`heavy_first`, `list_schedule` and its table, `constant`), and buffers and refs
(`uninitialized`, `discharged`).

The package of Hopper pieces: this module; `_hopper_gemm` (the warp-specialized GEMM with an
epilogue per tile: the linear + cross-entropy's kernels); `_hopper_ring` (the K/V TMA ring and
the consumers' turns of the attention kernels); `_hopper_bwd` (the attention backward's
products); the ops' kernels in `attention_hopper*.py`, `linear_cross_entropy.py` and
`swiglu_hopper.py`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import heapq
import inspect
from collections.abc import Callable, Sequence

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jaxfuse.pallas import _common as C

# Shared memory a CTA may use on an H100/H200 (227 KiB), less 1 KiB for the barriers and the
# buffers' 1 KiB alignment (Mosaic GPU aligns every buffer; the sm90 lowering tests check the
# tightest rings against it).
SMEM_BYTES = 227 * 1024 - 1024
# Rows of one wgmma M (a warpgroup's accumulator): the attention kernels' rows per consumer.
ROWS = 64


def tiles_repr(tiles) -> str:
    """`tiles` (a frozen dataclass) as its class and the fields that differ from their
    defaults: what a user asked for, for error messages."""
    changed = [f"{f.name}={getattr(tiles, f.name)!r}" for f in dataclasses.fields(tiles)
               if getattr(tiles, f.name) != f.default]
    return f"{type(tiles).__name__}({', '.join(changed)})"


def ring_depth(tiles, where: str, layout: Callable, budget: int, fixes: Sequence[dict] = (),
               cap: int = 4, why: str = "") -> int:
    """The depth of a kernel's shared-memory ring for `tiles` (a frozen dataclass with a
    `stages` field): `layout(tiles)` gives (bytes of the other buffers, bytes a slot, the
    fewest slots the kernel runs with); `tiles.stages` slots, or None: as many as fit in
    `budget`, at most `cap`. Where they do not fit (Mosaic GPU's lowering would refuse the
    kernel past the 227 KiB), a ValueError names the tiles `where` they ran and which of
    `fixes` (field replacements, e.g. dict(block_k=64)) would make them fit. `why`: why the
    kernel needs its fewest slots, where that is more than one."""
    def depth(t):
        fixed, stage, least = layout(t)
        fit = (budget - fixed) // stage
        want = least if t.stages is None else t.stages
        return fit, want >= least and fit >= want, fixed, stage, least

    fit, ok, fixed, stage, least = depth(tiles)
    if ok:
        return min(fit, cap) if tiles.stages is None else tiles.stages
    helps = [f for f in fixes if depth(dataclasses.replace(tiles, **f))[1]]
    every = {k: v for f in fixes for k, v in f.items()}
    said = lambda f: ", ".join(f"{k}={v!r}" for k, v in f.items())
    if helps:
        hint = "pass " + " or ".join(map(said, helps))
    elif len(fixes) > 1 and depth(dataclasses.replace(tiles, **every))[1]:
        hint = "pass " + " and ".join(map(said, fixes)) + " together"
    else:
        hint = "leave the tiles at their defaults"
    if tiles.stages is not None and tiles.stages < least:
        raise ValueError(f"{tiles_repr(tiles)} {where}: stages={tiles.stages} is fewer than "
                         f"the {least} slots the kernel needs ({why}); {hint}")
    asked = (f"stages={tiles.stages}" if tiles.stages is not None
             else "one slot" if least == 1 else f"{least} slots")
    asked += f" of {stage} bytes" + (f" ({why})" if least > 1 else "")
    fit = max(fit, 0)
    fits = f"{fit} slot{' fits' if fit == 1 else 's fit'}"
    raise ValueError(
        f"{tiles_repr(tiles)} {where}: {asked} beside {fixed} bytes of other buffers: {fits} "
        f"the {budget} bytes of shared memory the tiles plan with (of the 227 KiB a CTA has, "
        f"less room for barriers); {hint}")


def check_forced(what: str) -> None:
    """A forced Hopper kernel (`what`, e.g. "AttnBlocks(hopper=True)") refused under
    jax_enable_x64, where `available()` says no: the kernels' index arithmetic is int32 beside
    the int64 that Python ints become there, which Mosaic GPU's lowering refuses."""
    if C.x64():
        raise ValueError(f"{what}: the Hopper kernels do not run with jax_enable_x64 on (their "
                         "index arithmetic is int32); leave hopper=None, which takes the "
                         "portable kernels there, or turn x64 off")


def available() -> bool:
    """The Hopper kernels can run here: a Hopper (sm90) GPU, and jax_enable_x64 off
    (`check_forced`). wgmma is sm90-only (Blackwell has tcgen05 instead), so newer GPUs take
    the other path."""
    if C.x64():
        return False
    try:
        dev = jax.devices()[0]
        return dev.platform == "gpu" and int(float(dev.compute_capability)) == 9  # "9.0"
    except Exception:  # noqa: BLE001 - no GPU backend, or no compute capability to read
        return False


def _swizzle_elems(dtype, k: int) -> int:
    itemsize = jnp.dtype(dtype).itemsize
    return plgpu.find_swizzle(k * itemsize * 8) // itemsize


def _tma_transforms(dtype, minor: int) -> tuple:
    """The shared-memory layout TMA and wgmma want for tiles whose rows hold `minor` elements:
    8-row tiles of one swizzle row, swizzled."""
    swizzle = _swizzle_elems(dtype, minor)
    return (plgpu.TilingTransform((8, swizzle)),
            plgpu.SwizzleTransform(swizzle * jnp.dtype(dtype).itemsize))


_TRACE: dict = {}


@contextlib.contextmanager
def traced(space: dict, directory: str):
    """Kernels built inside record Mosaic GPU's on-device trace: each warpgroup's first thread
    stamps the SM clock on entering and leaving every `jax.named_scope` of the kernel body, and
    a Chrome trace JSON lands in `directory` (benchmarks/attention_trace.py reads it).
    `space` maps a part of a kernel's name to the scope ranges a warpgroup may record (16 bytes
    each, kept in shared memory until the kernel ends); kernels it does not name are not traced.
    A diagnostic: the stamps cost a few cycles each and the buffer takes shared memory."""
    _TRACE.update(space=dict(space), dir=directory)
    try:
        yield
    finally:
        _TRACE.clear()


def compiler_params(name: str, **kw) -> plgpu.CompilerParams:
    """Kernel `name`'s Mosaic GPU compiler parameters, with `traced`'s if it names it."""
    for part, space in _TRACE.get("space", {}).items():
        if part in name:
            kw.update(profile_space=space, profile_dir=_TRACE["dir"])
            break
    return plgpu.CompilerParams(**kw)


# Mosaic GPU's interpreter as jax 0.10 has it (0.11 rewrote parts): it needs a kernel's refs'
# memory space spelled out (`linear_cross_entropy`) and fails to lower a kernel whose two
# branches each allocate shared memory (`attention_hopper_bwd`'s one launch).
INTERPRETER_010 = jax.__version_info__ < (0, 11)


def _interpret_params():
    # Mosaic GPU's interpreter is only reachable through a private module in jax 0.10 / 0.11.
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    return InterpretGPUParams()


def cta_share(n_tiles, ctas: int, cta):
    """Work tiles of CTA `cta` of a persistent grid of `ctas` walking `n_tiles` round robin
    (tiles cta, cta + ctas, ...)."""
    return (n_tiles - cta + ctas - 1) // ctas


def heavy_first(cta, n_tiles: int, n_bh: int, heads: int):
    """(rank, bh) of CTA `cta` of a one-dimensional grid of n_tiles * n_bh CTAs (the hardware
    launches them in index order, each on the first free multiprocessor): heads in groups of
    `heads`, and within a group the tiles' ranks outer (rank 0, the heaviest, of every head
    of the group first), the heads inner. The dynamic launch then deals unequal tiles (causal
    masks) heaviest first, which balances the multiprocessors (`list_schedule`'s greedy in
    hardware); a group sized to stay in L2 keeps the CTAs at work at a time on the K/V (or
    Q/dO) of a few heads. Groups of one head repeat each head's heavy-to-light sawtooth."""
    per_group = heads * n_tiles
    group = cta // per_group
    r = cta - group * per_group
    in_group = jnp.minimum(heads, n_bh - group * heads)      # the last group may be short
    return r // in_group, group * heads + r % in_group


def list_schedule(costs, ctas: int) -> np.ndarray:
    """A static schedule of a persistent grid for work items of unequal cost: items, taken in
    the order given, each go to the CTA that is free first by `costs` (greedy list scheduling,
    Graham 1966; equal costs deal them round robin, as `cta_share` does). Causal attention's
    query tiles see 1 to n key blocks: round robin over them left some CTAs 9% more work than
    others. Computed at trace time (the shapes are static).

    Returns int32 [ctas, max items + 2]: column 0 is the CTA's item count, columns 1.. its
    positions in `costs` in the order given, padded with 0, one column to spare so that a
    walk may read its item i + 1 while at its last."""
    free = [(0.0, c) for c in range(ctas)]
    mine = [[] for _ in range(ctas)]
    for i, cost in enumerate(costs):
        load, c = heapq.heappop(free)
        mine[c].append(i)
        heapq.heappush(free, (load + float(cost), c))
    table = np.zeros((ctas, max(map(len, mine)) + 2), np.int32)
    for c, items in enumerate(mine):
        table[c, 0] = len(items)
        table[c, 1:1 + len(items)] = items
    return table


def constant(a: np.ndarray) -> jax.Array:
    """`a` as an operand of a kernel traced inside `jaxfuse.sharding`'s custom_partitioning,
    which refuses constants closed over by the function it traces: made by a nested jit, the
    constant belongs to that jit's own jaxpr."""
    return jax.jit(lambda: jnp.asarray(a))()


def kernel(body, out_types, *, grid, num_threads, interpret: bool, batchable: bool,
           name: str = "jaxfuse_hopper"):
    """A Mosaic GPU kernel `name` over a grid "sm" (threads "wg"), compiled or interpreted.
    `batchable`: plgpu.kernel, which batches under vmap; else pl.kernel, which takes JAX refs
    (aliased in and out) and may sit in a function with refs (plgpu.kernel's vmap wrapper has
    no rule for those)."""
    params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)
    mesh = dict(grid=grid, grid_names=("sm",), num_threads=num_threads, thread_name="wg",
                kernel_name=name)
    if batchable:
        return plgpu.kernel(body, out_type=out_types, compiler_params=params, **mesh,
                            **({"interpret": _interpret_params()} if interpret else {}))
    return pl.kernel(body, out_type=out_types, compiler_params=params, mesh=plgpu.Mesh(**mesh),
                     interpret=_interpret_params() if interpret else False, name=name)


# jax 0.12 dropped `plgpu.load`'s index argument (a ref is sliced with `.at[...]` first).
_LOAD_TAKES_INDEX = "idx" in inspect.signature(plgpu.load).parameters


def load(ref, layout) -> jax.Array:
    """The whole of shared-memory `ref` in registers, in `layout` (`plgpu.load`)."""
    if _LOAD_TAKES_INDEX:
        return plgpu.load(ref, (), layout=layout)
    return plgpu.load(ref, layout=layout)


def uninitialized(shape, dtype, interpret: bool) -> jax.Array:
    """A GPU buffer whose contents are left as they come (a kernel that writes nothing): for an
    output every element of which later kernels write, where zero-filling would cost a pass over
    it (0.6 ms for a 1 GB dW on an H200). For functions with refs (not batchable)."""
    return kernel(lambda out: None, jax.ShapeDtypeStruct(shape, dtype), grid=(1,),
                  num_threads=1, interpret=interpret, batchable=False, name="uninitialized")()


def discharged(f: Callable) -> Callable:
    """f, whose body updates JAX refs in place (`matmul_epilogue(refs=...)`), as a function of
    arrays with those refs discharged into aliased kernel operands, as jit would do them. Needed
    to wrap it in `jax.custom_batching.custom_vmap`, which has no rule for refs inside."""
    from jax._src import core
    from jax._src.state.discharge import discharge_state   # no public API in jax 0.10 / 0.11

    def pure(*args):
        closed, shapes = jax.make_jaxpr(f, return_shape=True)(*args)
        pure_ = discharge_state(closed)
        out = core.eval_jaxpr(pure_.jaxpr, pure_.consts, *jax.tree.leaves(args))
        return jax.tree.unflatten(jax.tree.structure(shapes), out)
    return pure
