"""Beam-search cache reorder in place (LightSeq's cache refresh, lecture 10 sec. 6): every beam
takes its parent beam's keys and values at the positions decoded so far, and nothing else moves.

XLA's version is a gather of the whole cache into a new buffer (every position, every beam,
the prompt included), and inside a decoding loop a copy of that buffer back into the loop's
own: measured on an H200 (157M model, beam search B=8 K=4, 8 layers), 141 us of a 620 us step.
Two facts make most of that work unnecessary: beams grown from one prompt hold the same keys
and values at the prompt's positions, and positions not yet decoded are never read. So the
kernel visits only positions [start, stop) and writes only beams whose parent is another beam,
in place (the caches are aliased to the outputs), all caches of the model in one launch.

A program owns one batch row's K beams at a feature tile of one cache and walks the positions
[start, stop) in tiles: at each it loads the K tiles, then stores tile parent[j] into beam j.
Reads and writes of one element happen in the same thread and in that order, and no other
program touches the tile, so the permutation is safe in place (a barrier between the loads and
the stores makes it explicit on the GPU). The walk is a loop rather than a grid axis over the
cache's positions, most of whose programs would find nothing to do: measured on an H100 (s44,
157M model, beam search B=8 K=4, 32-token profile), 19.7 -> 7.9 us a step; the 256-token call's
step 0.432 -> 0.391 ms (two leases of the card, between which greedy's moved 0.363 -> 0.351).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jaxfuse.pallas import _common as C
from jaxfuse.pallas._rows import RowBlocks
from jaxfuse.reference import reorder_beams as ref

_GPU_TILE_ELEMS = 4096     # elements per beam tile: K of them live in registers at once


def _tiles(s: int, f: int, interpret: bool, blocks: RowBlocks | None) -> tuple[int, int, int]:
    """(positions a loop step, features per program, warps). Interpreted: one program per
    batch row and cache, whole rows a step."""
    if blocks is not None:
        return blocks.block_rows, blocks.block_cols, blocks.num_warps
    if interpret:
        return C.next_pow2(s), C.next_pow2(f), 1
    bf = min(128, C.next_pow2(f))
    return min(C.next_pow2(s), max(1, _GPU_TILE_ELEMS // bf)), bf, 4


def _kernel(par_ref, start_ref, stop_ref, *refs, k: int, n: int, widths: tuple, bs: int,
            bf: int, n_f: int, interpret: bool):
    srcs, dsts = refs[:n], refs[n:]
    b = pl.program_id(0)
    # Grid axis 1 is (cache, feature tile): one cache per program, so that the caches of a
    # model (16 for 8 layers) are reordered side by side rather than one after the other in
    # each program (measured on an H200: 75 us a call that way, latency-bound).
    cache, f0 = pl.program_id(1) // n_f, (pl.program_id(1) % n_f) * bf
    start, stop = start_ref[b], stop_ref[b]
    cols = f0 + jax.lax.broadcasted_iota(jnp.int32, (bs, bf), 1)
    parent = [par_ref[b, j] for j in range(k)]
    for i, (src, dst, f) in enumerate(zip(srcs, dsts, widths)):
        @pl.when((cache == i) & (f0 < f))
        def _(src=src, dst=dst, f=f):
            # The positions [start, stop) in tiles of bs, walked by the program: a grid axis
            # over all S positions launched a program for each tile of the cache, nearly all
            # of them outside the range, and those empty programs were most of the launch.
            def tile(t, carry):
                s0 = t * bs
                rows = s0 + jax.lax.broadcasted_iota(jnp.int32, (bs, bf), 0)
                valid = (rows >= start) & (rows < stop) & (cols < f)
                at = lambda ref, j: ref.at[b, jnp.int32(j), pl.ds(s0, bs), pl.ds(f0, bf)]
                tiles = [pltriton.load(at(src, j), mask=valid, other=0) for j in range(k)]
                if not interpret:
                    pltriton.debug_barrier()       # every load of the tile before any store
                for j in range(k):
                    new = tiles[k - 1]
                    for m in range(k - 2, -1, -1):
                        new = jnp.where(parent[j] == m, tiles[m], new)
                    pltriton.store(at(dst, j), new, mask=valid & (parent[j] != j))
                return carry
            jax.lax.fori_loop(start // bs, (stop + bs - 1) // bs, tile, 0)


def reorder_beams(caches, parent: jax.Array, start: jax.Array, stop: jax.Array, *,
                  interpret: bool | None = None, block_sizes: RowBlocks | None = None) -> tuple:
    """Pallas in-place beam reorder; same semantics as `jaxfuse.reference.reorder_beams`.
    `block_sizes=RowBlocks(block_rows=positions, block_cols=features per program, num_warps)`."""
    ref.validate(caches, parent, start, stop)
    interpret = C.resolve_interpret(interpret)
    if block_sizes is not None:
        block_sizes.validate(interpret)
    b, k = parent.shape
    s = caches[0].shape[2]
    parent, start, stop = ref.clip(parent, start, stop, k, s)
    flat = [c.reshape(b, k, s, math.prod(c.shape[3:])) for c in caches]
    widths = tuple(c.shape[3] for c in flat)
    bs, bf, warps = _tiles(s, max(widths), interpret, block_sizes)
    n = len(flat)
    n_f = C.cdiv(max(widths), bf)
    kernel = functools.partial(_kernel, k=k, n=n, widths=widths, bs=bs, bf=bf, n_f=n_f,
                               interpret=interpret)
    out = C.pallas_call(
        kernel, out_shape=[jax.ShapeDtypeStruct(c.shape, c.dtype) for c in flat],
        grid=(b, n * n_f), name="jaxfuse_reorder_beams",
        interpret=interpret, num_warps=warps,
        input_output_aliases={3 + i: i for i in range(n)})(parent, start, stop, *flat)
    return tuple(o.reshape(c.shape) for o, c in zip(out, caches))
