"""ptxas's report (registers, spills, wgmma serialization warnings) for the Hopper attention
forward's schedules (or, with `bwd`, the backward's kernels: the default and the
`HopperBwdTiles(dkv_overlap=False)` variant), on the GPU: Mosaic GPU prints it when
MOSAIC_GPU_DUMP_PTXAS is set (this script sets it before jax is imported). A "wgmma ... serialized" warning means ptxas waits for
each product before the next instruction, which undoes any overlap the schedule asks for.

    PYTHONPATH=. python benchmarks/hopper_ptxas.py [d ...] > ptxas.log 2>&1
    PYTHONPATH=. python benchmarks/hopper_ptxas.py bwd [d ...] > ptxas.log 2>&1
    PYTHONPATH=. python benchmarks/hopper_ptxas.py d64 > ptxas.log 2>&1   (pair, fused, fixed)
    PYTHONPATH=. python benchmarks/hopper_ptxas.py one > ptxas.log 2>&1   (the pair in one
        launch against two, MHA: why one launch loses there, NOTES s48)
    PYTHONPATH=. python benchmarks/hopper_ptxas.py seg > ptxas.log 2>&1   (s56: the D = 64
        dK/dV kernel with segment ids, wrong compiled without GQA, against its twins)
"""
from __future__ import annotations

import dataclasses
import os
import sys

os.environ.setdefault("MOSAIC_GPU_DUMP_PTXAS", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxfuse  # noqa: E402
from jaxfuse import AttnBlocks  # noqa: E402
from jaxfuse.pallas.attention_hopper import HopperAttnTiles  # noqa: E402
from jaxfuse.pallas.attention_hopper_bwd import HopperBwdTiles  # noqa: E402


def report(d: int, causal: bool, **kw):
    tiles = dataclasses.replace(HopperAttnTiles.for_head_dim(d), backward=False, **kw)
    q = jax.ShapeDtypeStruct((1, 1024, 4, d), jnp.bfloat16)
    f = jax.jit(lambda q, k, v: jaxfuse.flash_attention(
        q, k, v, causal=causal, block_sizes=AttnBlocks(hopper=tiles)))
    print(f"=== D={d} causal={causal} {kw}", flush=True)
    f.lower(q, q, q).compile()
    sys.stdout.flush()


def report_bwd(d: int, causal: bool, deterministic: bool = True, **kw):
    """The forward and both backward kernels (fwd+bwd) with the backward tiles `kw`."""
    tiles = dataclasses.replace(HopperAttnTiles.for_head_dim(d), backward=HopperBwdTiles(**kw))
    q = jax.ShapeDtypeStruct((1, 1024, 4, d), jnp.bfloat16)

    def fb(q, k, v):
        o, vjp = jax.vjp(lambda q, k, v: jaxfuse.flash_attention(
            q, k, v, causal=causal, deterministic=deterministic,
            block_sizes=AttnBlocks(hopper=tiles)), q, k, v)
        return vjp(o)
    print(f"=== fwd+bwd D={d} causal={causal} deterministic={deterministic} {kw}", flush=True)
    jax.jit(fb).lower(q, q, q).compile()
    sys.stdout.flush()


def report_seg(hq: int, hkv: int, segments: bool, **kw):
    """s56: the D = 64 kernel pair with segment ids, K and V in registers (the rule of
    `attention_hopper_bwd.regs_fault` off: wrong dK/dV compiled without GQA's one launch),
    against its twins (s58-1: ptxas injects a warpgroup.arrive with kv_regs=False only)."""
    from benchmarks.seg_probe import regs_rule_off
    tiles = dataclasses.replace(HopperAttnTiles.for_head_dim(64), backward=HopperBwdTiles(**kw))
    q = jax.ShapeDtypeStruct((1, 1024, hq, 64), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, 1024, hkv, 64), jnp.bfloat16)
    ids = jnp.zeros((1, 1024), jnp.int32)
    seg = dict(q_segment_ids=ids, kv_segment_ids=ids) if segments else {}

    def fb(q, k, v):
        o, vjp = jax.vjp(lambda q, k, v: jaxfuse.flash_attention(
            q, k, v, causal=True, block_sizes=AttnBlocks(hopper=tiles), **seg), q, k, v)
        return vjp(o)
    print(f"=== fwd+bwd D=64 causal Hq{hq} Hkv{hkv} segments={segments} {kw}", flush=True)
    with regs_rule_off():
        jax.jit(fb).lower(q, k, k).compile()
    sys.stdout.flush()


if __name__ == "__main__":
    if sys.argv[1:2] == ["seg"]:   # s56: the failing dK/dV kernel and its passing twins
        report_seg(2, 2, True)                     # wrong (s56-2)
        report_seg(2, 2, False)                    # right: no segment ids
        report_seg(4, 1, True)                     # right: GQA, one launch
        from benchmarks.seg_probe import FIXES     # the switches that could mend it
        for _, kw in FIXES:
            report_seg(2, 2, True, **kw)
        sys.exit()
    if sys.argv[1:2] == ["d64"]:   # s43: the three D = 64 backwards, K and V in registers or not
        for kv in (True, False):
            report_bwd(64, True, kv_regs=kv)
            report_bwd(64, True, False, kv_regs=kv)
            report_bwd(64, True, kv_regs=kv, fixed_dq=True)
        sys.exit()
    if sys.argv[1:2] == ["one"]:   # s49: the kernel pair as one launch or two, without groups
        for d in (64, 128):
            for causal in (True, False):
                for one in (True, False):
                    report_bwd(d, causal, one_launch=one)
        sys.exit()
    if sys.argv[1:2] == ["bwd"]:
        for d in [int(a) for a in sys.argv[2:]] or [128, 64]:
            for kw in ({}, dict(dkv_overlap=False)):
                report_bwd(d, True, **kw)
        sys.exit()
    for d in [int(a) for a in sys.argv[1:]] or [128]:
        for causal in (False, True):
            report(d, causal)
            report(d, causal, overlap=True)
