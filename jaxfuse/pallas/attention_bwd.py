"""FlashAttention-2 backward: recompute P from q, k and the saved lse; never store it.

With P = exp(s - lse), delta = rowsum(dO * O) - dlse (lecture 5, sec. 7.3; the dlse term lets
gradients flow through a returned lse; P is recomputed from the forward's lse_u in the kernels'
score units, `_attn`, so that it is exact for a single visible key at any logit size):

    dV = P^T dO,   dP = dO V^T,   dS = P * (dP - delta)   (times 1 - tanh^2 under a soft cap),
    dQ = scale * dS K,   dK = scale * dS^T Q.

Two kernels, no atomics, so gradients are deterministic (bitwise equal across runs):
* dK/dV: one program per key block (and batch, KV head) walks the query blocks that see it,
  for every query head of its group, and writes dK and dV once.
* dQ: one program per query block walks its key blocks (as the forward does) and writes dQ once.
Both skip wholly masked blocks with the same bounds as the forward (`_attn`).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxfuse import _philox
from jaxfuse.pallas import _attn as A
from jaxfuse.pallas import _common as C
from jaxfuse.pallas._attn import AttnBlocks, AttnSpec


def _ds(spec: AttnSpec, p, dp, delta, t):
    ds = p * (dp - delta[..., None])
    if spec.softcap is not None:
        ds = ds * (1.0 - t * t)
    return ds


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, spec: AttnSpec, bq: int,
               bk: int):
    key, refs = A.take_key(refs, spec)
    (qs_ref, ks_ref), (dq_ref,) = A.split_refs(refs, spec, 1)
    r0 = pl.program_id(0) * bq
    q = A.load_rows(q_ref, 0, bq, spec.rows, spec, global_r0=r0)             # [..., bq, Dp]
    do = A.load_rows(do_ref, 0, bq, spec.rows, spec, global_r0=r0)
    lse_u = A.safe_lse(C.load_vec(lse_ref, 0, bq, spec.rows, global_row0=r0))   # [..., bq]
    delta = C.load_vec(delta_ref, 0, bq, spec.rows, global_row0=r0)
    q_pos, _ = A.row_positions(spec, r0, bq)
    q_seg = C.load_vec(qs_ref, 0, bq, spec.rows, global_row0=r0) if spec.segments else None
    if spec.dropout:
        base = A.prob_rows(spec, q.shape[:-2])
        r = r0 + jax.lax.broadcasted_iota(jnp.int32, (bq, 1), 0)

    def step(j, dq, masked):
        k0 = j * bk
        k = A.load_rows(k_ref, k0, bk, spec.n_k, spec)
        v = A.load_rows(v_ref, k0, bk, spec.n_k, spec)
        k_pos = k0 + jax.lax.broadcasted_iota(jnp.int32, (1, bk), 1)
        k_seg = C.load_vec(ks_ref, k0, bk, spec.n_k, other=-1) if spec.segments else None
        keep = A.visible(spec, q_pos, k_pos, q_seg, k_seg) if masked else None
        u, t = A.transform(spec, A.dot(q, k, "...qd,...kd->...qk"), keep)
        p = A.probs(spec, u, lse_u[..., None])                               # [..., bq, bk]
        dp = A.dot(do, v, "...qd,...kd->...qk")
        if spec.dropout:   # dO V^T is the gradient of the dropped P: dP = that * Z
            dp = A.dropout(spec, key, base, r, k0, dp)
        ds = _ds(spec, p, dp, delta, t)
        if masked:     # garbage in masked keys reaches no gradient (`_attn.finite_rows`)
            ds = jnp.where(keep, ds, 0.0)
            k = A.finite_rows(k)[0]
        return dq + A.dot(ds.astype(k.dtype), k, "...qk,...kd->...qd")

    dq = jnp.zeros(q.shape, jnp.float32)
    dq = A.split_loop(A.key_blocks(spec, r0, bq, bk), step, dq)
    A.store_rows(dq_ref, dq * spec.scale, 0, spec.rows, spec, global_r0=r0)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, spec: AttnSpec, bq: int,
                bk: int):
    # GPU: q_ref/do_ref [Tq, G, Dp] (the group's query heads), lse_ref/delta_ref [G, Tq].
    # Interpret: q_ref [BH, G*Tq, Dp] (heads already stacked in rows), lse_ref [BH, G*Tq].
    key, refs = A.take_key(refs, spec)
    (qs_ref, ks_ref), (dk_ref, dv_ref) = A.split_refs(refs, spec, 2)
    k0 = pl.program_id(0) * bk
    k = A.load_rows(k_ref, 0, bk, spec.n_k, spec, global_r0=k0)              # [..., bk, Dp]
    v = A.load_rows(v_ref, 0, bk, spec.n_k, spec, global_r0=k0)
    k_pos = k0 + jax.lax.broadcasted_iota(jnp.int32, (1, bk), 1)
    k_seg = C.load_vec(ks_ref, 0, bk, spec.n_k, global_row0=k0, other=-1) if spec.segments \
        else None
    bounds = A.query_blocks(spec, k0, bk, bq)
    # The slab of head 0 of the group (program ids are read outside the loops).
    base0 = A.prob_rows(spec, k.shape[:-2], head=0) if spec.dropout else None

    def rows_of_head(ref, g, q0):
        return A.load_rows(ref, q0, bq, spec.rows, spec, head=None if spec.folded else g)

    def vec_of_head(ref, g, q0, other=0.0):
        return C.load_vec(ref, q0, bq, spec.rows, other=other, head=None if spec.folded else g)

    def head(g, carry):
        def step(i, carry, masked):
            dk, dv = carry
            q0 = i * bq
            q = rows_of_head(q_ref, g, q0)                                     # [..., bq, Dp]
            do = rows_of_head(do_ref, g, q0)
            lse_u = A.safe_lse(vec_of_head(lse_ref, g, q0))
            delta = vec_of_head(delta_ref, g, q0)
            q_pos, _ = A.row_positions(spec, q0, bq)
            q_seg = C.load_vec(qs_ref, q0, bq, spec.rows) if spec.segments else None
            keep = A.visible(spec, q_pos, k_pos, q_seg, k_seg) if masked else None
            u, t = A.transform(spec, A.dot(q, k, "...qd,...kd->...qk"), keep)
            p = A.probs(spec, u, lse_u[..., None])                           # [..., bq, bk]
            if masked:     # a NaN row (it saw garbage) leaks nothing into keys it does not see
                p = jnp.where(keep, p, 0.0)
            dp = A.dot(do, v, "...qd,...kd->...qk")
            if spec.dropout:   # dV = (P * Z)^T dO and dP = (dO V^T) * Z, Z = keep / P(keep)
                z = A.dropout_keep(spec, key, base0 + g * spec.rows,
                                   q0 + jax.lax.broadcasted_iota(jnp.int32, (bq, 1), 0), k0, bk)
                # dV's 1 / keep probability is applied once, to the sum (below the loop).
                dv = dv + A.dot(jnp.where(z, p, 0.0).astype(do.dtype), do, "...qk,...qd->...kd")
                dp = A.drop(spec, z, dp)
            else:
                dv = dv + A.dot(p.astype(do.dtype), do, "...qk,...qd->...kd")
            ds = _ds(spec, p, dp, delta, t)
            if masked:     # garbage in masked keys reaches no gradient (`_attn.finite_rows`)
                ds = jnp.where(keep, ds, 0.0)
            dk = dk + A.dot(ds.astype(q.dtype), q, "...qk,...qd->...kd")
            return dk, dv
        return A.split_loop(bounds, step, carry)

    carry = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    n_heads = 1 if spec.folded else spec.groups
    dk, dv = C.reduce_tiles(n_heads, head, carry)
    A.store_rows(dk_ref, dk * spec.scale, 0, spec.n_k, spec, global_r0=k0)
    if spec.dropout:
        dv = dv * _philox.scale(spec.dropout)
    A.store_rows(dv_ref, dv, 0, spec.n_k, spec, global_r0=k0)


def delta(o, do, dlse, spec: AttnSpec):
    """delta = rowsum(dO * O) - dlse in float32, in lse's layout (see `backward`): a cheap XLA
    reduction before the kernels, which read it once per tile (shared with the Hopper
    backward)."""
    d = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)
    if not spec.folded:
        d = jnp.swapaxes(d, 1, 2)                            # [B, Tq, Hq] -> [B, Hq, Tq]
    return d if dlse is None else d - dlse


def backward(q, k, v, qs, ks, o, lse_u, do, dlse, spec: AttnSpec, blocks: AttnBlocks,
             key=None):
    """dq, dk, dv in the kernels' layout (see `_attn`).

    `lse_u`: the forward's log-sum-exp in the kernels' score units (`_attn` docstring), float32
    in lse's layout ([B*Hkv, G*Tq] folded, [B, Hq, Tq] otherwise), -inf where a row saw no key.
    A forward that has only the natural lse passes `_attn.residual_from_lse(lse, spec)`.
    `dlse`: the cotangent of the natural-log lse (or None). `key`: the dropout key words (with
    `spec.dropout`), from which both kernels regenerate the forward's mask."""
    dp, g = spec.head_dim_pad, spec.groups
    delta_rows = delta(o, do, dlse, spec)
    segs = [qs, ks] if spec.segments else []
    bq, bk = blocks.block_q_dq, blocks.block_k_dq
    bq2, bk2 = blocks.block_q_dkv, blocks.block_k_dkv
    if spec.folded:
        bh = q.shape[0]
        full = lambda *shape: pl.BlockSpec((bh,) + shape, lambda i: (0,) * (len(shape) + 1))
        q_blk = pl.BlockSpec((bh, bq, dp), lambda i: (0, i, 0))
        vec_blk = pl.BlockSpec((bh, bq), lambda i: (0, i))
        dq_specs = [q_blk, full(spec.n_k, dp), full(spec.n_k, dp), q_blk, vec_blk, vec_blk]
        dq_seg = [vec_blk, full(spec.n_k)]
        k_blk = pl.BlockSpec((bh, bk2, dp), lambda j: (0, j, 0))
        dkv_specs = [full(spec.rows, dp), k_blk, k_blk, full(spec.rows, dp), full(spec.rows),
                     full(spec.rows)]
        dkv_seg = [full(spec.rows), pl.BlockSpec((bh, bk2), lambda j: (0, j))]
        dq_grid, dkv_grid = (C.cdiv(spec.rows, bq),), (C.cdiv(spec.n_k, bk2),)
    else:
        b, _, hq, _ = q.shape
        hkv = hq // g
        q_blk = pl.BlockSpec((None, bq, None, dp), lambda i, b_, h: (b_, i, h, 0))
        kv_all = pl.BlockSpec((None, spec.n_k, None, dp), lambda i, b_, h: (b_, 0, h // g, 0))
        vec_blk = pl.BlockSpec((None, None, bq), lambda i, b_, h: (b_, h, i))
        dq_specs = [q_blk, kv_all, kv_all, q_blk, vec_blk, vec_blk]
        dq_seg = [pl.BlockSpec((None, bq), lambda i, b_, h: (b_, i)),
                  pl.BlockSpec((None, spec.n_k), lambda i, b_, h: (b_, 0))]
        q_grp = pl.BlockSpec((None, spec.n_q, g, dp), lambda j, b_, h: (b_, 0, h, 0))
        k_blk = pl.BlockSpec((None, bk2, None, dp), lambda j, b_, h: (b_, j, h, 0))
        vec_grp = pl.BlockSpec((None, g, spec.n_q), lambda j, b_, h: (b_, h, 0))
        dkv_specs = [q_grp, k_blk, k_blk, q_grp, vec_grp, vec_grp]
        dkv_seg = [pl.BlockSpec((None, spec.n_q), lambda j, b_, h: (b_, 0)),
                   pl.BlockSpec((None, bk2), lambda j, b_, h: (b_, j))]
        dq_grid, dkv_grid = (C.cdiv(spec.n_q, bq), b, hq), (C.cdiv(spec.n_k, bk2), b, hkv)
    keys = [key] if spec.dropout else []
    key_spec = [pl.BlockSpec((key.shape[0],), lambda *_: (0,))] if spec.dropout else []
    dq_specs, dkv_specs = dq_specs + key_spec, dkv_specs + key_spec
    args = (q, k, v, do, lse_u, delta_rows, *keys, *segs)
    call = functools.partial(C.pallas_call, interpret=spec.interpret,
                             num_warps=blocks.num_warps_bwd, num_stages=blocks.num_stages_bwd)
    dq = call(functools.partial(_dq_kernel, spec=spec, bq=bq, bk=bk),
              out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype), grid=dq_grid,
              name="jaxfuse_flash_bwd_dq", in_specs=dq_specs + (dq_seg if segs else []),
              out_specs=dq_specs[0])(*args)
    dk, dv = call(functools.partial(_dkv_kernel, spec=spec, bq=bq2, bk=bk2),
                  out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype)] * 2, grid=dkv_grid,
                  name="jaxfuse_flash_bwd_dkv", in_specs=dkv_specs + (dkv_seg if segs else []),
                  out_specs=[dkv_specs[1]] * 2)(*args)
    return dq, dk, dv
