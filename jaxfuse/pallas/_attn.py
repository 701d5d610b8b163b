"""What the attention kernels share (forward, both backward kernels, decoding): the problem's
static description, the block-size rule, the score transform with its masks, and the loop bounds
that skip key (or query) blocks that are wholly masked.

Score units. The kernels keep each score in the units the matmul gives it, u = q.k (or
u = tanh(scale q.k / c) under a soft cap c), and exponentiate with exp2((u - m) * c2), c2 =
unit * log2(e) where the natural logit is s = unit * u (unit = scale, or c under the cap): the
scale and log2(e) are one multiply per score, applied after the subtraction. The running max m
and the u in the exponent are then the same rounded number, so the maximal key gets exactly
exp2(0) = 1. Forming s2 = c2 * u first and subtracting a max of the s2 breaks at large logits:
the compiler contracts c2 * u - m into a fused multiply-add (XLA on the CPU does, and the GPU
may), which subtracts the rounded max from the unrounded product, and at |s| ~ 1e9 their
difference is hundreds of units: exp2 of it is 0 or 2^100, so l = 0 (lse = -inf) or o = NaN.

The forward writes lse_u = m + log2(l) / c2, the log-sum-exp in the same units (`lse_u`), as
the residual of the backward, which recomputes P = exp2((u - lse_u) * c2) from it (one visible
key: exactly 1). The public lse is natural-log: lse = unit * lse_u (`lse_natural`);
`residual_from_lse` is the inverse for a forward that produces a natural lse.

Layouts (house style, "one kernel body, two regimes"):
* GPU: q, o [B, Tq, Hq, D] and k, v [B, Tk, Hkv, D] as given; a program sees one query block
  [block_q, Dp] of one (batch, head) and the whole key range [Tk, Dp] of its KV head, with the
  batch and head axes squeezed away. Dp is D rounded up to a power of two (masked loads).
* Interpret: batch and KV heads folded into one leading axis and the query heads of a group
  stacked along the rows: q [B*Hkv, G*Tq, D], k [B*Hkv, Tk, D]. A query row r sits at position
  r % Tq. One grid step by default.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxfuse import _checks, _philox
from jaxfuse.pallas import _common as C
from jaxfuse.pallas import _rng

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
SUPPORTED_HEAD_DIM = 256


@dataclasses.dataclass(frozen=True)
class AttnSpec:
    """Static description of one attention problem (hashable: it keys the custom_vjp)."""
    scale: float
    causal: bool
    window: int | None
    softcap: float | None
    n_q: int          # query positions Tq
    n_k: int          # key positions Tk
    head_dim: int     # D
    head_dim_pad: int  # Dp: D on the CPU, next power of two (>= 16) on the GPU
    groups: int       # G = Hq // Hkv
    segments: bool
    folded: bool      # interpret-mode layout (batch and heads folded into the block)
    itemsize: int     # bytes per element of q, k, v (tile sizes depend on it)
    interpret: bool   # interpret the pallas_call (normally == folded; tests run the GPU layout
                      # in interpret mode by forcing AttnBlocks(folded=False))
    dropout: float = 0.0  # attention-probability dropout rate (0: none; the key is an input)
    # Backward: gradients bitwise identical across runs (the Hopper backward's dQ in a fixed
    # order; False lets it add dQ partials with reducing stores; the portable path is always
    # deterministic).
    deterministic: bool = True

    @classmethod
    def make(cls, *, n_q: int, n_k: int, head_dim: int, groups: int, dtype, scale, interpret: bool,
             folded: bool | None = None, causal: bool = False, window=None, softcap=None,
             segments: bool = False, dropout: float = 0.0,
             deterministic: bool = True) -> "AttnSpec":
        """The spec of a problem; `folded=None` folds in interpret mode and squeezes on the GPU,
        where the head dim is padded to a power of two of at least 16 (Triton's tile rules)."""
        folded = interpret if folded is None else folded
        dp = head_dim if folded else max(16, C.next_pow2(head_dim))
        return cls(1.0 / math.sqrt(head_dim) if scale is None else float(scale), bool(causal),
                   None if window is None else int(window),
                   None if softcap is None else float(softcap), n_q, n_k, head_dim, dp, groups,
                   segments, folded, jnp.dtype(dtype).itemsize, interpret, float(dropout),
                   bool(deterministic))

    @property
    def rows(self) -> int:
        """Query rows per slab: G * Tq when heads are stacked (interpret), else Tq."""
        return self.groups * self.n_q if self.folded else self.n_q

    @property
    def shift(self) -> int:
        return self.n_k - self.n_q

    @property
    def unit(self) -> float:
        """The natural logit of one unit of the kernels' scores u: s = unit * u."""
        return self.scale if self.softcap is None else self.softcap

    @property
    def c2(self) -> float:
        """exp(s - s') = exp2((u - u') * c2)."""
        return self.unit * LOG2E


def lse_natural(lse_u, spec: AttnSpec):
    """The public natural-log lse from the kernels' lse_u (-inf stays -inf, NaN stays NaN)."""
    return lse_u * spec.unit


def residual_from_lse(lse, spec: AttnSpec):
    """The backward's residual lse_u from a natural-log lse (for a forward that produces the
    natural lse). Exact up to one rounding, which at large logits moves P by ~|s| * 6e-8 in the
    exponent: a forward that can write lse_u directly should."""
    return lse * (1.0 / spec.unit)


@dataclasses.dataclass(frozen=True)
class AttnBlocks:
    """Tiles of the three attention kernels. `num_*` only matter on the GPU."""
    block_q: int = 128          # forward: query rows per program
    block_k: int = 128          # forward: keys per inner step
    block_q_dq: int = 64        # dq kernel: query rows per program
    block_k_dq: int = 64        # dq kernel: keys per inner step
    block_k_dkv: int = 64       # dk/dv kernel: keys per program
    block_q_dkv: int = 64       # dk/dv kernel: query rows per inner step
    num_warps: int = 8
    num_stages: int = 3
    num_warps_bwd: int = 4
    num_stages_bwd: int = 2
    folded: bool | None = None  # layout; None: folded in interpret mode, squeezed on the GPU
    # Hopper forward (`attention_hopper`, Mosaic GPU): None runs it on an sm90 GPU where the
    # problem fits, True also in interpret mode (Mosaic GPU's interpreter), False never; a
    # `HopperAttnTiles` means True with those tiles.
    hopper: object = None

    @classmethod
    def for_shape(cls, spec: AttnSpec) -> "AttnBlocks":
        if spec.folded:
            # Whole slabs: one interpreted step per kernel (an interpreted step copies its operands).
            return cls(spec.rows, spec.n_k, spec.rows, spec.n_k, spec.n_k, spec.rows, 1, 1, 1, 1)
        dp = spec.head_dim_pad
        small = lambda b, n: max(16, min(b, C.next_pow2(n)))
        # Measured on an H200 (BENCHMARKS.md): 128 x 128 tiles with 8 warps and 3 stages for the
        # forward at D <= 128 (455 TFLOP/s non-causal vs 413 at 128 x 64), 64 x 64 tiles with
        # 4 warps for both backward kernels (8 warps ran 1.9x slower).
        # float32 inputs double the bytes per tile: 128 x 128 tiles in 3 stages asked for 272 KiB
        # of shared memory (the H200 has 227 KiB), so they get smaller tiles and 2 stages.
        wide = spec.itemsize >= 4
        if dp <= 128:
            bq, bk, w, st = (64, 64, 4, 2) if wide else (128, 128, 4 if dp <= 64 else 8, 3)
        else:
            bq, bk, w, st = (32, 32, 4, 2) if wide else (64, 32, 8, 3)
        bwd = 32 if dp > 128 else 64
        return cls(small(bq, spec.n_q), small(bk, spec.n_k), small(bwd, spec.n_q),
                   small(bwd, spec.n_k), small(bwd, spec.n_k), small(bwd, spec.n_q), w, st, 4, 2)

    def validate(self, folded: bool) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in ("folded", "hopper"):
                continue
            if not (_checks.is_int(v) and v >= 1):
                raise ValueError(f"AttnBlocks({f.name}={v!r}): {f.name} must be a positive int")
            if not folded and f.name.startswith("block") and v != C.next_pow2(v):
                raise ValueError(f"{f.name}={v} must be a positive power of two on the GPU")


def safe_lse(lse_u):
    """A row that saw no key (lse_u = -inf) gets +inf, so that `probs` gives P = 0 there."""
    return jnp.where(lse_u == C.NEG_INF, jnp.inf, lse_u)


def probs(spec: AttnSpec, u, lse):
    """The backward's P = exp2((u - lse_u) c2) (lse: `safe_lse` of the forward's lse_u,
    broadcast against u), recomputed in the forward's units: exactly 1 for a query's only
    visible key, at any logit size (`exp2_shifted`). u <= lse_u in exact arithmetic; the clamp
    keeps rounding from pushing P above 1 where logits are large (a bounded P bounds every
    gradient): min(u, lse) - lse is min(u - lse, 0) to the bit."""
    return exp2_shifted(jnp.minimum(u, lse), lse, spec.c2)


def split_refs(refs, spec: AttnSpec, n_out: int):
    """(segment-id refs or (None, None), output refs) from a kernel's trailing refs."""
    if spec.segments:
        return tuple(refs[:2]), tuple(refs[2:])
    assert len(refs) == n_out
    return (None, None), tuple(refs)


def take_key(refs, spec: AttnSpec):
    """(the Philox key words, or None; the other refs): with dropout the key is the first
    input after the kernel's fixed ones (two words, or five with a shard's row map: the
    probabilities' [B * Hq * Tq, Tk] view split over batch and heads, `_rng.global_rows`)."""
    if not spec.dropout:
        return None, refs
    return tuple(refs[0][i] for i in range(refs[0].shape[0])), refs[1:]


def prob_rows(spec: AttnSpec, lead_shape: tuple, head=None):
    """Index of each (batch, query head) slab in the [B, Hq, Tq, Tk] probabilities, times the
    slab's rows, for `dropout`: on the GPU the program's (batch, head) from the grid
    (`head` overrides the head: the dK/dV kernel walks a group's heads itself); folded, the
    leading axis b * Hkv + kv_head, whose rows already stack the group's heads."""
    if spec.folded:
        lead = jax.lax.broadcasted_iota(jnp.int32, lead_shape + (1, 1), 0)
        return lead * spec.rows
    if head is None:
        lead = pl.program_id(1) * pl.num_programs(2) + pl.program_id(2)
    else:
        lead = (pl.program_id(1) * pl.num_programs(2) + pl.program_id(2)) * spec.groups + head
    return lead * spec.rows


def dropout(spec: AttnSpec, key, base, r, k0, x, *, scaled: bool = True):
    """where(keep, x / keep probability, 0) for x [..., bq, bk] at query rows r [bq, 1]
    (slab-local) and keys k0 .. k0 + bk - 1 (`scaled=False`: where(keep, x, 0), for a caller
    that scales a sum once instead): the mask of `jaxfuse.dropout` over the probabilities'
    [B * Hq * Tq, Tk] view, so `jaxfuse.reference.attention` drops exactly the same entries
    (FlashAttention-2 likewise regenerates its dropout mask from a counter-based generator in the
    backward). One Philox call per 8 entries of P (`_rng.keep_tile`): one per entry cost 2.5x
    the attention itself on an H200."""
    keep = dropout_keep(spec, key, base, r, k0, x.shape[-1])
    return drop(spec, keep, x) if scaled else jnp.where(keep, x, 0.0)


def dropout_keep(spec: AttnSpec, key, base, r, k0, bk: int):
    """The keep-mask (bool [..., bq, bk]) that `dropout` applies."""
    return _rng.keep_tile(key, base + r, k0, bk, spec.dropout, spec.interpret)


def drop(spec: AttnSpec, keep, x):
    return jnp.where(keep, x * _philox.scale(spec.dropout), 0.0)


def row_positions(spec: AttnSpec, r0, n: int):
    """Positions [n, 1] of query rows r0..r0+n-1, and which rows exist."""
    r = r0 + jax.lax.broadcasted_iota(jnp.int32, (n, 1), 0)
    pos = r % spec.n_q if spec.folded and spec.groups > 1 else r
    return pos, r < spec.rows


def transform(spec: AttnSpec, s, keep=None):
    """Raw scores q.k -> the kernels' scores u (see the module docstring: q.k itself, or
    tanh(scale q.k / c) under a soft cap), -inf where `keep` (the tile's `visible` mask; None on
    tiles the masks do not cut) is False. Also returns tanh of the capped logits (for the
    backward) or None."""
    t = None
    u = s
    if spec.softcap is not None:
        t = jnp.tanh(s * (spec.scale / spec.softcap))
        u = t
    if keep is not None:
        u = jnp.where(keep, u, C.NEG_INF)
    return u, t


def visible(spec: AttnSpec, q_pos, k_pos, q_seg=None, k_seg=None, same=None):
    """Which (query, key) pairs of a tile are kept by the masks (causal, window, segments).
    Segment ids come as a vector of the rows' and one of the keys', or as `same`, the tile's
    pairs in one segment (the Hopper kernels: `_hopper_ring.outer_equal`)."""
    keep = C.keep_mask(q_pos, k_pos, n_q=spec.n_q, n_k=spec.n_k, causal=spec.causal,
                       window=spec.window)
    if spec.segments:
        keep = keep & (q_seg[..., :, None] == k_seg[..., None, :] if same is None else same)
    return keep


def visible_range(spec: AttnSpec):
    """(lo, hi, seen), each [Tq]: the keys query row i sees by the causal and window masks
    are [lo_i, hi_i] (clipped to the keys), none where not seen_i. Segment ids are not taken."""
    i = jnp.arange(spec.n_q)
    lo, end = (jnp.broadcast_to(x, i.shape) for x in key_span(spec, i, i))   # [Tq] unmasked too
    n = spec.n_k
    return jnp.clip(lo, 0, n - 1), jnp.clip(end - 1, 0, n - 1), end > lo


def _prefix_max(x, block: int = 128):
    """The running max along x's last axis, exactly: within blocks of `block` keys and across
    the blocks' maxima. (XLA's cumulative max is a reduce-window, whose work grows with the
    square of the axis: two short ones here instead of one long one.)"""
    n = x.shape[-1]
    nb = -(-n // block)
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, nb * block - n)])
    inner = jax.lax.cummax(x.reshape(x.shape[:-1] + (nb, block)), axis=x.ndim)
    before = jax.lax.cummax(inner[..., -1], axis=x.ndim - 1)            # blocks <= b
    before = jnp.pad(before[..., :-1], [(0, 0)] * (x.ndim - 1) + [(1, 0)])  # blocks < b
    return jnp.maximum(inner, before[..., None]).reshape(x.shape)[..., :n]


