"""What every jaxfuse kernel needs, written once.

* `resolve_interpret`: the one rule that says whether a `pallas_call` is interpreted (CPU) or
  compiled (GPU, through Triton).
* `cdiv`, `next_pow2`, `num_multiprocessors`: arithmetic for picking block sizes.
* `keep_mask`: the causal / sliding-window / tail mask shared by softmax and attention.
* `load_tile` / `store_tile` / `load_vec` / `store_vec`: masked loads and stores of a
  `[rows, cols]` tile or a per-row vector at any offset, over any leading axes. Triton does no
  bounds checks of its own, so every tile at an edge must be masked; in interpret mode the same
  masked primitives pad instead of clamping, so a tile that hangs over the edge reads the right
  elements there too.
* `pallas_call`: `pl.pallas_call` with the compiler parameters for the current regime.
* `recip`, `sincos`: 1 / x, and cos and sin, as the regime computes them best (exact when
  interpreted, the multi-function unit's approximations compiled).

The two regimes (house style, "one kernel body, two regimes"): on the GPU a program sees one
small power-of-two tile; in interpret mode a program sees as much of the array as possible,
because each interpreted grid step copies its operands. Kernel bodies are written against tile
sizes they are given, so the wrapper alone decides which regime it is in.
"""
from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jaxfuse import _checks
from jaxfuse.reference._masks import keep_mask  # noqa: F401  (re-exported for kernels)

__all__ = [
    "cdiv", "next_pow2", "resolve_interpret", "num_multiprocessors", "keep_mask",
    "online_max_sum", "rescale", "finite_shift", "safe_max", "tile_index", "tiles_exactly",
    "load_tile", "store_tile", "load_vec", "store_vec", "pallas_call", "reduce_tiles", "recip",
    "exact_recip", "sincos", "NEG_INF",
]

NEG_INF = float("-inf")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def prev_pow2(n: int) -> int:
    """The largest power of two <= n (1 for n < 2)."""
    return 1 if n < 2 else 1 << (int(n).bit_length() - 1)


def resolve_interpret(interpret: bool | None) -> bool:
    """`None` means: interpret on a CPU backend, compile otherwise (`JAXFUSE_INTERPRET=1|0`
    overrides). Anything but None or a bool (a string is truthy) is a ValueError naming it."""
    if interpret is not None:
        return _checks.check_bool("interpret", interpret)
    env = os.environ.get("JAXFUSE_INTERPRET")
    if env is not None and env != "":
        if env not in ("0", "1"):
            raise ValueError(f"JAXFUSE_INTERPRET={env!r} must be '1' (interpret) or '0' (compile)")
        return env == "1"
    return jax.default_backend() == "cpu"


def mosaic_interpreted(interpret: bool | None, block_sizes) -> bool:
    """Whether a call runs forced Hopper kernels (`block_sizes.hopper`) in Mosaic GPU's
    interpreter. Its simulated memory and barriers are ordered IO callbacks, which
    `jax.experimental.custom_partitioning` cannot lower inside a jit (a KeyError naming
    OrderedIOEffect, jax 0.10-0.12): such calls run on one device, unpartitioned
    (`jaxfuse.sharding.partitioned(..., partition=False)`)."""
    return resolve_interpret(interpret) and bool(getattr(block_sizes, "hopper", None))


@functools.lru_cache(maxsize=None)
def num_multiprocessors() -> int:
    """Streaming multiprocessors of the default device (132 on an H200); 1 on a CPU."""
    dev = jax.devices()[0]
    if dev.platform == "cpu":
        return 1
    return int(getattr(dev, "core_count", 0) or 132)


def exact_recip(x):
    return 1.0 / x


def _mufu(op: str, x):
    """One PTX `op.approx.ftz.f32` of a float32 tile (the multi-function unit's instruction)."""
    return pltriton.elementwise_inline_asm(
        f"{op}.approx.ftz.f32 $0, $1;", args=[x], constraints="=r,r", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)])[0]


