"""FlashAttention backward on a Hopper GPU (sm90) in Pallas Mosaic GPU: TMA ring, wgmma, a
producer warpgroup and two consumer warpgroups (FlashAttention-3, Shah et al. 2024, sec. 3.3;
the maths of FlashAttention-2's backward, lecture 5 sec. 7.3, as in `attention_bwd`):

    P = exp2((u - lse_u) c2)  (recomputed in the forward's score units, `_attn`: exact),
    dV = P^T dO,  dP = dO V^T,  dS = P * (dP - delta)  (* (1 - tanh^2) under a soft cap),
    dK = scale dS^T Q,  dQ = scale dS K,   delta = rowsum(dO * O) - dlse (an XLA pre-pass).

dK/dV kernel: one CTA per (batch * KV head, 128 keys: two consumers; `HopperBwdTiles.
consumers` = 3 takes 192); each consumer warpgroup keeps its 64 keys' K and V in shared memory
and dK, dV [64, D] in float32 registers, and walks the query tiles of 64 rows that see its
keys, for every query head of the KV group (GQA/MQA reduced in the kernel: no K/V repeat, no
sum over the group). The producer warpgroup streams Q, dO (and lse_u, delta) through a ring of
`stages` slots with TMA: every query tile that sees any of the CTA's keys. The scores are kept
transposed (S^T = K Q^T, [64 keys, 64 queries]) so that P^T and dS^T are the register A
operands of dV += P^T dO and dK += dS^T Q (as jax's `attention_mgpu` backward does).
Causal/window tiles come from `_attn.query_blocks` per consumer: a tile wholly masked for a
consumer's own 64 keys is passed over (its ring slot released, nothing computed), only the
consumer's own edge tiles are masked (H200, s10-3: 2.271 -> 2.171 ms at the 1B model's
attention, 0.335 -> 0.308 at the 157M's, against both consumers computing the CTA's edge tiles).
A consumer past Tk (the last CTA of three consumers) only releases slots.

dQ, three ways (`AttnSpec.deterministic`, `HopperBwdTiles.fixed_dq`):
* False (at D = 64; at D = 128 the separate dQ kernel below is faster, so it runs there too
  unless `HopperBwdTiles(fused_dq=True)`): the dK/dV kernel also forms dQ_partial = dS K over
  its 128 keys (the fifth GEMM) and adds it into a float32 [B, Tq, Hq, D] buffer with a
  reducing TMA store; the sum's order depends on which CTA comes first, so the bits may differ
  between runs. Cast to the input dtype afterwards. Both consumers put their dS^T [64 keys,
  bq] in shared memory, and dQ is formed from both halves (A operand read transposed): one
  [bq, D] float32 store per step, as FlashAttention-3 does. At D = 128 each consumer forms
  its half of the columns every step (FlashAttention-3's split of the dQ product); at D = 64
  a half would be 32 columns, less than wgmma's 64-element swizzle row of K, so there the
  consumers take turns (even steps the first, odd the second) forming all D columns. Each
  dQ tile leaves by one reducing TMA store from the consumer's own shared-memory tile, not
  waited for (the next store into that tile waits only until it was read, a step or two later).
  (One store per consumer, of its own 64 keys' partial, moved twice the bytes: B4 H32 T4096
  D128 fwd+bwd 12.07 against 10.02 ms, the 157M model's D = 64 0.998-1.074 against 0.910
  ms, H200. Turns at D = 128, with each tile in four pieces that waited on each other: the
  consumers serialized on each other's dQ work, 6085 cycles a step against 4815 for the
  kernel pair, s14-1; the split: fwd+bwd 9.82-9.86 ms, s14-2/3.) What bounds it at D = 128
  (H200, s14-3, B4 H32 T4096 fwd+bwd): the reducing stores, 9.86 ms with them against 7.72
  with the dQ tiles left in shared memory (8.6 GB of float32 additions into L2), and then
  its products, which take twice as long a step as in the dK/dV kernel beside the fifth
  (S^T 1036 against 500 cycles, dV + dP^T 1222 against 645: five products of N = 64 with
  shared-memory operands a step); the kernel pair takes 8.81, cuDNN 6.78.
* True (default): a separate dQ kernel, one CTA per (batch * query head, 128 rows), walks the
  key tiles like the forward (S, dP and dQ += dS K: 3 GEMMs) and writes dQ once: a fixed
  summation order, bitwise identical across runs, at the cost of recomputing S and dP
  (7 GEMMs per tile pair instead of 5).
* True with `HopperBwdTiles(fixed_dq=True)` (opt-in; not with segment ids): the fused dQ as
  above, its partials scaled per row by a power of two, truncated to int32 and added by
  integer reducing stores (`_fixed_sum`): exact adds, so bitwise identical across runs with
  5 products. Measured (H100, s38, the 1B model's B2 Hq32 Hkv8 T8192 D64 causal, profiler,
  one fwd+bwd call): its kernel 3.33-3.36 ms against the float32 one's 3.22 and the pair's
  3.59 (2.15 + 1.44), but the rows' scales (an XLA pre-pass over K, V and dO) and the int32
  buffer's zeroing and conversion bring the call to 4.65-4.75 ms against the pair's 4.73-4.75
  and the float32 fused one's 4.49; at the 157M model's T2048 0.785 against 0.765. The model
  step (1B, s38-5, with an earlier pre-pass): 322.1 ms against 357.7 for plain JAX + cuDNN
  (1.110x; deterministic=False 322.5; the pair 329.4 in s37-4). Opt-in: what it adds to a
  call, 0.09-0.18 ms at these shapes, is mostly bytes the pair never moves (the int32
  buffer's zeroing and its conversion, 0.040 + 0.069 ms at the 1B shape, both at the copy
  rate), while the products it saves are ~7% of the pair's kernel time, so it wins
  only on the largest problems and not by length alone (H100, s39-2, one call, pair against
  fixed point: 1B 4.766 / 4.668 ms, B4 Hq32 Hkv8 T4096 causal 2.637 / 2.609, T3072 causal
  1.683 / 1.839, B8 H16 T2048 full 1.287 / 1.378, the 157M's 0.771 / 0.790; model steps
  in one run (s39-1): 1B 325.4 / 321.6 ms, 157M 34.92 / 35.20). With the fused kernel's
  steps overlapped (`HopperBwdTiles.dkv_overlaps`, the default since s41; H100, s40-1): 1B
  4.722 / 4.571, T4096 causal 2.654 / 2.547, T2048 full 1.272 / 1.317, the 157M's 0.771 /
  0.777; H200, s41-2/3: 1B 4.747 / 4.527, T4096 causal 2.613 / 2.515, T3072 causal 1.651 /
  1.777, T2048 full 1.277 / 1.304, the 157M's 0.756 / 0.750: still no shape rule that wins
  everywhere. Its reducing stores are not what holds the fused kernel back: with its dQ
  tiles never leaving shared memory (diagnostic) it ran no faster at D = 64 (H200, s41-1,
  1B 3.022 / 3.046 ms float32, 3.236 / 3.234 fixed point), unlike D = 128 (above).

Counting (bf16/f16; one dK/dV step = one CTA's 128 keys x 64 query rows):
* bytes in per step: Q and dO tiles 2 * 64 * D * 2 (32 KiB at D = 128, 16 at 64) + lse and
  delta 512 B; K and V (2 * 128 * D * 2: 64 KiB at D = 128) once per CTA.
* FLOPs per step: each product is 2 * 128 * 64 * D (2.1 MFLOP at D = 128): 4 of them (S^T,
  dV, dP^T, dK) = 8.4 MFLOP, 5 with the fused dQ = 10.5: ~250 FLOP per byte read at any
  D, against the H200's ~205 (989 TFLOP/s / 4.8 TB/s); the Q tiles of one
  head are read by every key-tile CTA of that head, which run together, mostly from L2.
  The fused dQ stores 64 * D * 4 bytes per step with reducing TMA stores (as many bytes as the
  step reads, half what one store per consumer moved; they land in L2, where the CTAs of one
  head, which run together, add into the same 2 MiB of dQ at T = 4096, D = 128).
* shared memory (227 KiB, less ~8 for barriers and Mosaic GPU's own = 219): K, V 64 KiB at
  D = 128 (32 at 64); one ring stage (Q, dO [64, D], lse, delta [64] f32) 32.5 KiB (16.5);
  fused dQ: dS^T [2 steps x 2 consumers, 64, 64] 32 KiB and a float32 dQ tile a consumer
  [bq, D / 2] (D = 128) or [bq, D] (D = 64), 32 KiB. D = 128: 4 stages (194 KiB), 2 with the
  fused dQ (193);
  D = 64: 4 stages (98 / 162 KiB; the ring is capped at 4).
* registers (232 per consumer thread): dK and dV [64, D] float32 take D / 2 each per thread
  (128 at D = 128), S^T and dP^T [64, 64] 32 each; the fused dQ's product (32 at D = 128,
  its half of the columns; 32 at D = 64 on every other step) lives after S^T and dP^T are
  dead. D = 256 would need 256 for dK and dV alone: there the consumers split the columns
  (below). At D = 64 a consumer also holds its K and V tiles (16 each, bf16) as the A
  operands of S^T and dP^T (`HopperBwdTiles.kv_regs`): those products then read only Q and
  dO from shared memory, which took the pair's dK/dV kernel 8-11% faster (H100, s42-1); at
  D = 128 their 64 registers spill.
* dQ kernel (per consumer 64 query rows; key tiles of 64 at D = 128, 128 at D = 64): Q, dO of
  both consumers 4 * 64 * D * 2 (64 KiB at D = 128) + one K/V stage 2 * bk * D * 2 = 32 KiB:
  4 stages (193 KiB; 161 at D = 64); registers dQ [64, D] (64 at D = 128) + S, dP [64, bk]
  (32 + 32) + the previous step's dS [64, bk] carried under the overlap (16 at bk = 64, the
  input dtype). Its 3 products per (64 rows x bk keys) tile recompute S and dP: 7 per tile pair
  for both kernels against 5 fused, the price of a fixed summation order.

Launch order (both kernels, `_hopper.heavy_first`): a one-dimensional grid whose CTAs start
in index order on the first free multiprocessor, in groups of heads whose shared operands fill
16 MiB of L2 (`_BWD_GROUP_BYTES`; dK/dV: the Q and dO of a KV head's query heads, dQ: a query
head's K and V), every head's heaviest tile of a group first (causal: the first key tiles, the
last query tiles), then every head's next: the hardware's dynamic launch then balances unequal
causal tiles as a greedy list schedule would, among CTAs that read the same few heads from L2.
Measured (H200, s18-1, `benchmarks/attention_bwd.py groups`, fwd+bwd interleaved medians of 5,
16 MiB groups / every head one group (the order before s18) / one head a group / cuDNN): B4
H32 T4096 D128 full 8.172 / 8.964 / 8.037 / 7.515 ms (every head at once reads 132 heads' Q
and dO, 264 MB, through 50 MB of L2), causal 4.659 / 4.810 / 4.561 / 4.282, GQA 32/8 causal
4.513 / 4.419 / 4.508 / 4.321, the 157M model's GQA B8 Hq16 Hkv4 T2048 D64 causal 0.864 /
0.866 / 0.933 / 0.925, D64 MHA 0.908 / 0.923 / 0.926 / 0.890, the 1B model's B2 Hq32 Hkv8
T8192 D64 causal 5.303 / 5.379 / 5.508 / 4.880: never the slowest, within the rounds' spread
(2-8%) of the best where it is not the best. (Pallas Mosaic GPU gives a grid's last axis to
CUDA's x, which launches fastest: the two-dimensional grids before s17 ran every head's
heaviest tile first.)

One launch (`HopperBwdTiles.one_launch`, by default with GQA/MQA): the kernel pair as one
grid whose first CTAs run the dK/dV body and the rest the dQ body (each branch allocates its
own shared memory and barriers; the launch takes the larger), so dQ CTAs start on the
multiprocessors that the dK/dV grid's last round leaves idle. A GQA dK/dV CTA walks every
query head of its group: G times fewer, longer CTAs, whose last round idles most. Measured
(H100, s48, backward kernels of one call, two launches -> one): GQA 32/8 T4096 D128 causal
3.247 -> 2.943 ms, the 1B model's attention 3.396 -> 3.332, the 157M's 0.539 -> 0.526;
without groups mixed (`launches_once`). The same bits as two launches (tested).

Overlap: the dQ kernel issues each step's dQ += dS K behind the next step's S and dP and
computes the next step's dS while the tensor cores finish it (FlashAttention-3 sec. 3.2's
intra-warpgroup overlap; dQ in a wgmma accumulator for the whole key loop). A K tile is then
held one step longer (released after the product behind the next step), so the overlap needs
a ring of 2 slots or more; with one it runs the plain schedule. Kernel time (H200, profiler,
two runs): 2.57 -> 2.48 ms at B4 H32 T4096 D128, 0.269 -> 0.256 ms at the 157M model's
D = 64. The same schedule in the dK/dV kernel (dV and dK behind the next S^T and dP^T) was
slower, 3.46 -> 4.64 ms and 0.368 -> 0.401 ms; that kernel overlaps within a step instead
(S^T and dP^T issued together, P formed under dP^T, dS under dV += P^T dO: nothing carried
to the next step; `HopperBwdTiles.dkv_overlaps`, 3.318 -> 3.135 ms at B4 H32 T4096 D128).
At D = 256 (32-key steps, S and dP [64, 32] against a [64, 256] dQ) the overlap loses: there a
ring of two slots is all that fits beside Q and dO under `AH._SMEM_BYTES`, and with two K
tiles held no copy runs ahead (each step's K waited for the step before to end); a third slot
(`_SMEM_TIGHT`) takes the dQ kernel from 2.29 to 1.38 ms (B2 H16 T4096, no mask, profiler),
and without the overlap two slots are faster still (fwd+bwd interleaved, s19-3/4, causal /
no mask: 2.684 / 4.640 ms without, 2.846 / 4.712 with the overlap and three slots, 3.228 /
5.510 with two, cuDNN 2.554 / 4.681). So the overlap is the default up to D = 128
(`HopperBwdTiles.dq_overlap`).

D = 256 (`HopperBwdTiles.split_d`): a dK/dV CTA holds 64 keys, and its two consumers split
dK's and dV's columns (each [64, 128] float32: 64 registers a thread apiece) instead of the
keys. A step is 64 query rows; each consumer forms S^T and dP^T of its half of them ([64 keys,
32 queries]: 16 registers each), writes P^T and dS^T as its 32 columns of two shared [64, 64]
tiles, and once both halves are in (a rendezvous) adds P^T dO and dS^T Q over all 64 rows into
its columns of dV and dK (both operands from shared memory; column slices of the ring's tiles
as B); a second barrier tells a consumer that the other's products of the last step have read
the tiles before it overwrites them (`HopperBwdTiles.exchange`, FlashAttention-3's exchange of
P and dS through shared memory). wgmma wants both shared operands in one swizzle and the
product's K a whole number of swizzle rows, so every tile of these kernels takes 64-byte
swizzles (`_hopper_bwd._transforms`), as do the dQ kernel's 32-key steps (beside dQ's 128
registers).
After the loop each consumer writes its columns of dK and dV into K's and V's shared tiles and
one TMA store a tile leaves. The dQ is always the separate kernel (no fused dQ: its dS^T
exchange assumes consumers on different keys). Shared memory: K, V 64 KiB, P^T and dS^T 16,
2 ring stages of 64.5 (dK/dV); Q, dO of both consumers 128 KiB + 2 stages of 32 (dQ).
Without the exchange (`exchange=False`) each consumer forms the whole S^T and dP^T of 32-row
steps itself: those two products run twice a CTA, 6 products' work a tile pair where 4 do.
Measured (H200, B2 H16 T4096 bf16, fwd+bwd with the Hopper forward, interleaved medians):
s18-4, causal 3.229 ms with the exchange against 3.496 without (cuDNN 2.503: 0.78x), no mask
5.387 against 6.408 (4.662: 0.87x); s18-3 (without it): causal 3.424 ms with 2 ring stages,
3.662 with 4, 3.743 with the consumers taking turns, 5.534 with the Triton backward (cuDNN
2.582); no mask 6.428 / 6.511 / 6.935 / 9.658 (4.917). What is left against cuDNN: the dQ
kernel's recomputed S and dP (7 products a tile pair against cuDNN's 5) and 32-key dQ steps.

What it takes (`fits`): what the Hopper forward takes (bf16/f16, D in {64, 128, 256}); anything
else (dropout, float32) runs the portable kernels of `attention_bwd`. Segment ids at D = 64
on the kernel pair without GQA's one launch (by default: no GQA, deterministic=True) take K
and V from shared memory (`regs_fault`: from registers the dK/dV kernel gave wrong dK and dV
there compiled, s56; from shared memory right, s58; `kv_regs=True` raises there).
Segment ids: the dK/dV
kernel's producer streams each step's queries' ids beside its Q and lse, each consumer copies
its keys' once with its K; the dQ kernel takes them as the forward does (rows' with Q, each key
block's through a ring slot of their own); every tile is masked. Lengths that are not whole
tiles (Tq of 128 rows, Tk of 128 keys) take TMA's bounds compiled and run padded with zeros
interpreted (`_attn.pad_rows`), the masks keeping the true lengths, as in the forward; the
fused dQ keeps k padded where its last CTA's second consumer would have no key (`backward`).
Garbage in masked keys: scores and dS of masked pairs are selected away on edge tiles (and P of
a NaN row, which saw garbage); the K rows that multiply a zero dS in dQ = dS K come cleaned by
the dQ kernel's producer, on its edge tiles, as the forward's producer cleans its own
(`HopperBwdTiles.cleans`); the dK/dV kernel reads raw K and V (its products contract over
queries). The fused dQ, and `HopperBwdTiles(clean=False)`, take an XLA pass over K and V
instead (`_attn.clean_keys`, which also makes V NaN where K is not finite).

Regimes: compiled by Mosaic GPU on an sm90 GPU. In Mosaic GPU's interpreter (jax 0.10.2) the
products are plain dots of the same tiles (it reads no register or transposed wgmma operand),
and the fused dQ has no reducing TMA store: there each warpgroup reads, adds and writes a
float32 buffer of its own ([2, B, Tq, Hq, D], summed after; the interpreter runs the grid
sequentially, so nothing races).

Files: this one holds the tiles (`HopperBwdTiles`), what the path takes (`fits`) and the
launches (`backward`); the kernel bodies are `attention_hopper_dkv` (dK/dV, and the fused dQ)
and `attention_hopper_dq` (the deterministic dQ); what they share is `_hopper_bwd` (product
forms, tile layouts, P and dS) and, with the forward, `_hopper_ring` (the K/V ring, turns).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxfuse import _checks
from jaxfuse.pallas import _attn as A
from jaxfuse.pallas import _fixed_sum as FS
from jaxfuse.pallas import _hopper as H
from jaxfuse.pallas import _hopper_ring as R
from jaxfuse.pallas import attention_bwd
from jaxfuse.pallas import attention_hopper as AH
from jaxfuse.pallas import attention_hopper_dkv as DKV
from jaxfuse.pallas import attention_hopper_dq as DQ
from jaxfuse.pallas._hopper_bwd import _F32, _KEYS, _ROWS, _SMEM_TIGHT
from jaxfuse.pallas._attn import AttnSpec


@dataclasses.dataclass(frozen=True)
class HopperBwdTiles:
    """block_q: query rows per dK/dV step, 32, 64 or 128 (the N of S^T; None: 64, 32 at D =
    256 without the exchange; the fused dQ takes 64 or 128);
    block_k_dq: keys per dQ-kernel step, 32, 64 or 128 (None: 128 at D = 64, 64 at 128, 32 at
    256, for registers; at 256 only 32 is taken, `k_dq`); stages: ring depth (None: as many as
    shared memory holds, at most 4, but 2 in the dK/dV kernel at D = 64 without the fused dQ
    and at D = 256, measured faster; more than fit is refused, `check`); fused_dq: with
    deterministic=False, dQ from the dK/dV kernel (True) or the separate dQ kernel (False;
    None: fused at D <= 64, where it is faster: at D = 128 its reducing stores cost more than
    the two products the dQ kernel recomputes, BENCHMARKS.md); overlap: the dQ kernel issues
    each step's dQ product behind the next step's S and dP and computes the next step's dS
    under it (needs 2 ring stages or more; False: each product waited for in turn; None: at
    D <= 128, module docstring "Overlap"); pingpong:
    the two consumers take turns on the tensor cores (`R.PingPong`: one's exponentials run
    under the other's products; needs 2 ring stages or more): None in the dQ kernel at D = 64
    only, True in both kernels, False in neither. Measured (H200, s9): the dQ kernel 1.542 ->
    1.473 ms with it at the 1B model's attention (B2 T8192 H32/8 D64 causal, profiler); the
    dK/dV kernel 2.271 -> 2.633 ms (its five short phases a step, each as long as the longer
    of the two consumers' halves, cost more than the overlap gains); at D = 128 (B4 H32 T4096,
    wall clock) fwd+bwd 8.55 ms without it against 9.29 with it in the dQ kernel.
    consumers: consumer warpgroups of the dK/dV kernel (64 keys each; a CTA holds 64 x
    consumers keys), 2 (None) or 3 (at D = 64: 160 registers a thread, dK and dV taking 32
    each). Measured (H200, profiler, s10-3): three are slower, 2.171 -> 2.260 ms at the 1B
    model's attention (B2 T8192 H32/8 causal) and 0.308 -> 0.324 at the 157M's, unlike the
    forward's. The fused dQ pairs two consumers' dS^T every step, so it always runs 2.
    exchange: at D = 256, the dK/dV kernel's consumers exchange P^T and dS^T through shared
    memory (`exchanges`; measured faster); False: each forms the whole S^T and dP^T itself.
    clean: where masks hide keys, the dQ kernel's producer cleans its edge tiles of masked
    keys' garbage in shared memory (`cleans`), instead of an XLA pass over K and V before
    the backward (`_attn.clean_keys`; 0.125 ms of a 4.1 ms B4 H32 T4096 D128 causal fwd+bwd,
    s19-1). Default since s20-1 (H200, fwd+bwd interleaved medians of 5, causal, without ->
    with: D64 B8 H16 T2048 0.902 -> 0.857 ms, its GQA 16/4 0.876 -> 0.835, B4 H32 T4096
    D128 4.546 -> 4.466, GQA 32/8 4.428 -> 4.446, 1B B2 T8192 D64 5.089 -> 5.095, D256 B2
    H16 T4096 2.834 -> 2.728; 19 compiled checks and the garbage cases ok).
    dkv_overlap: the dK/dV kernel's steps with their vector work under their own products
    (`dkv_overlaps`; True, the default: on, with the fused dQ or without; False: off).
    fixed_dq: with deterministic=True, run the fused dQ (where `fused_dq` puts it: D = 64 by
    default) with its partials added as int32 fixed point (`_fixed_sum`: exact integer adds,
    so any order gives the same bits) instead of the kernel pair's 7 products; not with
    segment ids (the pair runs there). Off by default (module docstring: faster only on the
    largest problems, by ~2% of the call at most).
    kv_regs: the dK/dV kernel's consumers hold their K and V tiles in registers (loaded once
    a CTA) as the A operands of S^T = K Q^T and dP^T = V dO^T, so those products read only
    Q and dO from shared memory: half their shared-memory bytes (a wgmma of N = 64 with
    both operands in shared memory reads 128 bytes a cycle, all of shared memory's rate:
    benchmarks/NOTES.md s42 item 2). 16 registers a thread a tile at D = 64. None (default)
    or True: at D = 64 (`kv_in_regs`), except None with segment ids on the kernel pair
    outside GQA's one launch (`regs_fault`: wrong there compiled, where True is refused);
    True at a larger head dim is refused (`check`); False: K and V read from shared memory.
    Measured (H100, s42-1, profiler, one fwd+bwd call): the pair's dK/dV kernel 2.189 ->
    1.953 ms at the 1B model's attention (B2 Hq32 Hkv8 T8192 D64 causal), 0.306 -> 0.282 at
    the 157M's; the float32 fused dQ's kernel
    3.042 -> 2.986 and 0.435 -> 0.434, the fixed point's 3.241 -> 3.263 and 0.470 -> 0.469;
    at D = 128 (B4 H32 T4096 causal) 1.683 -> 2.609 ms (64 more registers a thread spill).
    one_launch: the kernel pair (deterministic, or dQ not fused) in one launch whose first
    CTAs run the dK/dV body and the rest the dQ body, so the dQ CTAs fill the
    multiprocessors that the dK/dV grid's last round leaves idle (True); two launches
    (False); None (default): one launch with GQA/MQA (`launches_once`)."""
    block_q: int | None = None
    block_k_dq: int | None = None
    stages: int | None = None
    fused_dq: bool | None = None
    overlap: bool | None = None
    pingpong: bool | None = None
    consumers: int | None = None
    exchange: bool = True
    clean: bool = True
    dkv_overlap: bool = True
    fixed_dq: bool = False
    kv_regs: bool | None = None
    one_launch: bool | None = None

    def __post_init__(self):
        if self.consumers is not None and self.consumers not in R.REGISTERS:
            raise ValueError(f"HopperBwdTiles.consumers={self.consumers} must be one of "
                             f"{tuple(R.REGISTERS)} (consumer warpgroups of 64 keys a CTA)")
        if self.stages is not None and not (_checks.is_int(self.stages) and self.stages >= 1):
            raise ValueError(f"HopperBwdTiles.stages={self.stages!r} must be a positive int "
                             f"(ring slots), or None for as many as fit")
        # Switches are True or False: None no longer means "the default" for dkv_overlap (on
        # since s41), which would otherwise be taken quietly as off.
        for name in ("exchange", "clean", "dkv_overlap", "fixed_dq"):
            v = getattr(self, name)
            if not isinstance(v, bool):
                raise ValueError(f"HopperBwdTiles.{name}={v!r} must be True or False")
        if self.kv_regs is not None and not isinstance(self.kv_regs, bool):
            raise ValueError(f"HopperBwdTiles.kv_regs={self.kv_regs!r} must be True, False "
                             f"or None (the default: on at head_dim 64)")
        if self.one_launch is not None and not isinstance(self.one_launch, bool):
            raise ValueError(f"HopperBwdTiles.one_launch={self.one_launch!r} must be True, "
                             f"False or None (the default: one launch with GQA/MQA)")
        # A step's float32 statistics and int32 segment ids travel by TMA in whole 128-byte
        # rows (32 entries), and a wgmma's K at head_dim 64 is a multiple of 64 keys.
        for name in ("block_q", "block_k_dq"):
            v = getattr(self, name)
            if v is not None and v not in (32, 64, 128):
                raise ValueError(f"HopperBwdTiles.{name}={v!r} must be 32, 64 or 128, or None "
                                 f"for the default")

    def check(self, spec: AttnSpec) -> None:
        """Raises a ValueError where these tiles cannot run `spec`'s backward (the rings'
        depths, the fused dQ's rows): at plan time, before any kernel is traced."""
        d, fused = spec.head_dim, self.fuse(spec)
        if self.kv_regs and d > 64:
            # s42-1 (H100): 55% slower at D = 128 (spills), and a register Q of [64, 128] in
            # the forward (since withdrawn) gave wrong outputs compiled on some schedules: a
            # [64, D > 64] register operand is not taken until checked on every schedule.
            raise ValueError(f"HopperBwdTiles(kv_regs=True) at head_dim {d}: K and V are held "
                             f"in registers at head_dim 64 only; leave kv_regs=None (the "
                             f"default) or False")
        if self.kv_regs and regs_fault(spec, self):
            raise ValueError(
                f"{H.tiles_repr(self)} with segment ids at head_dim 64 on the kernel pair "
                f"(groups={spec.groups}, deterministic={spec.deterministic}): with K and V in "
                f"registers its dK/dV kernel gave wrong gradients there compiled "
                f"(benchmarks/NOTES.md s56, s58). Leave kv_regs=None (the default: K and V "
                f"from shared memory there) or pass kv_regs=False")
        self.dkv_stages(d, spec.itemsize, fused, spec.segments, self.fixes(spec))
        if not fused:
            self.dq_stages(d, spec.itemsize, self.cleans(spec), spec.segments)

    def launches_once(self, spec: AttnSpec) -> bool:
        """Whether the kernel pair runs as one launch (`one_launch`; both bodies then share
        its warpgroups, so the dK/dV kernel's consumers must be the dQ kernel's two). By
        default with GQA/MQA: there each dK/dV CTA walks every query head of its group, so
        its grid is G times fewer, G times longer CTAs, and the last round leaves
        multiprocessors idle for longer. Measured (H100, s48-2, profiler, the backward
        kernels of one fwd+bwd call, two launches -> one): GQA 32/8 T4096 D128 causal 3.247
        -> 2.943 ms, the 1B model's attention (B2 Hq32 Hkv8 T8192 D64 causal) 3.396 -> 3.332,
        the 157M's (B8 Hq16 Hkv4 T2048 D64 causal) 0.539 -> 0.526; without groups it is
        mixed: B4 H32 T4096 D128 full 5.261 -> 5.206, D256 B2 H16 T4096 causal 2.095 ->
        2.002, but causal D128 2.908 -> 2.933, D64 B8 H16 T2048 causal 0.567 -> 0.585,
        T32768 D128 causal 20.958 -> 21.774 (why the one launch loses there is not known:
        those grids are 2048-4096 short CTAs whose time follows the work, s48-3)."""
        if self.dkv_consumers(spec.head_dim, False) != 2:
            return False
        return spec.groups > 1 if self.one_launch is None else self.one_launch

    def dkv_consumers(self, d: int, fused_dq: bool) -> int:
        if fused_dq or self.split_d(d):
            return 2
        return self.consumers or 2

    @staticmethod
    def split_d(d: int) -> bool:
        """Whether the dK/dV kernel's two consumers share the CTA's 64 keys and each forms
        half of dK's and dV's columns (D = 256: a [64, 256] float32 dK and dV would take 256
        registers a thread, over the 232 a consumer gets; halves take 128). They exchange P^T
        and dS^T (`exchanges`) or each forms the whole S^T and dP^T (module docstring)."""
        return d > 128

    def key_rows(self, d: int, fused_dq: bool) -> int:
        """Keys a dK/dV CTA holds: 64 a consumer, or 64 shared (`split_d`)."""
        return _ROWS if self.split_d(d) else self.dkv_consumers(d, fused_dq) * _ROWS

    def bq(self, d: int) -> int:
        """Query rows a dK/dV step (None: 64, 32 at D = 256, where S^T and dP^T [64, bq]
        float32 sit beside 128 registers of dK and dV halves; 64 with `exchange`, each
        consumer forming 32 rows' S^T and dP^T)."""
        return self.block_q or (32 if self.split_d(d) and not self.exchanges(d) else 64)

    def exchanges(self, d: int) -> bool:
        """Whether the split_d consumers exchange P^T and dS^T (each forms half the step's
        query rows' S^T and dP^T and writes P^T and dS^T into shared memory, where both read
        the whole step's as the A operands of their dV and dK products: 4 products' work a
        tile pair instead of 6). Default; measured (H200, s18-4, B2 H16 T4096 bf16 fwd+bwd,
        interleaved medians of 3): causal 3.229 ms against 3.496 without (cuDNN 2.503), no
        mask 5.387 against 6.408 (4.662)."""
        return self.exchange and self.split_d(d)

    def _fuses(self, d: int) -> bool:
        """Whether the dK/dV kernel may form dQ at head dim d (`fused_dq`; never at D = 256,
        whose consumers split the columns, not the keys)."""
        return not self.split_d(d) and (d <= 64 if self.fused_dq is None else self.fused_dq)

    def fuse(self, spec: AttnSpec) -> bool:
        """Whether dQ comes from the dK/dV kernel by reducing stores: float32 ones with
        deterministic=False, integer ones (`fixes`) with the default, else the dQ kernel."""
        return self.fixes(spec) if spec.deterministic else self._fuses(spec.head_dim)

    def fixes(self, spec: AttnSpec) -> bool:
        """Whether dQ comes from the dK/dV kernel added in fixed point: deterministic, with
        `fixed_dq`, where the kernel may form dQ; not with segment ids, under which a row's
        visible keys are not a range for its bound (`_fixed_sum`)."""
        return (spec.deterministic and self.fixed_dq and not spec.segments
                and self._fuses(spec.head_dim))

    def cleans(self, spec: AttnSpec) -> bool:
        """Whether the dQ kernel cleans masked keys' garbage itself (`clean`, where masks
        hide keys); else an XLA pass does, before the kernels. Only dS K, a
        contraction over keys, multiplies a hidden key's zero by its row; the dK/dV kernel's
        products contract over queries, so a key's garbage reaches only its own dK and dV
        rows (and the masks' selects drop it from the rows that do not see it). The fused
        dQ contracts over keys inside the dK/dV kernel: it keeps the XLA pass."""
        return self.clean and A.hides_keys(spec) and not self.fuse(spec)

    def dq_overlap(self, d: int) -> bool:
        """Whether the dQ kernel runs the overlapped schedule (module docstring, "Overlap")."""
        return d <= 128 if self.overlap is None else self.overlap

    def dkv_overlaps(self, d: int) -> bool:
        """Whether the dK/dV kernel's steps run the overlapped schedule (`dkv_overlap`,
        default True): S^T and dP^T issued together, P formed while dP^T runs, dS while
        dV += P^T dO runs (FlashAttention-3 sec. 3.2's intra-warpgroup overlap within a
        step; nothing carried to the next step, so no registers beyond the plain schedule's,
        and the same products of the same operands: the same bits). Not with the split
        columns of D = 256 or the consumers' ping-pong, whose steps are their own.
        Measured (H200, s29-1, profiler, one fwd+bwd call): the dK/dV kernel 3.318 -> 3.135
        ms at B4 H32 T4096 D128 (701 TFLOP/s on its 4 products), 2.194 -> 2.192 at the 1B
        model's B2 Hq32 Hkv8 T8192 D64 causal; fwd+bwd interleaved (medians of 3) D128 full
        8.069 -> 7.984 ms, causal 4.480 -> 4.360, the 157M model's GQA D64 0.833 -> 0.817.
        With the fused dQ too (dS^T goes to shared memory for dQ's product while dV's runs;
        the default since s41, after the compiled checks at D = 64, H200, s41-1): its kernel
        at the 1B model's shape (H200, s41-2, profiler, one call) float32 3.230 -> 3.026 ms,
        fixed point 3.335 -> 3.236; at the 157M's 0.459 -> 0.432 and 0.487 -> 0.466 (the
        call 2-5% faster); at D = 128 (forced fused, float32, H100, s33-3) fwd+bwd 8.910 ->
        8.400 ms."""
        if self.split_d(d) or self.pingpong is True:
            return False
        return self.dkv_overlap

    def kv_in_regs(self, spec: AttnSpec) -> bool:
        """Whether the dK/dV kernel's S^T and dP^T take K and V from registers on `spec`'s
        problem (`kv_regs`: at D = 64 unless False, and by default not where `regs_fault`)."""
        if self.kv_regs is False or spec.head_dim > 64:
            return False
        return bool(self.kv_regs) or not regs_fault(spec, self)

    def dq_pingpong(self, d: int) -> bool:
        return d <= 64 if self.pingpong is None else self.pingpong

    def k_dq(self, d: int) -> int:
        # D = 256: dQ [64, 256] float32 is 128 registers, so S and dP take 32-key tiles.
        if d > 128 and self.block_k_dq not in (None, 32):
            # Compiled on the H200 (s19-2), 64-key steps at D = 256 gave wrong dq in one of
            # six checks and a gradient that was not bitwise repeatable in another; until that
            # is understood they are refused rather than left to run.
            raise ValueError(f"HopperBwdTiles.block_k_dq={self.block_k_dq} at head_dim={d}: "
                             "the dQ kernel takes 32-key steps at head_dim 256 (leave "
                             "block_k_dq=None or set 32)")
        return self.block_k_dq or (128 if d <= 64 else 64 if d <= 128 else 32)

    @staticmethod
    def dq_split(d: int) -> bool:
        """Whether the fused dQ's product is split by columns (each consumer forms dS K over
        the CTA's keys for its D / 2 columns, every step) rather than taken in turns (one
        consumer forms all D columns, every other step): a column half must be whole
        128-byte swizzle rows of K (64 elements) for wgmma's B operand, so D = 128 splits
        and D = 64 takes turns."""
        return d % 128 == 0

    def dq_cols(self, d: int) -> int:
        """Columns of the float32 dQ tile one consumer stores at a time."""
        return d // 2 if self.dq_split(d) else d

    def dkv_stages(self, d: int, itemsize: int, fused_dq: bool, segments: bool = False,
                   fixed_point: bool = False) -> int:
        bq = self.bq(d)
        if fused_dq and bq % _ROWS:
            # dQ += dS K has the step's query rows as its M, whole wgmma tiles of 64.
            raise ValueError(f"{H.tiles_repr(self)} at head_dim {d}: the fused dQ takes "
                             f"block_q 64 or 128, not {bq}; pass block_q=None or fused_dq=False")
        layout = lambda t: t._dkv_layout(d, itemsize, fused_dq and t.fused_dq is not False,
                                         segments, fixed_point)
        fixes = ([dict(stages=None)] * (self.stages is not None)
                 + [dict(block_q=v) for v in (64, 32) if v < bq and not (fused_dq and v % 64)]
                 + [dict(fused_dq=False)] * fused_dq)
        kernel = "the dK/dV kernel" + (" with the fused dQ" if fused_dq else "")
        fit = H.ring_depth(self, f"in {kernel} at head_dim {d}", layout, AH._SMEM_BYTES, fixes)
        if self.stages is None and (d <= 64 or self.split_d(d)) and not fused_dq:
            # Measured (H200, profiler, benchmarks/attention_d64_tiles.py): 2 stages instead of
            # the 4 that fit take the kernel from 2.385 to 2.262 ms at the 1B model's attention
            # (B2 T8192 H32/8 causal) and 0.342 to 0.331 at the 157M's; the dQ kernel is
            # slower with 2 (1.61 -> 1.90 ms), so only this one drops them. D = 256 (s18-3,
            # fwd+bwd interleaved, B2 H16 T4096): 3.424 ms against 3.662 with 4 causal, 6.428
            # against 6.511 without masks.
            return min(2, fit)
        return fit

    def _dkv_layout(self, d: int, itemsize: int, fused_dq: bool, segments: bool,
                    fixed_point: bool = False):
        """(bytes of the dK/dV kernel's fixed buffers, bytes a ring slot, 1 slot at least)."""
        bq = self.bq(d)
        fixed = 2 * self.key_rows(d, fused_dq) * d * itemsize   # K, V
        if self.exchanges(d):
            fixed += 2 * _ROWS * bq * itemsize         # P^T, dS^T [64 keys, bq]
        if fused_dq:
            fixed += 4 * _ROWS * bq * itemsize         # dS^T [2 steps x 2 consumers]
            # A float32 dQ tile per consumer, [block_q, cols]: 32 KiB at block_q = 64 (at 128
            # with D = 64, 64 KiB: the ring then gets one stage and the ping-pong is off).
            fixed += 2 * bq * self.dq_cols(d) * 4
        stage = 2 * bq * d * itemsize + 2 * bq * 4
        if segments:       # each step's query ids; the consumers' keys' ids once
            stage, fixed = stage + bq * 4, fixed + 1024
        if fused_dq and fixed_point:       # each step's rows' scales (`_fixed_sum`)
            stage += bq * 4
        return fixed, stage, 1

    def dq_stages(self, d: int, itemsize: int, clean: bool = False,
                  segments: bool = False) -> int:
        """The dQ kernel's ring depth: as many K/V slots as fit, at most 4. The overlapped
        schedule holds two K tiles (dQ += dS K of the step before runs behind this step's S
        and dP), so with two slots the next tile's copy waits for the end of a step and its
        landing for the start of the next: where a third slot fits closer to the 227 KiB
        (D = 256 with the overlap forced: Q and dO take 128 KiB, a slot 32 KiB), it gets
        one, and `stages=3` is taken there too. Without the overlap two slots measured faster
        than three at D = 256 (module docstring, "Overlap"). With segment ids the rows' and
        the slots' ids take two more buffers (1 KiB or 2, as Mosaic GPU aligns every buffer):
        at D = 256 the third slot then does not fit."""
        def layout(t):
            # Q, dO, and lse, delta (512 bytes each, 1 KiB as Mosaic GPU aligns them).
            fixed = 2 * 2 * _ROWS * d * itemsize + 2 * 1024 + (2 * 1024 if segments else 0)
            return fixed, 2 * t.k_dq(d) * d * itemsize, 1
        # The cleaning's count is a warpgroup reduction: Mosaic GPU keeps scratch for it.
        tight = _SMEM_TIGHT - (plgpu.CompilerParams().reduction_scratch_bytes if clean else 0)
        fixes = ([dict(stages=None)] * (self.stages is not None)
                 + [dict(block_k_dq=v) for v in (64, 32) if v < self.k_dq(d)])
        where = f"in the dQ kernel at head_dim {d}"
        if self.stages is not None:         # as many as the 227 KiB take (the tight third)
            return H.ring_depth(self, where, layout, tight, fixes)
        fit = H.ring_depth(self, where, layout, AH._SMEM_BYTES, fixes)
        fixed, stage, _ = layout(self)
        if self.dq_overlap(d) and fit == 2 and fixed + 3 * stage <= tight:
            return 3
        return fit


