"""The pieces of a warp-specialized Hopper (sm90) attention kernel in Pallas Mosaic GPU that
the forward (`attention_hopper`) and the backward (`attention_hopper_bwd`) share, written once:

* `produce_kv` / `drain_ring`: the producer warpgroup's TMA ring of K and V tiles (full and
  empty barriers, slots and phases that run on across a persistent CTA's work tiles), which
  cleans masked keys' garbage out of a CTA's edge tiles in shared memory on the way
  (`hide_masked_garbage`);
* `PingPong` / `Turns`: two consumer warpgroups taking turns on the tensor cores (a rendezvous,
  or a token passed), on hardware named barriers (`named_barrier`) or mbarriers;
* `REGISTERS`: how the producer gives its registers to the consumers;
* `fold_columns`, `row_vec`, `iota`, `zeros`: row reductions and per-row vectors in the wgmma
  register layout (plain arrays in the interpreter).

The GEMM (tiles, rings of A/B tiles, epilogues) is `_hopper_gemm`'s; Mosaic GPU helpers and
launch orders are `_hopper`'s.
"""
from __future__ import annotations

import functools

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxfuse.pallas import _hopper as H


# Row reductions: Mosaic GPU reduces a row of a thread's registers as one chain of dependent
# operations (32 of them for a [64, 128] tile), so a row max or sum costs the chain's latency,
# not its instructions. `fold_columns` halves the columns elementwise instead (a tree: 4
# dependent steps from 128 columns to 8, 2 of a thread's columns per 8), and the row sum l
# stays a [64, 8] tile of per-thread partial sums until the end (FlashAttention-3 reduces it
# across threads once, after the loop); the max needs the whole row every step.
LANES = 8


def fold_columns(x, op):
    """x [64, n] -> [64, 8]: column halves combined by `op` until 8 columns are left."""
    while x.shape[1] > LANES:
        h = x.shape[1] // 2
        x = op(x[:, :h], x[:, h:])
    return x


class PingPong:
    """Two consumer warpgroups taking turns on the tensor cores (FlashAttention-3 sec. 3.1).

    Each consumer calls `switch` wherever it passes from issuing products to vector work
    (exponentials, masks) or back; the second starts one switch behind (`start`) and the first
    ends with one more (`end`), so while one runs vector work the other's products run, and
    their exponentials never queue on the same units. The switch is a rendezvous on a barrier
    of two arrivals; `arrive` and `wait` split it (work that needs neither side goes between).
    Off (`on=False`), every call is a no-op and the consumers run free. It stays off with a
    ring of fewer than 2 slots (`stages`): with one, the consumer ahead would wait for the slot
    that the one behind releases only after their next switch."""

    def __init__(self, barrier, wg, on: bool, stages: int, named: bool = False):
        self.barrier, self.wg, self.on = barrier, wg, on and stages >= 2
        # named: the rendezvous is a hardware named barrier of both warpgroups (`bar.sync`,
        # one instruction that parks the warps) instead of an mbarrier's arrive and polling
        # wait; an arrival then cannot be split from its wait, so `arrive` does nothing and
        # `wait` is the whole rendezvous. GPU only (the interpreter has no named barriers).
        self.named = named

    def arrive(self):
        if self.on and not self.named:
            plgpu.barrier_arrive(self.barrier)

    def wait(self):
        if self.on:
            if self.named:
                named_barrier(_PINGPONG_BARRIER_ID, 2 * 128)
            else:
                plgpu.barrier_wait(self.barrier)

    def switch(self):
        if self.on:
            with jax.named_scope("turn"):
                self.arrive()
                self.wait()

    def start(self):
        pl.when(self.wg == 1)(self.switch)

    def end(self):
        pl.when(self.wg == 0)(self.switch)


# Hardware named barriers for the ping-pong (`PingPong(named=True)`: this one; `Turns`: this
# one and the next): Mosaic GPU uses 0 (the CTA) and 1 + warpgroup (its warpgroup barriers);
# 16 exist.
_PINGPONG_BARRIER_ID = 8


