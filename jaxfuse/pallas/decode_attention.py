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

A decoding step's attention input (the model's): the new token's q, k and v may come as a fused
projection's float32 partial sums, grouped by KV head, which every program adds for its group
(each partial a [G + 2, D] read: XLA then has no split-K reduction to launch), and RoPE turns q
and k at position kv_lengths[b] in the same prologue (`rope_base`; compiled, the angles' cos and
sin are MUFU's after a two-part reduction by 2 pi, `_common.sincos`: libdevice's cosf/sinf made
the prologue, which the first K/V loads wait behind, 1.1-1.5 us longer on an H200).
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
from jaxfuse.reference import rope as rope_ref
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


def _kernel(k_ref, v_ref, len_ref, *refs, spec: A.AttnSpec, bh: int, bk: int,
            split_len: int, parts: int, append: bool, rope: bool | None, rms: tuple | None):
    # GPU: k_ref/v_ref [S, Dp], len_ref a scalar; refs: (f_ref [Dp/2], the RoPE pairs'
    # frequencies, with `rope`), (x_ref [dm'], the projection's input row, with `rms` = (eps,
    # dm)), then `parts` refs of the group's query heads [G, Dp] (partial sums to add when
    # parts > 1), with `append` `parts` refs of the new key [1, Dp] and as many of the new
    # value, then the outputs. Interpret: k_ref [B*Hkv, S, D], len_ref [B*Hkv], the
    # q refs [B*Hkv, G, D], the new rows' [B*Hkv, 1, D].
    # append: ko_ref/vo_ref are the caches again (aliased to k_ref/v_ref: in place); the new
    # row goes at len_ref's value, unclipped (a device holding one slice of the cache gets it
    # shifted, maybe outside [0, S): not its row).
    refs = list(refs)
    f_ref = refs.pop(0) if rope is not None else None
    x_ref = refs.pop(0) if rms is not None else None
    q_refs, refs = refs[:parts], refs[parts:]
    if append:
        kn_refs, vn_refs, refs = refs[:parts], refs[parts:2 * parts], refs[2 * parts:]
        o_ref, lse_ref, ko_ref, vo_ref = refs
    else:
        o_ref, lse_ref = refs
    g = spec.groups
    s0 = pl.program_id(_SPLIT_AXIS[spec.folded]) * split_len
    length = jnp.clip(len_ref[...], 0, spec.n_k)
    n = length[..., None, None]                                              # [..., 1, 1]
    q = _added(q_refs, bh, g, spec)                                           # [..., bh, Dp]
    if append:
        k_new, v_new = (_added(r, 1, 1, spec) for r in (kn_refs, vn_refs))   # [..., 1, Dp]
    if rms is not None:
        # The projection's input RMSNorm, its weight folded into the projection: each row of
        # q, k and v times rsqrt(mean(x^2) + eps) of the input row x.
        eps, dm = rms
        x = C.load_vec(x_ref, 0, x_ref.shape[-1], dm).astype(jnp.float32)     # [..., dm']
        r = jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) / dm + eps)[..., None]
        q, k_new, v_new = (t.astype(jnp.float32) * r for t in (q, k_new, v_new))
    if rope is not None:
        # RoPE at the new token's position, the angles' cos and sin once for the q rows and
        # the key; the rotation is `jaxfuse.reference.rope`'s own function.
        theta = len_ref[...][..., None, None].astype(jnp.float32) * C.load_vec(
            f_ref, 0, spec.head_dim_pad // 2, spec.head_dim // 2)               # [..., 1, Dp/2]
        cos, sin = C.sincos(spec.interpret)(theta)
        q, k_new = (rope_ref.rotate(x.astype(jnp.float32), cos, sin, rope) for x in (q, k_new))
    if parts > 1 or rope is not None or rms is not None:
        # The new token's q, k and v as the cache holds them (and the matrix unit takes q).
        q, k_new, v_new = (x.astype(k_ref.dtype) for x in (q, k_new, v_new))
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


def _added(refs, n: int, n_valid, spec: A.AttnSpec):
    """Rows [0, n) of the refs (`load_rows`), added in float32 when there are several (a
    projection's partial sums); one ref's rows as stored."""
    tiles = [A.load_rows(r, 0, n, n_valid, spec) for r in refs]
    if len(tiles) == 1:
        return tiles[0]
    total = tiles[0].astype(jnp.float32)
    for t in tiles[1:]:
        total = total + t.astype(jnp.float32)
    return total


def decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                     kv_lengths: jax.Array, *, scale: float | None = None,
                     num_splits: int | None = None, logits_soft_cap: float | None = None,
                     return_lse: bool = False, k_new: jax.Array | None = None,
                     v_new: jax.Array | None = None, packed_qkv: bool | str = False,
                     partial_sums: bool = False, rope_base: float | None = None,
                     rope_interleaved: bool = True, rms_input: jax.Array | None = None,
                     rms_eps: float = 1e-6, interpret: bool | None = None,
                     block_sizes: DecodeBlocks | None = None):
    """Pallas Flash-Decoding; same semantics as `jaxfuse.reference.decode_attention`.

    Inference only: it has no gradient (train with `flash_attention`)."""
    ref.validate_call(q, k_cache, v_cache, kv_lengths, num_splits, logits_soft_cap, scale, k_new,
                      v_new, packed_qkv, partial_sums, rope_base, rope_interleaved, rms_input,
                      rms_eps)
    check_head_dim(q.shape[-1])
    interpret = C.resolve_interpret(interpret)
    blocks = block_sizes or DecodeBlocks()
    blocks.validate(interpret if blocks.folded is None else blocks.folded)
    run = functools.partial(_decode, scale=scale, num_splits=num_splits,
                            logits_soft_cap=logits_soft_cap, interpret=interpret, blocks=blocks,
                            packed=packed_qkv, partial_sums=partial_sums, rope_base=rope_base,
                            rope_interleaved=rope_interleaved,
                            rms_eps=None if rms_input is None else rms_eps)
    # With an append the lengths are also where the new row goes (`_kernel`).
    outs = _inference_op(run, q_batch_axis=1 if partial_sums else 0)(
        q, k_cache, v_cache, ref.clip_lengths(kv_lengths, k_cache.shape[1]),
        *operands(k_new, v_new, rms_input))
    return results(outs, return_lse)