def fits(dtype, spec: AttnSpec, tiles: HopperBwdTiles = HopperBwdTiles()) -> bool:
    """Whether the Hopper backward takes this problem (its forward ran on `attention_hopper`)."""
    return (jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
            and spec.head_dim in (64, 128, 256) and not spec.dropout
            and not spec.folded and spec.n_q > 0 and spec.n_k > 0)


def regs_fault(spec: AttnSpec, tiles: HopperBwdTiles) -> bool:
    """Where the kernel pair's dK/dV kernel gives wrong gradients compiled with K and V held
    in registers (`HopperBwdTiles.kv_in_regs`): segment ids at head_dim 64 without GQA, or
    with GQA in two launches (`launches_once` False). Measured (H100, s56-1/2,
    `benchmarks/seg_probe.py`, bf16 and f16): relative errors dk 0.52-0.83, dv 0.46-0.79
    against the float32 reference at T 1024-4160, causal or not, with three segments or one,
    where o, lse and dq were right and the same problem was right without segment ids, at
    D = 128, with the fused dQ (deterministic=False), with GQA 4/1 in one launch, and in
    Mosaic GPU's interpreter: a compiled-only fault. With K and V from shared memory the same
    kernel is right (H100, s58-1: T1024, and T4160 causal and T1024 not in bf16 and f16 within
    2.5e-3, bitwise repeatable; the plain steps alone stayed wrong, 0.52). ptxas injects a
    warpgroup.arrive into that kernel "to allow use of registers in GMMA" and none into the
    failing one (s58-1's report): a register hazard at the wgmma that ptxas does not see, by
    all signs. So there the default takes K and V from shared memory, at ~1% of the
    fwd+bwd call (s58-2, B8 T2048 H16 causal, three documents a row: 1.448 against 1.436 ms,
    and 1.733 on the portable backward that ran there in s56-s57), and kv_regs=True raises.
    MHA forced into one launch and GQA into two have not run compiled; they follow the same
    rule."""
    return (spec.segments and spec.head_dim == 64 and not tiles.fuse(spec)
            and (spec.groups == 1 or not tiles.launches_once(spec)))


