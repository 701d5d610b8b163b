"""The dQ kernel of the Hopper attention backward's deterministic scheme (design and
measurements: `attention_hopper_bwd`'s docstring): laid out as the forward, a CTA of query
tiles walks the K and V tiles they see, recomputing S and dP to form dQ += dS K in registers,
one fixed summation order, bitwise reproducible.
"""
from __future__ import annotations

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxfuse.pallas import _attn as A
from jaxfuse.pallas import _hopper_ring as R
from jaxfuse.pallas import attention_hopper as AH
from jaxfuse.pallas._attn import AttnSpec
from jaxfuse.pallas._hopper_bwd import (_F32, _ROWS, _ds, _Mma, _prev_slot,
                                        _transforms, _vec, nt, rs)


def dq_body(q_gmem, k_gmem, v_gmem, do_gmem, lse_gmem, delta_gmem, *refs,
            spec: AttnSpec, bk: int, stages: int, n_q_tiles: int, overlap: bool,
            pingpong: bool, heads: int, clean: bool = False, first_cta: int = 0):
    # As the forward (`attention_hopper`): a CTA per (batch * query head, 128 query rows),
    # consumer wg on rows wg * 64.., the producer streaming the K and V tiles its rows see;
    # launched in `_hopper.heavy_first` order from CTA `first_cta` (the CTAs before it run the
    # dK/dV kernel's body in a launch of both, `HopperBwdTiles.one_launch`). refs: the segment ids qs [B, Tq] and ks [B, Tk]
    # (int32) if spec.segments, then the output dq. As in the forward, each consumer copies
    # its rows' ids with its Q, the producer each key block's into a ring slot of their own.
    (qs_gmem, ks_gmem), (dq_gmem,) = A.split_refs(refs, spec, 1)
    d, g = spec.head_dim, spec.groups
    dtype = q_gmem.dtype
    mma = _Mma(spec.interpret)
    transforms = _transforms(dtype, d, bk)

    # dQ of the overlapped schedule: in shared memory in the interpreter, in registers on the
    # GPU, where it takes no buffer (buffers are aligned to 1 KiB, and the overlapped D = 256
    # ring of three slots leaves less than that beside the barriers).
    scratch = overlap and spec.interpret

    def scoped(q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, q_full, k_full, v_full,
               k_empty, v_empty, turns, *optional):
        acc_scratch = optional[0] if scratch else None
        landed = optional[scratch:scratch + clean]
        qseg_smem, kseg_smem, seg_full = optional[scratch + clean:] if spec.segments \
            else (None,) * 3
        b, h, row0, (lo, f_lo, f_hi, hi) = AH.query_tile(
            spec, q_gmem.shape[2], n_q_tiles, bk, groups=(q_gmem.shape[0] * q_gmem.shape[2],
                                                          heads), first_cta=first_cta)
        n = hi - lo
        wg = lax.axis_index("wg")

        @pl.when(wg == 2)
        def _producer():
            # clean: edge tiles land on `landed` and are cleaned with K and V swapped
            # (`HopperBwdTiles.cleans`); the overlap holds a K tile one step longer.
            edges = (f_lo - lo, f_hi - lo, landed[0]) if clean else None
            R.produce_kv(k_gmem, v_gmem, b, h // g, lo, n, bk, stages, (k_smem, v_smem),
                          (k_full, v_full), (k_empty, v_empty), edges=edges,
                          interpret=spec.interpret, held=int(overlap), swap=True,
                          minor=min(d, bk), coupled=pingpong and stages >= 2,
                          segments=(ks_gmem, kseg_smem, seg_full) if spec.segments else None)

        @pl.when(wg < 2)
        def _consumer():
            plgpu.set_max_registers(232, action="increase")
            r0 = row0 + wg * _ROWS
            rows = pl.ds(r0, _ROWS)
            plgpu.copy_gmem_to_smem(q_gmem.at[b, rows, h], q_smem.at[wg], q_full.at[wg])
            plgpu.copy_gmem_to_smem(do_gmem.at[b, rows, h], do_smem.at[wg], q_full.at[wg])
            plgpu.copy_gmem_to_smem(lse_gmem.at[b, h, rows], lse_smem.at[wg], q_full.at[wg])
            plgpu.copy_gmem_to_smem(delta_gmem.at[b, h, rows], delta_smem.at[wg],
                                    q_full.at[wg])
            if spec.segments:
                plgpu.copy_gmem_to_smem(qs_gmem.at[b, rows], qseg_smem.at[wg], q_full.at[wg])
            plgpu.barrier_wait(q_full.at[wg])
            q_seg = R.load_vec(qseg_smem.at[wg], 1, spec.interpret) if spec.segments else None
            lse = _vec(lse_smem.at[wg], 1, bk, spec.interpret, A.safe_lse)
            delta = _vec(delta_smem.at[wg], 1, bk, spec.interpret)
            q_pos = r0 + R.iota((_ROWS, bk), 0, spec.interpret)

            def grads(s, dp, j, masked):
                """dS [64, bk] of key step j in the input dtype from its S and dP."""
                keep = None
                if masked:
                    k_pos = (lo + j) * bk + R.iota((_ROWS, bk), 1, spec.interpret)
                    same = None
                    if spec.segments:     # the key block's ids, in the slot of its K and V
                        slot = lax.rem(j, stages)
                        plgpu.barrier_wait(seg_full.at[slot])
                        same = R.outer_equal(q_seg, R.load_vec(kseg_smem.at[slot], 0,
                                                               spec.interpret))
                    keep = A.visible(spec, q_pos, k_pos, same=same)
                u, t = A.transform(spec, s, keep)
                return _ds(spec, A.probs(spec, u, lse), dp, delta, t, keep).astype(dtype)

            def products(slot):
                plgpu.barrier_wait(k_full.at[slot])
                plgpu.barrier_wait(v_full.at[slot])
                return (nt(q_smem.at[wg], k_smem.at[slot]),                     # S [64, bk]
                        nt(do_smem.at[wg], v_smem.at[slot]))                    # dP

            # Products and vector work alternate (S, dP | dS | dQ += dS K and the next S, dP):
            # a switch at each change hands the tensor cores to the other consumer.
            pp = R.PingPong(turns, wg, pingpong, stages)

            def step(j, dq, masked):
                slot = lax.rem(j, stages)
                s, dp = mma.run(*products(slot))
                plgpu.barrier_arrive(v_empty.at[slot])
                pp.switch()
                ds = grads(s, dp, j, masked)
                pp.switch()
                (dq,) = mma.run(rs(dq, ds, k_smem.at[slot]))                   # += dS K
                plgpu.barrier_arrive(k_empty.at[slot])
                return dq

            def loop(step, carry):
                """step(j, carry, masked) over the key steps: masked edge, unmasked, edge."""
                run = lambda a, z, masked, c: lax.fori_loop(
                    a, z, lambda j, c: step(j, c, masked), c)
                carry = run(0, f_lo - lo, True, carry)
                carry = run(f_lo - lo, f_hi - lo, False, carry)
                return run(f_hi - lo, n, True, carry)

            def finish(dq):
                q_smem[wg] = (dq * spec.scale).astype(dtype)      # Q is done with: dQ goes here
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(q_smem.at[wg], dq_gmem.at[b, rows, h])
                plgpu.wait_smem_to_gmem(0)

            zero = R.zeros((_ROWS, d), spec.interpret)
            pp.start()
            if not overlap:
                finish(loop(step, zero))
                pp.end()
                return

            # Overlapped: step j issues S_j and dP_j, then dQ += dS_{j-1} K_{j-1}, and computes
            # dS_j while the tensor cores finish that product. K_{j-1}'s slot is released only
            # then, so two slots are held at once (the caller asks for stages >= 2).
            def overlapped(dq_ref):
                def ostep(j, ds, masked):
                    slot, prev = lax.rem(j, stages), _prev_slot(j, stages)
                    with jax.named_scope("wait_kv"):
                        prods = products(slot)
                    with jax.named_scope("s_dp"):
                        s, dp = mma.run_behind(prods, ((dq_ref, ds, k_smem.at[prev]),))
                    plgpu.barrier_arrive(v_empty.at[slot])
                    pp.switch()
                    with jax.named_scope("ds"):
                        ds = grads(s, dp, j, masked)
                    with jax.named_scope("drain"):
                        mma.drain()
                    pl.when(j > 0)(lambda: plgpu.barrier_arrive(k_empty.at[prev]))
                    pp.switch()
                    return ds

                ds = loop(ostep, R.zeros((_ROWS, bk), spec.interpret).astype(dtype))
                last = lax.rem(n - 1, stages)
                mma.run_behind((), ((dq_ref, ds, k_smem.at[last]),))
                mma.drain()
                plgpu.barrier_arrive(k_empty.at[last])
                finish(dq_ref[...])

            # Rows that see no key (causal with Tq > Tk) have no last step.
            pl.when(n > 0)(lambda: mma.accumulate(
                overlapped, (_ROWS, d), None if acc_scratch is None else acc_scratch.at[wg]))
            pl.when(n == 0)(lambda: finish(zero))
            pp.end()

    pl.run_scoped(
        scoped,
        plgpu.SMEM((2, _ROWS, d), dtype, transforms=transforms),
        plgpu.SMEM((2, _ROWS, d), dtype, transforms=transforms),
        plgpu.SMEM((2, _ROWS), _F32),
        plgpu.SMEM((2, _ROWS), _F32),
        plgpu.SMEM((stages, bk, d), dtype, transforms=transforms),
        plgpu.SMEM((stages, bk, d), dtype, transforms=transforms),
        plgpu.Barrier(num_arrivals=4 + spec.segments, num_barriers=2),   # Q, dO, lse, delta (ids)
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        plgpu.Barrier(num_arrivals=2),                         # the consumers' turns
        *([plgpu.SMEM((2, _ROWS, d), _F32)] if scratch else []),
        *([plgpu.Barrier(num_arrivals=2, num_barriers=stages)] if clean else []),   # landed
        # Segment ids: the consumers' rows', a key block's a ring slot, the slots' barriers.
        *([plgpu.SMEM((2, _ROWS), jnp.int32), plgpu.SMEM((stages, bk), jnp.int32),
           plgpu.Barrier(num_barriers=stages)] if spec.segments else []),
        collective_axes="wg")