def operands(k_new, v_new, rms_input) -> tuple:
    """The optional operands after the lengths, as `_decode` takes them: (k_new, v_new) for an
    unpacked append, then rms_input."""
    return (() if k_new is None else (k_new, v_new)) + (() if rms_input is None else
                                                        (rms_input,))


def split_operands(extra: tuple, rms: bool) -> tuple:
    """`operands` backwards: (k_new, v_new, rms_input), None where absent."""
    rms_input = extra[-1] if rms else None
    k_new, v_new = extra[:2] if len(extra) >= 2 else (None, None)
    return k_new, v_new, rms_input


def results(outs, return_lse: bool):
    """The public return value from the kernel's (o, lse[, k_cache, v_cache]): o, or (o, lse),
    followed by the caches when they were appended to."""
    o, lse, *caches = outs
    head = (o, lse) if return_lse else (o,)
    return head + tuple(caches) if caches else (head if return_lse else o)


def _inference_op(run, q_batch_axis: int = 0):
    """`run` under a vmap rule that folds the mapped axis into the batch axis (the kernel's loop
    bounds come from kv_lengths, data that a batched pallas_call cannot loop over), and with a
    gradient that fails loudly rather than silently. The batch is every argument's axis 0 but
    q's `q_batch_axis` (1: q's partial sums lead)."""
    @jax.custom_jvp
    @jax.custom_batching.custom_vmap
    def op(q, k_cache, v_cache, lengths, *append):
        return run(q, k_cache, v_cache, lengths, *append)

    @op.fun.def_vmap
    def _fold(axis_size, in_batched, *args):
        args = [a if batched else jnp.broadcast_to(a, (axis_size, *a.shape))
                for a, batched in zip(args, in_batched)]
        q = jnp.moveaxis(args[0], 0, q_batch_axis)       # the mapped axis just before the batch
        q = q.reshape(*q.shape[:q_batch_axis], -1, *q.shape[q_batch_axis + 2:])
        outs = op.fun(q, *[a.reshape(-1, *a.shape[2:]) for a in args[1:]])
        unfold = lambda x: x.reshape(axis_size, -1, *x.shape[1:])
        return tuple(unfold(x) for x in outs), (True,) * len(outs)

    @op.defjvp
    def _no_gradient(primals, tangents):
        raise ValueError("decode_attention is for inference and has no gradient; "
                         "use jaxfuse.flash_attention (with kv segment ids or causal) to train")

    return op


