"""FlashAttention-2 forward in Pallas, with a `custom_vjp` backward that recomputes P.

Forward (Dao 2023, Algorithm 1; lecture 5, sec. 5-6): query blocks on the grid with batch and
heads, key/value blocks in an inner loop, running (m, l, acc) in float32 and one write of o and
of lse. Nothing of size Tq x Tk touches memory, so memory is O(T). Key blocks that are wholly
masked (the causal upper triangle, blocks outside the sliding window) are skipped by the loop
bounds, and blocks wholly visible skip the mask arithmetic (`_attn.key_blocks`), so causal costs
about half of non-causal.

Grouped-query attention: query head h reads KV head h // G straight from k and v; nothing is
repeated in memory. In interpret mode the G query heads of a group are stacked into one block,
so each K/V tile is read once per group.

Backward: `attention_bwd.py` (saves only q, k, v, o and lse_u, the log-sum-exp in the
kernels' score units, see `_attn`; the public lse is the natural-log one), or after the Hopper
forward `attention_hopper_bwd.py` where it takes the problem (`_backward`).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxfuse import _auto_axes, _checks, _philox
from jaxfuse.pallas import _attn as A
from jaxfuse.pallas import _common as C
from jaxfuse.pallas import attention_bwd, attention_hopper, attention_hopper_bwd
from jaxfuse.pallas._attn import AttnBlocks, AttnSpec
from jaxfuse.reference import attention as ref


def _fwd_kernel(q_ref, k_ref, v_ref, *refs, spec: AttnSpec, bq: int, bk: int):
    # q_ref: [..., bq, Dp] this program's query block; k_ref, v_ref: [..., Tk, Dp].
    key, refs = A.take_key(refs, spec)
    (qs_ref, ks_ref), (o_ref, lse_ref) = A.split_refs(refs, spec, 2)
    r0 = pl.program_id(0) * bq
    q = A.load_rows(q_ref, 0, bq, spec.rows, spec, global_r0=r0)            # [..., bq, Dp]
    q_pos, _ = A.row_positions(spec, r0, bq)                                  # [bq, 1]
    q_seg = C.load_vec(qs_ref, 0, bq, spec.rows, global_row0=r0) if spec.segments else None
    if spec.dropout:
        base = A.prob_rows(spec, q.shape[:-2])
        r = r0 + jax.lax.broadcasted_iota(jnp.int32, (bq, 1), 0)

    def step(j, carry, masked):
        k0 = j * bk
        k = A.load_rows(k_ref, k0, bk, spec.n_k, spec)                        # [..., bk, Dp]
        v = A.load_rows(v_ref, k0, bk, spec.n_k, spec)
        k_pos = k0 + jax.lax.broadcasted_iota(jnp.int32, (1, bk), 1)
        k_seg = C.load_vec(ks_ref, k0, bk, spec.n_k, other=-1) if spec.segments else None
        keep = A.visible(spec, q_pos, k_pos, q_seg, k_seg) if masked else None
        nan_v = None
        if masked:     # masked keys may hold garbage: `_attn.finite_rows`
            v, bad_v = A.finite_rows(v)
            nan_v = A.sees(keep, bad_v)
        u, _ = A.transform(spec, A.dot(q, k, "...qd,...kd->...qk"), keep)    # [..., bq, bk]
        # Dropout acts on P after the normalizer l has summed it (l counts every kept score).
        drop = (lambda p: A.dropout(spec, key, base, r, k0, p, scaled=False)) if spec.dropout \
            else (lambda p: p)

        def pv_of(p):
            pv = A.dot(drop(p).astype(v.dtype), v, "...qk,...kd->...qd")
            return pv if nan_v is None else jnp.where(nan_v, jnp.nan, pv)
        return A.online_update(carry, u, pv_of, spec.c2)

    carry = A.split_loop(A.key_blocks(spec, r0, bq, bk), step,
                         A.online_init(q.shape[:-2], bq, spec))
    o, lse_u = A.online_finish(carry, spec.c2)
    if spec.dropout:   # the keep probability's inverse, once per row instead of per entry of P
        o = o * _philox.scale(spec.dropout)
    A.store_rows(o_ref, o, 0, spec.rows, spec, global_r0=r0)
    C.store_vec(lse_ref, lse_u, 0, spec.rows, global_row0=r0)


def _key_spec(spec: AttnSpec, key):
    """(the key as an extra input, its BlockSpec): whole, in every program; none without dropout."""
    if not spec.dropout:
        return [], []
    # two words, or five with a shard's row map (`_rng.shard_rows`)
    return [key], [pl.BlockSpec((key.shape[0],), lambda *_: (0,))]


def _forward(q, k, v, qs, ks, spec: AttnSpec, blocks: AttnBlocks, key=None):
    if isinstance(blocks.hopper, attention_hopper.HopperAttnTiles):   # resolved by `plan`
        return attention_hopper.forward(q, k, v, spec, blocks.hopper, qs, ks)
    bq, bk = blocks.block_q, blocks.block_k
    dp, g = spec.head_dim_pad, spec.groups
    kernel = functools.partial(_fwd_kernel, spec=spec, bq=bq, bk=bk)
    if spec.folded:
        bh = q.shape[0]
        grid = (C.cdiv(spec.rows, bq),)
        q_spec = pl.BlockSpec((bh, bq, dp), lambda i: (0, i, 0))
        kv_spec = pl.BlockSpec((bh, spec.n_k, dp), lambda i: (0, 0, 0))
        seg_specs = [pl.BlockSpec((bh, bq), lambda i: (0, i)),
                     pl.BlockSpec((bh, spec.n_k), lambda i: (0, 0))]
        lse_spec = pl.BlockSpec((bh, bq), lambda i: (0, i))
        lse_shape = (bh, spec.rows)
    else:
        b, _, hq, _ = q.shape
        grid = (C.cdiv(spec.n_q, bq), b, hq)
        q_spec = pl.BlockSpec((None, bq, None, dp), lambda i, b_, h: (b_, i, h, 0))
        kv_spec = pl.BlockSpec((None, spec.n_k, None, dp), lambda i, b_, h: (b_, 0, h // g, 0))
        seg_specs = [pl.BlockSpec((None, bq), lambda i, b_, h: (b_, i)),
                     pl.BlockSpec((None, spec.n_k), lambda i, b_, h: (b_, 0))]
        lse_spec = pl.BlockSpec((None, None, bq), lambda i, b_, h: (b_, h, i))
        lse_shape = (b, hq, spec.n_q)
    segs = [qs, ks] if spec.segments else []
    keys, key_specs = _key_spec(spec, key)
    in_specs = [q_spec, kv_spec, kv_spec] + key_specs + (seg_specs if spec.segments else [])
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct(lse_shape, jnp.float32)]
    return C.pallas_call(kernel, out_shape=out_shape, grid=grid, name="jaxfuse_flash_fwd",
                         interpret=spec.interpret, num_warps=blocks.num_warps,
                         num_stages=blocks.num_stages, in_specs=in_specs,
                         out_specs=[q_spec, lse_spec])(q, k, v, *keys, *segs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _flash(q, k, v, qs, ks, key, spec, blocks):
    """(o, natural-log lse) in the kernels' layout."""
    o, lse_u = _forward(q, k, v, qs, ks, spec, blocks, key)
    return o, A.lse_natural(lse_u, spec)