def visible_max(x, spec: AttnSpec, axis: int):
    """For each query row, the max over the keys it sees (`visible_range`) of x, non-negative
    with the keys along `axis`: the same array with Tq rows there, 0 for a row that sees no
    key. Exact: a key a row does not see never enters its value (masked garbage). A prefix
    max where the ranges start at key 0 (causal, or no mask), a suffix max where they end at
    the last (a window without causal), else a sparse table (log2 Tk levels of maxima of 2^l
    keys; a range is two overlapping blocks of one level)."""
    lo, hi, seen = visible_range(spec)
    x = jnp.moveaxis(x, axis, -1)
    n = spec.n_k
    if spec.window is None:
        m = _prefix_max(x)[..., hi]
    elif not spec.causal:
        m = jnp.flip(_prefix_max(jnp.flip(x, -1)), -1)[..., lo]
    else:
        levels, w = [x], 1
        while 2 * w <= n:
            prev = levels[-1]
            shifted = jnp.pad(prev[..., w:], [(0, 0)] * (x.ndim - 1) + [(0, w)])
            levels.append(jnp.maximum(prev, shifted))
            w *= 2
        table = jnp.concatenate(levels, axis=-1)            # level l at [l * n, (l + 1) * n)
        length = hi - lo + 1
        lvl = jnp.zeros_like(length)
        for l in range(1, len(levels)):                     # floor(log2(length)), exactly
            lvl = jnp.where(length >= (1 << l), l, lvl)
        m = jnp.maximum(table[..., lvl * n + lo], table[..., lvl * n + hi - (1 << lvl) + 1])
    return jnp.moveaxis(jnp.where(seen, m, 0), -1, axis)


