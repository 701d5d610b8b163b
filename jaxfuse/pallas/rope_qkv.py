"""The grouped q/k/v projection split into heads with RoPE on q and k, in one kernel each way.

qkv [..., T, Hkv, G + 2, D] (`jaxfuse.reference.rope_qkv`) is read once and q, k (turned) and v
(copied) written once: RoPE's kernel and custom_vjp (`rope.moved`) with three pieces instead of
one. Written as slices and `rope`, XLA copies q, k and v out of the projection (custom calls
take whole arrays) and the RoPE kernels read and write q and k again; the backward's pad + add
of dq, dk and dv into the projection's gradient ran at ~56% of the copy rate (1B model, H200,
s34). Here the backward is one kernel too: dq and dk turned back, dv copied, into one packed
gradient. H100, fwd+bwd at the 1B model's shape: 0.166 ms against the sliced path's 0.292
(benchmarks/NOTES.md s36).
"""
from __future__ import annotations

import jax

from jaxfuse.pallas import _common as C
from jaxfuse.pallas import rope as _rope
from jaxfuse.pallas._rows import RowBlocks
from jaxfuse.pallas.rope import Piece
from jaxfuse.reference import rope_qkv as ref


# A token's pieces are small tiles at the models' shapes (q [Hkv, G, D/2]: 512-1024 words, a
# padded tile of at most this many elements): two warps move them faster than RoPE's four.
# H100, fwd+bwd (s36, rope_qkv.py sweep): 1B shape 0.164 ms against 0.172 with 4 warps, 0.204
# with 8; 157M 0.092 against 0.112. Larger tiles keep the row rule's four.
_SMALL_TOKEN = 2048


def _pieces(g: int, unpack: bool) -> tuple[Piece, ...]:
    """Forward (unpack): the packed input's slots to q (0..G-1), k (G), v (G+1); backward:
    dq, dk, dv into the packed gradient's slots."""
    if unpack:
        return Piece(0, 0, 0, 0, g), Piece(0, g, 1, 0, 1), Piece(0, g + 1, 2, 0, 1, turn=False)
    return Piece(0, 0, 0, 0, g), Piece(1, 0, 0, g, 1), Piece(2, 0, 0, g + 1, 1, turn=False)


def rope_qkv(qkv: jax.Array, positions: jax.Array, *, base: float = 10000.0,
             interleaved: bool = True, interpret: bool | None = None,
             block_sizes: RowBlocks | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Pallas split + RoPE of qkv [..., T, Hkv, G + 2, D]; see `jaxfuse.reference.rope_qkv`.
    `block_sizes=RowBlocks(block_rows=tokens per program, block_cols >= D, num_warps)`."""
    ref.validate(qkv, positions, base)
    interpret = C.resolve_interpret(interpret)
    *lead, hkv, s, d = qkv.shape
    g = s - 2
    _rope.check_blocks(block_sizes, d, interpret)
    qkv4 = qkv.reshape(-1, hkv, s, d)
    per_token = hkv * g * d if interpret else _rope._padded(hkv, g, d)    # q: the largest piece
    bt, warps = _rope._tokens_per_program(qkv4.shape[0], per_token, interpret, block_sizes,
                                          warps=2 if per_token <= _SMALL_TOKEN else 4)
    pos = _rope.kernel_positions(positions.reshape(-1))          # one position per token
    st = lambda unpack, slots: _rope._Static(float(base), bool(interleaved), bt, interpret, warps,
                                             _pieces(g, unpack), slots, "rope_qkv")
    q, k, v = _rope.moved(qkv4, pos, st(True, (g, 1, 1)), st(False, (s,)))
    return q.reshape(*lead, hkv * g, d), k.reshape(*lead, hkv, d), v.reshape(*lead, hkv, d)
