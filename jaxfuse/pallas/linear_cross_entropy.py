"""Fused linear + cross-entropy that never holds the logits (lecture 10, sec. 5.2).

With a 128K vocabulary the logits x @ W of a batch outweigh the model: 8192 tokens give a
[8192, 128256] float32 array of 4.2 GB, and its gradient another. Here:

Forward (one Pallas kernel): a program owns a tile of tokens and walks the vocabulary in tiles;
for each it computes the logits tile (the matmul over D in chunks, float32 accumulation), applies
the soft cap, and folds it into the online (m, l) log-sum-exp, the sum of logits (smoothing) and
the label's logit. It writes the per-token loss and lse: nothing of size N x V exists anywhere.

Backward (`custom_vjp`, saves x, weight, labels, lse): the vocabulary is walked in slabs of a few
thousand columns. For each slab a Pallas kernel recomputes the logits tiles and forms
dz = (q (1 + 2 z_loss lse) - p) * g (times 1 - tanh^2 under a soft cap) in registers, writing
only dz for that slab ([N, slab], a few tens of MB); two matmuls then add dz @ W_slab^T into a
float32 dx and give dW_slab = x^T dz exactly (each element accumulated over all tokens in float32
and cast once). No atomics anywhere, so gradients are deterministic. The slab bounds the
temporary memory to about N x slab + N x D x 4 bytes whatever V is.

Cost: the logits are computed twice (forward, and recomputed backward): 4 matmuls of
2 N D V FLOPs against XLA's 3, the price of never storing them.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxfuse.pallas import _common as C
from jaxfuse.reference import linear_cross_entropy as ref
from jaxfuse.reference import cross_entropy as ce
from jaxfuse.reference.cross_entropy import reduce_loss


@dataclasses.dataclass(frozen=True)
class LCEBlocks:
    """Tiles: `block_n` tokens x `block_v` vocabulary per logits tile, `block_d` of D per matmul
    step; `slab` vocabulary columns per backward step. `num_*` only matter on the GPU."""
    block_n: int = 128
    block_v: int = 128
    block_d: int = 64
    slab: int | None = None
    num_warps: int = 8
    num_stages: int = 3

    @classmethod
    def for_shape(cls, n: int, d: int, v: int, itemsize: int, interpret: bool) -> "LCEBlocks":
        if interpret:
            # One interpreted step over all tokens, the vocabulary walked in-kernel.
            bv = min(v, 256)
            slab_budget = 1 << 20                     # elements of dz per slab (4 MiB f32)
            return cls(n, bv, d, _slab(slab_budget, n, bv, v), 1, 1)
        slab_budget = (64 << 20) // itemsize          # 64 MiB of dz per slab
        return cls(128, 128, 64, _slab(slab_budget, n, 128, v), 8, 4)


def _slab(budget: int, n: int, bv: int, v: int) -> int:
    return min(C.cdiv(v, bv) * bv, max(bv, (budget // max(n, 1)) // bv * bv))


@dataclasses.dataclass(frozen=True)
class _Static:
    label_smoothing: float
    ignore_index: int
    z_loss: float
    softcap: float | None
    n: int
    d: int
    v: int
    blocks: LCEBlocks
    interpret: bool


def _logits(x_ref, w_ref, t0, v0, st: _Static, predicate: bool = False):
    """Float32 logits tile [bn, bv] of tokens t0.. and vocabulary columns v0.., and tanh(z / c)
    under a soft cap (else None). Out-of-range rows/columns read zeros."""
    b = st.blocks
    bn, bv, bd = b.block_n, b.block_v, b.block_d

    def d_step(c, acc):
        d0 = c * bd
        xt = C.load_tile(x_ref, t0, d0, bn, bd, st.n, st.d, predicate=predicate)[0]
        wt = C.load_tile(w_ref, d0, v0, bd, bv, st.d, st.v, predicate=predicate)[0]
        return acc + jnp.dot(xt, wt, preferred_element_type=jnp.float32)

    z = C.reduce_tiles(C.cdiv(st.d, bd), d_step, jnp.zeros((bn, bv), jnp.float32))
    if st.softcap is None:
        return z, None
    t = jnp.tanh(z / st.softcap)
    return st.softcap * t, t


def _fwd_kernel(x_ref, w_ref, lab_ref, loss_ref, lse_ref, *, st: _Static):
    b = st.blocks
    bn, bv = b.block_n, b.block_v
    t0 = pl.program_id(0) * bn
    label = C.load_vec(lab_ref, t0, bn, st.n)[:, None]                        # [bn, 1]
    cols0 = jax.lax.broadcasted_iota(jnp.int32, (bn, bv), 1)

    def v_step(j, carry):
        m, l, sum_z, picked = carry
        v0 = j * bv
        z, _ = _logits(x_ref, w_ref, t0, v0, st)
        cols = v0 + cols0
        valid = cols < st.v
        m, l = C.online_max_sum((m, l), jnp.where(valid, z, C.NEG_INF))
        sum_z = sum_z + jnp.sum(jnp.where(valid, z, 0.0), axis=-1, keepdims=True)
        picked = picked + jnp.sum(jnp.where(cols == label, z, 0.0), axis=-1, keepdims=True)
        return m, l, sum_z, picked

    zero = jnp.zeros((bn, 1), jnp.float32)
    init = (jnp.full((bn, 1), C.NEG_INF, jnp.float32), zero, zero, zero)
    m, l, sum_z, picked = C.reduce_tiles(C.cdiv(st.v, bv), v_step, init)
    lse = m + jnp.log(l)
    loss = ce.loss_from_stats(lse, picked, sum_z, label, st.v, label_smoothing=st.label_smoothing,
                              ignore_index=st.ignore_index, z_loss=st.z_loss)
    C.store_vec(loss_ref, loss[:, 0], t0, st.n)
    C.store_vec(lse_ref, lse[:, 0], t0, st.n)


def _dz_kernel(off_ref, x_ref, w_ref, lab_ref, lse_ref, g_ref, dz_ref, *, st: _Static,
               width: int):
    b = st.blocks
    bn, bv = b.block_n, b.block_v
    t0, v0 = pl.program_id(0) * bn, pl.program_id(1) * bv
    off = off_ref[0]
    # Predicated loads measured faster here than unpredicated ones (H200: 55.6 vs 81.6 ms for
    # the backward at N=8192, V=128256; BENCHMARKS.md), the opposite of the forward.
    z, t = _logits(x_ref, w_ref, t0, off + v0, st, predicate=True)
    label, lse, g = (C.load_vec(r, t0, bn, st.n)[:, None] for r in (lab_ref, lse_ref, g_ref))
    cols = off + v0 + jax.lax.broadcasted_iota(jnp.int32, (bn, bv), 1)
    dz = ce.logits_grad(z, cols, label, lse, g, st.v, label_smoothing=st.label_smoothing,
                        z_loss=st.z_loss)
    if t is not None:
        dz = dz * (1.0 - t * t)
    C.store_tile(dz_ref, dz, t0, v0, st.n, width)


def _forward(x2, w, labels, st: _Static):
    b = st.blocks
    return C.pallas_call(
        functools.partial(_fwd_kernel, st=st),
        out_shape=[jax.ShapeDtypeStruct((st.n,), jnp.float32)] * 2,
        grid=(C.cdiv(st.n, b.block_n),), name="jaxfuse_linear_cross_entropy_fwd",
        interpret=st.interpret, num_warps=b.num_warps, num_stages=b.num_stages)(x2, w, labels)


def _dz(offset, width: int, x2, w, labels, lse, g, st: _Static):
    """dz for vocabulary columns [offset, offset + width) ([N, width], in x's dtype)."""
    b = st.blocks
    return C.pallas_call(
        functools.partial(_dz_kernel, st=st, width=width),
        out_shape=jax.ShapeDtypeStruct((st.n, width), x2.dtype),
        grid=(C.cdiv(st.n, b.block_n), C.cdiv(width, b.block_v)),
        name="jaxfuse_linear_cross_entropy_dz", interpret=st.interpret,
        num_warps=b.num_warps, num_stages=b.num_stages)(
        jnp.reshape(offset, (1,)).astype(jnp.int32), x2, w, labels, lse, g)


def _backward(x2, w, labels, lse, g, st: _Static):
    slab = st.blocks.slab
    n_full, tail = divmod(st.v, slab)

    def add_slab(offset, width, dx, dw):
        dz = _dz(offset, width, x2, w, labels, lse, g, st)                    # [N, width]
        w_slab = jax.lax.dynamic_slice(w, (0, offset), (st.d, width))
        dx = dx + jnp.dot(dz, w_slab.T, preferred_element_type=jnp.float32)
        dw_slab = jnp.dot(x2.T, dz, preferred_element_type=jnp.float32).astype(w.dtype)
        return dx, jax.lax.dynamic_update_slice(dw, dw_slab, (0, offset))

    carry = (jnp.zeros((st.n, st.d), jnp.float32), jnp.zeros_like(w))
    if n_full:
        carry = jax.lax.fori_loop(0, n_full, lambda s, c: add_slab(s * slab, slab, *c), carry)
    if tail:
        carry = add_slab(n_full * slab, tail, *carry)
    dx, dw = carry
    return dx.astype(x2.dtype), dw


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def token_loss(x2, w, labels, st: _Static):
    """Per-token loss [N] (0 at ignored tokens, NaN at out-of-range labels)."""
    return _forward(x2, w, labels, st)[0]


def _token_loss_fwd(x2, w, labels, st):
    loss, lse = _forward(x2, w, labels, st)
    return loss, (x2, w, labels, lse)


def _token_loss_bwd(st, res, g):
    x2, w, labels, lse = res
    dx, dw = _backward(x2, w, labels, lse, ce.token_cotangent(g, labels, st.v, st.ignore_index),
                       st)
    return dx, dw, jnp.zeros(labels.shape, jax.dtypes.float0)


token_loss.defvjp(_token_loss_fwd, _token_loss_bwd)


def linear_cross_entropy(x: jax.Array, weight: jax.Array, labels: jax.Array, *,
                         label_smoothing: float = 0.0, ignore_index: int = -100,
                         z_loss: float = 0.0, logits_soft_cap: float | None = None,
                         reduction: str = "mean", interpret: bool | None = None,
                         block_sizes: LCEBlocks | None = None) -> jax.Array:
    """Pallas linear + cross-entropy; see `jaxfuse.reference.linear_cross_entropy`."""
    ref.validate(x, weight, labels, label_smoothing, reduction, z_loss, logits_soft_cap)
    interpret = C.resolve_interpret(interpret)
    d, v = weight.shape
    x2 = x.reshape(-1, d)
    n = x2.shape[0]
    blocks = block_sizes or LCEBlocks.for_shape(n, d, v, x.dtype.itemsize, interpret)
    if blocks.slab is None:
        blocks = dataclasses.replace(blocks, slab=_slab(1 << 24, n, blocks.block_v, v))
    if blocks.slab % blocks.block_v:
        raise ValueError(f"slab={blocks.slab} must be a multiple of block_v={blocks.block_v}")
    st = _Static(float(label_smoothing), int(ignore_index), float(z_loss),
                 None if logits_soft_cap is None else float(logits_soft_cap), n, d, v, blocks,
                 interpret)
    labels1 = labels.reshape(-1).astype(jnp.int32)
    loss = token_loss(x2, weight, labels1, st).reshape(labels.shape)
    return reduce_loss(loss, labels != ignore_index, reduction)
