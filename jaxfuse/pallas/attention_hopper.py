"""FlashAttention forward on a Hopper GPU (sm90) in Pallas Mosaic GPU: TMA, wgmma, warp
specialization and two ping-ponging consumer warpgroups (FlashAttention-3, Shah et al. 2024,
sec. 3.1-3.2).

One CTA computes a [consumers * 64, D] tile of o for one (batch, query head):

* a producer warpgroup streams the K and V tiles of the visible key range into a ring of
  `stages` shared-memory slots with TMA (each slot has a "full" barrier that the copy completes
  and an "empty" barrier that every consumer arrives on once it has read it);
* two consumer warpgroups (three at D = 64, `HopperAttnTiles.consumers`, without the
  ping-pong below; measured 9% faster there) each own block_q = 64 query rows (one wgmma
  M), keep (m, l, acc) in
  registers and walk the same key tiles: S = Q K^T by wgmma from shared memory, the online
  softmax in the log2 domain (exp2((u - m) c2), c2 = unit log2(e) in `_attn`'s score units:
  exactly 1 at the row's max, finite at any finite score), then
  O += P V by wgmma with P straight from registers (never through shared memory);
* the two consumers take turns on the tensor cores (a rendezvous of both on a hardware named
  barrier, `bar.sync`, the second warpgroup one phase behind): while one runs its softmax the
  other's GEMMs run, so the exponentials hide under matrix work (FlashAttention-3 sec. 3.1,
  ping-pong).
  At D = 256 they run free (`HopperAttnTiles.for_head_dim`): 64-key tiles make the softmax
  short beside the products, and each consumer overlaps its own softmax with its P V product
  instead (`HopperAttnTiles.overlap`: S_{j+1} and P_j V_j issued together, FlashAttention-3
  sec. 3.2).

Where keys are at most 4096 (and head_dim <= 128) the CTAs are persistent
(`HopperAttnTiles.persistent`): one a multiprocessor walks its share of the (batch, head,
query tile) work tiles, so a tile's start (its first K and V, its Q) no longer waits behind the
last one's end: the producer runs on into the next tile's keys, each consumer loads its next Q
once its last S is formed, and O leaves through a buffer of its own. The shares come from a
static schedule built at trace time (`work_schedule`: greedy list scheduling of the tiles,
heaviest first within groups of heads whose K and V fit in 16 MiB of L2), read by each CTA
from a small table: causal tiles see 1 to n key blocks, and round robin over them left some
CTAs 9% more work than others (s16-1: 5% slower at D128, 43% at D64 than a CTA a tile).
Equal tiles (no mask) whose last round would leave half the CTAs idle or more have that
round's tiles split over their key blocks, the parts' (o, lse) merged after the kernel
(`HopperAttnTiles.split_tail`, `tail_schedule`; H100, s49-1: B4 H32 T4096 D128 1.933 ->
1.883 ms).
H200, interleaved medians: without masks (s16-1, round robin, which the schedule deals equal
tiles) B4 H32 T4096 D128 1.895 ms against 2.008 with a CTA a tile (cuDNN 1.918), GQA 32/8
1.879 against 1.945, D64 B8 H16 T2048 0.312 against 0.344 (cuDNN 0.346); causal (s17-3)
D128 1.016 against 1.079 (cuDNN 1.081), GQA 1.009 against 1.067 (1.060), D64 0.194 against
0.213 (0.216). Longer rows lost (s17-2/3): the 1B model's B2 T8192 D64 GQA causal 1.257
against 1.206 ms (whichever L2 share: 1, 4 or 16 MiB), T = 32768 D128 causal 7.351 against
7.262 (there the O buffer leaves room for 2 ring slots, not 3); why the first loses is not
known. Those run a CTA a tile, in head groups whose K and V fill 16 MiB of L2, every head's
heaviest tile of a group first (`_FWD_GROUP_BYTES`; s18-1: the 1B row 1.188 ms against 1.366
one head's tiles after another's, cuDNN 1.293). (Without masks, rows beyond 4096 keys were
persistent before s17 and are not now: neither timed.)

Causal and sliding-window masks come from `_attn.key_blocks`, shared with the Triton kernels:
key tiles wholly masked for the CTA's rows are never loaded, tiles wholly visible take no mask
arithmetic, and only the tiles on an edge are masked. With `causal`, CTAs (a CTA a tile) are
launched heaviest first within a head group (the last query tiles, which see the most keys, get
the first multiprocessors) so the short tiles fill in behind them; persistent CTAs take the
tiles in the same order (`work_schedule`).

Masked keys may hold garbage: P V multiplies a hidden key's zero probability by its value row
as it lies in shared memory, so with a causal mask or a window the producer cleans the CTA's
edge tiles (those outside its wholly visible key blocks) in shared memory before the consumers
see them (`_hopper_ring.hide_masked_garbage`: V's non-finite entries 0, K NaN where K or V
is not finite, so a row that sees such a key still gets a NaN row). A first read-only pass
counts the tile's non-finite entries; only a dirty tile is rewritten. H200, causal, timed
interleaved with the kernel without the guard (s15-1): D = 64 B8 H16 T2048 0.215 ms against
0.218 (rewriting every edge tile, as before s15: 0.229; s14-5 measured it at +16%), B4 H32
T4096 D128 1.064 against 1.086 (1.123), D = 256 0.545 against 0.529 (0.544); an XLA pass over
K and V before the kernel had cost 12% (s12-3).

What it takes (`fits`): bf16/f16, D in {64, 128, 256}. Anything else runs the portable Triton
kernels (`attention.py`). Segment ids: each consumer copies its rows' with its Q and holds them
in registers, the producer copies each key block's into a ring slot of their own (overwritten
only once the block's K and V are released), and every key block is masked (no block is
skipped for them, as in the portable kernels). Lengths that are not whole tiles (Tq of 2 * 64
rows, Tk of block_k) take TMA's bounds on the GPU (the last tile's loads read zeros past the
end, its stores stop there: no copy; `_attn.pad_rows`) and are padded with zeros in the
interpreter; the masks keep the true lengths. The backward is
`attention_hopper_bwd` where it takes the problem, else the portable one.

Regimes: compiled by Mosaic GPU on an sm90 GPU. On a CPU the same body runs in Mosaic GPU's
interpreter (threads, TMA, barriers simulated), except the two matrix products, which that
interpreter (jax 0.10.2) cannot read from registers or transposed shared memory: there they
are plain dots of the same tiles (`_Mma`). The wgmma forms are checked by the sm90 lowering
test on a CPU and against the reference on the GPU (benchmarks/attention.py).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from jaxfuse import _checks
from jaxfuse.pallas import _attn as A
from jaxfuse.pallas import _common as C
from jaxfuse.pallas import _hopper as H
from jaxfuse.pallas import _hopper_ring as R
from jaxfuse.pallas._attn import AttnSpec
from jaxfuse.reference import attention as ref_attn

_ROWS = H.ROWS      # query rows per consumer warpgroup: one wgmma M
# Shared memory the forward's buffers plan with (`HopperAttnTiles._buffers` counts them all):
# 2 KiB under `_hopper.SMEM_BYTES` for the barriers and Mosaic GPU's 2 KiB of reduction
# scratch, which took 2.2 KiB at D = 128 in its count (the sm90 lowering, s52: a three-slot
# ring beside Q alone, no O or lse buffer, came to 231,576 of the 232,448 bytes a CTA has).
_SMEM_BYTES = H.SMEM_BYTES - 2 * 1024


# Columns of `HopperAttnTiles.sum_mma`'s ones tile: wgmma's smallest N for a 2-byte B operand
# (Mosaic GPU's smallest swizzle, 32 bytes, is 16 elements).
_SUM_COLS = 16

# Keys up to which the forward's CTAs are persistent by default (`HopperAttnTiles.persistent`).
_PERSISTENT_KEYS = 4096


@dataclasses.dataclass(frozen=True)
class HopperAttnTiles:
    """block_k: keys per step; stages: K/V ring depth (None: as many as shared memory holds,
    at most 4); pingpong: the consumers take turns on the tensor cores (False: they run free;
    the default tiles of D = 256, `for_head_dim`, run free);
    backward: the Hopper backward (`attention_hopper_bwd`) follows where it takes the problem,
    with its default tiles (True) or with these (`attention_hopper_bwd.HopperBwdTiles`); False:
    the portable backward after this forward; consumers: consumer warpgroups of 64 query rows
    a CTA, 2 (ping-pong) or 3 (two softmaxes share the multiprocessor while the third
    multiplies; no ping-pong; a consumer past the last row, and each block wholly masked for
    a consumer's own rows, only releases the ring); None: 3 at head_dim 64, else 2;
    overlap: each consumer issues S_{j+1} = Q K_{j+1}^T and P_j V_j together and runs softmax
    j+1 while P_j V_j multiplies (FlashAttention-3 sec. 3.2, intra-warpgroup overlap); with
    `pingpong` two consumers also pass a turn to issue their products (`Turns`); the ring
    needs 2 slots or more, since each consumer holds a V tile one step longer; "issue": the
    same two products issued together but both waited for before softmax j+1 (one wgmma wait
    a step where the plain step has two, and P_j's registers free again in the softmax, which
    the overlap holds: s15-4 measured it 3-7% slower at D = 64, where three consumers have 160
    registers a thread); None (the default): "issue" at head_dim 64 with three consumers where
    the CTAs are not persistent (by default past `_PERSISTENT_KEYS` keys), True at 256
    (`for_head_dim`), else False (`overlap_for`, applied by `tiles_for`);
    persistent: one CTA a multiprocessor walks its share of the (batch, head, query tile)
    work tiles (`work_schedule`: balanced by their key blocks), so the producer loads the next
    tile's K and V while the consumers finish the last one, each consumer loads its next Q as
    soon as its last S is formed, and O leaves through a buffer of its own; None: where keys
    are at most `_PERSISTENT_KEYS` (measured faster there, slower beyond: module docstring)
    and the O buffer fits beside two ring slots, or the `stages` asked for (not at head_dim
    256, nor with three consumers or 256-key tiles at 128);
    split_tail: a persistent walk of equal tiles whose last round would leave at least half
    the multiprocessors idle splits that round's tiles over their key blocks (stream-K on the
    tail, `tail_schedule`): each part writes its rows' (o, lse) over its keys, merged after
    the kernel (bf16/f16 partial o, so those rows round twice); None (the default): wherever
    `tail_schedule` applies; False: never. H100, s49-1, B4 T4096 D128 without a mask, forward
    interleaved: 32 heads (4 tiles in the last of 32 rounds) 1.933 -> 1.883 ms (cuDNN 1.887),
    31 heads (8 tiles) 1.837 -> 1.793 (cuDNN 1.811); 33 heads (no tail) 1.873 / 1.878;
    sum_mma: the row sums l by the tensor cores, l += P 1 (one more wgmma beside P V, of P with
    a [block_k, 16] tile of ones), not by a float32 add an element: one operation an element
    off the softmax, to win back what the exact exponents (s53) cost the D = 64 forward; l
    then sums P as rounded to the input dtype, the P that P V takes (lse within
    log(1 + u) of the exact one, u the dtype's unit roundoff: ~5e-4 in bf16). Not with
    `overlap`. Measured (H100, s54-2, forward interleaved against the default): the 1B model's
    D = 64 1.328 against 1.375 ms (cuDNN 1.291), the 157M's 0.214 against 0.212, D = 128
    1.967 against 1.864 without a mask and 1.075 against 1.076 causal: the forward is bound by
    the latency of its softmax chain, not by issuing its operations (ncu, s54-3: issue slots
    45% busy), and the extra product sits in that chain. Off by default (NOTES s54)."""
    block_k: int = 128
    stages: int | None = None
    pingpong: bool = True
    backward: object = True
    consumers: int | None = None
    overlap: bool | str | None = None
    persistent: bool | None = None
    split_tail: bool | None = None
    sum_mma: bool = False

    def __post_init__(self):
        if self.consumers is not None and self.consumers not in R.REGISTERS:
            raise ValueError(f"HopperAttnTiles.consumers={self.consumers} must be one of "
                             f"{tuple(R.REGISTERS)} (consumer warpgroups of 64 rows a CTA)")
        # P V's K (keys) must be a multiple of 64 for a wgmma with P in registers, and the
        # softmax folds S's columns in halves. 192 keys, made to lower, ran 5.5% faster than
        # 128 a CTA a tile without masks at T = 4224 (H200, s28), the gain persistence gives
        # 128 (s16), which 192's two slots leave no room for: not taken (benchmarks/NOTES.md
        # s28). s52 made the room (O and lse stored from registers, no buffers) and measured
        # 192 persistent 17% slower than the default on an H100 at B4 H32 T4096 (the register
        # store alone cost ~6-7 us a work tile): removed again (NOTES s52 item 4). 256 needs
        # room in registers (`check_head_dim`).
        if self.block_k not in (64, 128, 256):
            raise ValueError(f"HopperAttnTiles.block_k={self.block_k} must be 64, 128 or 256 "
                             f"(keys a step; 128 is the default, 64 at head_dim 256)")
        if self.overlap is not None and self.overlap not in (False, True, "issue"):
            raise ValueError(f"HopperAttnTiles.overlap={self.overlap!r} must be False, True "
                             f"(softmax j+1 under P_j V_j), 'issue' (both products issued "
                             f"together, both waited for before the softmax) or None (by head "
                             f"dim and keys)")
        if self.sum_mma and self.overlap:
            raise ValueError("HopperAttnTiles(sum_mma=True, overlap=True): the row sums' product "
                             "is issued beside P V in the step without the overlap; pass "
                             "overlap=False (the default below head_dim 256)")
        if self.split_tail is not None and not isinstance(self.split_tail, bool):
            raise ValueError(f"HopperAttnTiles.split_tail={self.split_tail!r} must be True, "
                             f"False or None (where `tail_schedule` applies)")
        if self.stages is not None and not (_checks.is_int(self.stages) and self.stages >= 1):
            raise ValueError(f"HopperAttnTiles.stages={self.stages!r} must be a positive int "
                             f"(K/V ring slots), or None for as many as fit")
        from jaxfuse.pallas.attention_hopper_bwd import HopperBwdTiles  # it imports this module
        if not isinstance(self.backward, (bool, HopperBwdTiles)):
            raise ValueError(f"HopperAttnTiles.backward={self.backward!r} must be True (the "
                             f"Hopper backward with its default tiles), False (the portable "
                             f"backward) or a HopperBwdTiles")

    @classmethod
    def for_head_dim(cls, d: int) -> "HopperAttnTiles":
        # D = 256: a [64, 256] float32 accumulator is 128 registers a thread, so S takes
        # 64-key tiles (32 registers) to stay under the 232 that a consumer gets. There the
        # consumers run free: a [64, 64] softmax is short beside its two [64, 64, 256]
        # products, so waiting for the other consumer's turn costs more than it hides (H200,
        # s13-1, B2 H16 T4096 causal: 0.534 ms free against 0.562 taking turns; cuDNN 0.514;
        # 128-key tiles 0.564, one stage 0.566), and each overlaps its softmax with its own
        # P V (s15-4, same shape, interleaved: 0.496 ms against 0.538 without; cuDNN 0.540).
        # At D = 128 the overlap ties the ping-pong without masks and loses 5-6% causal
        # (s15-4: 1.889 / 1.101 ms against 1.872 / 1.037; passing turns with it, s15-6: 1.946
        # / 1.132 against 1.923 / 1.083), at D = 64 3-7% (0.223-0.230 against 0.214-0.217):
        # there the defaults stay (H100, s55-1: D128 full 1.994 against 1.894, causal 1.132
        # against 1.047; "issue" 1.987 / 1.137; the 157M's D = 64 0.201 against 0.193), but
        # for D = 64 past 4096 keys, which takes "issue" (`overlap_for`).
        return cls(block_k=64, pingpong=False, overlap=True) if d > 128 else cls()

    def overlap_for(self, spec: AttnSpec) -> bool | str:
        """`overlap` as the forward of `spec` runs it. None: "issue" at head_dim 64 with three
        consumers where each CTA walks one tile (`persists` False: by default past
        `_PERSISTENT_KEYS` keys), whose consumers waited twice a step for their products:
        H100, s55-1/s55-4, forward interleaved, default -> "issue" (cuDNN), the 1B model's
        B2 Hq32 Hkv8 T8192 causal 1.362 -> 1.222 and 1.416 -> 1.307 ms (1.251, 1.300), B4
        Hq32 Hkv8 T4096 causal a CTA a tile 0.768 -> 0.712 (persistent: 0.717 -> 0.724, so
        not there; the 157M's T2048, persistent, 0.193 -> 0.195). Not with `sum_mma` nor on
        a ring of one slot."""
        if self.overlap is not None:
            return self.overlap
        # Not in the interpreter: three consumers with the overlap stall its simulated threads
        # on 2 cores (tests/test_attention_hopper.py's _CASES; the sm90 lowering test and the
        # GPU checks cover them).
        measured = (spec.head_dim == 64 and self.n_consumers(64) == 3 and not self.sum_mma
                    and not self.persists(spec) and not spec.interpret)
        return "issue" if measured and self.stages != 1 else False   # holds V: 2 slots

    def resolved(self, spec: AttnSpec) -> "HopperAttnTiles":
        """These tiles with `overlap` as the forward of `spec` runs it (`overlap_for`)."""
        if self.overlap is not None:
            return self
        return dataclasses.replace(self, overlap=self.overlap_for(spec))

    def check_head_dim(self, d: int) -> None:
        """Raises ValueError where the key tile does not fit a consumer's registers: S [64,
        block_k] float32 beside O [64, d] float32. 256 keys take two consumers and head_dim <=
        128 (at head_dim 64 with three consumers' 160 registers ptxas refused the kernel on an
        H200, s28; two consumers' 232 hold it at 128)."""
        if self.block_k == 256 and (d > 128 or self.n_consumers(d) != 2):
            raise ValueError(
                f"HopperAttnTiles(block_k=256) at head_dim {d} with {self.n_consumers(d)} "
                f"consumers: a [64, 256] float32 S does not fit beside O in a consumer's "
                f"registers; it takes head_dim <= 128 with consumers=2 (pass consumers=2 at "
                f"head_dim 64), else block_k <= 128")

    def n_consumers(self, d: int) -> int:
        # D = 64: three consumers (160 registers each: acc 32, S 64, P 32). Measured (H200,
        # profiler, s9-6): 1.292 -> 1.174 ms at the 1B model's attention (B2 T8192 H32/8
        # causal; cuDNN 1.218), 0.217 -> 0.200 at the 157M's (cuDNN 0.194). Its softmax is
        # latency-bound with one warp a multiprocessor quarter doing vector work; with three
        # consumers two share each quarter while the third multiplies. Above D = 64 the
        # accumulator does not fit in 160 registers.
        return self.consumers or (3 if d <= 64 else 2)

    def persists(self, spec: AttnSpec) -> bool:
        """Whether the forward of `spec` runs persistent CTAs (see the class docstring)."""
        if self.persistent is not None:
            return self.persistent
        # Not by default in the interpreter: its simulated threads hung intermittently on
        # persistent walks with 2-slot rings under pytest (all three waiting on barriers that
        # were never to complete; never in 52 standalone runs, nor on the GPU, where D = 128
        # runs 2 slots; benchmarks/NOTES.md s16). Its tests force it on 4-slot rings.
        if spec.n_k > _PERSISTENT_KEYS or spec.interpret:
            return False
        # Where O's own buffer leaves room for two ring slots (or the slots asked for): not
        # at head_dim 256, nor with three consumers or 256-key tiles at 128.
        fixed, stage = self._buffers(spec.head_dim, spec.itemsize, True, spec.segments)
        return fixed + (self.stages or 2) * stage <= _SMEM_BYTES

    def _buffers(self, d: int, itemsize: int, persistent: bool, segments: bool):
        """(bytes of the forward's fixed buffers, bytes of one K/V ring slot)."""
        # Q tiles, reused for O on the way out; a persistent CTA's O has a buffer of its own
        # (the next Q lands while O leaves); lse's buffer, 1 KiB as Mosaic GPU aligns it.
        # Segment ids: the rows' and the slots' buffers and barriers, 3 KiB (measured as
        # `_SMEM_BYTES`). Before s52 Q, O and segments' 2 KiB were counted against 7 KiB
        # under SMEM_BYTES: the same ring depths (648 tile settings compared).
        fixed = self.n_consumers(d) * _ROWS * d * itemsize * (2 if persistent else 1)
        fixed += 1024 + (3 * 1024 if segments else 0)
        fixed += self.block_k * _SUM_COLS * itemsize if self.sum_mma else 0   # the ones tile
        return fixed, 2 * self.block_k * d * itemsize

    def stages_for(self, d: int, itemsize: int, persistent: bool = False,
                   segments: bool = False) -> int:
        """The K/V ring's depth (`stages`, or as many slots as fit, at most 4; the overlap
        needs two); a ValueError naming what would fit where these tiles do not."""
        def layout(t):
            held = persistent if t.persistent is None else t.persistent
            return t._buffers(d, itemsize, held, segments) + (2 if t.overlap else 1,)
        fixes = ([dict(stages=None)] * (self.stages is not None)
                 + [dict(block_k=64)] * (self.block_k > 64)
                 + [dict(consumers=2)] * (self.n_consumers(d) > 2)
                 + [dict(persistent=False)] * persistent
                 + [dict(overlap=False)] * bool(self.overlap))
        where = (f"at head_dim {d} ({self.n_consumers(d)} consumers"
                 f"{', persistent' if persistent else ''})")
        return H.ring_depth(self, where, layout, _SMEM_BYTES, fixes,
                            why="the overlap holds each V tile a step longer")


def fits(dtype, spec: AttnSpec, tiles: HopperAttnTiles) -> bool:
    """Whether the Hopper forward takes this problem (q, k, v of `dtype`) as it is (see the
    module docstring)."""
    del tiles      # any lengths: `forward` takes partial tiles (`_attn.pad_rows`)
    return (jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
            and spec.head_dim in (64, 128, 256) and spec.n_q > 0 and spec.n_k > 0)


def tiles_for(hopper, dtype, q_shape, spec: AttnSpec) -> HopperAttnTiles | None:
    """The Hopper forward's tiles if it is to run, else None (see `AttnBlocks.hopper`); `spec`
    must be the squeezed (GPU-layout) spec. None runs it on an sm90 GPU, compiled, where the
    problem fits; True or tiles force it (also in the interpreter) and raise where it does not."""
    if hopper is False or (hopper is None and (spec.interpret or not H.available())):
        return None
    if hopper is not None:
        H.check_forced(f"AttnBlocks(hopper={hopper})")
    tiles = hopper if isinstance(hopper, HopperAttnTiles) else HopperAttnTiles.for_head_dim(
        spec.head_dim)
    tiles.check_head_dim(spec.head_dim)
    if fits(dtype, spec, tiles):
        # The rings' depths, checked now rather than when the kernels are traced: the tiles
        # as given first (an error names what the caller wrote), then as the forward runs
        # them where that differs (`resolved`; `overlap_for` keeps a 1-slot ring plain).
        resolved = tiles.resolved(spec)
        for t in dict.fromkeys((tiles, resolved)):
            t.stages_for(spec.head_dim, spec.itemsize, t.persists(spec), spec.segments)
        if not isinstance(tiles.backward, bool):       # HopperBwdTiles (`__post_init__`)
            tiles.backward.check(spec)
        return resolved
    if hopper is not None:
        raise ValueError(
            f"AttnBlocks(hopper={hopper}) needs bf16/f16 q, k, v of one dtype and head_dim in "
            f"(64, 128, 256); got q {tuple(q_shape)} {jnp.dtype(dtype).name}, Tk={spec.n_k}. "
            f"Use hopper=None to fall back to the portable kernel where it does not fit")
    return None


class _Mma:
    """The two matrix products of a step: wgmma on the GPU, plain dots in the interpreter."""

    def __init__(self, interpret: bool):
        self.interpret = interpret

    def qk(self, q_smem, k_smem, after_issue):
        """S = Q K^T as float32 [64, bk]; `after_issue` runs while the wgmma is in flight."""
        if self.interpret:
            after_issue()
            return A.dot(q_smem[...], k_smem[...], "qd,kd->qk")

        def body(acc):
            plgpu.wgmma(acc, q_smem, k_smem.transpose((1, 0)))
            after_issue()
            return acc[...]
        return pl.run_scoped(body, plgpu.ACC((_ROWS, k_smem.shape[0]), jnp.float32))

    def pv(self, acc, p, v_smem, after_issue):
        """acc + P V with P [64, bk] in registers (the input dtype); `after_issue` runs while
        the wgmma is in flight."""
        if self.interpret:
            after_issue()
            return acc + A.dot(p, v_smem[...], "qk,kd->qd")

        def body(acc_ref):
            plgpu.wgmma(acc_ref, p, v_smem)
            after_issue()
        return pl.run_state(body)(plgpu.ACC.init(acc))

    def pv_sum(self, acc, l, p, v_smem, ones_smem, after_issue):
        """(acc + P V, l + P 1) with P [64, bk] in registers and 1 the [bk, _SUM_COLS] ones
        tile (`HopperAttnTiles.sum_mma`): both products issued back to back."""
        if self.interpret:
            after_issue()
            return (acc + A.dot(p, v_smem[...], "qk,kd->qd"),
                    l + A.dot(p, ones_smem[...], "qk,kd->qd"))

        def body(refs):
            acc_ref, l_ref = refs
            plgpu.wgmma(acc_ref, p, v_smem)
            plgpu.wgmma(l_ref, p, ones_smem)
            after_issue()
        return pl.run_state(body)((plgpu.ACC.init(acc), plgpu.ACC.init(l)))

    # The overlapped loop (`HopperAttnTiles.overlap`): O lives in one accumulator for the whole
    # key loop (a wgmma accumulator on the GPU, a float32 shared-memory tile in the interpreter,
    # `scratch`), and each step's two products are issued back to back.
    def accumulate(self, body, shape, scratch=None):
        """body(o_ref) with O's float32 accumulator of `shape`, zero at first (`scratch`: the
        interpreter's shared-memory tile for it); returns what body returns."""
        if self.interpret:
            scratch[...] = jnp.zeros(shape, jnp.float32)
            return body(scratch)
        return pl.run_scoped(body, plgpu.ACC(shape, jnp.float32))

    def drain(self):
        """Waits for every product issued (the interpreter's have run)."""
        if not self.interpret:
            plgpu.wgmma_wait(0)

    def qk_behind(self, q_smem, k_smem, o_ref, p, v_smem, after_issue, wait_pv=False):
        """Issues S = Q K^T, then O += P V behind it; returns S as float32 [64, bk] once it is
        done, while P V may still run (wgmma groups complete in order), or once both are
        (`wait_pv`). `after_issue` runs while both are in flight."""
        if self.interpret:
            after_issue()
            s = A.dot(q_smem[...], k_smem[...], "qd,kd->qk")
            o_ref[...] += A.dot(p, v_smem[...], "qk,kd->qd")
            return s

        def body(s_acc):
            plgpu.wgmma(s_acc, q_smem, k_smem.transpose((1, 0)))
            plgpu.wgmma(o_ref, p, v_smem)
            after_issue()
            return plgpu.wgmma_accumulator_load(s_acc, wait_n=0 if wait_pv else 1)
        return pl.run_scoped(body, plgpu.ACC((_ROWS, k_smem.shape[0]), jnp.float32))

    def pv_into(self, o_ref, p, v_smem):
        """O += P V (the last tile's product, after the loop)."""
        if self.interpret:
            o_ref[...] += A.dot(p, v_smem[...], "qk,kd->qd")
        else:
            plgpu.wgmma(o_ref, p, v_smem)


# Named barriers for the consumers' turns on the GPU (`PingPong`, `Turns`; False: mbarriers,
# a diagnostic for benchmarks/attention.py named). H200, s17-1, interleaved medians of 7,
# forward: D128 full 1.855 ms against 1.920 with mbarriers, GQA full 1.814 / 1.912, causal
# 1.101 / 1.119, GQA causal 1.078 / 1.097 (cuDNN 1.896, 1.877, 1.107, 1.086); the named
# rows also spread less (2.6-3.6% against 19-26% without masks).
_NAMED_PINGPONG = True
# Tried and dropped (s21-1): fencing the softmax's results (`lax.optimization_barrier` on p,
# the rescaled O, m, l) before the rendezvous, as JAX's attention_mgpu and tokamax do: D128
# forward 1.919 against 1.917 ms without masks, 1.056 against 1.055 causal (interleaved x5).


def query_tile(spec: AttnSpec, hq: int, n_q_tiles: int, bk: int, consumers: int = 2,
               item=None, groups=None, first_cta: int = 0):
    """(b, h, row0, key block bounds `A.key_blocks`) of consumers x 64 query rows: this CTA's,
    grid ("cta",) launched in `_hopper.heavy_first` order, groups = (n_bh, heads), causal
    heaviest first (the last query tiles see the most keys), counting from CTA `first_cta`
    (a grid whose first CTAs do other work); or work tile `item` = bh * n_q_tiles + query
    tile of a persistent walk (`work_schedule` orders them)."""
    if item is None:
        tile, bh = H.heavy_first(lax.axis_index("cta") - first_cta, n_q_tiles, *groups)
        if spec.causal:
            tile = n_q_tiles - 1 - tile
    else:
        bh, tile = item // n_q_tiles, lax.rem(item, n_q_tiles)
    row0 = tile * (consumers * _ROWS)
    return bh // hq, bh % hq, row0, A.key_blocks(spec, row0, consumers * _ROWS, bk)


# Mosaic GPU's barriers around shared-memory loads, stores and TMA issues (False: its
# `unsafe_no_auto_barriers`, as tokamax compiles; a diagnostic for benchmarks/attention.py
# persistent, not a default: the producer's cleaning rewrites what it reads).
_AUTO_BARRIERS = True


def _forward_body(q_gmem, k_gmem, v_gmem, *refs, spec: AttnSpec, tiles: HopperAttnTiles,
                  stages: int, n_q_tiles: int, ctas: int | None, n_parts: int = 0):
    """ctas: None, a CTA a work tile (grid ("cta",), in `launch_groups` order); else a
    persistent grid ("sm",) of `ctas` CTAs walking the work tiles that `refs[0]`
    (`work_schedule`) deals them (`HopperAttnTiles.persistent`); n_parts: the last round's
    tiles split over key blocks (`tail_schedule`): `refs[1]` holds the parts, whose
    (o, lse) go to two more outputs."""
    refs = list(refs)
    sched_gmem = refs.pop(0) if ctas is not None else None
    parts_gmem = refs.pop(0) if n_parts else None
    ones_gmem = refs.pop(0) if tiles.sum_mma else None
    # Segment ids (int32 [B, Tq] and [B, Tk]): each consumer reads its rows' once per work
    # tile with its Q, the producer streams each key block's beside its V.
    (qs_gmem, ks_gmem), outs = A.split_refs(refs, spec, 4 if n_parts else 2)
    (o_gmem, lse_gmem), part_outs = outs[:2], outs[2:]
    bk, d, g = tiles.block_k, spec.head_dim, spec.groups
    nc = tiles.n_consumers(d)
    mma = _Mma(spec.interpret)
    dtype = q_gmem.dtype
    transforms = H._tma_transforms(dtype, d)
    producer_regs, consumer_regs = R.REGISTERS[nc]
    hq = q_gmem.shape[2]
    n_bh = q_gmem.shape[0] * hq
    groups = (n_bh, launch_groups(n_bh, kv_head_bytes(spec), _FWD_GROUP_BYTES))
    n_items = n_bh * n_q_tiles

    def part_of(item):
        """(whether work item `item` is a part of a split tile, the part's index)."""
        if not n_parts:
            return False, 0
        return item >= n_items, jnp.maximum(item - n_items, 0)

    def where(item):
        """`query_tile` of work item `item`; a part of a split tile (`tail_schedule`) sees
        its key blocks [lo + start, lo + stop) of the tile's, its edges clipped to them."""
        if not n_parts:
            return query_tile(spec, hq, n_q_tiles, bk, nc, item, groups)
        is_part, p = part_of(item)
        b, h, row0, (lo, flo, fhi, hi) = query_tile(
            spec, hq, n_q_tiles, bk, nc, jnp.where(is_part, parts_gmem[p, 0], item), groups)
        plo = jnp.where(is_part, lo + parts_gmem[p, 1], lo)
        phi = jnp.where(is_part, lo + parts_gmem[p, 2], hi)
        flo = jnp.clip(flo, plo, phi)
        return b, h, row0, (plo, flo, jnp.clip(fhi, flo, phi), phi)

    def walk(body, carry):
        """body(i, item, next_item, has_next, carry) over this CTA's work tiles (i: its own
        count; next_item() reads the next one from the schedule)."""
        if ctas is None:
            return body(0, None, None, False, carry)
        sm = lax.axis_index("sm")
        local = sched_gmem[sm, 0]
        return lax.fori_loop(0, local, lambda i, c: body(
            i, sched_gmem[sm, 1 + i], lambda: sched_gmem[sm, 2 + i], i + 1 < local, c), carry)

    def scoped(q_smem, k_smem, v_smem, lse_smem, k_full, v_full, q_full, k_empty, v_empty,
               turn, *rest):
        landed = rest[:1] if A.hides_keys(spec) else ()
        takes_turns = tiles.pingpong and nc == 2 and stages >= 2   # the consumers' turns
        rest = rest[len(landed):]
        if spec.segments:     # allocated last (`pl.run_scoped` below)
            rest, (qseg_smem, kseg_smem, seg_full) = rest[:-3], rest[-3:]
        if tiles.sum_mma:     # the ones tile and its barrier, just before them
            rest, (ones_smem, ones_full) = rest[:-2], rest[-2:]
        o_smem = rest[0] if ctas is not None else q_smem     # O leaves through here
        o_scratch = rest[1:] if ctas is not None else rest
        wg = lax.axis_index("wg")

        @pl.when(wg == nc)
        def _producer():
            plgpu.set_max_registers(producer_regs, action="decrease")
            if tiles.sum_mma:
                plgpu.copy_gmem_to_smem(ones_gmem, ones_smem, ones_full)

            def item_kv(i, item, next_item, has_next, base):
                b, h, row0, (lo, flo, fhi, hi) = where(item)
                n = hi - lo
                edges = (flo - lo, fhi - lo, landed[0]) if landed else None
                R.produce_kv(k_gmem, v_gmem, b, h // g, lo, n, bk, stages, (k_smem, v_smem),
                           (k_full, v_full), (k_empty, v_empty), None, edges, spec.interpret,
                           held=int(bool(tiles.overlap)), base=base, drain=False,
                           coupled=takes_turns,
                           segments=(ks_gmem, kseg_smem, seg_full) if spec.segments else None)
                return base + n
            R.drain_ring((k_empty, v_empty), stages, walk(item_kv, jnp.int32(0)))

        @pl.when(wg < nc)
        def _consumer():
            plgpu.set_max_registers(consumer_regs, action="increase")
            if tiles.sum_mma:
                plgpu.barrier_wait(ones_full)
            named = _NAMED_PINGPONG and not spec.interpret   # the interpreter has none
            pp = R.PingPong(turn, wg, takes_turns and not tiles.overlap, stages, named=named)
            turns = R.Turns(turn, wg, takes_turns and tiles.overlap, named=named)

            def my_rows(item):
                """(b, h, first row of this consumer, whether it has rows, the CTA's key
                blocks) of work tile item."""
                b, h, row0, blocks = where(item)
                r0 = row0 + wg * _ROWS
                # A consumer past the last query row (the last CTA when Tq is not a multiple
                # of its rows) only releases the ring's slots.
                return b, h, r0, r0 < spec.n_q, blocks

            def load_q(item):
                b, h, r0, active, _ = my_rows(item)

                @pl.when(active)
                def _():
                    plgpu.copy_gmem_to_smem(q_gmem.at[b, pl.ds(r0, _ROWS), h], q_smem.at[wg],
                                            q_full.at[wg])
                    if spec.segments:
                        plgpu.copy_gmem_to_smem(qs_gmem.at[b, pl.ds(r0, _ROWS)],
                                                qseg_smem.at[wg], q_full.at[wg])

            def item_o(i, item, next_item, has_next, base):
                b, h, r0, active, (lo, _, _, hi) = my_rows(item)
                n = hi - lo
                if ctas is None:
                    load_q(item)
                else:
                    pl.when(i == 0)(lambda: load_q(item))
                pl.when(active)(lambda: plgpu.barrier_wait(q_full.at[wg]))
                # The rows' segment ids, held in registers through the walk (the next work
                # tile's land in the buffer while this one's last blocks run).
                q_seg = R.load_vec(qseg_smem.at[wg], 1, spec.interpret) if spec.segments \
                    else None
                # A persistent consumer loads its next Q once its last S is formed (has_next
                # is False, not traced, without persistence: then nothing calls this).
                load_next_q = lambda: load_q(next_item())
                # This consumer's own key blocks within the CTA's [lo, hi): blocks wholly
                # masked for its 64 rows (causal, window) are passed over, only its own edges
                # masked.
                # A part of a split tile (`tail_schedule`): within the part's blocks.
                c_lo, c_flo, c_fhi, c_hi = (jnp.where(active, jnp.clip(x, lo, hi), lo) - lo
                                            for x in A.key_blocks(spec, r0, _ROWS, bk))
                ring = lambda j: lax.rem(base + j, stages)     # slot of key block j

                def s_done(j):
                    """After key block j's S is formed: Q is free after the last one."""
                    if has_next is not False:
                        pl.when((j == c_hi - 1) & has_next)(load_next_q)

                def segments_of(slot):
                    """[64, bk] bool: which of the rows and the key block's keys share a
                    segment (the block's ids waited for), or None without segment ids."""
                    if not spec.segments:
                        return None
                    plgpu.barrier_wait(seg_full.at[slot])
                    return R.outer_equal(q_seg, R.load_vec(kseg_smem.at[slot], 0,
                                                           spec.interpret))

                def softmax(j, s, m, l, masked, same=None):
                    """(p in the input dtype, alpha, m, l) of raw scores s of key block j."""
                    keep = None
                    if masked:   # positions made here, not held across the loop (registers)
                        q_pos = r0 + R.iota((_ROWS, bk), 0, spec.interpret)
                        k_pos = (lo + j) * bk + R.iota((_ROWS, bk), 1, spec.interpret)
                        keep = A.visible(spec, q_pos, k_pos, same=same)
                    u, _ = A.transform(spec, s, keep)
                    m_new = jnp.maximum(m, jnp.max(R.fold_columns(u, jnp.maximum), axis=1))
                    shift = C.safe_max(m_new)
                    # As `_attn.online_update`, not FlashAttention-3's one FMA an element
                    # (`exp2_shifted`: NaN at scores ~1e9, GPU run s53-1).
                    alpha = A.exp2_shifted(m, shift, spec.c2)
                    p = A.exp2_shifted(u, R.row_vec(shift, bk), spec.c2)
                    if tiles.sum_mma:       # P 1 is added by the product beside P V
                        return p.astype(dtype), alpha, m_new, l * R.row_vec(alpha, _SUM_COLS)
                    l = l * R.row_vec(alpha, R.LANES) + R.fold_columns(p, jnp.add)
                    return p.astype(dtype), alpha, m_new, l

                # The named scopes are what `_hopper.traced` stamps
                # (benchmarks/attention_trace.py).
                def step(j, carry, masked):
                    acc, m, l = carry
                    slot = ring(j)
                    with jax.named_scope("wait_k"):
                        plgpu.barrier_wait(k_full.at[slot])
                    with jax.named_scope("qk"):
                        s = mma.qk(q_smem.at[wg], k_smem.at[slot], pp.switch)
                    plgpu.barrier_arrive(k_empty.at[slot])
                    s_done(j)
                    with jax.named_scope("softmax"):
                        p, alpha, m, l = softmax(j, s, m, l, masked, segments_of(slot))
                        acc = acc * R.row_vec(alpha, d)
                    with jax.named_scope("wait_v"):
                        pp.arrive()                           # my softmax is done
                        plgpu.barrier_wait(v_full.at[slot])
                        pp.wait()                             # the other's GEMMs are issued
                    with jax.named_scope("pv"):
                        if tiles.sum_mma:
                            acc, l = mma.pv_sum(acc, l, p, v_smem.at[slot], ones_smem,
                                                lambda: None)
                        else:
                            acc = mma.pv(acc, p, v_smem.at[slot], lambda: None)
                    plgpu.barrier_arrive(v_empty.at[slot])
                    return acc, m, l

                def step_behind(o_ref, j, carry, masked):
                    """`overlap`: S_j and P_{j-1} V_{j-1} issued together, softmax j under
                    the latter (or after it, `overlap="issue"`), then O rescaled by alpha_j
                    (O_j - P_j V_j = alpha_j O_{j-1});
                    P_j waits for the next step, V_j stays held. At the consumer's first block
                    P is 0 against that block's own V (one uniform step; a first block is
                    cleaned or seen by all rows, so 0 times its V is 0 or a NaN those rows
                    get anyway)."""
                    p_prev, m, l = carry
                    slot = ring(j)
                    prev = jnp.where(j > c_lo, ring(j - 1 + stages), slot)
                    with jax.named_scope("wait_k"):
                        plgpu.barrier_wait(k_full.at[slot])
                        # V is waited for when it is multiplied, a step after its K: V_{j-1}
                        # here, except that the first block's own V (the operand of P = 0) is
                        # waited for at the first block and so not again at the second.
                        # Waiting for V_j with K_j exposed each copy's latency with 2 slots,
                        # where V_j's copy waits for V_{j-2}'s release at the end of step
                        # j - 1.
                        pl.when(j != c_lo + 1)(lambda: plgpu.barrier_wait(v_full.at[prev]))
                    turns.take()
                    with jax.named_scope("qk"):
                        s = mma.qk_behind(q_smem.at[wg], k_smem.at[slot], o_ref, p_prev,
                                          v_smem.at[prev], turns.give,
                                          wait_pv=tiles.overlap == "issue")
                    plgpu.barrier_arrive(k_empty.at[slot])
                    s_done(j)
                    with jax.named_scope("softmax"):
                        p, alpha, m, l = softmax(j, s, m, l, masked, segments_of(slot))
                    with jax.named_scope("pv"):            # waits for P_{j-1} V_{j-1}
                        o_ref[...] = o_ref[...] * R.row_vec(alpha, d)
                    pl.when(j > c_lo)(lambda: plgpu.barrier_arrive(v_empty.at[prev]))
                    return p, m, l

                def last_pv(o_ref, carry):
                    """The held tile's product, once the consumer's blocks are done."""
                    p = carry[0]
                    slot = ring(c_hi - 1)
                    pl.when(c_hi - 1 != c_lo)(lambda: plgpu.barrier_wait(v_full.at[slot]))
                    mma.pv_into(o_ref, p, v_smem.at[slot])
                    mma.drain()                             # then the slot is free
                    plgpu.barrier_arrive(v_empty.at[slot])
                    return carry

                def pass_over(j, carry):
                    """A key block wholly masked for this consumer's rows: release its slots
                    (and keep the ping-pong's count of switches)."""
                    slot = ring(j)
                    plgpu.barrier_wait(k_full.at[slot])
                    if spec.segments:
                        plgpu.barrier_wait(seg_full.at[slot])
                    turns.take()
                    turns.give()
                    pp.switch()
                    plgpu.barrier_arrive(k_empty.at[slot])
                    pp.arrive()
                    plgpu.barrier_wait(v_full.at[slot])
                    pp.wait()
                    plgpu.barrier_arrive(v_empty.at[slot])
                    return carry

                def blocks(step, carry):
                    """The consumer's key blocks: passed over, masked edge, visible, masked
                    edge, passed over."""
                    carry = lax.fori_loop(0, c_lo, pass_over, carry)
                    carry = lax.fori_loop(c_lo, c_flo, lambda j, c: step(j, c, True), carry)
                    carry = lax.fori_loop(c_flo, c_fhi, lambda j, c: step(j, c, False), carry)
                    return lax.fori_loop(c_fhi, c_hi, lambda j, c: step(j, c, True), carry)

                # per-thread partial row sums, or P 1's accumulator (every column the sum)
                l = R.zeros((_ROWS, _SUM_COLS if tiles.sum_mma else R.LANES), spec.interpret)
                m = jnp.full((_ROWS,), C.NEG_INF, jnp.float32)
                if not spec.interpret:
                    m = plgpu.layout_cast(m, plgpu.Layout.WGMMA.reduce(1))
                if tiles.overlap:
                    def overlapped(o_ref):
                        p0 = R.zeros((_ROWS, bk), spec.interpret).astype(dtype)
                        carry = blocks(lambda j, c, masked: step_behind(o_ref, j, c, masked),
                                       (p0, m, l))
                        # A loop of 0 or 1 steps rather than a branch: the accumulator stays
                        # a loop carry, as in the key loop.
                        carry = lax.fori_loop(0, jnp.minimum(c_hi - c_lo, 1),
                                              lambda _, c: last_pv(o_ref, c), carry)
                        _, m_, l_ = lax.fori_loop(c_hi, n, pass_over, carry)
                        return o_ref[...], m_, l_
                    acc, m, l = mma.accumulate(overlapped, (_ROWS, d),
                                               o_scratch[0].at[wg] if o_scratch else None)
                else:
                    carry = blocks(step, (R.zeros((_ROWS, d), spec.interpret), m, l))
                    acc, m, l = lax.fori_loop(c_hi, n, pass_over, carry)
                if has_next is not False:       # no S formed here: load the next Q now
                    pl.when((c_hi <= c_lo) & has_next)(load_next_q)

                @pl.when(active)
                def _():
                    # As `_attn.online_finish`: lse_u in the scores' units, only l == 0 is an
                    # empty row.
                    lsum = jnp.max(l, axis=1) if tiles.sum_mma else jnp.sum(l, axis=1)
                    empty = lsum == 0
                    inv = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, lsum))
                    lse = jnp.where(empty, C.NEG_INF,
                                    m + jnp.log2(jnp.where(empty, 1.0, lsum)) * (1.0 / spec.c2))
                    if ctas is not None:    # the last tile's O and lse have left the buffers
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    o_smem[wg] = (acc * R.row_vec(inv, d)).astype(dtype)
                    lse_smem[wg] = lse
                    plgpu.commit_smem()
                    def store(o_dst, lse_dst):
                        plgpu.copy_smem_to_gmem(o_smem.at[wg], o_dst)
                        plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_dst)

                    whole = lambda: store(o_gmem.at[b, pl.ds(r0, _ROWS), h],
                                          lse_gmem.at[b, h, pl.ds(r0, _ROWS)])
                    if n_parts:     # a part's (o, lse) over its keys, merged after the kernel
                        is_part, p = part_of(item)
                        rows = pl.ds(wg * _ROWS, _ROWS)
                        pl.when(is_part)(lambda: store(part_outs[0].at[p, rows],
                                                       part_outs[1].at[p, rows]))
                        pl.when(jnp.logical_not(is_part))(whole)
                    else:
                        whole()
                    if ctas is None:
                        plgpu.wait_smem_to_gmem(0)
                return base + n

            pp.start()
            turns.start()
            walk(item_o, jnp.int32(0))
            pp.end()
            turns.end()
            if ctas is not None:
                plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(
        scoped,
        plgpu.SMEM((nc, _ROWS, d), dtype, transforms=transforms),
        plgpu.SMEM((stages, bk, d), dtype, transforms=transforms),
        plgpu.SMEM((stages, bk, d), dtype, transforms=transforms),
        plgpu.SMEM((nc, _ROWS), jnp.float32),
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_arrivals=1 + spec.segments, num_barriers=nc),   # Q (segment ids)
        plgpu.Barrier(num_arrivals=nc, num_barriers=stages),
        plgpu.Barrier(num_arrivals=nc, num_barriers=stages),
        # The consumers' turns: a rendezvous of two (`PingPong`), or one barrier each that
        # the other arrives on (`Turns`, with the overlap).
        (plgpu.Barrier(num_barriers=2) if tiles.overlap else plgpu.Barrier(num_arrivals=2)),
        # Masks hide keys: the producer cleans the CTA's edge tiles, which land here first.
        *([plgpu.Barrier(num_arrivals=2, num_barriers=stages)] if A.hides_keys(spec) else []),
        # A persistent CTA's O buffer (the next Q lands in Q's while O leaves).
        *([plgpu.SMEM((nc, _ROWS, d), dtype, transforms=transforms)] if ctas is not None
          else []),
        # The overlapped O in the interpreter (a wgmma accumulator on the GPU). Allocated last:
        # a small buffer between the lse tile and the barriers stalled Mosaic GPU's
        # interpreter (jax 0.10.2) on every forward.
        *([plgpu.SMEM((nc, _ROWS, d), jnp.float32)] if tiles.overlap and spec.interpret
          else []),
        # `HopperAttnTiles.sum_mma`'s ones tile, loaded once by the producer.
        *([plgpu.SMEM((bk, _SUM_COLS), dtype, transforms=H._tma_transforms(dtype, _SUM_COLS)),
           plgpu.Barrier()] if tiles.sum_mma else []),
        # Segment ids: the rows' of each consumer, a key block's a ring slot, and the slots'
        # barriers (a block's ids are released with its V: `_hopper_ring.produce_kv`).
        *([plgpu.SMEM((nc, _ROWS), jnp.int32), plgpu.SMEM((stages, bk), jnp.int32),
           plgpu.Barrier(num_barriers=stages)] if spec.segments else []),
        collective_axes="wg")


