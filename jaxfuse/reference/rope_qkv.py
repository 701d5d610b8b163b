"""Reference split of a grouped q/k/v projection into heads, with RoPE on q and k.

One matmul forms q, k and v of grouped-query attention as [..., T, Hkv, G + 2, D]: for each of
the Hkv KV heads its G query heads, then its key, then its value (`jaxfuse.model`'s
`qkv_weight`, the layout `decode_attention(packed_qkv="grouped")` reads). This returns

    q = rope(qkv[..., :G, :] as [..., T, Hkv G, D])
    k = rope(qkv[..., G, :]),   v = qkv[..., G + 1, :]

query head h = n G + i being slot i of KV head n (so q's heads split over devices with their KV
head). Written with slices the split copies q, k and v out and RoPE then reads and writes q
and k again; the kernel does it in one pass each way.
"""
from __future__ import annotations

import jax

from jaxfuse import _checks
from jaxfuse.reference import rope as _rope


def validate(qkv, positions, base) -> None:
    _checks.check_float("qkv", qkv)
    _checks.check_ndim("qkv", qkv, min_ndim=4)
    if qkv.shape[-2] < 3:
        raise ValueError(f"qkv.shape[-2]={qkv.shape[-2]} must be G + 2 >= 3: each KV head's G "
                         "query heads, then its k and its v (qkv is [..., T, Hkv, G + 2, D])")
    _checks.check_int("positions", positions)
    if tuple(positions.shape) != tuple(qkv.shape[:-3]):
        raise ValueError(f"positions.shape={tuple(positions.shape)} must be qkv.shape[:-3]="
                         f"{tuple(qkv.shape[:-3])} (qkv is [..., T, Hkv, G + 2, D], positions "
                         "[..., T])")
    if qkv.shape[-1] % 2:
        raise ValueError(f"the head dim qkv.shape[-1]={qkv.shape[-1]} must be even")
    _checks.check_positive("base", base, allow_none=False)


def split(qkv: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(q [..., T, Hkv G, D], k [..., T, Hkv, D], v [..., T, Hkv, D]) of the grouped qkv."""
    *lead, hkv, s, d = qkv.shape
    return qkv[..., :s - 2, :].reshape(*lead, hkv * (s - 2), d), qkv[..., s - 2, :], \
        qkv[..., s - 1, :]


def rope_qkv(qkv: jax.Array, positions: jax.Array, *, base: float = 10000.0,
             interleaved: bool = True) -> tuple[jax.Array, jax.Array, jax.Array]:
    validate(qkv, positions, base)
    q, k, v = split(qkv)
    turn = lambda x: _rope.rope(x, positions, base=base, interleaved=interleaved)
    return turn(q), turn(k), v