def finite_rows(x):
    """(x with its non-finite entries zeroed, [..., n] whether each of its n rows held one).

    Masked keys may hold anything (the padding of packed sequences, keys outside a window).
    Where a masked key only enters through a score, the mask's select already drops it (S =
    NaN there becomes -inf, dS = NaN becomes 0). Only the products that multiply a zero by the
    key's row itself need a clean row: P V in the forward (whose rows that see a non-finite
    value get their NaN back, as the reference's) and dS K in the dq kernel. Nothing else is
    cleaned: each extra tile in the backward kernels costs registers for the whole loop."""
    # Max over int32 flags rather than all/any: Triton's lowering has no boolean reductions.
    ok = jnp.isfinite(x)
    return (jnp.where(ok, x, jnp.zeros((), x.dtype)),
            jnp.max(jnp.where(ok, 0, 1), axis=-1) > 0)


def hides_keys(spec: AttnSpec) -> bool:
    """Whether masks hide some keys from some queries (where masked keys may hold garbage)."""
    return spec.causal or spec.window is not None or spec.segments


def clean_keys(k, v):
    """(k, v) for the Hopper backward's fused dQ, or `HopperBwdTiles(clean=False)` (one
    elementwise XLA pass, only where masks hide keys; the dQ kernel's producer does the same
    to its edge tiles, `_hopper_ring.produce_kv(swap=True)`):
    k's non-finite entries 0, since dQ = dS K multiplies a hidden key's zero dS by the key's
    row as it lies in shared memory (a Triton tile is cleaned in registers: `finite_rows`);
    v NaN wherever k is not finite, so that dP = dO V^T is NaN on such a key's column. Hidden
    pairs drop it (the select on dS); a row that sees the key gets NaN dq, as it would from the
    raw key. Without v's NaN a row that saw the key through a tile every row sees (raw there,
    in the forward) with a -inf score, so a finite row, would recompute a finite score from
    the cleaned k and get finite, wrong gradients. Rows that saw junk on an edge tile already
    have lse = NaN (the forward's producer made the key NaN there:
    `_hopper_ring.hide_masked_garbage`)."""
    ok = jnp.isfinite(k)
    return (jnp.where(ok, k, jnp.zeros((), k.dtype)),
            jnp.where(ok, v, jnp.array(jnp.nan, v.dtype)))


