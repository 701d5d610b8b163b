"""What the two kernels of the Hopper attention backward (`attention_hopper_dkv`,
`attention_hopper_dq`; design in `attention_hopper_bwd`) share: the forms of their matrix
products (`nt`, `rs`, `ss`, `tn`) and `_Mma`, which issues them as wgmma on the GPU and as
plain dots of the same tiles in Mosaic GPU's interpreter; the tiles' shared-memory layout;
P and dS recomputed from the forward's log-sum-exp.
"""
from __future__ import annotations

import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxfuse.pallas import _attn as A
from jaxfuse.pallas import _hopper as H
from jaxfuse.pallas import _hopper_ring as R
from jaxfuse.pallas._attn import AttnSpec

_ROWS = H.ROWS               # rows of one wgmma M: keys (dK/dV) or queries (dQ) per consumer
# Shared memory for a ring that only fits closer to the hardware's 227 KiB than
# `attention_hopper._SMEM_BYTES` (which leaves 8 KiB): all of `_hopper.SMEM_BYTES`.
_SMEM_TIGHT = H.SMEM_BYTES
_KEYS = 2 * _ROWS            # Tq and Tk run padded to multiples of this (dQ kernel CTA rows)
_F32 = jnp.float32


def nt(a, b):
    """A B^T of shared-memory tiles a [m, d], b [n, d] -> [m, n] (a product for `_Mma.run`)."""
    return ("nt", None, a, b)


def rs(acc, a, b):
    """acc + A B with A [m, k] in registers (the input dtype), B [k, n] in shared memory."""
    return ("rs", acc, a, b)


def ss(acc, a, b):
    """acc + A B of shared-memory tiles a [m, k], b [k, n]."""
    return ("ss", acc, a, b)


def tn(a, b):
    """A^T B of shared-memory tiles a [..., k, m], b [..., k, n] -> [m, n], summed over the
    leading axis if any (one wgmma chain into one accumulator: a contraction over the
    stacked k's without a reshape of the tiles)."""
    return ("tn", None, a, b)