def _kernel(body, out_type, grid, names, name: str, spec: AttnSpec, batchable: bool = True,
            consumers: int = 2):
    """A Mosaic GPU kernel of `consumers` warpgroups and the producer's, compiled or
    interpreted. `batchable`: plgpu.kernel, which batches under vmap; else pl.kernel, which
    takes JAX refs (aliased in and out; see `_hopper.kernel`)."""
    params = H.compiler_params(name, approx_math=True)
    interpret = H._interpret_params() if spec.interpret else None
    mesh = dict(grid=grid, grid_names=names, num_threads=consumers + 1, thread_name="wg",
                kernel_name=name)
    if batchable:
        return plgpu.kernel(body, out_type=out_type, compiler_params=params,
                            **({"interpret": interpret} if interpret else {}), **mesh)
    return pl.kernel(body, out_type=out_type, mesh=plgpu.Mesh(**mesh), compiler_params=params,
                     interpret=interpret or False, name=name)


def _dkv_plan(q, k, spec: AttnSpec, tiles: HopperBwdTiles, fused_dq: bool):
    """(body, CTAs, consumers) of the dK/dV kernel for q's and k's shapes."""
    b, _, _, d = q.shape
    tk, hkv = k.shape[1], k.shape[2]
    fixed = fused_dq and tiles.fixes(spec)
    stages = tiles.dkv_stages(d, q.dtype.itemsize, fused_dq, spec.segments, fixed)
    n_k_tiles = pl.cdiv(tk, tiles.key_rows(d, fused_dq))
    body = functools.partial(DKV.dkv_body, spec=spec, tiles=tiles, stages=stages,
                             fused_dq=fused_dq, fixed=fixed, n_k_tiles=n_k_tiles,
                             heads=_dkv_heads(q, k))
    return body, n_k_tiles * b * hkv, tiles.dkv_consumers(d, fused_dq)


