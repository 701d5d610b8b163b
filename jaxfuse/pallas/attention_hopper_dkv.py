"""The dK/dV kernel of the Hopper attention backward (the design, its measurements and the
dQ schemes: `attention_hopper_bwd`'s docstring): a CTA holds a tile of keys of one KV head and
walks the query tiles that see them, recomputing S^T and dP^T to form dV += P^T dO and
dK += dS^T Q; with the fused dQ it also adds dQ += dS K into a buffer by reducing TMA stores
(`add_dq`): float32 (`deterministic=False`) or int32 fixed point (`fixed`, deterministic:
`_fixed_sum`).
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxfuse.pallas import _attn as A
from jaxfuse.pallas import _fixed_sum as FS
from jaxfuse.pallas import _hopper as H
from jaxfuse.pallas import _hopper_ring as R
from jaxfuse.pallas._attn import AttnSpec
from jaxfuse.pallas._hopper_bwd import (_F32, _ROWS, _ds, _Mma, _transforms,
                                        _vec, nt, rs, ss, tn)

if TYPE_CHECKING:
    from jaxfuse.pallas.attention_hopper_bwd import HopperBwdTiles


def dkv_body(q_gmem, k_gmem, v_gmem, do_gmem, lse_gmem, delta_gmem, *refs, spec: AttnSpec,
             tiles: HopperBwdTiles, stages: int, fused_dq: bool, n_k_tiles: int, heads: int,
             fixed: bool = False):
    # q/do [B, Tq, Hq, D], k/v [B, Tk, Hkv, D], lse/delta [B, Hq, Tq]; refs: the segment ids
    # qs [B, Tq] and ks [B, Tk] (int32) if spec.segments, the rows' fixed-point scales r
    # [B, Hq, Tq] (float32) if fixed, (dq [B, Tq, Hq, D] added into, float32 or int32 if
    # fixed; [2, ...] one per consumer in the interpreter) if fused_dq, then the outputs dk,
    # dv [B, Tk, Hkv, D].
    (qs_gmem, ks_gmem), refs = A.split_refs(refs, spec, 2 + fused_dq + fixed)
    r_gmem, refs = (refs[0], refs[1:]) if fixed else (None, refs)
    dq_gmem, (dk_gmem, dv_gmem) = (refs[0], refs[1:]) if fused_dq else (None, refs)
    d, g = spec.head_dim, spec.groups
    bq, nc, key_rows = tiles.bq(d), tiles.dkv_consumers(d, fused_dq), tiles.key_rows(d, fused_dq)
    # split_d (D = 256): both consumers on the CTA's 64 keys, consumer wg forming dK's and dV's
    # columns [wg * half, (wg + 1) * half); else consumer wg on keys wg * 64.. , all columns.
    split_d = tiles.split_d(d)
    half = d // 2 if split_d else d
    producer_regs, consumer_regs = R.REGISTERS[nc]
    hkv = k_gmem.shape[2]
    dtype = q_gmem.dtype
    mma = _Mma(spec.interpret)
    exchange = tiles.exchanges(d)
    overlap = tiles.dkv_overlaps(d)
    xq = bq // 2                  # exchange: query rows of a step whose S^T a consumer forms
    # Exchange: P^T and dS^T [64, bq] are A operands from shared memory, written in xq-column
    # halves, so every tile takes xq-element swizzle rows (wgmma: both operands one swizzle).
    transforms = _transforms(dtype, d, xq if exchange else bq)
    split, cols = tiles.dq_split(d), tiles.dq_cols(d)

    def scoped(k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, r_smem, ds_smem,
               dq_smem, pt_x, ds_x, kv_full, q_full, do_full, empty, ds_full, ds_free, turns,
               kv_read, halves_in, x_full, x_free, *segs):
        # Segment ids: each step's queries' beside its Q and lse, each consumer's keys' once.
        qseg_smem, kseg_smem, kseg_full = segs if spec.segments else (None,) * 3
        k_tile, bh = H.heavy_first(lax.axis_index("cta"), n_k_tiles, k_gmem.shape[0] * hkv,
                                   heads)
        b, hk = bh // hkv, bh % hkv
        k0 = k_tile * key_rows
        lo, f_lo, f_hi, hi = A.query_blocks(spec, k0, key_rows, bq)
        n = hi - lo
        total = g * n                          # steps: (query head of the group, query tile)
        wg = lax.axis_index("wg")

        @pl.when(wg == nc)
        def _producer():
            plgpu.set_max_registers(producer_regs, action="decrease")

            @pl.loop(0, total)
            def _step(j):
                slot = lax.rem(j, stages)
                h = hk * g + j // n
                rows = pl.ds((lo + lax.rem(j, n)) * bq, bq)

                @pl.when(j >= stages)
                def _():
                    plgpu.barrier_wait(empty.at[slot])
                plgpu.copy_gmem_to_smem(q_gmem.at[b, rows, h], q_smem.at[slot], q_full.at[slot])
                plgpu.copy_gmem_to_smem(lse_gmem.at[b, h, rows], lse_smem.at[slot],
                                        q_full.at[slot])
                if spec.segments:
                    plgpu.copy_gmem_to_smem(qs_gmem.at[b, rows], qseg_smem.at[slot],
                                            q_full.at[slot])
                plgpu.copy_gmem_to_smem(do_gmem.at[b, rows, h], do_smem.at[slot],
                                        do_full.at[slot])
                plgpu.copy_gmem_to_smem(delta_gmem.at[b, h, rows], delta_smem.at[slot],
                                        do_full.at[slot])
                if fixed:
                    plgpu.copy_gmem_to_smem(r_gmem.at[b, h, rows], r_smem.at[slot],
                                            do_full.at[slot])

            # Observe the last releases (every barrier completion is waited for, see the
            # forward).
            @pl.loop(jnp.maximum(total, stages), total + stages)
            def _drain(j):
                plgpu.barrier_wait(empty.at[lax.rem(j, stages)])

        def consumer(c0):
            """Consumer wg's work; c0: the first of its dK/dV columns (static: a column
            offset into a swizzled tile must be), 0 unless `split_d`."""
            plgpu.set_max_registers(consumer_regs, action="increase")
            # This consumer's K and V tiles and their barrier (split_d: the CTA's one each;
            # refs without an index: a constant index into a ref failed to lower in jax 0.11).
            k_tile, v_tile, kv_bar = ((k_smem, v_smem, kv_full) if split_d else
                                      (k_smem.at[wg], v_smem.at[wg], kv_full.at[wg]))
            kr = k0 if split_d else k0 + wg * _ROWS
            # A consumer past the last key row of k (the last CTA of three 64-key consumers,
            # or of two when Tk % 128 is 1..64 and k came unpadded: `_attn.pad_rows`) only
            # releases the ring's slots. Keys past n_k in a consumer's rows (read as zeros past
            # the end, or padding) are worked like any other, all masked. The fused dQ reads
            # both consumers' K, so there `attention_hopper_bwd.backward` keeps k padded
            # wherever its last CTA's second consumer would have no key; the exchange's
            # consumers (D = 256) share their keys, so both are active or neither.
            active = kr < k_gmem.shape[1]
            own = pl.ds(c0, half)         # this consumer's columns of dK and dV
            do_cols = lambda slot: do_smem.at[slot, :, own] if split_d else do_smem.at[slot]
            q_cols = lambda slot: q_smem.at[slot, :, own] if split_d else q_smem.at[slot]

            @pl.when(active)
            def _():
                keys = pl.ds(kr, _ROWS)
                if split_d:       # the shared tiles: K by the first consumer, V by the second
                    src, dst = (k_gmem, k_tile) if c0 == 0 else (v_gmem, v_tile)
                    plgpu.copy_gmem_to_smem(src.at[b, keys, hk], dst, kv_bar)
                else:
                    plgpu.copy_gmem_to_smem(k_gmem.at[b, keys, hk], k_tile, kv_bar)
                    plgpu.copy_gmem_to_smem(v_gmem.at[b, keys, hk], v_tile, kv_bar)
                plgpu.barrier_wait(kv_bar)
                if spec.segments:
                    plgpu.copy_gmem_to_smem(ks_gmem.at[b, keys], kseg_smem.at[wg],
                                            kseg_full.at[wg])
                    plgpu.barrier_wait(kseg_full.at[wg])
            # K and V as register A operands of S^T and dP^T (`HopperBwdTiles.kv_in_regs`):
            # loaded once, in the wgmma layout, after their copy landed.
            if tiles.kv_in_regs(spec):
                k_a, v_a = (t[...] if spec.interpret else
                            H.load(t, plgpu.Layout.WGMMA) for t in (k_tile, v_tile))
            else:
                k_a, v_a = k_tile, v_tile
            # The keys' segment ids, held in registers (one a row of S^T).
            k_seg = R.load_vec(kseg_smem.at[wg], 1, spec.interpret) if spec.segments else None
            if fused_dq:       # dQ = dS K reads the other consumer's K rows too
                plgpu.barrier_wait(kv_full.at[1 - wg])
                bounds = (lo, f_lo, f_hi, hi)   # both consumers form their dS^T every step
            else:
                # This consumer's own query tiles within the CTA's [lo, hi): tiles wholly
                # masked for its 64 keys (causal, window) are passed over, only its own
                # edges masked (the clip only guards the loops' order).
                bounds = tuple(jnp.clip(jnp.where(active, x, lo), lo, hi)
                               for x in A.query_blocks(spec, kr, _ROWS, bq))
            c_lo, c_flo, c_fhi, c_hi = bounds
            # A step's products and vector work alternate (S^T | P | dV, dP^T | dS | dK and
            # the next S^T): a switch at each change hands the tensor cores to the other.
            pp = R.PingPong(turns, wg, tiles.pingpong is True and nc == 2, stages)

            def probs(st, q0, lse, masked, q_seg=None):
                """(P^T, t, keep) of S^T [64 keys, n queries from q0]; lse: the queries' [n]
                lse_u in shared memory, q_seg their segment ids there (with spec.segments).
                A NaN row (it saw garbage) leaks nothing into hidden keys."""
                n, keep = st.shape[1], None
                if masked:   # positions made here, not held across the loop (registers)
                    q_pos = q0 + R.iota((_ROWS, n), 1, spec.interpret)
                    k_pos = kr + R.iota((_ROWS, n), 0, spec.interpret)
                    same = (R.outer_equal(k_seg, R.load_vec(q_seg, 0, spec.interpret))
                            if spec.segments else None)          # S^T: keys x queries
                    keep = A.visible(spec, q_pos, k_pos, same=same)
                u, t = A.transform(spec, st, keep)
                p = A.probs(spec, u, _vec(lse, 0, _ROWS, spec.interpret, A.safe_lse))
                return (p if keep is None else jnp.where(keep, p, 0.0)), t, keep

            def qseg(slot, cols=None):
                """The step's queries' segment ids in shared memory (None without them)."""
                if not spec.segments:
                    return None
                return qseg_smem.at[slot] if cols is None else qseg_smem.at[slot, cols]

            def share_ds(ds, j):
                """The fused dQ: this consumer's dS^T [64 keys, bq] into step j's slot. Both
                consumers' dS^T go to the step's two slots (steps alternate between two
                pairs), and dQ = dS K is formed over the CTA's 128 keys (`add_dq_of_step`)."""
                turn = lax.rem(j, 2)

                @pl.when(j >= 2)
                def _():             # the dQ of step j - 2 has read this slot
                    plgpu.barrier_wait(ds_free.at[turn])
                ds_smem[2 * turn + wg] = ds
                plgpu.commit_smem()
                plgpu.barrier_arrive(ds_full.at[turn])

            def rows_scale(slot):
                """The fixed-point dQ's scales of step `slot`'s query rows (None in float32),
                read before the slot is released."""
                return R.load_vec(r_smem.at[slot], 1, spec.interpret) if fixed else None

            def add_dq_of_step(gi, j, q0, r):
                """The fused dQ of step j: [bq, D] float32 (or int32 fixed point, its rows
                scaled by r) of reducing stores (two column halves at D = 128, one tile by the
                consumer whose turn it is at 64), half the bytes of a partial per consumer
                (FlashAttention-3 sec. 3.3's dQ)."""
                turn = lax.rem(j, 2)

                def dq_product(c0):
                    """dQ[:, c0:c0 + cols] = dS K over both consumers' keys, added into
                    dq_gmem from this consumer's shared-memory tile."""
                    with jax.named_scope("wait_ds"):
                        plgpu.barrier_wait(ds_full.at[turn])
                    with jax.named_scope("dq"):
                        (dq,) = mma.run(tn(ds_smem.at[pl.ds(2 * turn, 2)],
                                           k_smem.at[:, :, pl.ds(c0, cols)]))
                    plgpu.barrier_arrive(ds_free.at[turn])
                    with jax.named_scope("dq_store"):
                        dq = dq * spec.scale
                        if fixed:
                            dq = FS.quantize(dq * R.row_vec(r, dq.shape[1]))
                        add_dq(dq, dq_smem.at[wg], dq_gmem, wg, b, q0, hk * g + gi, c0,
                               spec.interpret)
                if split:
                    # Both consumers every step, each its half of the columns: the same work
                    # for both, so neither waits on the other's turn. (Two static branches:
                    # the column offset of a swizzled tile must be static.)
                    for w in range(2):
                        pl.when(wg == w)(functools.partial(dq_product, w * cols))
                else:
                    # The consumer whose turn it is (steps alternate), all D columns.
                    pl.when(turn == wg)(functools.partial(dq_product, 0))

            def end_step(gi, j, q0, slot):
                """A step's close: its slot released (the rows' scales read before), then
                with the fused dQ the step's dQ formed (`add_dq_of_step`)."""
                r = rows_scale(slot)
                plgpu.barrier_arrive(empty.at[slot])
                if fused_dq:
                    add_dq_of_step(gi, j, q0, r)

            def step(gi, i, j, carry, masked):
                dk, dv = carry
                slot = lax.rem(j, stages)
                q0 = i * bq
                # The named scopes are what `_hopper.traced` stamps (attention_trace.py).
                with jax.named_scope("wait_q"):
                    plgpu.barrier_wait(q_full.at[slot])
                with jax.named_scope("st"):
                    (st,) = mma.run(nt(k_a, q_smem.at[slot]))                  # S^T [64, bq]
                pp.switch()
                with jax.named_scope("p"):
                    p, t, keep = probs(st, q0, lse_smem.at[slot], masked, qseg(slot))
                    pt = p.astype(dtype)
                pp.switch()
                with jax.named_scope("wait_do"):
                    plgpu.barrier_wait(do_full.at[slot])
                with jax.named_scope("dv_dpt"):
                    dv, dpt = mma.run(rs(dv, pt, do_cols(slot)),                   # += P^T dO
                                      nt(v_a, do_smem.at[slot]))                 # dP^T [64, bq]
                pp.switch()
                with jax.named_scope("ds"):
                    ds = _ds(spec, p, dpt, _vec(delta_smem.at[slot], 0, _ROWS, spec.interpret),
                             t, keep)
                    ds = ds.astype(dtype)
                if fused_dq:
                    share_ds(ds, j)
                pp.switch()
                with jax.named_scope("dk"):
                    (dk,) = mma.run(rs(dk, ds, q_cols(slot)))                  # += dS^T Q
                end_step(gi, j, q0, slot)
                return dk, dv

            def ostep(gi, i, j, carry, masked):
                """`step`'s products and vector work, the vector work under the products
                (`HopperBwdTiles.dkv_overlaps`)."""
                dk, dv = carry
                slot = lax.rem(j, stages)
                q0 = i * bq
                delta = delta_smem.at[slot]
                with jax.named_scope("wait_q"):
                    plgpu.barrier_wait(q_full.at[slot])

                def p_of(st):
                    p, t, keep = probs(st, q0, lse_smem.at[slot], masked, qseg(slot))
                    return p, p.astype(dtype), (t, keep)

                def ds_of(p, dpt, aux):
                    ds = _ds(spec, p, dpt, _vec(delta, 0, _ROWS, spec.interpret), *aux)
                    ds = ds.astype(dtype)
                    if fused_dq:      # written while dV's product runs, as dS is formed
                        share_ds(ds, j)
                    return ds
                with jax.named_scope("products"):
                    dk, dv = mma.dkv_overlapped(
                        dk, dv, k_a, q_smem.at[slot], v_a, do_smem.at[slot],
                        lambda: plgpu.barrier_wait(do_full.at[slot]), p_of, ds_of)
                end_step(gi, j, q0, slot)
                return dk, dv

            def xstep(gi, i, j, carry, masked):
                """A step with the exchange: this consumer forms S^T and dP^T of the step's
                query rows [c * xq, (c + 1) * xq) (c = its half), writes its P^T and dS^T
                columns into the shared [64, bq] tiles, and once both halves are in, adds
                P^T dO and dS^T Q over all bq rows into its columns of dV and dK."""
                dk, dv = carry
                slot = lax.rem(j, stages)
                c = c0 // half
                mine = pl.ds(c * xq, xq)
                q0 = i * bq + c * xq
                plgpu.barrier_wait(q_full.at[slot])
                plgpu.barrier_wait(do_full.at[slot])
                st, dpt = mma.run(nt(k_tile, q_smem.at[slot, mine]),          # S^T [64, xq]
                                  nt(v_tile, do_smem.at[slot, mine]))         # dP^T [64, xq]
                p, t, keep = probs(st, q0, lse_smem.at[slot, mine], masked, qseg(slot, mine))
                ds = _ds(spec, p, dpt, _vec(delta_smem.at[slot, mine], 0, _ROWS,
                                            spec.interpret), t, keep)
                # The other consumer's products of the last step have read the tiles.
                pl.when(j > 0)(lambda: plgpu.barrier_wait(x_free))
                pt_x.at[:, mine][...] = p.astype(dtype)
                ds_x.at[:, mine][...] = ds.astype(dtype)
                plgpu.commit_smem()
                plgpu.barrier_arrive(x_full)
                plgpu.barrier_wait(x_full)
                dv, dk = mma.run(ss(dv, pt_x, do_cols(slot)),                   # += P^T dO
                                 ss(dk, ds_x, q_cols(slot)))                    # += dS^T Q
                plgpu.barrier_arrive(x_free)
                plgpu.barrier_arrive(empty.at[slot])
                return dk, dv

            def pass_over(j, carry):
                """A query tile wholly masked for this consumer's keys: release its slot,
                after its loads landed (so this consumer never runs a lap ahead on the ring),
                keeping the ping-pong's count of switches."""
                slot = lax.rem(j, stages)
                plgpu.barrier_wait(q_full.at[slot])
                pp.switch()
                pp.switch()
                plgpu.barrier_wait(do_full.at[slot])
                pp.switch()
                pp.switch()
                plgpu.barrier_arrive(empty.at[slot])
                return carry

            def head(gi, carry):
                j0 = gi * n - lo             # the running step of query tile i is j0 + i
                body = xstep if exchange else ostep if overlap else step
                run = lambda a, z, masked, c: lax.fori_loop(
                    a, z, lambda i, c: body(gi, i, j0 + i, c, masked), c)
                skip = lambda a, z, c: lax.fori_loop(a, z, lambda i, c: pass_over(j0 + i, c), c)
                carry = skip(lo, c_lo, carry)
                carry = run(c_lo, c_flo, True, carry)
                carry = run(c_flo, c_fhi, False, carry)
                carry = run(c_fhi, c_hi, True, carry)
                return skip(c_hi, hi, carry)

            zero = R.zeros((_ROWS, half), spec.interpret)
            pp.start()
            dk, dv = lax.fori_loop(0, g, head, (zero, zero))
            pp.end()
            if exchange:    # observe the last step's release of the exchange tiles
                pl.when(total > 0)(lambda: plgpu.barrier_wait(x_free))
            if split_d:     # both consumers are done reading K and V before they are written
                plgpu.barrier_arrive(kv_read)
                plgpu.barrier_wait(kv_read)
            if fused_dq:
                # Observe the last two steps' releases of the dS^T slots (see the producer).
                @pl.loop(jnp.maximum(total, 2) - 2, total)
                def _drain(j):
                    plgpu.barrier_wait(ds_free.at[lax.rem(j, 2)])
                if not spec.interpret:
                    plgpu.wait_smem_to_gmem(0)

            @pl.when(active)
            def _():
                # K and V are done with: dK and dV leave through their tiles (the other
                # consumer may still read this K for its last dQ: that waited for ds_free).
                keys = pl.ds(kr, _ROWS)
                if not split_d:
                    k_tile[...] = (dk * spec.scale).astype(dtype)
                    v_tile[...] = dv.astype(dtype)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(k_tile, dk_gmem.at[b, keys, hk])
                    plgpu.copy_smem_to_gmem(v_tile, dv_gmem.at[b, keys, hk])
                    plgpu.wait_smem_to_gmem(0)
                    return
                # Each consumer writes its columns of both tiles; once both halves are in,
                # the first stores dK, the second dV.
                k_tile.at[:, own][...] = (dk * spec.scale).astype(dtype)
                v_tile.at[:, own][...] = dv.astype(dtype)
                plgpu.commit_smem()
                plgpu.barrier_arrive(halves_in)
                plgpu.barrier_wait(halves_in)
                src, dst = (k_tile, dk_gmem) if c0 == 0 else (v_tile, dv_gmem)
                plgpu.copy_smem_to_gmem(src, dst.at[b, keys, hk])
                plgpu.wait_smem_to_gmem(0)

        if split_d:         # static column offsets: one branch a consumer
            for w in range(2):
                pl.when(wg == w)(functools.partial(consumer, w * half))
        else:
            pl.when(wg < nc)(functools.partial(consumer, 0))

    # [2 steps x 2 consumers, 64 keys, bq] (flat: Mosaic GPU's interpreter in jax 0.10.2 stalled
    # on a [2, 2, 64, bq] buffer here).
    ds_type = (plgpu.SMEM((4, _ROWS, bq), dtype, transforms=H._tma_transforms(dtype, bq))
               if fused_dq else plgpu.SMEM((1, 8), _F32))
    acc = jnp.int32 if fixed else _F32
    dq_type = (plgpu.SMEM((2, bq, cols), acc, transforms=H._tma_transforms(acc, cols))
               if fused_dq and not spec.interpret else plgpu.SMEM((1, 8), _F32))
    pl.run_scoped(
        scoped,
        *[plgpu.SMEM(((nc,) if not split_d else ()) + (_ROWS, d), dtype, transforms=transforms)
          for _ in "kv"],
        plgpu.SMEM((stages, bq, d), dtype, transforms=transforms),
        plgpu.SMEM((stages, bq, d), dtype, transforms=transforms),
        plgpu.SMEM((stages, bq), _F32),
        plgpu.SMEM((stages, bq), _F32),
        plgpu.SMEM((stages, bq) if fixed else (1, 8), _F32),        # the rows' scales r
        ds_type,
        dq_type,
        *[plgpu.SMEM((_ROWS, bq) if exchange else (1, 8), dtype if exchange else _F32,
                     transforms=transforms if exchange else ()) for _ in "pd"],  # P^T, dS^T
        plgpu.Barrier(num_arrivals=2, **({} if split_d else dict(num_barriers=nc))),  # K, V
        plgpu.Barrier(num_arrivals=2 + spec.segments, num_barriers=stages),  # Q, lse (ids)
        plgpu.Barrier(num_arrivals=2 + fixed, num_barriers=stages),  # dO, delta (and r)
        plgpu.Barrier(num_arrivals=nc, num_barriers=stages),        # every consumer done
        plgpu.Barrier(num_arrivals=2, num_barriers=2),              # both dS^T halves written
        plgpu.Barrier(num_arrivals=2 if split else 1, num_barriers=2),  # dQ read the dS^T
        plgpu.Barrier(num_arrivals=2),                              # the consumers' turns
        plgpu.Barrier(num_arrivals=2),             # split_d: both consumers done with K, V
        plgpu.Barrier(num_arrivals=2),             # split_d: both halves of dK and dV in
        plgpu.Barrier(num_arrivals=2),             # exchange: both halves of P^T, dS^T in
        plgpu.Barrier(num_arrivals=2),             # exchange: both consumers' products read them
        # Segment ids: the steps' queries', each consumer's keys' and their barrier.
        *([plgpu.SMEM((stages, bq), jnp.int32), plgpu.SMEM((nc, _ROWS), jnp.int32),
           plgpu.Barrier(num_barriers=nc)] if spec.segments else []),
        collective_axes="wg")


def add_dq(dq, smem, dq_gmem, wg, b, q0, h, c0, interpret: bool):
    """dq_gmem[b, q0:q0 + bq, h, c0:c0 + n] += dq ([bq, n] float32 or int32): one reducing
    TMA store from this consumer's shared-memory tile, not waited for: the next call waits
    only until that store has read the tile, a step or two later (long done), so the consumer
    never waits on global memory. In the interpreter (no reducing store) a read-add-write of
    this consumer's own buffer."""
    rows, cols = pl.ds(q0, dq.shape[0]), pl.ds(c0, dq.shape[1])
    # (A head-major float32 buffer, [B, Hq, Tq, D], whose [64, D] tiles are contiguous, was
    # no faster: B4 H32 T4096 D128 fwd+bwd 10.22 against 9.86 ms, H200, s14-3.)
    at = (b, rows, h, cols)
    if interpret:
        dst = dq_gmem.at[(wg,) + at]
        dst[...] = dst[...] + dq
        return
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    smem[...] = dq
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(smem, dq_gmem.at[at], reduction_op="add")
