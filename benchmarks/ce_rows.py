"""The cross-entropy kernels on the token-slab loss's rows (`LCEBlocks(token_slab=n)` runs
them on [n, V] bf16 logits: V = 128256 at the 1B preset, 32768 at the 157M; the presets' n is
4096 since s37, 2048 here as in s8), tile by tile.

Two ways to get a slab's loss and its gradient dz = q - p (cotangent 1):
* "pair": `jaxfuse.cross_entropy`'s forward kernel (one read of the logits for lse) and its
  backward kernel (one read, one write), as the slabs ran until s37;
* "one kernel": `cross_entropy.loss_and_grad`, which walks each row for lse and again
  (backwards) for dz, written over the logits; a row of one tile is read once.
Profiler kernel times of each for a few `RowBlocks`, with the rate against the bytes each must
move at least (read the logits, write dz: 2 N V bytes at bf16; the pair's forward: N V). Each
"one kernel" row first checks its loss and dz bitwise against the pair on the same tiles (the
same sums and formula). `other_ms`: the call's other kernels (XLA's gather of the labels'
logits, the sum of the losses; for the one kernel also XLA's copy of the logits, which a jit
argument that is not donated needs before dz is written over it: in the model the logits are
the slab's own temporary and are not copied), not in the rates.

    PYTHONPATH=. PYTHONUNBUFFERED=1 python benchmarks/ce_rows.py [OUT.json]
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxfuse import RowBlocks
from jaxfuse.pallas import cross_entropy as pce
from benchmarks import _profile, _timing
from benchmarks._timing import guarded, record

S = "ce_rows"
SHAPES = [(2048, 128256), (2048, 32768)]
TILES = {(2048, 128256): [None, RowBlocks(1, 8192, 8), RowBlocks(1, 2048, 4),
                          RowBlocks(1, 4096, 8)],
         (2048, 32768): [None, RowBlocks(1, 8192, 8), RowBlocks(1, 32768, 16),
                         RowBlocks(1, 32768, 32), RowBlocks(1, 16384, 16)]}


def _calls(z, labels, tiles):
    st = pce.static(z.shape, label_smoothing=0.0, ignore_index=-100, interpret=False,
                    block_sizes=tiles)

    def pair(z):
        loss, pull = jax.vjp(lambda z: jnp.sum(pce.token_loss(z, labels, st)), z)
        return loss, pull(jnp.float32(1.0))[0]

    def one(z):
        loss, dz = pce.loss_and_grad(z, labels, st)
        return jnp.sum(loss), dz

    return {"pair": jax.jit(pair), "one kernel": jax.jit(one)}


def main() -> None:
    copy = _timing.copy_ceiling()
    record(S, "copy 1 GiB f32 (read+write)", "xla", None, TBps=copy / 1e12)
    for n, v in SHAPES:
        ks = jax.random.split(jax.random.key(0), 2)
        z = jax.random.normal(ks[0], (n, v), jnp.bfloat16) * 3
        labels = jax.random.randint(ks[1], (n,), 0, v).at[5].set(-100)
        nbytes = n * v * 2
        for tiles in TILES[(n, v)]:
            for name, call in _calls(z, labels, tiles).items():
                def run(name=name, call=call, tiles=tiles):
                    extra = {}
                    if name == "one kernel":
                        got = call(z)
                        want = _calls(z, labels, tiles)["pair"](z)
                        extra["bitwise_as_pair"] = all(
                            np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
                            for a, b in zip(got, want))
                    ms = {k: t for k, _, t in _profile.kernel_times(call, (z,))}
                    ours = {k: t for k, t in ms.items() if "cross_entropy" in k}
                    total = sum(ours.values())
                    record(S, f"[{n}, {v}] bf16 loss and dz, kernels", f"{name}, "
                           f"{tiles or 'default'}", None, ms=total, **{
                               k.split("cross_entropy_")[-1] + "_ms": t
                               for k, t in ours.items()},
                           other_ms=sum(ms.values()) - total,
                           of_copy=2 * nbytes / total / 1e9 / (copy / 1e12), **extra)
                guarded(S, f"[{n}, {v}] bf16 loss and dz", f"{name}, {tiles or 'default'}", run)


if __name__ == "__main__":
    _timing.script(main)