def _flash_fwd(q, k, v, qs, ks, key, spec, blocks):
    # The backward's residual is lse_u (the kernel's own units, `_attn`), not the natural lse:
    # converting back from the natural lse would cost P its exactness at large logits.
    o, lse_u = _forward(q, k, v, qs, ks, spec, blocks, key)
    return (o, A.lse_natural(lse_u, spec)), (q, k, v, qs, ks, key, o, lse_u)


def _flash_bwd(spec, blocks, res, cts):
    q, k, v, qs, ks, key, o, lse_u = res
    do, dlse = cts
    dq, dk, dv = _backward(q, k, v, qs, ks, o, lse_u, do, dlse, spec, blocks, key)
    int_ct = lambda s: None if s is None else jnp.zeros(s.shape, jax.dtypes.float0)
    return dq, dk, dv, int_ct(qs), int_ct(ks), int_ct(key)


_flash.defvjp(_flash_fwd, _flash_bwd)


def _backward(q, k, v, qs, ks, o, lse_u, do, dlse, spec: AttnSpec, blocks: AttnBlocks,
              key=None):
    """(dq, dk, dv) in the kernels' layout: the Hopper backward after the Hopper forward (the
    plan resolved `blocks.hopper` to its tiles) where it takes the problem, else the portable
    kernels (which ignore `spec.deterministic`: they are always deterministic)."""
    t = blocks.hopper
    if isinstance(t, attention_hopper.HopperAttnTiles) and t.backward is not False:
        bt = t.backward if isinstance(t.backward, attention_hopper_bwd.HopperBwdTiles) \
            else attention_hopper_bwd.HopperBwdTiles()
        if attention_hopper_bwd.fits(q.dtype, spec, bt):
            # Masked keys may hold garbage: an XLA pass (`_attn.clean_keys`) unless the dQ
            # kernel cleans its edge tiles itself (`HopperBwdTiles.cleans`).
            if A.hides_keys(spec) and not bt.cleans(spec):
                k, v = A.clean_keys(k, v)
            return attention_hopper_bwd.backward(q, k, v, o, lse_u, do, dlse, spec, bt, qs, ks)
    return attention_bwd.backward(q, k, v, qs, ks, o, lse_u, do, dlse, spec, blocks, key)