def _recip_ptx(x):
    # Triton lowers `1 / x` to div.full.f32: a reciprocal plus range checks and scalings for
    # |x| near the float32 limits (~8 instructions); rcp.approx.ftz is the reciprocal alone
    # (MUFU.RCP, within 1 ulp), for denominators known to stay in the normal range.
    return _mufu("rcp", x)


def recip(interpret: bool):
    """1 / x of a float32 tile: exact in interpret mode, `rcp.approx.ftz.f32` compiled (a
    subnormal result flushes to 0; an infinite x gives 0). For activations' denominators
    (gelu's 1 + p |z| in `_dropout.normal_cdf2`, the sigmoid's 1 + e^-z): in the dropout
    family's kernels it took their instruction counts down by ~10% (benchmarks/NOTES.md s25
    item 7)."""
    return exact_recip if interpret else _recip_ptx


def sincos(interpret: bool):
    """(cos x, sin x) of a float32 tile: exact in interpret mode; compiled, x reduced to
    [-pi, pi] (Cody and Waite: k = x / 2 pi rounded, x - k hi - k lo with 2 pi = hi + lo and
    k hi exact for |k| < 2^16) and `cos.approx`/`sin.approx` (MUFU, absolute error < 2^-20
    there): RoPE's angles in `decode_attention`, where libdevice's cosf/sinf (their range
    reductions and slow-path branches) sat in the prologue every K/V load waits behind."""
    return _exact_sincos if interpret else _sincos_ptx


def _exact_sincos(x):
    return jnp.cos(x), jnp.sin(x)


_TWO_PI_HI = 6.28125                         # 8 significant bits: k * hi is exact
_TWO_PI_LO = float(np.float32(2 * np.pi - _TWO_PI_HI))


def _sincos_ptx(x):
    k = jnp.floor(x * np.float32(1 / (2 * np.pi)) + 0.5)
    r = (x - k * _TWO_PI_HI) - k * _TWO_PI_LO
    return _mufu("cos", r), _mufu("sin", r)


def online_max_sum(state, s):
    """Folds scores `s` [..., n] into a running `(m, l)` = (max, sum of exp(s - shift)) per
    row, shift = `finite_shift(m)`: the logsumexp is shift + log(l) (jax.nn.logsumexp's rule).

    `state=None` starts a fold. Entries of -inf contribute nothing, and a row that has seen only
    -inf keeps m = -inf and l = 0 rather than producing NaN (lecture 5, sec. 4.3-4.4); a row
    with a +inf gets l = +inf (its logsumexp +inf), not exp(inf - inf) = NaN.
    """
    m_tile = jnp.max(s, axis=-1, keepdims=True)
    if state is None:
        m_new, l_old = m_tile, 0.0
    else:
        m_old, l_old = state
        m_new = jnp.maximum(m_old, m_tile)
        l_old = l_old * rescale(m_old, finite_shift(m_new))
    return m_new, l_old + jnp.sum(jnp.exp(s - finite_shift(m_new)), axis=-1, keepdims=True)


def rescale(m_old, shift):
    """exp(m_old - shift): what rebases sums of exp(x - finite_shift(m_old)) onto `shift`, the
    `finite_shift` of a max m_new >= m_old (the online softmax's merge). Exact where m_new is
    finite; 0 where m_old is -inf (nothing was summed); clamped at 1 where m_new is +inf
    (shift 0): the row's sum is +inf then anyway, and a partial sum of 0 (a lane that saw only
    -inf) must not meet exp(+large) = inf, since 0 * inf is NaN."""
    return jnp.exp(jnp.minimum(m_old - shift, 0.0))


def finite_shift(m):
    """The shift softmax's reference takes (`reference.softmax`, jax.nn.logsumexp): m where it
    is finite, else 0. A row whose max is +inf (an inf score, or scale * x overflowing) then
    gives NaN where the inf is (and where exp(s) overflows) and 0 elsewhere in a softmax, and
    lse = +inf, as the references do, where exp(s - inf) gave a row of zeros that looked
    masked, or all NaN."""
    # Two comparisons, not jnp.isfinite: Mosaic GPU has no lowering for is_finite (the
    # Hopper LCE's epilogue takes this too). A NaN max stays NaN (its row is NaN anyway).
    return jnp.where(m == jnp.inf, 0.0, jnp.where(m == NEG_INF, 0.0, m))