def _dkv_fused(q, k, spec: AttnSpec, tiles: HopperBwdTiles):
    """The dK/dV kernel with the fused dQ (taking the dQ ref last, after the rows' scales
    when it adds in fixed point) for q's and k's shapes; a ref it adds into, so not batched
    (`_fused`). The kernel pair is `_pair`'s."""
    name = ("jaxfuse_flash_bwd_dkv_dq_fixed_hopper" if tiles.fixes(spec) else
            "jaxfuse_flash_bwd_dkv_dq_hopper")
    body, ctas, nc = _dkv_plan(q, k, spec, tiles, True)
    return _kernel(body, (jax.ShapeDtypeStruct(k.shape, k.dtype),) * 2, (ctas,), ("cta",),
                   name, spec, batchable=False, consumers=nc)


def _dq_plan(q, k, spec: AttnSpec, tiles: HopperBwdTiles):
    """(body, CTAs) of the dQ kernel for q's and k's shapes (two consumers)."""
    b, tq, hq, d = q.shape
    clean = tiles.cleans(spec)
    stages = tiles.dq_stages(d, q.dtype.itemsize, clean, spec.segments)
    n_q_tiles = pl.cdiv(tq, 2 * _ROWS)
    # The overlap holds two K tiles at once: with a one-slot ring it would wait forever.
    # Every head's heaviest query tile first (`_hopper.heavy_first`, module docstring).
    body = functools.partial(DQ.dq_body, spec=spec, bk=tiles.k_dq(d), stages=stages,
                             n_q_tiles=n_q_tiles, overlap=tiles.dq_overlap(d) and stages >= 2,
                             pingpong=tiles.dq_pingpong(d), clean=clean,
                             heads=_dq_heads(k, spec))
    return body, n_q_tiles * b * hq


