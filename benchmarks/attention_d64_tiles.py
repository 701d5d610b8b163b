"""The Hopper attention kernels at the models' head dim 64, tile by tile, against cuDNN: profiler
kernel times (steadier than wall clock) of the forward and of the backward's kernels, for a few
`HopperAttnTiles` / `HopperBwdTiles`, at the 1B preset's attention (B2 T8192 H32/8, causal) and
the 157M preset's (B8 T2048 H16/4, causal), after checking the default and each variant
against the float32 reference on awkward shapes (`CHECKS`). Each variant's o and gradients are compared with
the default tiles' (bf16 rounding apart, they compute the same sums).

    PYTHONPATH=. PYTHONUNBUFFERED=1 python benchmarks/attention_d64_tiles.py [OUT.json]
"""
from __future__ import annotations

import functools
import jax
import jax.numpy as jnp

import jaxfuse
from jaxfuse import AttnBlocks
from jaxfuse.pallas.attention_hopper import HopperAttnTiles
from jaxfuse.pallas.attention_hopper_bwd import HopperBwdTiles
from benchmarks import _profile
from benchmarks._timing import guarded, record, rel_err

S = "attn_d64"
WORKLOADS = {"1B B2 T8192 H32/8": (2, 8192, 32, 8), "157M B8 T2048 H16/4": (8, 2048, 16, 4)}
# Variants measured before (NOTES s7-5: block_k 64 / 256, 2 stages, no ping-pong forward;
# block_q 128, stages 2, block_k_dq 64 backward; s9-2: the backward's consumers free against
# ping-pong; s9-6: two forward consumers; s10-3: three dK/dV consumers) lost to the default.
# Kept: three dK/dV consumers, the option nearest to winning (2.260 against 2.171 ms at 1B).
FWD = []
BWD = [HopperBwdTiles(consumers=3)]


def variants() -> list:
    """None (the default tiles), then each FWD and BWD variant as `AttnBlocks.hopper`."""
    return [None, *FWD, *(HopperAttnTiles(backward=t) for t in BWD)]


# Awkward D = 64 shapes (b, tq, tk, hq, hkv), options: CTAs of 192 query rows or keys with
# one or two consumers past Tq or Tk, bottom-right causal with rows that see no key (Tq > Tk)
# and keys no row sees (Tk > Tq), windows and soft caps, GQA.
CHECKS = [((1, 640, 640, 4, 2), dict(causal=True)),
          ((2, 256, 384, 6, 2), dict(sliding_window=77, logits_soft_cap=10.0)),
          ((1, 384, 128, 2, 1), dict(causal=True)),
          ((1, 128, 384, 2, 2), dict(causal=True)),
          ((1, 512, 512, 8, 1), dict())]


def check_variants() -> None:
    """o, lse, dq, dk and dv of the default tiles and of each variant against the float32
    reference, bf16."""
    from jaxfuse.reference import attention as ref
    for tiles in variants():
        for (b, tq, tk, hq, hkv), opts in CHECKS:
            def run(tiles=tiles, b=b, tq=tq, tk=tk, hq=hq, hkv=hkv, opts=opts):
                ks = jax.random.split(jax.random.key(tq + tk + hq), 4)
                q = jax.random.normal(ks[0], (b, tq, hq, 64), jnp.bfloat16)
                k, v = (jax.random.normal(kk, (b, tk, hkv, 64), jnp.bfloat16) for kk in ks[1:3])
                do = jax.random.normal(ks[3], q.shape, jnp.bfloat16)
                bs = None if tiles is None else AttnBlocks(hopper=tiles)
                f = lambda q, k, v: jaxfuse.flash_attention(
                    q, k, v, return_lse=True, block_sizes=bs, **opts)
                r = lambda q, k, v: ref.attention(q, k, v, return_lse=True, **opts)
                (o, lse), pull = jax.vjp(jax.jit(f), q, k, v)
                (ro, rlse), rpull = jax.vjp(r, *(x.astype(jnp.float32) for x in (q, k, v)))
                g = pull((do, jnp.zeros_like(lse)))
                rg = rpull((do.astype(jnp.float32), jnp.zeros_like(rlse)))
                fin = jnp.isfinite(rlse)
                record(S, f"check {(b, tq, tk, hq, hkv)} {opts}", str(tiles or "default"), None,
                       o_err=rel_err(o, ro),
                       lse_err=float(jnp.max(jnp.where(fin, jnp.abs(lse - rlse), 0.0))),
                       lse_inf_match=bool(jnp.all(jnp.isfinite(lse) == fin)),
                       grad_err=max(rel_err(a, c) for a, c in zip(g, rg)))
            guarded(S, f"check {(b, tq, tk, hq, hkv)} {opts}", str(tiles or "default"), run)


def _kernel_ms(fn, args) -> dict:
    return {name: ms for name, _, ms in _profile.kernel_times(jax.jit(fn), args)}


def main() -> None:
    check_variants()
    for label, (b, t, hq, hkv) in WORKLOADS.items():
        ks = jax.random.split(jax.random.key(0), 4)
        q = jax.random.normal(ks[0], (b, t, hq, 64), jnp.bfloat16)
        k, v = (jax.random.normal(kk, (b, t, hkv, 64), jnp.bfloat16) for kk in ks[1:3])
        do = jax.random.normal(ks[3], q.shape, jnp.bfloat16)

        def attend(q, k, v, tiles=None):
            bs = None if tiles is None else AttnBlocks(hopper=tiles)
            return jaxfuse.flash_attention(q, k, v, causal=True, block_sizes=bs)

        def fwd_bwd(q, k, v, tiles=None):
            o, pull = jax.vjp(functools.partial(attend, tiles=tiles), q, k, v)
            return (o, *pull(do))

        cudnn = functools.partial(jax.nn.dot_product_attention, is_causal=True,
                                  implementation="cudnn")
        guarded(S, f"{label} cudnn", "cudnn", lambda: record(
            S, f"{label} kernels", "cudnn fwd | fwd+bwd", None,
            fwd=sum(_kernel_ms(cudnn, (q, k, v)).values()),
            fwd_bwd=sum(_kernel_ms(lambda q, k, v: jax.vjp(cudnn, q, k, v)[1](do),
                                   (q, k, v)).values())))
        ref = jax.jit(fwd_bwd)(q, k, v)
        for tiles in variants():
            name = "default" if tiles is None else str(tiles)

            def run(tiles=tiles, name=name):
                got = jax.jit(functools.partial(fwd_bwd, tiles=tiles))(q, k, v)
                err = max(rel_err(g, r) for g, r in zip(got, ref))
                ms = _kernel_ms(functools.partial(fwd_bwd, tiles=tiles), (q, k, v))
                fwd = sum(v for n, v in ms.items() if "flash_fwd" in n)
                record(S, f"{label} kernels", name, None, fwd=fwd, fwd_bwd=sum(ms.values()),
                       err_vs_default=err,
                       **{n.replace("jaxfuse_flash_", "")[:24]: v for n, v in ms.items()
                          if "flash" in n})
            guarded(S, f"{label} kernels", name, run)


if __name__ == "__main__":
    from benchmarks import _timing
    _timing.script(main)