def pad_length(x, multiple: int, axis: int = 1):
    """x with zeros appended along `axis` (the sequence axis, 1 in the GPU layout) up to a
    multiple of `multiple`; x itself where it already is one.

    The Hopper kernels' interpreted regime (and the arrays `pad_rows` cannot leave as they
    are) run on whole tiles; the masks keep their true lengths (`AttnSpec.n_q`, `n_k`): a
    padded key sits in the last, partial key tile, which is always a masked tile
    (`key_blocks`, `query_blocks`), and `keep_mask` hides keys >= n_k, so it gets probability
    0; a padded query row's output is sliced off, and in the backward its dO, O and dlse are
    the zeros appended here, so its P meets dO = 0 and dS = P (dP - delta) = 0: it adds
    nothing to dK or dV."""
    extra = -x.shape[axis] % multiple
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


# Rows of the tiles in which Mosaic GPU lays out a TMA operand (`_hopper._tma_transforms`).
_TMA_ROWS = 8


def pad_rows(x, multiple: int, spec: AttnSpec, axis: int = 1):
    """`pad_length` where the Hopper kernels need it, for their large operands (q, k, v, dO).

    Compiled, TMA's bounds take a partial last tile themselves: a load past an array's end reads
    zeros and a store past it is dropped (`benchmarks/tma_oob_probe.py`, on an H200), exactly
    what the padding's zeros gave, so these operands go in as they are and no copy is made
    (the copies cost ~1.0 / 0.7 ms of a B4 H32 T4000 D128 fwd+bwd, full / causal, on an H100:
    benchmarks/NOTES.md s33). They are padded where that cannot be: in Mosaic GPU's
    interpreter, which drops a store that runs past the end whole; for a length that is not a
    whole number of `_TMA_ROWS` (Mosaic GPU lays a TMA operand's global rows out in tiles of
    8 and refuses a dimension of, say, 300: "must have size smaller or a multiple of its
    tiling 8"); and for one shorter than `multiple` (a box longer than its dimension). The
    kernels' float32 and int32 rows (lse, delta, segment ids) take `pad_length` always: TMA
    wants their rows' strides in whole 16 bytes, and they are small."""
    n = x.shape[axis]
    if not spec.interpret and n >= multiple and n % _TMA_ROWS == 0:
        return x
    return pad_length(x, multiple, axis)