def _pair(args, spec: AttnSpec, tiles: HopperBwdTiles):
    """(dq, dk, dv) by the kernel pair: two launches, or one whose first CTAs run the dK/dV
    body and the rest the dQ body (`HopperBwdTiles.one_launch`)."""
    q, k = args[:2]
    dkv, n_dkv, nc = _dkv_plan(q, k, spec, tiles, False)
    dq, n_dq = _dq_plan(q, k, spec, tiles)
    kv_type = (jax.ShapeDtypeStruct(k.shape, k.dtype),) * 2
    q_type = jax.ShapeDtypeStruct(q.shape, q.dtype)
    if not tiles.launches_once(spec) or (spec.interpret and H.INTERPRETER_010):
        dk, dv = _kernel(dkv, kv_type, (n_dkv,), ("cta",), "jaxfuse_flash_bwd_dkv_hopper",
                         spec, consumers=nc)(*args)
        return _kernel(dq, q_type, (n_dq,), ("cta",), "jaxfuse_flash_bwd_dq_hopper",
                       spec)(*args), dk, dv

    def both(*refs):
        ins, (dk_gmem, dv_gmem, dq_gmem) = refs[:len(args)], refs[len(args):]
        cta = lax.axis_index("cta")
        # Each branch allocates its own shared memory and barriers (`pl.run_scoped`): the
        # launch takes the larger of the two.
        pl.when(cta < n_dkv)(lambda: dkv(*ins, dk_gmem, dv_gmem))
        pl.when(cta >= n_dkv)(lambda: dq(*ins, dq_gmem, first_cta=n_dkv))

    dk, dv, dq = _kernel(both, kv_type + (q_type,), (n_dkv + n_dq,), ("cta",),
                         "jaxfuse_flash_bwd_hopper", spec)(*args)
    return dq, dk, dv


