"""Is a three-product loss worth building? The fused linear + cross-entropy recomputes the
logits in its backward (four [N, D] x [D, V] products, BENCHMARKS.md: its floor), where a loss
that holds the logits does three. This times, at the two presets' loss shapes (profiler kernel
time of loss + dx + dW, bf16, mean over tokens):

  fused:    `jaxfuse.linear_cross_entropy` under `jax.value_and_grad` (today's model loss);
  slabs:    `LCEBlocks(token_slab=2048)`: the gradient computed in the forward, slab by
            slab of tokens (Liger-Kernel's scheme, possible because the mean's cotangent is one
            scalar): per slab, logits by XLA's matmul, loss and dlogits by
            `jaxfuse.cross_entropy`'s kernels, dx and dW by XLA's matmuls; no [N, V] logits
            held, three products (run s7-7 timed the same composition written out here);
  unfused:  `jaxfuse.cross_entropy(x @ w)`: the logits held from forward to backward.

    PYTHONPATH=. PYTHONUNBUFFERED=1 python benchmarks/lce_paths.py [OUT.json]
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

import jaxfuse
from benchmarks import _profile
from benchmarks._timing import guarded, record, rel_err

S = "lce_paths"
SHAPES = {"1B": (16384, 2048, 128256), "157M": (16384, 1024, 32768)}
SLAB = 2048


def fused(x, w, y):
    return jax.value_and_grad(lambda x, w: jaxfuse.linear_cross_entropy(x, w, y),
                              argnums=(0, 1))(x, w)


def unfused(x, w, y):
    return jax.value_and_grad(lambda x, w: jaxfuse.cross_entropy(x @ w, y), argnums=(0, 1))(x, w)


def slabs(x, w, y):
    return jax.value_and_grad(lambda x, w: jaxfuse.linear_cross_entropy(
        x, w, y, block_sizes=jaxfuse.LCEBlocks(token_slab=SLAB)), argnums=(0, 1))(x, w)


def main() -> None:
    for label, (n, d, v) in SHAPES.items():
        ks = jax.random.split(jax.random.key(0), 3)
        x = jax.random.normal(ks[0], (n, d), jnp.bfloat16)
        w = (jax.random.normal(ks[1], (d, v), jnp.float32) / d ** 0.5).astype(jnp.bfloat16)
        y = jax.random.randint(ks[2], (n,), 0, v).at[:7].set(-100)
        ref = jax.jit(fused)(x, w, y)
        for name, fn in (("fused", fused), ("slabs", slabs), ("unfused", unfused)):
            def run(fn=fn, name=name):
                f = jax.jit(fn)
                loss, (dx, dw) = f(x, w, y)
                temp = f.lower(x, w, y).compile().memory_analysis().temp_size_in_bytes
                ms = _profile.kernel_times(f, (x, w, y))
                record(S, f"{label} N{n} D{d} V{v} loss+dx+dW", name, None,
                       kernel_ms=sum(t for _, _, t in ms), temp_GB=temp / 1e9,
                       loss_err=rel_err(loss, ref[0]), dx_err=rel_err(dx, ref[1][0]),
                       dw_err=rel_err(dw, ref[1][1]),
                       top=" | ".join(f"{k[:28]} {t:.2f}" for k, _, t in ms[:4]))
            guarded(S, f"{label} loss+dx+dW", name, run)


if __name__ == "__main__":
    from benchmarks import _timing
    _timing.script(main)