def check_head_dim(d: int) -> None:
    if d % 8 or d > A.SUPPORTED_HEAD_DIM:
        raise ValueError(f"head_dim={d} is not supported: it must be a multiple of 8 and at most "
                         f"{A.SUPPORTED_HEAD_DIM} (e.g. 64, 80, 96, 128, 256)")


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = False,
                    scale: float | None = None, q_segment_ids: jax.Array | None = None,
                    kv_segment_ids: jax.Array | None = None, sliding_window: int | None = None,
                    logits_soft_cap: float | None = None, return_lse: bool = False,
                    dropout_rate: float = 0.0, dropout_key=None, deterministic: bool = True,
                    interpret: bool | None = None, block_sizes: AttnBlocks | None = None):
    """Pallas FlashAttention-2; same semantics as `jaxfuse.reference.attention.attention`.
    With dropout the forward is the Triton kernel (the Hopper forward has no dropout).
    `deterministic=False` lets the Hopper backward add dQ with reducing stores (see
    `attention_hopper_bwd`)."""
    ref.validate(q, k, v, q_segment_ids, kv_segment_ids, sliding_window, logits_soft_cap, scale,
                 dropout_rate, dropout_key)
    check_head_dim(q.shape[-1])
    rate = float(dropout_rate) if _philox.active(dropout_rate, dropout_key) else 0.0
    spec, blocks = plan(q.shape, k.shape, q.dtype, causal=causal, scale=scale,
                        segments=q_segment_ids is not None, sliding_window=sliding_window,
                        logits_soft_cap=logits_soft_cap, interpret=interpret,
                        block_sizes=block_sizes, dropout=rate, deterministic=deterministic)
    lay = _Layout(q.shape, k.shape[1], k.shape[2], spec.folded)
    qs, ks = _segs(q_segment_ids, kv_segment_ids)
    key = _philox.key_words(dropout_key) if rate else None
    o, lse = _flash(lay.q(q), lay.kv(k), lay.kv(v), lay.q_seg(qs), lay.kv_seg(ks), key, spec,
                    blocks)
    o, lse = lay.o_back(o), lay.lse_back(lse)
    return (o, lse) if return_lse else o