def named_barrier(barrier_id: int, threads: int, op: str = "sync"):
    """PTX `bar.sync barrier_id, threads` (waits until `threads` threads have reached the
    barrier, its own warps included) or `bar.arrive` (counts its warps without waiting)."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import llvm

    @plgpu.inline_mgpu()
    def bar(_):
        llvm.inline_asm(ir.Type.parse("!llvm.void"), [], f"bar.{op} {barrier_id}, {threads};",
                        "", has_side_effects=True)
    bar()


class Turns:
    """Two consumer warpgroups passing a turn to issue their products (FlashAttention-3's
    scheduler barrier), for the overlapped step: each waits for its turn on its own barrier
    (`take`), issues S and P V, and passes the turn on the other's (`give`); the softmaxes are
    not inside the turn, so one consumer's softmax runs under the other's products without the
    two waiting for each other's whole step (the rendezvous of `PingPong` made them
    alternate: s15-4). The first consumer starts with the turn; the last pass comes back to
    it and is taken at the end, so every barrier completion is waited for."""

    def __init__(self, barriers, wg, on: bool, named: bool = False):
        self.barriers, self.wg, self.on = barriers, wg, on
        # named: each consumer's barrier is a hardware named one (`bar.sync` to take, the
        # other's `bar.arrive` to give: 128 + 128 threads), as FlashAttention-3 passes turns.
        self.named = named

    def _named(self, i, op):
        # A named barrier's id is an immediate here: one branch a consumer (i may be traced).
        for c in (0, 1):
            pl.when(i == c)(functools.partial(named_barrier, _PINGPONG_BARRIER_ID + c,
                                              2 * 128, op))

    def _wait(self, i):
        if self.named:
            self._named(i, "sync")
        else:
            plgpu.barrier_wait(self.barriers.at[i])

    def _arrive(self, i):
        if self.named:
            self._named(i, "arrive")
        else:
            plgpu.barrier_arrive(self.barriers.at[i])

    def take(self):
        if self.on:
            with jax.named_scope("turn"):
                self._wait(self.wg)

    def give(self):
        if self.on:
            self._arrive(1 - self.wg)

    def start(self):
        if self.on:
            pl.when(self.wg == 1)(lambda: self._arrive(0))

    def end(self):
        if self.on:
            pl.when(self.wg == 0)(lambda: self._wait(0))


def row_vec(x, n: int):
    """A per-row vector [64] broadcast to a [64, n] tile (Mosaic GPU has no [64, 1] layout)."""
    return lax.broadcast_in_dim(x, (x.shape[0], n), (0,))


# Registers a thread (of 65536 a multiprocessor, 128 threads a warpgroup): the producer gives
# back what the consumers take. Two consumers: 232 each (the most a thread can have), three:
# 160 and the producer 32 (FlashAttention-3's split for its three consumer warpgroups:
# 32 x 128 + 160 x 384 = 65536). The producer cleans edge tiles (`hide_masked_garbage`):
# with 24 registers the D = 64 causal forward (B8 H16 T2048) took 0.239 ms, with 32 0.232
# (H200, s14-1, same run; 0.216 with no cleaning).
REGISTERS = {2: (40, 232), 3: (32, 160)}


def produce_kv(k_gmem, v_gmem, b, h_kv, lo, n, bk: int, stages: int, smem, full, empty,
               registers: int | None = 40, edges=None, interpret: bool = False, held: int = 0,
               base=0, drain: bool = True, swap: bool = False, minor: int | None = None,
               coupled: bool = True, segments=None):
    """The producer warpgroup of a kernel that walks n key blocks from block lo: K and V of
    (b, h_kv) through a ring of `stages` shared-memory slots, (k, v) pairs of smem refs,
    'full' barriers it arrives on and 'empty' barriers the consumers release.

    edges=(e_lo, e_hi, landed): blocks j < e_lo or j >= e_hi (relative to lo: the CTA's edge
    tiles, where masks hide some keys from some rows) land on the `landed` barrier instead;
    the producer cleans them in shared memory (`hide_masked_garbage`) and then completes
    their 'full' barriers itself, so the consumers wait as for any tile. With two slots or
    more it cleans block j - 1 after issuing block j's copy, so that a second edge tile's
    copy is in flight while the first is cleaned (causal CTAs end on two or three edge tiles),
    where that copy cannot wait on the cleaning itself (`deferrable`); with one slot block j
    reuses block j - 1's slot, so each is cleaned as soon as it lands.
    H200, B4 H32 T4096 D128 causal: the guard cost 4% cleaning each tile as it landed (s12-5),
    nothing this way (s13-6: 1.014 ms, 1.027 without the guard, same run).

    held: steps for which a consumer keeps a V tile after the next tile's K (the overlapped
    forward holds 1). Deferring the cleaning then needs stages >= 2 + held: with 2 slots and a
    held V, tile j's copy waits for tile j - 2's V, which the consumers release only after
    tile j - 1, which would wait for the cleaning that comes after tile j's copy.

    base: ring steps taken before these (a persistent CTA's earlier work tiles: slots and
    barrier phases run on across them); drain: observe the ring's last releases at the end
    (`drain_ring`; a persistent CTA drains once, after its last tile). registers: None
    leaves the count as it is (the forward sets it once, before its walk of work tiles).
    swap: clean edge tiles with K and V in each other's roles (`hide_masked_garbage(v, k)`:
    K's non-finite entries 0, V NaN wherever K or V is not), for the backward's dQ kernel,
    whose dQ += dS K multiplies a hidden key's zero dS by its K row. minor: the row width
    the tiles' swizzle was chosen for (`_hopper._tma_transforms`; None: D). coupled: the
    consumers take turns (`PingPong`, `Turns`), so that one's release of a slot can wait for
    the other's start on a later block (`deferrable`). segments=(ks_gmem, smem, full): the key
    segment ids [B, Tk] (int32), each block's copied into its slot of smem [stages, bk] with
    its own 'full' barrier, issued after V's copy: a slot's ids are overwritten only once both
    its K and V are released, and each kernel's consumers release one of them only after
    their masks are formed (the forward V, the dQ kernel K)."""
    if registers is not None:
        plgpu.set_max_registers(registers, action="decrease")
    kv = lambda ref, j: ref.at[b, pl.ds((lo + j) * bk, bk), h_kv]

    def load(j, slot, barriers):
        for src, dst, f, e in zip((k_gmem, v_gmem), smem, barriers, empty):
            @pl.when(base + j >= stages)
            def _():
                plgpu.barrier_wait(e.at[slot])
            plgpu.copy_gmem_to_smem(kv(src, j), dst.at[slot], f.at[slot])
        if segments is not None:     # never garbage: not cleaned, so straight to its barrier
            ks_gmem, seg_smem, seg_full = segments
            plgpu.copy_gmem_to_smem(ks_gmem.at[b, pl.ds((lo + j) * bk, bk)], seg_smem.at[slot],
                                    seg_full.at[slot])

    if edges is not None:
        e_lo, e_hi, landed = edges
        is_edge = lambda j: (j < e_lo) | (j >= e_hi)
    defer = stages >= 2 + held

    def deferrable(j):
        """Whether edge block j may be cleaned after block j + 1's copy is issued. That copy
        waits for block j + 1 - stages's slot, which a consumer releases `held` steps after
        its own step on it and, when the consumers take turns (`coupled`), only once the
        other consumer has started on its next block: with fewer than 2 + held + coupled
        slots, a block that may itself wait for the cleaning of block j, a cycle. Then block
        j is cleaned first unless it is the last (nothing is copied after it) or block j + 1
        takes a slot never used (no wait). Without this (s28), on 2 slots with turns, a
        sliding window whose first edge blocks were followed by more blocks hung the
        D = 128 forward (B1 T384 window 200 in Mosaic GPU's interpreter)."""
        if stages >= 2 + held + int(coupled):
            return True             # static (Mosaic GPU lowers no boolean constants)
        return (j == n - 1) | (base + j + 1 < stages)

    def clean(j):
        slot = lax.rem(base + j, stages)
        with jax.named_scope("land"):            # scopes for benchmarks/attention_trace.py
            plgpu.barrier_wait(landed.at[slot])
        with jax.named_scope("clean"):
            tiles = (smem[0].at[slot], smem[1].at[slot])
            hide_masked_garbage(*(tiles[::-1] if swap else tiles), interpret, minor)
        for f in full:
            plgpu.barrier_arrive(f.at[slot])

    @pl.loop(0, n)
    def _step(j):
        slot = lax.rem(base + j, stages)
        if edges is None:
            load(j, slot, full)
            return
        edge = is_edge(j)

        @pl.when(jnp.logical_not(edge))
        def _():
            load(j, slot, full)

        @pl.when(edge)
        def _():
            load(j, slot, (landed, landed))
            if not defer:
                clean(j)
            elif (now := deferrable(j)) is not True:
                pl.when(jnp.logical_not(now))(lambda: clean(j))

        if defer:
            later = (j >= 1) & is_edge(j - 1)
            if (prev := deferrable(j - 1)) is not True:
                later = later & prev
            pl.when(later)(lambda: clean(j - 1))

    if edges is not None and defer:
        pl.when((n >= 1) & is_edge(n - 1))(lambda: clean(n - 1))
    if drain:
        drain_ring(empty, stages, base + n)


def drain_ring(empty, stages: int, steps):
    """Observes the releases ('empty' barriers) of a ring's last `stages` steps of `steps`, so
    every barrier completion is waited for before the kernel ends (the interpreter checks it;
    on the GPU it costs nothing)."""
    @pl.loop(jnp.maximum(steps, stages), steps + stages)
    def _drain(j):
        slot = lax.rem(j, stages)
        for e in empty:
            plgpu.barrier_wait(e.at[slot])


# Elements of a K/V tile the producer cleans at a time: four of the TMA layout's [8, 64] tiles
# (one a warp, the copy layout's unit), 16 a thread of K and of V, within its 32-40 registers.
_CLEAN_ELEMS = 4 * 8 * 64
# Count before writing (below); False rewrites every edge tile (the code before s15, kept as a
# diagnostic for benchmarks/attention.py guard).
_COUNT_FIRST = True


def hide_masked_garbage(k_tile, v_tile, interpret: bool, minor: int | None = None):
    """Masked keys' garbage out of one [bk, D] K/V tile in shared memory: V's non-finite
    entries 0 (P V then adds 0 * 0 for a key the masks hide), K NaN wherever K or V is not
    finite (a row that sees such a key gets a NaN score; the mask's select drops it for a row
    that does not). Only edge tiles need it: on a tile every row sees, a non-finite value
    reaches exactly the rows that see it, as it should.

    Garbage is rare, so a first pass only reads: (k - k) + (v - v) is 0 for finite entries
    and NaN otherwise, summed over the tile's chunks per thread and then across the
    warpgroup; the tile is rewritten (a second read, the writes and the proxy fence before the
    consumers' wgmma) only when that sum is not 0. minor: the row width the tiles' swizzle
    was chosen for (None: D; the backward's D = 256 dQ tiles swizzle 32-element rows)."""
    bk, d = v_tile.shape
    dt = v_tile.dtype
    chunk = _CLEAN_ELEMS // d                   # rows: 32 at D = 64, 16 at 128, 8 at 256
    layout = plgpu.Layout.SMEM_GMEM_COPY(
        (chunk, d), dt, H._swizzle_elems(dt, minor or d) * jnp.dtype(dt).itemsize)

    def load(ref):
        if interpret:
            return ref[...]
        # The layout TMA's swizzled tiles are copied with (vectorized, one tile a warp).
        return H.load(ref, layout)

    def rows(c):
        return pl.ds(pl.multiple_of(c * chunk, chunk), chunk)

    def count(c, junk):
        r = rows(c)
        v, k = load(v_tile.at[r]), load(k_tile.at[r])
        return junk + (k - k) + (v - v)         # NaN stays NaN: one NaN marks the tile

    junk = jnp.zeros((chunk, d), dt)
    if not interpret:
        junk = plgpu.layout_cast(junk, layout)
    junk = lax.fori_loop(0, bk // chunk, count, junk)
    total = jnp.sum(jnp.sum(junk.astype(jnp.float32), axis=1), axis=0)
    dirty = (total != 0) | (not _COUNT_FIRST)   # NaN != 0

    @pl.when(dirty)
    def _():
        @pl.loop(0, bk // chunk)
        def _chunk(c):
            r = rows(c)
            v, k = load(v_tile.at[r]), load(k_tile.at[r])
            v_ok = (v - v) == 0                 # False for NaN and +-inf
            ok = jnp.logical_and(v_ok, (k - k) == 0)
            v_tile[r, :] = jnp.where(v_ok, v, jnp.zeros_like(v))
            k_tile[r, :] = jnp.where(ok, k, jnp.full_like(k, jnp.nan))
        plgpu.commit_smem()                 # the consumers' wgmma reads through the async proxy


def load_vec(smem, axis: int, interpret: bool):
    """A [n] vector from shared memory, laid out for a wgmma tile it is broadcast along
    `axis` of (1: one value a row of S, 0: one a column) when compiled."""
    if interpret:
        return smem[...]
    return H.load(smem, plgpu.Layout.WGMMA.reduce(axis))


def outer_equal(rows, cols):
    """[n, m] bool: rows[i] == cols[j], of a per-row vector [n] and a per-column one [m]
    (`load_vec` with axis 1 and 0): which pairs of a tile share a segment id."""
    return row_vec(rows, cols.shape[0]) == lax.broadcast_in_dim(
        cols, (rows.shape[0], cols.shape[0]), (1,))


def iota(shape, dim, interpret):
    if interpret:
        return jax.lax.broadcasted_iota(jnp.int32, shape, dim)
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)


def zeros(shape, interpret):
    z = jnp.zeros(shape, jnp.float32)
    return z if interpret else plgpu.layout_cast(z, plgpu.Layout.WGMMA)