class _Mma:
    """The products of a step: wgmma on the GPU, plain dots of the same tiles in the
    interpreter (which reads no register or transposed wgmma operand)."""

    _CONTRACT = {"nt": "md,nd->mn", "rs": "mk,kn->mn", "ss": "mk,kn->mn", "tn": "km,kn->mn"}

    def __init__(self, interpret: bool):
        self.interpret = interpret

    def run(self, *products):
        """The float32 results of `products` (`nt`, `rs`, `tn`), issued together and waited
        for once: independent products share one wgmma wait (jax's `attention_mgpu`
        backward does the same for dV and dP^T)."""
        if self.interpret:
            outs = []
            for form, acc, a, b in products:
                a, b = (a if form == "rs" else a[...]), b[...]
                r = (sum(A.dot(a[i], b[i], self._CONTRACT[form]) for i in range(a.shape[0]))
                     if form == "tn" and a.ndim == 3 else A.dot(a, b, self._CONTRACT[form]))
                outs.append(r if acc is None else acc + r)
            return tuple(outs)

        def shape(form, a, b):
            return ((a.shape[0], b.shape[0]) if form == "nt" else
                    (a.shape[0], b.shape[1]) if form in ("rs", "ss") else
                    (a.shape[-1], b.shape[-1]))

        def body(refs):
            for ref, (form, _, a, b) in zip(refs, products):
                if form == "nt":
                    plgpu.wgmma(ref, a, b.transpose((1, 0)))
                elif form == "tn" and len(a.shape) == 3:
                    for i in range(a.shape[0]):
                        plgpu.wgmma(ref, a.at[i].transpose((1, 0)), b.at[i])
                elif form == "tn":
                    plgpu.wgmma(ref, a.transpose((1, 0)), b)
                else:
                    plgpu.wgmma(ref, a, b)
        inits = tuple(plgpu.ACC.init(R.zeros(shape(f, a, b), False) if acc is None else acc)
                      for f, acc, a, b in products)
        return pl.run_state(body)(inits)

    def dkv_overlapped(self, dk, dv, k, q, v, do, wait_do, p_of, ds_of):
        """(dk + dS^T Q, dv + P^T dO) of one dK/dV step with its vector work under its own
        products (FlashAttention-3 sec. 3.2's intra-warpgroup overlap, within the step):
        S^T = K Q^T and dP^T = V dO^T issued together (`wait_do()` between them: dO's copy),
        P formed by p_of(S^T) -> (P float32, P^T in the input dtype, aux) while dP^T runs,
        dV's product issued, dS^T = ds_of(P, dP^T, aux) (the input dtype) formed while it
        runs, then dK's. The same products, of the same operands, in the same order as the
        plain schedule's (`run` a product at a time): the same bits. In the interpreter,
        that plain sequence."""
        if self.interpret:
            (st,) = self.run(nt(k, q))
            wait_do()
            (dpt,) = self.run(nt(v, do))
            p, pt, aux = p_of(st)
            (dv,) = self.run(rs(dv, pt, do))
            ds = ds_of(p, dpt, aux)
            (dk,) = self.run(rs(dk, ds, q))
            return dk, dv

        def body(refs):
            dk_ref, dv_ref = refs

            def scoped(st_ref, dpt_ref):
                # Each wgmma is one group, waited for in order: wait_n = 1 leaves the last
                # one issued in flight.
                plgpu.wgmma(st_ref, k, q.transpose((1, 0)))
                wait_do()
                plgpu.wgmma(dpt_ref, v, do.transpose((1, 0)))
                p, pt, aux = p_of(plgpu.wgmma_accumulator_load(st_ref, wait_n=1))
                plgpu.wgmma(dv_ref, pt, do)
                ds = ds_of(p, plgpu.wgmma_accumulator_load(dpt_ref, wait_n=1), aux)
                plgpu.wgmma(dk_ref, ds, q)
                plgpu.wgmma_wait(0)
            shape = (k.shape[0], q.shape[0])
            pl.run_scoped(scoped, plgpu.ACC(shape, _F32), plgpu.ACC(shape, _F32))
        return pl.run_state(body)((plgpu.ACC.init(dk), plgpu.ACC.init(dv)))

    def accumulate(self, body, shape, scratch):
        """body(ref) with a zeroed float32 accumulator of `shape`: a wgmma accumulator on the
        GPU (registers, for the whole of body's loops), the shared-memory ref `scratch` in the
        interpreter. body adds into it with `run_behind` and reads it with [...] at its end."""
        if self.interpret:
            scratch[...] = jnp.zeros(shape, _F32)
            body(scratch)
            return
        pl.run_state(body)(plgpu.ACC.init(R.zeros(shape, False)))

    def run_behind(self, products, behind):
        """The float32 results of `products` (`nt` forms), with the accumulations `behind`
        ((acc ref of `accumulate`, A [m, k] in registers, B [k, n] in shared memory): acc += A
        B) issued after them and left in flight: the caller's work until `drain` runs while
        the tensor cores finish them."""
        if self.interpret:
            for ref, a, b in behind:
                ref[...] += A.dot(a, b[...], self._CONTRACT["rs"])
            return self.run(*products)
        assert all(form == "nt" for form, *_ in products)

        def body(*refs):
            for ref, (_, _, a, b) in zip(refs, products):
                plgpu.wgmma(ref, a, b.transpose((1, 0)))
            for ref, a, b in behind:
                plgpu.wgmma(ref, a, b)
            if not refs:
                return ()
            plgpu.wgmma_wait(len(behind))         # each wgmma is one group, waited in order
            return tuple(plgpu.wgmma_accumulator_load(r, wait_n=None) for r in refs)
        if not products:
            return body()
        return pl.run_scoped(body, *(plgpu.ACC((a.shape[0], b.shape[0]), _F32)
                                     for _, _, a, b in products))

    def drain(self):
        """Waits for the products `run_behind` left in flight."""
        if not self.interpret:
            plgpu.wgmma_wait(0)


def _transforms(dtype, d: int, rows: int) -> tuple:
    """The shared-memory layout of a kernel's [*, d] tiles. The ring's [rows, d] tiles are
    also the B operand [K = rows, N] of a product (dV += P^T dO, dK += dS^T Q; dQ += dS K),
    and wgmma wants K a whole number of swizzle rows, and both operands of a product in one
    swizzle: so with 32-row ring tiles (D = 256; or 32-column halves of P^T and dS^T as A
    operands, `HopperBwdTiles.exchange`) every tile takes 64-byte swizzles (rows of 32
    elements) instead of 128-byte ones (64)."""
    return H._tma_transforms(dtype, min(d, rows))


def _prev_slot(j, stages: int):
    """The ring slot of step j - 1, and of step 0 itself for j = 0 (whose loaded tiles the
    zero product behind step 0 multiplies: a slot not yet loaded may hold NaN bits)."""
    return lax.rem(j + stages - jnp.minimum(j, 1), stages)


def _vec(smem, axis: int, n: int, interpret: bool, f=lambda x: x):
    """f of a float32 [64] vector from shared memory as a [64, n] tile: constant along `axis`
    (1: one value per row, 0: one per column), in the wgmma layout when compiled."""
    x = f(R.load_vec(smem, axis, interpret))
    return lax.broadcast_in_dim(x, (x.shape[0], n) if axis == 1 else (n, x.shape[0]),
                                (0,) if axis == 1 else (1,))


def _ds(spec: AttnSpec, p, dp, delta, t, keep):
    ds = p * (dp - delta)
    if spec.softcap is not None:
        ds = ds * (1.0 - t * t)
    # Garbage in a masked key (dP = NaN there) reaches no gradient.
    return ds if keep is None else jnp.where(keep, ds, 0.0)