# Bytes of shared operands a head group of the backward's grids holds (`attention_hopper.
# launch_groups`): `_L2_SHARE`, groups that stay in L2 (module docstring, "Launch order").
_BWD_GROUP_BYTES = AH._L2_SHARE


def _dq_heads(k, spec: AttnSpec) -> int:
    """Query heads a group of the dQ grid: they read the same K and V."""
    return AH.launch_groups(k.shape[0] * k.shape[2] * spec.groups,
                            AH.kv_head_bytes(spec), _BWD_GROUP_BYTES)


def _dkv_heads(q, k) -> int:
    """KV heads a group of the dK/dV grid: they read the Q and dO of their query heads."""
    b, tq, hq, d = q.shape
    return AH.launch_groups(b * k.shape[2], 2 * tq * (hq // k.shape[2]) * d * q.dtype.itemsize,
                            _BWD_GROUP_BYTES)


def _fused(*args, spec: AttnSpec, tiles: HopperBwdTiles):
    """(dq, dk, dv) by the dK/dV kernel with the fused dQ of `_grads`' operands (in fixed
    point, `tiles.fixes`: their last two are `_fixed_sum.row_scales`' r and bad)."""
    fixed = tiles.fixes(spec)

    # A ref with a memory space (the interpreter's) only lives inside a jit.
    @jax.jit
    def run(*args):
        q, k = args[:2]
        args, (r, bad) = (args[:-2], args[-2:]) if fixed else (args, (None, None))
        acc = jnp.int32 if fixed else _F32
        if spec.interpret:     # one buffer per consumer (module docstring)
            dq_ref = jax.new_ref(jnp.zeros((2,) + q.shape, acc), memory_space=plgpu.GMEM)
        else:
            dq_ref = jax.new_ref(jnp.zeros(q.shape, acc))
        dk, dv = _dkv_fused(q, k, spec, tiles)(*args, *(r,) * fixed, dq_ref)
        dq = dq_ref[...]
        if spec.interpret:
            dq = dq[0] + dq[1]
        if fixed:
            return FS.to_float(dq, r, bad, q.dtype), dk, dv
        return dq.astype(q.dtype), dk, dv
    return run(*args)


def backward(q, k, v, o, lse_u, do, dlse, spec: AttnSpec,
             tiles: HopperBwdTiles = HopperBwdTiles(), qs=None, ks=None):
    """(dq, dk, dv) of q [B, Tq, Hq, D], k, v [B, Tk, Hkv, D] from the forward's o and lse_u
    [B, Hq, Tq] (its score units, `_attn`) and the cotangents do and dlse (of the natural lse,
    or None), with `spec.segments` the segment ids qs [B, Tq] and ks [B, Tk] (int32); the
    problem must `fit`. `spec.deterministic` and `tiles.fused_dq` pick the dQ
    scheme (module docstring)."""
    n_q, n_k = q.shape[1], k.shape[1]
    # Lengths that are not whole tiles: compiled, TMA's bounds take the partial last tiles,
    # interpreted they run padded with zeros (`_attn.pad_rows`); either way the rows past the
    # end read dO = 0, lse = delta = 0, so they add nothing to dK and dV, and the masks keep
    # the true lengths. The padded rows of dq, dk and dv are sliced off.
    q_tile = math.lcm(_KEYS, tiles.bq(spec.head_dim))
    k_tile = math.lcm(_KEYS, tiles.k_dq(spec.head_dim))
    delta = attention_bwd.delta(o, do, dlse, spec)                     # [B, Hq, Tq] float32
    k_in, v_in, do_in = k, v, do
    q, do = (A.pad_rows(x, q_tile, spec) for x in (q, do))
    # The fused dQ's consumers each read the other's K (`attention_hopper_dkv`): where the last
    # CTA's second consumer would have no key of its own (Tk % 128 in 1..64), that consumer
    # would load nothing and the first wait for it forever, so there k and v stay padded.
    short_tail = 0 < n_k % _KEYS <= _ROWS and tiles.fuse(spec)
    k, v = (A.pad_length(x, k_tile) if short_tail else A.pad_rows(x, k_tile, spec)
            for x in (k, v))
    # The fixed-point dQ's rows' scales, from the unpadded operands (padded rows: r = 0).
    fixed = FS.row_scales(k_in, v_in, do_in, delta, lse_u, spec) if tiles.fixes(spec) else ()
    lse_u, delta = (A.pad_length(x, q_tile, axis=2) for x in (lse_u, delta))
    args = (q, k, v, do, lse_u.astype(_F32), delta)
    if spec.segments:
        args += (A.pad_length(qs, q_tile), A.pad_length(ks, k_tile))
    args += tuple(A.pad_length(x, q_tile, axis=2) for x in fixed)
    dq, dk, dv = _grads(args, spec, tiles)
    return dq[:, :n_q], dk[:, :n_k], dv[:, :n_k]     # no-ops where nothing was padded


def _grads(args, spec: AttnSpec, tiles: HopperBwdTiles):
    """(dq, dk, dv) of `backward`'s operands (q, k, v, do, lse_u, delta, and the
    segment ids qs, ks with spec.segments)."""
    if not tiles.fuse(spec):
        return _pair(args, spec, tiles)
    # The fused dQ is a ref that the kernel adds into, which pallas kernels do not batch:
    # under vmap the mapped axis folds into the batch instead.
    run = jax.custom_batching.custom_vmap(
        H.discharged(functools.partial(_fused, spec=spec, tiles=tiles)))

    @run.def_vmap
    def _folded(axis_size, in_batched, *args):
        # Every operand has the batch first ([B, T, H, D], [B, H, T], segment ids [B, T]):
        # [n, B, ...] -> [n B, ...].
        args = [a if b else jnp.broadcast_to(a, (axis_size,) + a.shape)
                for a, b in zip(args, in_batched)]
        outs = run(*[a.reshape((-1,) + a.shape[2:]) for a in args])
        return tuple(o.reshape((axis_size, -1) + o.shape[1:]) for o in outs), (True,) * 3
    return run(*args)
