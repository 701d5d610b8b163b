"""Split-KV decoding attention (Flash-Decoding) over a ragged KV cache, with GQA.

Decoding reads the whole cache for one query per sequence: it is memory-bound (about 1 FLOP per
byte), and with one program per (batch, head) a small batch leaves most multiprocessors idle
(lecture 5, sec. 8.4). So the key axis is also split: program (b, kv head, split) attends its
group's G query heads to one slice of the cache and writes a partial (o, lse); the partials are
merged with the log-sum-exp rule (`merge_many`, the n-way form of `merge_states`). The query heads
of a KV group are processed together, so each K/V tile is read once per group (GQA).

Ragged lengths: a program reads kv_lengths[b] and loops only over tiles below it, so tiles wholly
beyond a sequence's length are never read, and the tail tile is loaded under a mask, so whatever
the cache holds there (NaN, inf) cannot leak in. The split count fills the GPU in whole waves
(`choose_splits`, wave quantization in lecture 5 sec. 8.4).

Append (a decoding step in one launch): the new token's key and value (`k_new`/`v_new`, or the
last heads of a packed q) are written into the cache at kv_lengths[b], in place (the caches are
aliased to outputs), by the split whose slice holds that position; that split attends them as
one more online-softmax step from registers after its loop over the keys already cached.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxfuse.pallas import _attn as A
from jaxfuse.pallas import _common as C
from jaxfuse.pallas.attention import check_head_dim
from jaxfuse.reference import decode_attention as ref
from jaxfuse.reference.attention import merge_many


@dataclasses.dataclass(frozen=True)
class DecodeBlocks:
    """`block_k` keys per inner step; `num_*` only matter on the GPU. `folded=None` folds batch
    and KV heads into the block in interpret mode and squeezes them on the GPU."""
    # None: 128 keys where a key row is at most 128 bytes (D = 64 in bf16), else 64 (float32
    # and D = 128 in shared memory). Measured on an H200 at the 157M model's decoding shape
    # (B = 32, 640 of 768 positions, 4 KV heads of 64, bf16): 128 keys 7.3 us, 64 keys 8.5 us.
    block_k: int | None = None
    num_warps: int = 4
    num_stages: int = 3
    folded: bool | None = None

    def validate(self, folded: bool) -> None:
        for name in ("block_k", "num_warps", "num_stages"):
            v = getattr(self, name)
            if name == "block_k" and v is None:
                continue
            if not (isinstance(v, int) and v >= 1):
                raise ValueError(f"DecodeBlocks({name}={v!r}): {name} must be a positive int")
        if not folded and self.block_k and self.block_k != C.next_pow2(self.block_k):
            raise ValueError(f"DecodeBlocks(block_k={self.block_k}) must be a power of two on "
                             "the GPU (e.g. 64)")


def choose_splits(units: int, seq_len: int, sms: int, min_keys: int = 512) -> int:
    """Split count that fills `sms` multiprocessors in whole waves of `units * splits` programs,
    keeping at least `min_keys` keys per split (lecture 5, sec. 8.4: 4 splits of a 32K cache on
    132 SMs is one wave, 5 spill into a second, mostly idle one)."""
    n_max = max(1, min(seq_len // min_keys, 256))
    best, best_eff = 1, 0.0
    for n in range(1, n_max + 1):
        eff = units * n / (C.cdiv(units * n, sms) * sms)
        if eff > best_eff + 1e-9:
            best, best_eff = n, eff
    return best


_SPLIT_AXIS = {True: 0, False: 2}   # grid axis of the split: (splits,) folded, (B, Hkv, splits)


def _kernel(q_ref, k_ref, v_ref, len_ref, *refs, spec: A.AttnSpec, bh: int, bk: int,
            split_len: int, append: bool):
    # GPU: q_ref [G, Dp] (the group's heads), k_ref/v_ref [S, Dp], len_ref a scalar.
    # Interpret: q_ref [B*Hkv, G, D], k_ref [B*Hkv, S, D], len_ref [B*Hkv].
    # append: kn_ref/vn_ref [(B*Hkv,) 1, Dp] the new rows, ko_ref/vo_ref the caches again
    # (aliased to k_ref/v_ref: in place); the new row goes at len_ref's value, unclipped (a
    # device holding one slice of the cache gets it shifted, maybe outside [0, S): not its row).
    if append:
        kn_ref, vn_ref, o_ref, lse_ref, ko_ref, vo_ref = refs
    else:
        o_ref, lse_ref = refs
    g = spec.groups
    s0 = pl.program_id(_SPLIT_AXIS[spec.folded]) * split_len
    length = jnp.clip(len_ref[...], 0, spec.n_k)
    n = length[..., None, None]                                              # [..., 1, 1]
    q = A.load_rows(q_ref, 0, bh, g, spec)                                   # [..., bh, Dp]
    end = jnp.minimum(s0 + split_len, jnp.max(length))

    def step(j, carry):
        k0 = j * bk
        k = A.load_rows(k_ref, k0, bk, n, spec)                               # [..., bk, Dp]
        v = A.load_rows(v_ref, k0, bk, n, spec)
        if bh == 1:   # one query row (MHA): a 2-D multiply-reduce, no 16-row matmul tile
            s = jnp.sum(q.astype(jnp.float32) * k.astype(jnp.float32), axis=-1)[..., None, :]
            pv_of = lambda p: jnp.sum(jnp.swapaxes(p, -1, -2) * v.astype(jnp.float32),
                                      axis=-2, keepdims=True)                 # [..., 1, Dp]
        else:
            s = A.dot(q, k, "...hd,...kd->...hk")                             # [..., bh, bk]
            pv_of = lambda p: A.dot(p.astype(v.dtype), v, "...hk,...kd->...hd")
        u, _ = A.transform(spec, s)
        k_pos = k0 + jax.lax.broadcasted_iota(jnp.int32, (1, bk), 1)
        return A.online_update(carry, jnp.where(k_pos < n, u, C.NEG_INF), pv_of, spec.c2)

    carry = jax.lax.fori_loop(s0 // bk, (end + bk - 1) // bk, step,
                              A.online_init(q.shape[:-2], bh, spec))
    if append:
        # The new key is one more step of the online softmax, taken from k_new/v_new in
        # registers by the split that holds its position; the loop above attends the `length`
        # keys already cached and leaves the cache tiles as loaded. (Splicing the new row into
        # the loaded tiles, or storing it inside the loop, measured 15.4 against 7.3 us a call
        # on an H200: the loaded tiles no longer went straight to the matrix unit.)
        pos = len_ref[...][..., None, None]                                  # [..., 1, 1]
        mine = (pos >= s0) & (pos < s0 + split_len) & (pos >= 0) & (pos < spec.n_k)
        k_new, v_new = (A.load_rows(r, 0, 1, 1, spec) for r in (kn_ref, vn_ref))
        s_new = jnp.sum(q.astype(jnp.float32) * k_new.astype(jnp.float32), axis=-1,
                        keepdims=True)                                        # [..., bh, 1]
        u, _ = A.transform(spec, s_new)
        carry = A.online_update(carry, jnp.where(mine, u, C.NEG_INF),
                                lambda p: p * v_new.astype(jnp.float32), spec.c2)
        # Then it is stored: on the GPU one row at pos; folded, rows differ in pos, so the
        # whole [S, D] block is written under a mask.
        r0, nr = (0, spec.n_k) if spec.folded else (len_ref[...], 1)
        row = r0 + jax.lax.broadcasted_iota(jnp.int32, (nr, 1), 0)            # [nr, 1]
        for cache_ref, new in ((ko_ref, k_new), (vo_ref, v_new)):
            tile = jnp.broadcast_to(new, (*new.shape[:-2], nr, new.shape[-1]))
            C.store_tile(cache_ref, tile, r0, 0, spec.n_k, spec.head_dim,
                         mask=jnp.broadcast_to(mine & (row == pos), tile.shape))
    o, lse_u = A.online_finish(carry, spec.c2)
    A.store_rows(o_ref, o, 0, g, spec)
    C.store_vec(lse_ref, A.lse_natural(lse_u, spec), 0, g)   # the splits merge natural lse


def decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                     kv_lengths: jax.Array, *, scale: float | None = None,
                     num_splits: int | None = None, logits_soft_cap: float | None = None,
                     return_lse: bool = False, k_new: jax.Array | None = None,
                     v_new: jax.Array | None = None, packed_qkv: bool = False,
                     interpret: bool | None = None, block_sizes: DecodeBlocks | None = None):
    """Pallas Flash-Decoding; same semantics as `jaxfuse.reference.decode_attention`.

    Inference only: it has no gradient (train with `flash_attention`)."""
    ref.validate_call(q, k_cache, v_cache, kv_lengths, num_splits, logits_soft_cap, scale, k_new,
                      v_new, packed_qkv)
    check_head_dim(q.shape[-1])
    interpret = C.resolve_interpret(interpret)
    blocks = block_sizes or DecodeBlocks()
    blocks.validate(interpret if blocks.folded is None else blocks.folded)
    run = functools.partial(_decode, scale=scale, num_splits=num_splits,
                            logits_soft_cap=logits_soft_cap, interpret=interpret, blocks=blocks,
                            packed=packed_qkv)
    # With an append the lengths are also where the new row goes (`_kernel`).
    outs = _inference_op(run)(q, k_cache, v_cache, ref.clip_lengths(kv_lengths, k_cache.shape[1]),
                              *(() if k_new is None else (k_new, v_new)))
    return results(outs, return_lse)


def results(outs, return_lse: bool):
    """The public return value from the kernel's (o, lse[, k_cache, v_cache]): o, or (o, lse),
    followed by the caches when they were appended to."""
    o, lse, *caches = outs
    head = (o, lse) if return_lse else (o,)
    return head + tuple(caches) if caches else (head if return_lse else o)


def _inference_op(run):
    """`run` under a vmap rule that folds the mapped axis into the batch axis (the kernel's loop
    bounds come from kv_lengths, data that a batched pallas_call cannot loop over), and with a
    gradient that fails loudly rather than silently."""
    @jax.custom_jvp
    @jax.custom_batching.custom_vmap
    def op(q, k_cache, v_cache, lengths, *append):
        return run(q, k_cache, v_cache, lengths, *append)

    @op.fun.def_vmap
    def _fold(axis_size, in_batched, *args):
        args = [a if batched else jnp.broadcast_to(a, (axis_size, *a.shape))
                for a, batched in zip(args, in_batched)]
        outs = op.fun(*[a.reshape(-1, *a.shape[2:]) for a in args])
        unfold = lambda x: x.reshape(axis_size, -1, *x.shape[1:])
        return tuple(unfold(x) for x in outs), (True,) * len(outs)

    @op.defjvp
    def _no_gradient(primals, tangents):
        raise ValueError("decode_attention is for inference and has no gradient; "
                         "use jaxfuse.flash_attention (with kv segment ids or causal) to train")

    return op


def _decode(q, k_cache, v_cache, lengths, k_new=None, v_new=None, *, scale, num_splits,
            logits_soft_cap, interpret, blocks: DecodeBlocks, packed=False):
    """(o [B, Hq, D] in q's dtype, float32 lse [B, Hq]) over the first `lengths` keys (clipped
    to [0, S]). With k_new/v_new [B, Hkv, D], or `packed` (q is [B, Hq + 2 Hkv, D]: the query
    heads then k_new's then v_new's), also over the new key where `lengths` lies in [0, S),
    written there in the returned caches (in place)."""
    s_len, hkv = k_cache.shape[1], k_cache.shape[2]
    b, hq, d = q.shape
    hq -= 2 * hkv if packed else 0
    g = hq // hkv
    append = packed or k_new is not None
    spec = A.AttnSpec.make(n_q=1, n_k=s_len, head_dim=d, groups=g, dtype=q.dtype, scale=scale,
                           interpret=interpret, folded=blocks.folded, softcap=logits_soft_cap)
    folded, dp = spec.folded, spec.head_dim_pad
    if num_splits is None:
        num_splits = 1 if folded else choose_splits(b * hkv, s_len, C.num_multiprocessors())
    block_k = blocks.block_k or (128 if dp * q.dtype.itemsize <= 128 else 64)
    bk = min(block_k, max(16, C.next_pow2(s_len))) if not folded else min(block_k, s_len)
    split_len = bk * C.cdiv(C.cdiv(s_len, num_splits), bk)   # whole tiles; trailing splits may be empty
    # One query row needs no matmul tile; G >= 2 rows are padded to Triton's 16-row minimum.
    bh = g if folded else (1 if g == 1 else max(16, C.next_pow2(g)))
    kernel = functools.partial(_kernel, spec=spec, bh=bh, bk=bk, split_len=split_len,
                               append=append)
    # One split (a short cache, or enough sequences to fill the GPU without splitting): its
    # result is final (merging one part is the identity, bitwise), so the kernel writes o in
    # q's dtype and no merge runs: two reductions and a cast fewer per call, in a decoding step
    # made of microsecond launches (measured on the 157M model: 3 of ~18 kernels per layer).
    o_dtype = q.dtype if num_splits == 1 else jnp.float32
    if folded and packed:     # interpreted: the heads are sliced apart (copies cost nothing here)
        q, k_new, v_new = q[:, :hq], q[:, hq:hq + hkv], q[:, hq + hkv:]
    if folded:
        n = b * hkv
        heads_major = lambda c: c.transpose(0, 2, 1, 3).reshape(n, s_len, d)
        qc, kc, vc = q.reshape(n, g, d), heads_major(k_cache), heads_major(v_cache)
        grid = (num_splits,)
        whole = lambda *shape: pl.BlockSpec(shape, lambda s: (0,) * len(shape))
        in_specs = [whole(n, g, d), whole(n, s_len, d), whole(n, s_len, d), whole(n)]
        out_specs = [pl.BlockSpec((n, None, g, d), lambda s: (0, s, 0, 0)),
                     pl.BlockSpec((n, None, g), lambda s: (0, s, 0))]
        out_shape = [jax.ShapeDtypeStruct((n, num_splits, g, d), o_dtype),
                     jax.ShapeDtypeStruct((n, num_splits, g), jnp.float32)]
        args = [qc, kc, vc, jnp.repeat(lengths, hkv)]
        if append:
            in_specs += [whole(n, 1, d), whole(n, 1, d)]
            out_specs += [whole(n, s_len, d)] * 2
            out_shape += [jax.ShapeDtypeStruct(kc.shape, kc.dtype)] * 2
            args += [k_new.reshape(n, 1, d), v_new.reshape(n, 1, d)]
    else:
        grid = (b, hkv, num_splits)
        cache_spec = pl.BlockSpec((None, s_len, None, dp), lambda b_, h, s: (b_, 0, h, 0))
        row_spec = pl.BlockSpec((None,), lambda b_, h, s: (b_,))
        in_specs = [pl.BlockSpec((None, g, dp), lambda b_, h, s: (b_, h, 0)),
                    cache_spec, cache_spec, row_spec]
        out_specs = [pl.BlockSpec((None, None, g, dp), lambda b_, h, s: (b_, s, h, 0)),
                     pl.BlockSpec((None, None, g), lambda b_, h, s: (b_, s, h))]
        out_shape = [jax.ShapeDtypeStruct((b, num_splits, hq, d), o_dtype),
                     jax.ShapeDtypeStruct((b, num_splits, hq), jnp.float32)]
        args = [q, k_cache, v_cache, lengths]
        if append:
            if packed:
                # The new key and value heads are read where they lie in the packed q (the
                # same buffer passed three times): no slice of it is copied out first.
                new_specs = [pl.BlockSpec((None, 1, dp), lambda b_, h, s, c=c: (b_, c + h, 0))
                             for c in (hq, hq + hkv)]
                args += [q, q]
            else:
                new_specs = [pl.BlockSpec((None, None, 1, dp), lambda b_, h, s: (b_, h, 0, 0))] * 2
                args += [k_new[:, :, None], v_new[:, :, None]]
            in_specs += new_specs
            out_specs += [cache_spec] * 2
            out_shape += [jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype)] * 2
    outs = C.pallas_call(
        kernel, out_shape=out_shape, grid=grid, name="jaxfuse_decode_attention",
        interpret=interpret, num_warps=blocks.num_warps, num_stages=blocks.num_stages,
        in_specs=in_specs, out_specs=out_specs,
        input_output_aliases={1: 2, 2: 3} if append else None)(*args)
    o_parts, lse_parts = outs[:2]
    if num_splits == 1:
        o, lse = o_parts[:, 0], lse_parts[:, 0]
    else:
        o, lse = merge_many(o_parts, lse_parts, axis=1)    # the split axis, in both layouts
    o, lse = o.reshape(b, hq, d).astype(q.dtype), lse.reshape(b, hq)
    if not append:
        return o, lse
    if folded:     # back from the kernel's [B * Hkv, S, D] to [B, S, Hkv, D]
        back = lambda c: c.reshape(b, hkv, s_len, d).transpose(0, 2, 1, 3)
        return o, lse, back(outs[2]), back(outs[3])
    return o, lse, outs[2], outs[3]