def sees(keep, bad):
    """[..., rows, 1]: whether a query row sees a key whose row is flagged in `bad` [..., keys]."""
    return jnp.max(jnp.where(keep & bad[..., None, :], 1, 0), axis=-1, keepdims=True) > 0


def _pos_range(spec: AttnSpec, r0, n: int):
    """Smallest and largest query position among rows r0..r0+n-1 (conservative when stacked
    heads make positions wrap inside a block)."""
    if spec.folded and spec.groups > 1 and spec.n_q % n:
        return jnp.int32(0), jnp.int32(spec.n_q - 1)
    lo = r0 % spec.n_q if spec.folded else r0
    return lo, jnp.minimum(lo + n - 1, spec.n_q - 1)


def key_span(spec: AttnSpec, p_lo, p_hi):
    """Keys [lo, hi) that some query position in [p_lo, p_hi] sees by the causal and window
    masks (hi <= lo: none); with p_lo and p_hi swapped, the keys every one of them sees."""
    lo, hi = jnp.int32(0), jnp.int32(spec.n_k)
    if spec.causal:
        hi = jnp.minimum(hi, p_hi + spec.shift + 1)
    if spec.window is not None:
        lo = jnp.maximum(lo, p_lo + spec.shift - spec.window + 1)
    return lo, hi