def forward(q, k, v, spec: AttnSpec, tiles: HopperAttnTiles, qs=None, ks=None):
    """(o [B, Tq, Hq, D], lse_u [B, Hq, Tq] float32 in the scores' units, see `_attn`) of
    q [B, Tq, Hq, D] over k, v [B, Tk, Hkv, D], with `spec.segments` the segment ids qs
    [B, Tq] and ks [B, Tk] (int32); the problem must `fit`, and `tiles` come as `tiles_for`
    resolves them (`HopperAttnTiles.resolved`: `plan` does so once a call)."""
    n_q = q.shape[1]
    # Lengths that are not whole tiles: compiled, TMA's bounds take the partial last tiles
    # (`_attn.pad_rows`); interpreted, they run padded. The masks keep the true lengths; the
    # lse rows go into a buffer of whole tiles (`pad_rows`: TMA's strides), sliced after.
    q = A.pad_rows(q, 2 * _ROWS, spec)
    k, v = (A.pad_rows(x, tiles.block_k, spec) for x in (k, v))
    segs = (A.pad_length(qs, 2 * _ROWS), A.pad_length(ks, tiles.block_k)) if spec.segments \
        else ()
    b, tq, hq, d = q.shape
    persistent = tiles.persists(spec)
    stages = tiles.stages_for(d, q.dtype.itemsize, persistent, spec.segments)
    nc = tiles.n_consumers(d)
    n_q_tiles = C.cdiv(tq, nc * _ROWS)
    ctas, sched, parts = None, (), None
    grid, grid_names = (b * hq * n_q_tiles,), ("cta",)
    if persistent:
        # Two CTAs in the interpreter, so that each walks several tiles.
        ctas = min(b * hq * n_q_tiles, 2 if spec.interpret else C.num_multiprocessors())
        grid, grid_names = (ctas,), ("sm",)
        split = tiles.split_tail is not False and tail_schedule(
            spec, b * hq, n_q_tiles, nc * _ROWS, tiles.block_k, ctas, _L2_SHARE)
        if split:
            table, parts = split
            sched = (H.constant(table), H.constant(parts))
        else:
            sched = (H.constant(work_schedule(spec, b * hq, n_q_tiles, nc * _ROWS,
                                              tiles.block_k, ctas, _L2_SHARE)),)
    n_parts = 0 if parts is None else len(parts)
    body = functools.partial(_forward_body, spec=spec, tiles=tiles, stages=stages,
                             n_q_tiles=n_q_tiles, ctas=ctas, n_parts=n_parts)
    out_types = (jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((b, hq, C.cdiv(tq, 2 * _ROWS) * 2 * _ROWS), jnp.float32))
    if n_parts:    # each part's (o, lse) over its keys
        out_types += (jax.ShapeDtypeStruct((n_parts, nc * _ROWS, d), q.dtype),
                      jax.ShapeDtypeStruct((n_parts, nc * _ROWS), jnp.float32))
    name = "jaxfuse_flash_fwd_hopper"
    kw = {"interpret": H._interpret_params()} if spec.interpret else {}
    f = plgpu.kernel(body, out_type=out_types, grid=grid, grid_names=grid_names,
                     num_threads=nc + 1, thread_name="wg",
                     compiler_params=H.compiler_params(
                         name, approx_math=True, unsafe_no_auto_barriers=not _AUTO_BARRIERS),
                     kernel_name=name, **kw)
    # The barrier keeps XLA from running the kernel twice. Inside a scanned, differentiated
    # model, o is both used and stacked as a residual, and XLA's GPU dynamic-slice fusion
    # cloned the custom call into a fusion that writes the residual stack, keeping the
    # original for the other user: measured on the H200, 16 forward launches for 8 layers
    # (0.235 ms each, 157M model). Behind the barrier the stack takes a copy of o instead.
    ones = (jnp.ones((tiles.block_k, _SUM_COLS), q.dtype),) if tiles.sum_mma else ()
    outs = jax.lax.optimization_barrier(f(q, k, v, *sched, *ones, *segs))
    o, lse_u = outs[:2]
    if n_parts:
        o, lse_u = _merge_parts(o, lse_u, *outs[2:], parts, spec, n_q_tiles, nc * _ROWS)
    return o[:, :n_q], lse_u[..., :n_q]          # no-ops where nothing was padded