def safe_max(m):
    """The shift for exp(s - m): a row max of -inf (nothing kept yet) shifts by 0 instead, so
    exp(-inf - 0) = 0 rather than exp(-inf + inf) = NaN."""
    return jnp.where(m == NEG_INF, 0.0, m)


def tile_index(row0, col0, block_rows: int, block_cols: int, n_rows, n_cols):
    """Absolute row and column indices of a [br, bc] tile, and which lie inside the array.
    `n_rows` may be traced (ragged lengths), broadcast against the tile."""
    rows = row0 + jax.lax.broadcasted_iota(jnp.int32, (block_rows, block_cols), 0)
    cols = col0 + jax.lax.broadcasted_iota(jnp.int32, (block_rows, block_cols), 1)
    return rows, cols, (rows < n_rows) & (cols < n_cols)


def tiles_exactly(n, block: int) -> bool:
    """True when every tile starting at a multiple of `block` lies inside a static length n
    (callers only start tiles at multiples of their block size)."""
    return isinstance(n, int) and n % block == 0


def x64() -> bool:
    """Whether jax_enable_x64 is on here (in this thread or context)."""
    return jax.dtypes.canonicalize_dtype(np.int64) == np.int64


def start(i):
    """A tile's start (or head) as an index. Under jax_enable_x64 Python ints (ours, and the
    interpreter's own for the axes a ref's `...` spans) become int64 while program ids are
    int32, and the interpreter's dynamic_slice refuses mixed index types: there every index
    is made int64. Without x64 it is left as it is (a literal stays static)."""
    if i is None or not x64():
        return i
    return jnp.asarray(i).astype(np.int64)


def _unchecked(i, n: int, dim: int):
    """A static tile start `i` as a traced index where its tile runs past the ref's end `dim`
    (a power-of-two tile over a shorter axis, the overhang masked by the load or store): jax
    >= 0.12 rejects such a slice when its start is static, though the masked access itself
    is valid (and compiles as before). A program id times 0 is an index no trace folds."""
    if isinstance(i, (int, np.integer)) and i + n > dim:
        return i + 0 * pl.program_id(0)
    return i


def _at(ref, row0, n: int, col0=None, n_cols: int | None = None, head=None):
    """`ref.at[...]` for rows [row0, row0+n) (and columns [col0, col0+n_cols)) over any leading
    axes, or at one `head` of a [rows, heads, cols] ref. One indexer per load: Triton's lowering
    does not compose `ref.at[...]` twice."""
    if head is None:
        rows_at = -1 if col0 is None else -2
    else:
        rows_at = 0 if col0 is not None else 1
    row0 = _unchecked(row0, n, ref.shape[rows_at])
    if col0 is not None:
        col0 = _unchecked(col0, n_cols, ref.shape[-1])
    row0, col0, head = start(row0), start(col0), start(head)
    idx = (pl.ds(row0, n),) if col0 is None else (pl.ds(row0, n), pl.ds(col0, n_cols))
    if head is None:
        return ref.at[(Ellipsis, *idx)]
    return ref.at[(idx[0], head, *idx[1:])] if col0 is not None else ref.at[(head, *idx)]