def key_blocks(spec: AttnSpec, r0, bq: int, bk: int):
    """Key blocks seen by query rows r0..r0+bq-1, as (lo, full_lo, full_hi, hi): blocks in
    [full_lo, full_hi) are visible to every row (no mask needed), the rest of [lo, hi) need
    the mask, and blocks outside [lo, hi) are skipped (FlashAttention-2 sec. 3.1.1)."""
    p_lo, p_hi = _pos_range(spec, r0, bq)
    key_lo, key_hi = key_span(spec, p_lo, p_hi)
    full_lo, full_hi = key_span(spec, p_hi, p_lo)
    full_hi = jnp.minimum(full_hi, (spec.n_k // bk) * bk)
    return _block_range(key_lo, full_lo, full_hi, key_hi, bk, spec.segments)


def query_blocks(spec: AttnSpec, k0, bk: int, bq: int):
    """Query blocks that see keys k0..k0+bk-1, as (lo, full_lo, full_hi, hi) like `key_blocks`."""
    if spec.folded and spec.groups > 1:
        hi = C.cdiv(spec.rows, bq)
        return 0, 0, 0, hi
    q_lo, q_hi = jnp.int32(0), jnp.int32(spec.n_q)
    full_lo = jnp.int32(0)
    # Integer arithmetic rather than jnp.where on scalars: Triton's lowering of a scalar
    # bool -> int select miscompiles (i1 vs i32), see tests/test_gpu_lowering.py.
    full_hi = _step01(spec.n_k - (k0 + bk) + 1) * spec.n_q   # 0 if this block has a key tail
    if spec.causal:
        q_lo = jnp.maximum(q_lo, k0 - spec.shift)
        full_lo = jnp.maximum(full_lo, k0 + bk - 1 - spec.shift)
    if spec.window is not None:
        q_hi = jnp.minimum(q_hi, k0 + bk - 1 - spec.shift + spec.window)
        full_hi = jnp.minimum(full_hi, k0 - spec.shift + spec.window)
    # Tail rows past n_q read zeros and are never stored, so no query tail forces a mask.
    full_hi = full_hi + _step01(full_hi - spec.n_q + 1) * (C.cdiv(spec.n_q, bq) * bq - spec.n_q)
    return _block_range(q_lo, full_lo, full_hi, q_hi, bq, spec.segments)


def _step01(x):
    """1 where the int32 x > 0, else 0."""
    return jnp.clip(x, 0, 1)


def _block_range(lo, full_lo, full_hi, hi, b: int, all_masked: bool):
    lo = jnp.maximum(lo, 0) // b
    hi = jnp.maximum((hi + b - 1) // b, lo)
    if all_masked:
        return lo, hi, hi, hi
    f_lo = jnp.clip((full_lo + b - 1) // b, lo, hi)
    f_hi = jnp.clip(full_hi // b, f_lo, hi)
    return lo, f_lo, f_hi, hi


def split_loop(bounds, step, carry):
    """Runs `step(j, carry, masked)` over masked, unmasked, masked block ranges."""
    lo, f_lo, f_hi, hi = bounds
    carry = jax.lax.fori_loop(lo, f_lo, lambda j, c: step(j, c, True), carry)
    carry = jax.lax.fori_loop(f_lo, f_hi, lambda j, c: step(j, c, False), carry)
    return jax.lax.fori_loop(f_hi, hi, lambda j, c: step(j, c, True), carry)


def load_rows(ref, r0, n: int, n_valid, spec: AttnSpec, global_r0=None, head=None):
    """Rows [r0, r0+n) x [0, Dp) of a [..., rows, D] ref (zeros outside), or of one `head` of a
    [rows, heads, D] ref (a KV group's query heads on the GPU)."""
    return C.load_tile(ref, r0, 0, n, spec.head_dim_pad, n_valid, spec.head_dim,
                       global_row0=global_r0, head=head)[0]


def store_rows(ref, value, r0, n_valid: int, spec: AttnSpec, global_r0=None):
    C.store_tile(ref, value, r0, 0, n_valid, spec.head_dim, global_row0=global_r0)


def exp2_shifted(x, shift, c2: float):
    """exp2((x - shift) c2): every attention kernel's exponent (scores, the rescale alpha, the
    backward's P), written once. Subtract, then scale (module docstring): at x = shift it is
    exactly 1 at any score size. Never x c2 - shift c2, which a compiler makes one FMA that
    subtracts the rounded shift c2 from the exact product, off by half an ulp of shift c2 (128
    at scores ~1e9: the Hopper kernels' NaN until s53), and which adds no operation to spare:
    the subtraction is the one this form pays for."""
    return jnp.exp2((x - shift) * c2)


def online_init(lead: tuple, rows: int, spec: AttnSpec):
    """Empty FlashAttention running state (acc, m, l) for `rows` query rows."""
    return (jnp.zeros(lead + (rows, spec.head_dim_pad), jnp.float32),
            jnp.full(lead + (rows, 1), C.NEG_INF, jnp.float32),
            jnp.zeros(lead + (rows, 1), jnp.float32))


def online_update(carry, u, pv_of, c2: float):
    """Folds a tile of scores u [..., rows, keys] into (acc, m, l): the row max grows, old sums
    are rescaled by exp2((m_old - m_new) c2) (FlashAttention-2, Algorithm 1). The max is taken
    over u itself and c2 applied after the subtraction (module docstring). `pv_of(p)` returns
    p @ V for the tile's values."""
    acc, m, l = carry
    m_new = jnp.maximum(m, jnp.max(u, axis=-1, keepdims=True))
    shift = C.safe_max(m_new)
    alpha = exp2_shifted(m, shift, c2)
    p = exp2_shifted(u, shift, c2)
    return acc * alpha + pv_of(p), m_new, l * alpha + jnp.sum(p, axis=-1, keepdims=True)


def online_finish(carry, c2: float):
    """(o [..., rows, Dp], lse_u [..., rows] in the scores' units, see `lse_natural`). A row
    that saw no key (l = 0) gets o = 0 and lse_u = -inf rather than 0/0; a NaN in the row's
    scores or values (l or acc NaN) stays NaN."""
    acc, m, l = carry
    empty = l == 0
    o = acc * jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, l))
    lse_u = jnp.where(empty, C.NEG_INF, m + jnp.log2(jnp.where(empty, 1.0, l)) * (1.0 / c2))
    return o, lse_u[..., 0]


def dot(a, b, contract: str):
    """Batched-or-not matmul with a float32 result, operands in their own dtype."""
    return jnp.einsum(contract, a, b, preferred_element_type=jnp.float32)
