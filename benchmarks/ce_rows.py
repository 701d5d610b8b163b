"""The cross-entropy kernels on long rows, tile by tile: the token-slab loss
(`LCEBlocks(token_slab=2048)`) runs them on [2048, 128256] bf16 logits, where run s7-7 saw the
forward read at 1.3 TB/s, a third of the copy rate. Profiler kernel times of the forward and
the backward for a few `RowBlocks` (the default since s8: one row x 4096 columns, 4 warps, one
program per row walking its tiles in turn), with the rate against the bytes each must move
(forward: the logits once; backward: the logits read and dlogits written). `other_ms`: the
step's other kernels (XLA's gather of the labels' logits before the forward pass, the sum of
the losses), not in the rates.

    PYTHONPATH=. PYTHONUNBUFFERED=1 python benchmarks/ce_rows.py [OUT.json]
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

import jaxfuse
from jaxfuse import RowBlocks
from benchmarks import _profile, _timing
from benchmarks._timing import guarded, record

S = "ce_rows"
SHAPES = [(2048, 128256), (8192, 128256), (2048, 32768)]
TILES = [None, RowBlocks(1, 8192, 8), RowBlocks(1, 4096, 4), RowBlocks(2, 8192, 16),
         RowBlocks(1, 16384, 8)]


def main() -> None:
    copy = _timing.copy_ceiling()
    record(S, "copy 1 GiB f32 (read+write)", "xla", None, TBps=copy / 1e12)
    for n, v in SHAPES:
        ks = jax.random.split(jax.random.key(0), 2)
        z = jax.random.normal(ks[0], (n, v), jnp.bfloat16)
        y = jax.random.randint(ks[1], (n,), 0, v)
        for tiles in TILES:
            def run(tiles=tiles):
                loss = lambda z: jaxfuse.cross_entropy(z, y, reduction="sum", block_sizes=tiles)
                step = jax.jit(jax.value_and_grad(loss))
                ms = {k: t for k, _, t in _profile.kernel_times(step, (z,))}
                fwd = sum(t for k, t in ms.items() if "cross_entropy_fwd" in k)
                bwd = sum(t for k, t in ms.items() if "cross_entropy_bwd" in k)
                other = sum(ms.values()) - fwd - bwd
                nbytes = n * v * 2
                record(S, f"[{n}, {v}] bf16 kernels", str(tiles or "default"), None,
                       fwd_ms=fwd, bwd_ms=bwd, other_ms=other, fwd_TBps=nbytes / fwd / 1e9,
                       bwd_TBps=2 * nbytes / bwd / 1e9,
                       fwd_of_copy=nbytes / fwd / 1e9 / (copy / 1e12))
            guarded(S, f"[{n}, {v}] bf16 kernels", str(tiles or "default"), run)


if __name__ == "__main__":
    _timing.script(main)