def load_tile(ref, row0, col0, block_rows: int, block_cols: int, n_rows, n_cols: int, *,
              other=0.0, predicate: bool = False, global_row0=None, head=None,
              cols_inside: bool = False):
    """Loads rows [row0, +br) x columns [col0, +bc) of a [..., rows, cols] ref (or of one `head`
    of a [rows, heads, cols] ref), `other` outside the array.

    `global_row0`: the absolute index of the first row when the ref is a block whose local row 0
    is not row 0 of the array (it decides the mask). Returns `(tile, rows, cols, valid)` with
    absolute indices. Tiles wholly inside a static shape skip the predicate, unless
    `predicate=True`. `cols_inside`: the caller knows this tile's columns lie inside (a row's
    inner tiles), so only rows are checked, and where the row blocks tile the rows exactly
    nothing is: `valid` is then a constant the compiler folds away.
    """
    g0 = row0 if global_row0 is None else global_row0
    rows, cols, valid = tile_index(g0, col0, block_rows, block_cols, n_rows, n_cols)
    at = _at(ref, row0, block_rows, col0, block_cols, head)
    rows_inside = tiles_exactly(n_rows, block_rows)
    if cols_inside:
        valid = jnp.ones(rows.shape, jnp.bool_) if rows_inside else rows < n_rows
    if not predicate and rows_inside and (cols_inside or tiles_exactly(n_cols, block_cols)):
        return pltriton.load(at), rows, cols, valid   # no tile hangs over: skip the predicate
    return pltriton.load(at, mask=valid, other=other), rows, cols, valid


def store_tile(ref, value, row0, col0, n_rows, n_cols: int, *, global_row0=None, mask=None,
               head=None, cols_inside: bool = False):
    """Stores a [..., br, bc] value at rows row0.. and columns col0.. (of one `head` of a
    [rows, heads, cols] ref), masking what lies outside (and, with `mask` [br, bc], what the
    caller leaves unwritten). `cols_inside`: as `load_tile`'s, only rows are checked."""
    block_rows, block_cols = value.shape[-2:]
    at = _at(ref, row0, block_rows, col0, block_cols, head)
    rows_inside = tiles_exactly(n_rows, block_rows)
    if mask is None and rows_inside and (cols_inside or tiles_exactly(n_cols, block_cols)):
        pltriton.store(at, value.astype(ref.dtype))
        return
    g0 = row0 if global_row0 is None else global_row0
    rows, _, valid = tile_index(g0, col0, block_rows, block_cols, n_rows, n_cols)
    if cols_inside:
        valid = rows < n_rows
    pltriton.store(at, value.astype(ref.dtype), mask=valid if mask is None else valid & mask)


def load_vec(ref, row0, n: int, n_valid, *, other=0, global_row0=None, head=None):
    """Masked load of entries [row0, row0+n) of a [..., rows] ref (per-row values: labels, lse,
    segment ids), or of `ref[head, row0:row0+n]`; returns [..., n]."""
    g0 = row0 if global_row0 is None else global_row0
    idx = g0 + jnp.arange(n, dtype=jnp.int32)
    return pltriton.load(_at(ref, row0, n, head=head), mask=idx < n_valid, other=other)


def store_vec(ref, value, row0, n_valid, *, global_row0=None):
    """Masked store of a [..., n] value at entries [row0, row0+n) of a [..., rows] ref."""
    n = value.shape[-1]
    g0 = row0 if global_row0 is None else global_row0
    idx = g0 + jnp.arange(n, dtype=jnp.int32)
    pltriton.store(_at(ref, row0, n), value.astype(ref.dtype), mask=idx < n_valid)


def reduce_tiles(n_tiles: int, step, init):
    """`init` folded with `step(j, carry)` over column tiles j; no loop when there is one tile."""
    if n_tiles == 1:
        return step(jnp.int32(0), init)  # a traced-like index, as the loop would pass
    return jax.lax.fori_loop(0, n_tiles, step, init)


def pallas_call(kernel, *, out_shape, grid, name: str, interpret: bool, num_warps: int = 4,
                num_stages: int | None = None, in_specs=None, out_specs=None,
                input_output_aliases=None):
    """`pl.pallas_call` for either regime. Without specs every ref sees its whole array and the
    body offsets by `pl.program_id` itself (that is what lets one body serve both regimes)."""
    kwargs = {}
    if in_specs is not None:
        kwargs["in_specs"] = in_specs
    if out_specs is not None:
        kwargs["out_specs"] = out_specs
    if input_output_aliases:
        kwargs["input_output_aliases"] = input_output_aliases
    params = None if interpret else pltriton.CompilerParams(num_warps=num_warps,
                                                            num_stages=num_stages)
    return pl.pallas_call(kernel, out_shape=out_shape, grid=grid, interpret=interpret,
                          name=name, compiler_params=params, **kwargs)