def _decode(q, k_cache, v_cache, lengths, *extra, scale, num_splits, logits_soft_cap,
            interpret, blocks: DecodeBlocks, packed=False, partial_sums=False, rope_base=None,
            rope_interleaved=True, rms_eps=None):
    """(o [B, Hq, D] in the cache's dtype, float32 lse [B, Hq]) over the first `lengths` keys
    (clipped to [0, S]). With k_new/v_new [B, Hkv, D], or a `packed` q (its layouts:
    `jaxfuse.reference.decode_attention`), also over the new key where `lengths` lies in
    [0, S), written there in the returned caches (in place). `partial_sums`: q is [P, ...],
    P partial sums the kernel adds; `rope_base`: the kernel rotates the new q and k; `rms_eps`
    (not None): the last of `extra` is rms_input, whose rows' RMS scale the kernel applies.
    `extra`: `operands`'s."""
    k_new, v_new, rms_input = split_operands(extra, rms_eps is not None)
    s_len, hkv, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    # query heads: a packed q's heads less the new key's and value's
    hq = q.shape[-2] - (2 * hkv if packed else 0)
    g = hq // hkv
    spec = A.AttnSpec.make(n_q=1, n_k=s_len, head_dim=d, groups=g, dtype=k_cache.dtype,
                           scale=scale, interpret=interpret, folded=blocks.folded,
                           softcap=logits_soft_cap)
    folded, dp = spec.folded, spec.head_dim_pad
    if rope_base is not None and not rope_interleaved and not folded and dp != d:
        # Halves [i, i + D/2] of a head dim padded for the matrix unit do not meet in the
        # kernel's reshape: XLA forms the new token first, the kernel appends and attends.
        q, k_new, v_new = ref.new_token(q, k_cache, v_cache, lengths, k_new, v_new, packed,
                                        partial_sums, rope_base, rope_interleaved, rms_input,
                                        rms_eps)
        packed, partial_sums, rope_base, rms_eps, rms_input = False, False, None, None, None
    layout = "heads" if packed is True else packed             # False, "heads" or "grouped"
    qp = q if partial_sums else q[None]                         # [P, B, heads, D]
    parts, b = qp.shape[:2]
    append = bool(layout) or k_new is not None
    rope = None if rope_base is None else bool(rope_interleaved)
    if num_splits is None:
        num_splits = 1 if folded else choose_splits(b * hkv, s_len, C.num_multiprocessors())
    block_k = blocks.block_k or (128 if dp * k_cache.dtype.itemsize <= 128 else 64)
    bk = min(block_k, max(16, C.next_pow2(s_len))) if not folded else min(block_k, s_len)
    # whole tiles; trailing splits may be empty
    split_len = bk * C.cdiv(C.cdiv(s_len, num_splits), bk)
    # One query row needs no matmul tile; G >= 2 rows are padded to Triton's 16-row minimum.
    bh = g if folded else (1 if g == 1 else max(16, C.next_pow2(g)))
    kernel = functools.partial(_kernel, spec=spec, bh=bh, bk=bk, split_len=split_len,
                               parts=parts, append=append, rope=rope,
                               rms=None if rms_eps is None else (rms_eps, rms_input.shape[1]))
    # One split (a short cache, or enough sequences to fill the GPU without splitting): its
    # result is final (merging one part is the identity, bitwise), so the kernel writes o in
    # the cache's dtype and no merge runs: two reductions and a cast fewer per call, in a
    # decoding step made of microsecond launches (measured on the 157M model: 3 of ~18 kernels
    # per layer).
    o_dtype = k_cache.dtype if num_splits == 1 else jnp.float32
    # the RoPE pairs' frequencies (padded to the kernel's Dp / 2 by its masked load)
    head = [] if rope is None else [rope_ref.pair_freqs(d, rope_base)]
    rows_x = [] if rms_input is None else [rms_input]           # [B, dm]: the projection's input
    if folded:
        # Interpreted: the heads are sliced apart per partial sum (copies cost nothing here);
        # the sums and the rotation stay in the kernel.
        n = b * hkv
        news = [ref.unpack_qkv(x, k_cache, None, None, layout) if layout else (x, k_new, v_new)
                for x in qp]
        heads_major = lambda c: c.transpose(0, 2, 1, 3).reshape(n, s_len, d)
        kc, vc = heads_major(k_cache), heads_major(v_cache)
        grid = (num_splits,)
        whole = lambda *shape: pl.BlockSpec(shape, lambda s: (0,) * len(shape))
        in_specs = [whole(n, s_len, d), whole(n, s_len, d), whole(n)] + [whole(d // 2)] * len(head)
        rows_x = [jnp.repeat(x, hkv, axis=0) for x in rows_x]        # a row per (b, KV head)
        in_specs += [whole(*x.shape) for x in rows_x] + [whole(n, g, d)] * parts
        out_specs = [pl.BlockSpec((n, None, g, d), lambda s: (0, s, 0, 0)),
                     pl.BlockSpec((n, None, g), lambda s: (0, s, 0))]
        out_shape = [jax.ShapeDtypeStruct((n, num_splits, g, d), o_dtype),
                     jax.ShapeDtypeStruct((n, num_splits, g), jnp.float32)]
        args = [kc, vc, jnp.repeat(lengths, hkv), *head, *rows_x] + [x[0].reshape(n, g, d)
                                                                     for x in news]
        if append:
            in_specs += [whole(n, 1, d)] * (2 * parts)
            out_specs += [whole(n, s_len, d)] * 2
            out_shape += [jax.ShapeDtypeStruct(kc.shape, kc.dtype)] * 2
            args += [x[1].reshape(n, 1, d) for x in news] + [x[2].reshape(n, 1, d) for x in news]
    else:
        grid = (b, hkv, num_splits)
        cache_spec = pl.BlockSpec((None, s_len, None, dp), lambda b_, h, s: (b_, 0, h, 0))
        row_spec = pl.BlockSpec((None,), lambda b_, h, s: (b_,))
        in_specs = [cache_spec, cache_spec, row_spec]
        in_specs += [pl.BlockSpec((dp // 2,), lambda b_, h, s: (0,))] * len(head)
        in_specs += [pl.BlockSpec((None, C.next_pow2(x.shape[1])), lambda b_, h, s: (b_, 0))
                     for x in rows_x]
        # Each kind of row (the group's query heads, the new key, the new value) of each
        # partial sum is read where it lies in q: the same buffer passed several times, no
        # slice of it copied out first. rows(p, n, at): n rows of part p at block index at(h).
        if layout == "grouped":     # [P, B, Hkv, G + 2, D]: group h's q heads, key, value
            src = qp.reshape(parts, b, hkv, g + 2, d)
            rows = lambda p, n, at: pl.BlockSpec((None, None, None, n, dp),
                                                 lambda b_, h, s: (p, b_, h, at(h), 0))
            at_q, at_k, at_v = (lambda h: 0), (lambda h: g), (lambda h: g + 1)
        else:                       # [P, B, heads, D]: q heads, then (packed) keys, values
            src = qp
            rows = lambda p, n, at: pl.BlockSpec((None, None, n, dp),
                                                 lambda b_, h, s: (p, b_, at(h), 0))
            at_q, at_k, at_v = (lambda h: h), (lambda h: hq + h), (lambda h: hq + hkv + h)
        in_specs += [rows(p, g, at_q) for p in range(parts)]
        args = [k_cache, v_cache, lengths, *head, *rows_x] + [src] * parts
        if append:
            if layout:
                in_specs += [rows(p, 1, at) for at in (at_k, at_v) for p in range(parts)]
                args += [src] * (2 * parts)
            else:                   # separate [B, Hkv, D] arrays: head h's row
                one = pl.BlockSpec((None, None, 1, dp), lambda b_, h, s: (0, b_, h, 0))
                in_specs += [one, one]
                args += [k_new[None], v_new[None]]
        out_specs = [pl.BlockSpec((None, None, g, dp), lambda b_, h, s: (b_, s, h, 0)),
                     pl.BlockSpec((None, None, g), lambda b_, h, s: (b_, s, h))]
        out_shape = [jax.ShapeDtypeStruct((b, num_splits, hq, d), o_dtype),
                     jax.ShapeDtypeStruct((b, num_splits, hq), jnp.float32)]
        if append:
            out_specs += [cache_spec] * 2
            out_shape += [jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype)] * 2
    outs = C.pallas_call(
        kernel, out_shape=out_shape, grid=grid, name="jaxfuse_decode_attention",
        interpret=interpret, num_warps=blocks.num_warps, num_stages=blocks.num_stages,
        in_specs=in_specs, out_specs=out_specs,
        input_output_aliases={0: 2, 1: 3} if append else None)(*args)
    o_parts, lse_parts = outs[:2]
    if num_splits == 1:
        o, lse = o_parts[:, 0], lse_parts[:, 0]
    else:
        o, lse = merge_many(o_parts, lse_parts, axis=1)    # the split axis, in both layouts
    o, lse = o.reshape(b, hq, d).astype(k_cache.dtype), lse.reshape(b, hq)
    if not append:
        return o, lse
    if folded:     # back from the kernel's [B * Hkv, S, D] to [B, S, Hkv, D]
        back = lambda c: c.reshape(b, hkv, s_len, d).transpose(0, 2, 1, 3)
        return o, lse, back(outs[2]), back(outs[3])
    return o, lse, outs[2], outs[3]