def plan(q_shape, k_shape, dtype, *, causal, scale, segments, sliding_window, logits_soft_cap,
         interpret, block_sizes, dropout: float = 0.0,
         deterministic: bool = True) -> tuple[AttnSpec, AttnBlocks]:
    """The kernels' spec and blocks for these shapes (also used per shard by `sharding`). The
    blocks' `hopper` comes back resolved: the Hopper forward's tiles, or False (always False
    with dropout, which only the Triton kernels implement)."""
    make = functools.partial(
        AttnSpec.make, n_q=q_shape[1], n_k=k_shape[1], head_dim=q_shape[-1],
        groups=q_shape[2] // k_shape[2], dtype=dtype, scale=scale,
        interpret=C.resolve_interpret(interpret), causal=causal, window=sliding_window,
        softcap=logits_soft_cap, segments=segments, dropout=dropout,
        deterministic=deterministic)
    spec = make(folded=None if block_sizes is None else block_sizes.folded)
    requested = None if block_sizes is None else block_sizes.hopper
    hopper = attention_hopper.tiles_for(False if dropout else requested, dtype, q_shape,
                                        make(folded=False))
    if hopper is not None:
        spec = make(folded=False)     # the Hopper forward writes the GPU layout
    if block_sizes is None or block_sizes == AttnBlocks(folded=block_sizes.folded,
                                                        hopper=block_sizes.hopper):
        blocks = AttnBlocks.for_shape(spec)     # only the layout or the Hopper switch was set
    else:
        blocks = block_sizes
    blocks.validate(spec.folded)
    return spec, dataclasses.replace(blocks, hopper=hopper or False)


def segment_ids_int32(q_segment_ids, kv_segment_ids):
    """The kernels' int32 segment ids: equal exactly where the given ids are equal (as the
    reference compares them, in their promoted dtype). A plain cast where it keeps every value
    (ids of at most 32 bits that fit int32) or maps one dtype one-to-one (uint32 on both
    sides); otherwise, e.g. int64 ids that differ by a multiple of 2^32, which a cast would make
    equal, each row's ids become their ranks among the row's distinct q and kv ids. On a mesh
    with Explicit axes that whole-row sort runs on Auto axes (`jaxfuse._auto_axes`), where XLA
    may gather a row split over the sequence."""
    qs, ks = q_segment_ids, kv_segment_ids
    if (_checks.fits_int32(qs.dtype) and _checks.fits_int32(ks.dtype)) or (
            qs.dtype == ks.dtype and qs.dtype.itemsize == 4):
        return qs.astype(jnp.int32), ks.astype(jnp.int32)
    found = _auto_axes.explicit_mesh((qs, ks))
    if found is None:
        return _dense_ranks(qs, ks)
    with found[1]():
        specs = tuple(jax.typeof(x).sharding.spec for x in (qs, ks))
        return _auto_axes.call(_dense_ranks, specs, qs, ks)


def _dense_ranks(qs, ks):
    """(qs, ks) [..., Tq], [..., Tk] as int32 ranks of their values among each row's distinct
    ids: one stable sort of the row, a running count of new values, the inverse permutation."""
    common = jax.dtypes.canonicalize_dtype(jnp.promote_types(qs.dtype, ks.dtype))
    both = jnp.concatenate([qs.astype(common), ks.astype(common)], axis=-1)   # [..., Tq + Tk]
    order = jnp.argsort(both, axis=-1, stable=True)
    ranked = jnp.take_along_axis(both, order, axis=-1)
    new = jnp.concatenate([jnp.zeros_like(ranked[..., :1], dtype=jnp.int32),
                           (ranked[..., 1:] != ranked[..., :-1]).astype(jnp.int32)], axis=-1)
    dense = jnp.cumsum(new, axis=-1)                   # rank of each sorted position
    rank = jnp.take_along_axis(dense, jnp.argsort(order, axis=-1), axis=-1)
    return rank[..., :qs.shape[-1]], rank[..., qs.shape[-1]:]