def _merge_parts(o, lse_u, o_parts, lse_parts, parts, spec: AttnSpec, n_q_tiles: int,
                 rows: int):
    """o and lse_u with the split tiles' rows (`tail_schedule`) merged from their parts
    (`merge_many`: lse = logsumexp of the parts', o their weighted sum, in float32), put in
    place by one scatter each."""
    hq = o.shape[2]
    n_tiles = len(np.unique(parts[:, 0]))
    per = len(parts) // n_tiles                  # parts a tile, consecutive
    item = parts[::per, 0]
    bh, tile = item // n_q_tiles, item % n_q_tiles
    rows_of = (tile * rows)[:, None] + np.arange(rows)             # [n_tiles, rows]
    o_m, lse_m = ref_attn.merge_many(
        o_parts.reshape(n_tiles, per, rows, -1),
        lse_parts.reshape(n_tiles, per, rows) * spec.unit, axis=1)
    # Indices as operands (`_hopper.constant`: a traced constant breaks custom_partitioning).
    bi, hi, rows_of = (H.constant(a.astype(np.int32)) for a in
                       ((bh // hq)[:, None], (bh % hq)[:, None], rows_of))
    # Rows past the padded length (a last tile of three consumers) are dropped.
    o = o.at[bi, rows_of, hi].set(o_m.astype(o.dtype), mode="drop")
    lse_u = lse_u.at[bi, hi, rows_of].set(lse_m * (1.0 / spec.unit), mode="drop")
    return o, lse_u


# K and V bytes that the CTAs of a persistent walk share at a time (`work_schedule`): a slice
# of the H200's 50 MB of L2.
_L2_SHARE = 16 << 20


def launch_groups(n_bh: int, head_bytes: int, group_bytes: int | None) -> int:
    """Heads a group of a CTA-a-tile grid launched in `_hopper.heavy_first` order (or of
    `work_schedule`'s order): as many as hold `group_bytes` of the operands they share (0: one
    head a group, each head's tiles heaviest first, then the next head's; None: every head
    one group, every head's heaviest tile first)."""
    if group_bytes is None:
        return n_bh
    return min(n_bh, max(1, group_bytes // max(head_bytes, 1)))


# The forward's CTA-a-tile launch order (`launch_groups`; `_hopper.heavy_first`): heads in
# groups whose K and V fill `_L2_SHARE`, every head's heaviest tile of a group first. Measured
# (H200, s18-1, `benchmarks/attention.py fwd_order`, causal, interleaved medians of 5, 16 MiB
# groups / every head one group / one head a group (the order before s18) / cuDNN): the 1B
# model's B2 Hq32 Hkv8 T8192 D64 1.188 / 1.154 / 1.366 / 1.293 ms, B1 H16 T32768 D128 7.160 /
# 7.719 / 7.270 / 7.652, D256 B2 H16 T4096 0.464 / 0.470 / 0.507 / 0.551: every head at once
# loses where their K and V outgrow L2 (T32768), one head at a time repeats each head's
# heavy-to-light sawtooth.
_FWD_GROUP_BYTES = _L2_SHARE


def kv_head_bytes(spec: AttnSpec) -> int:
    """K and V bytes of one query head (its KV head's, shared by the group's query heads)."""
    return 2 * spec.n_k * spec.head_dim * spec.itemsize // spec.groups


@functools.lru_cache(maxsize=64)
def work_schedule(spec: AttnSpec, n_bh: int, n_q_tiles: int, rows: int, bk: int, ctas: int,
                  l2_share: int = _L2_SHARE):
    """The persistent forward's schedule (`_hopper.list_schedule`) of its work tiles
    bh * n_q_tiles + query tile of `rows` rows: heaviest first (most key blocks, as a grid
    launched causal-heaviest-first would run them) within groups of heads whose K and V fit in
    `_L2_SHARE`, so that the CTAs at work at a time read the K and V of a few heads from L2;
    each tile costs its key blocks plus a quarter block for its start and end. Greedy list
    scheduling in that order balances a causal walk (B4 H32 T4096, 32 tiles a head of 1 to 32
    blocks, 132 CTAs: the busiest CTA 0.1% over the mean, against 3.5% with no head groups and
    up to 9% round robin)."""
    blocks, order = _tiles_in_order(spec, n_bh, n_q_tiles, rows, bk, l2_share)
    table = H.list_schedule(blocks[order % n_q_tiles] + 0.25, ctas)
    table = np.concatenate([table[:, :1], order[table[:, 1:]].astype(np.int32)], axis=1)
    table.setflags(write=False)              # cached: shared by every caller
    return table


def _tiles_in_order(spec: AttnSpec, n_bh: int, n_q_tiles: int, rows: int, bk: int,
                    l2_share: int):
    """(key blocks of each query tile [n_q_tiles], the work tiles bh * n_q_tiles + tile in
    the persistent schedules' order: heaviest first within groups of heads whose K and V fit
    in `l2_share`)."""
    with jax.ensure_compile_time_eval():
        lo, _, _, hi = A.key_blocks(spec, jnp.arange(n_q_tiles, dtype=jnp.int32) * rows,
                                    rows, bk)
        blocks = np.broadcast_to(np.asarray(hi - lo), (n_q_tiles,))
    heads = launch_groups(n_bh, kv_head_bytes(spec), l2_share)
    item = np.arange(n_bh * n_q_tiles)
    bh, tile = item // n_q_tiles, item % n_q_tiles
    return blocks, np.lexsort((tile, bh, -blocks[tile], bh // heads))


@functools.lru_cache(maxsize=64)
def tail_schedule(spec: AttnSpec, n_bh: int, n_q_tiles: int, rows: int, bk: int, ctas: int,
                  l2_share: int = _L2_SHARE):
    """`work_schedule` with the last round's tiles split over their key blocks (stream-K on
    the tail, `HopperAttnTiles.split_tail`), or None where it does not apply: tiles of equal
    work (no causal mask or window) whose last round would leave at least half the CTAs idle
    (B4 H32 T4096 at 128 rows: 4096 tiles over 132 CTAs, 31 full rounds and 4 tiles; s48
    item 2 measured that round at ~3% of the kernel). Each of the r tail tiles becomes
    min(key blocks, ctas // r) parts of consecutive key blocks, dealt like any item, each
    writing its own (o, lse); `forward` merges them.

    Returns (table as `work_schedule`'s, whose items past the n_bh * n_q_tiles tiles are
    parts: item = n_bh * n_q_tiles + part; parts int32 [n_parts, 3]: the part's tile, its
    first and its last + 1 key block counted from the tile's first)."""
    blocks, order = _tiles_in_order(spec, n_bh, n_q_tiles, rows, bk, l2_share)
    n_items = n_bh * n_q_tiles
    tail = n_items % ctas
    per = min(int(blocks[0]), ctas // max(tail, 1))
    if (blocks != blocks[0]).any() or not 0 < tail <= ctas // 2 or per < 2:
        return None
    whole, split = order[:n_items - tail], order[n_items - tail:]
    cuts = [np.linspace(0, blocks[0], per + 1).round().astype(int)] * tail
    parts = np.array([(t, c[i], c[i + 1]) for t, c in zip(split, cuts) for i in range(per)],
                     np.int32)
    costs = np.concatenate([np.full(len(whole), blocks[0] + 0.25),
                            parts[:, 2] - parts[:, 1] + 0.25])
    table = H.list_schedule(costs, ctas)
    codes = np.concatenate([whole, n_items + np.arange(len(parts))]).astype(np.int32)
    table = np.concatenate([table[:, :1], codes[table[:, 1:]]], axis=1)
    for a in (table, parts):
        a.setflags(write=False)              # cached: shared by every caller
    return table, parts