def _segs(q_segment_ids, kv_segment_ids):
    if q_segment_ids is None:
        return None, None
    return segment_ids_int32(q_segment_ids, kv_segment_ids)


class _Layout:
    """User layout (q [B, Tq, Hq, D], k/v [B, Tk, Hkv, D], lse [B, Hq, Tq]) <-> the kernels'.
    Folded (interpret mode): (batch, KV head) fold into one axis and the group's query heads
    stack along the rows; otherwise the kernels read the user layout."""

    def __init__(self, q_shape, tk: int, hkv: int, folded: bool):
        self.b, self.tq, self.hq, self.d = q_shape
        self.tk, self.hkv, self.g, self.folded = tk, hkv, self.hq // hkv, folded

    def q(self, x):             # also o and do
        if not self.folded:
            return x
        b, tq, hkv, g, d = self.b, self.tq, self.hkv, self.g, self.d
        return x.reshape(b, tq, hkv, g, d).transpose(0, 2, 3, 1, 4).reshape(b * hkv, g * tq, d)

    def kv(self, x):
        if not self.folded:
            return x
        return x.transpose(0, 2, 1, 3).reshape(self.b * self.hkv, self.tk, self.d)

    def q_seg(self, s):
        if s is None or not self.folded:
            return s
        b, hkv, g, tq = self.b, self.hkv, self.g, self.tq
        return jnp.broadcast_to(s[:, None, None, :], (b, hkv, g, tq)).reshape(b * hkv, g * tq)

    def kv_seg(self, s):
        if s is None or not self.folded:
            return s
        return jnp.broadcast_to(s[:, None, :], (self.b, self.hkv, self.tk)).reshape(
            self.b * self.hkv, self.tk)

    def lse(self, x):
        return x.reshape(self.b * self.hkv, self.g * self.tq) if self.folded else x

    def o_back(self, x):
        if not self.folded:
            return x
        b, tq, hkv, g, d = self.b, self.tq, self.hkv, self.g, self.d
        return x.reshape(b, hkv, g, tq, d).transpose(0, 3, 1, 2, 4).reshape(b, tq, self.hq, d)

    def kv_back(self, x):
        if not self.folded:
            return x
        return x.reshape(self.b, self.hkv, self.tk, self.d).transpose(0, 2, 1, 3)

    def lse_back(self, x):
        return x.reshape(self.b, self.hq, self.tq)


def forward(q, k, v, q_segment_ids, kv_segment_ids, spec: AttnSpec, blocks: AttnBlocks,
            key=None):
    """(o, natural lse, lse_u) in the user layout, no custom_vjp: the forward half for
    `sharding`; lse_u (the kernels' units, `_attn`) is the residual `backward` takes. `key`:
    the dropout key words (spec.dropout > 0)."""
    lay = _Layout(q.shape, k.shape[1], k.shape[2], spec.folded)
    qs, ks = _segs(q_segment_ids, kv_segment_ids)
    o, lse_u = _forward(lay.q(q), lay.kv(k), lay.kv(v), lay.q_seg(qs), lay.kv_seg(ks), spec,
                        blocks, key)
    lse_u = lay.lse_back(lse_u)
    return lay.o_back(o), A.lse_natural(lse_u, spec), lse_u


def backward(q, k, v, q_segment_ids, kv_segment_ids, o, lse_u, do, dlse, spec: AttnSpec,
             blocks: AttnBlocks, key=None):
    """(dq, dk, dv) in the user layout: the backward half of `forward`, from its lse_u and the
    cotangent dlse of its natural lse."""
    lay = _Layout(q.shape, k.shape[1], k.shape[2], spec.folded)
    qs, ks = _segs(q_segment_ids, kv_segment_ids)
    dq, dk, dv = _backward(lay.q(q), lay.kv(k), lay.kv(v), lay.q_seg(qs), lay.kv_seg(ks),
                           lay.q(o), lay.lse(lse_u), lay.q(do), lay.lse(dlse), spec, blocks, key)
    return lay.o_back(dq), lay.kv_back(dk), lay.kv_back(dv)
