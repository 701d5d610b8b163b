"""Where the Hopper path's gradients go wrong with segment ids (s56-1: the check (1, 4160,
4160, 2, 2, 64) causal with segment ids gave o and lse right and a gradient with relative
error 0.63, bf16 and f16). For each variant: dq, dk, dv errors against the float32
reference, the kernels that ran, and where the worst gradient is wrong (positions and heads
whose largest error exceeds 5% of the gradient's largest entry: count, first, last, and the
64-row blocks they fall in).

    PYTHONPATH=. PYTHONUNBUFFERED=1 python benchmarks/seg_probe.py [OUT.json]
    PYTHONPATH=. PYTHONUNBUFFERED=1 python benchmarks/seg_probe.py variants OUT.json
    PYTHONPATH=. PYTHONUNBUFFERED=1 python benchmarks/seg_probe.py fix OUT.json

The first is s56-2's run (since s58 its D = 64 MHA rows read K and V from shared memory,
`attention_hopper_bwd.regs_fault`: the fix that `fix` found, s58-1); `variants` and `fix`
turn that rule off (`regs_rule_off`) to look at the kernel with K and V in registers, as it
ran wrong: `variants` its switches one at a time, `fix` every switch that could mend it
screened and the first right one checked on the problems of the rule.
"""
from __future__ import annotations

import contextlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxfuse
from jaxfuse import AttnBlocks
from jaxfuse.pallas.attention_hopper import HopperAttnTiles
from jaxfuse.pallas import _hopper_ring as R
from jaxfuse.pallas import attention_hopper_bwd as AHB
from jaxfuse.pallas.attention_hopper_bwd import HopperBwdTiles
from benchmarks import _timing
from benchmarks._timing import guarded, record, rel_err

S = "seg_probe"
KERNELS = ("jaxfuse_flash_fwd_hopper", "jaxfuse_flash_bwd_hopper",
           "jaxfuse_flash_bwd_dkv_hopper", "jaxfuse_flash_bwd_dq_hopper",
           "jaxfuse_flash_bwd_dkv_dq_hopper", "jaxfuse_flash_bwd_dkv")


def _where(a, r):
    """(count, first, last, blocks) of the positions (axis 1) whose error in any head and
    column exceeds 5% of r's largest entry."""
    err = np.asarray(jnp.abs(a.astype(jnp.float32) - r).max(axis=(0, 3)))   # [T, H]
    bad = err > 0.05 * float(jnp.abs(r).max())
    pos, heads = np.nonzero(bad)
    if not len(pos):
        return 0, -1, -1, "", ""
    blocks = sorted(set(int(p) // 64 for p in pos))
    return (len(pos), int(pos.min()), int(pos.max()),
            ",".join(map(str, blocks[:40])), ",".join(map(str, sorted(set(heads.tolist())))))


def case(name, t=4160, d=64, hq=2, hkv=2, causal=True, segs="thirds", det=True, hopper=True,
         dtype=jnp.bfloat16, seed=0, **extra):
    def run():
        ks = jax.random.split(jax.random.key(seed), 4)
        q = jax.random.normal(ks[0], (1, t, hq, d), dtype)
        k = jax.random.normal(ks[1], (1, t, hkv, d), dtype)
        v = jax.random.normal(ks[2], (1, t, hkv, d), dtype)
        do = jax.random.normal(ks[3], (1, t, hq, d), dtype)
        kw = dict(causal=causal, **extra)
        if segs == "thirds":
            ids = _timing.segment_thirds(1, t, t)["q_segment_ids"]
        elif segs == "aligned":          # boundaries at multiples of 128
            ids = (jnp.arange(t) // 1408)[None]
        elif segs == "one":
            ids = jnp.zeros((1, t), jnp.int32)
        if segs:
            kw.update(q_segment_ids=ids, kv_segment_ids=ids)

        def fb(impl, q, k, v, do):
            o_kw = dict(kw, impl=impl)
            if impl == "pallas":
                o_kw.update(deterministic=det, block_sizes=AttnBlocks(hopper=hopper))
            f = lambda q, k, v: jaxfuse.flash_attention(q, k, v, **o_kw)
            o, vjp = jax.vjp(f, q, k, v)
            return o, vjp(do)
        jaxpr = str(jax.make_jaxpr(lambda *a: fb("pallas", *a))(q, k, v, do))
        ran = [n for n in KERNELS if re.search(n + r"\b", jaxpr)]
        o, g = jax.jit(lambda *a: fb("pallas", *a))(q, k, v, do)
        f32 = [a.astype(jnp.float32) for a in (q, k, v, do)]
        with jax.default_matmul_precision("highest"):
            ro, rg = jax.jit(lambda *a: fb("reference", *a))(*f32)
        errs = dict(o=rel_err(o, ro), dq=rel_err(g[0], rg[0]), dk=rel_err(g[1], rg[1]),
                    dv=rel_err(g[2], rg[2]))
        worst = max(("dq", "dk", "dv"), key=errs.get)
        i = "qkv".index(worst[1])
        n, first, last, blocks, heads = _where(g[i], rg[i])
        record(S, name, jnp.dtype(dtype).name, **{f"{x}_err": round(e, 5) for x, e in
                                                  errs.items()},
               worst=worst, bad_n=n, bad_first=first, bad_last=last, bad_heads=heads,
               bad_blocks=blocks, kernels=",".join(x.replace("jaxfuse_flash_", "") for x in ran),
               status="ok" if max(errs.values()) < 2e-2 else "FAIL")
    guarded(S, name, jnp.dtype(dtype).name, run)


def variants(t=1024):
    """Which part of the D = 64 dK/dV kernel pair's (MHA, two launches) segment-id path is
    wrong (s56-2): its switches one at a time, and the launch and grouping it differs by from
    GQA's passing one launch."""
    # Since s58 these problems read K and V from shared memory (`regs_fault`): the first case
    # with that rule, the rest with it off, to see the kernel as it ran wrong.
    case(f"T{t} MHA 2/2 default (K and V from shared memory)", t=t)
    with regs_rule_off():
        _lifted(t)


def tiles(**kw) -> HopperAttnTiles:
    """The Hopper tiles with the backward's switches `kw` (the forward's by default)."""
    return HopperAttnTiles(backward=HopperBwdTiles(**kw))


@contextlib.contextmanager
def regs_rule_off():
    """The rule of `attention_hopper_bwd.regs_fault` off: these problems run the kernel pair
    with K and V in registers by default (wrong compiled, s56), and kv_regs=True is not
    refused."""
    rule = AHB.regs_fault
    AHB.regs_fault = lambda spec, tiles: False
    try:
        yield
    finally:
        AHB.regs_fault = rule


# Candidate fixes of the dK/dV kernel's segment path, each one of `variants`' switches, in
# the order a fix is preferred. K and V from shared memory first: the leading hypothesis
# (helper-81, s56 item 6) is a register hazard around the in-flight wgmma whose A operands
# are K and V held in registers, which the segment path's extra live registers expose; this
# removes that class (s42-1: from registers the faster at D = 64). Then the plain steps
# (s29-1: the overlapped the faster), both, and the launch last: GQA's one launch is right on
# these problems (s56-2), but as one kernel with the dQ body it also changes the whole
# kernel's register allocation, so a pass there could hide the hazard rather than remove it.
FIXES = [("kv_regs=False", dict(kv_regs=False)),
         ("dkv_overlap=False", dict(dkv_overlap=False)),
         ("kv_regs=False dkv_overlap=False", dict(kv_regs=False, dkv_overlap=False)),
         ("one_launch=True", dict(one_launch=True))]


def fix(t=1024):
    """Every candidate of FIXES on `variants`' problem (T1024, MHA, D = 64, three segments,
    causal), then the first of them (FIXES' order) that gave right gradients from the kernel
    pair itself, checked as the library checks itself: `attention.py check_s56`'s problems (T
    4160 causal and T 1024 not, bf16 and f16, against the float32 reference, a second run
    bitwise equal), all with that candidate's tiles and the rule off. What it found (s58-1:
    kv_regs=False) is the rule of `attention_hopper_bwd.regs_fault`."""
    from benchmarks import attention
    passed = []
    with regs_rule_off():
        for name, kw in FIXES:
            case(f"T{t} fix {name}", t=t, hopper=tiles(**kw))
            row = _timing.ROWS[-1]
            # Right gradients from the kernel pair itself (not a fallback to the portable one).
            pair = {"bwd_dkv_hopper", "bwd_hopper"} & set(row.get("kernels", "").split(","))
            if row.get("status") == "ok" and pair:
                passed.append((name, kw))
        print(f"seg_probe fix: screened, right: {[n for n, _ in passed] or 'none'}")
        if not passed:
            return
        name, kw = passed[0]
        for dtype in (jnp.bfloat16, jnp.float16):
            for i, c in enumerate(attention.HOPPER_CASES):
                if attention.regs_fault_segments(c):
                    attention._check_case(i, c, dtype, AttnBlocks(hopper=tiles(**kw)),
                                          f" hopper fix {name}")
        print(f"seg_probe fix: {name} checked")


def _lifted(t):
    """`variants`' cases with the rule off (K and V in registers by default)."""
    case(f"T{t} MHA 2/2 K and V in registers", t=t)
    for name, kw in FIXES:             # the switches `fix` tries
        case(f"T{t} {name}", t=t, hopper=tiles(**kw))
    # Every step masked without segment ids: a window of 64 keys (an edge tile each step).
    case(f"T{t} window 64, no segments", t=t, segs=None, causal=False, sliding_window=64)
    case(f"T{t} GQA 2/1 one_launch=False", t=t, hq=2, hkv=1, hopper=tiles(one_launch=False))
    case(f"T{t} MHA 1/1", t=t, hq=1, hkv=1)
    case(f"T{t} GQA 2/1 (one launch)", t=t, hq=2, hkv=1)
    case(f"T{t} MHA 1/1 not causal", t=t, hq=1, hkv=1, causal=False)
    case(f"T{t} window 64, no segments, causal", t=t, segs=None, sliding_window=64)
    case(f"T{t} consumers=3", t=t, hopper=tiles(consumers=3))
    case(f"T{t} D128", t=t, d=128)
    case(f"T{t} stages=4", t=t, hopper=tiles(stages=4))
    # One segment (all ids 0), each side's ids alone in the mask (the other side's taken as
    # 0, which they are): which load, if either, brings the fault (helper-81's hypothesis 2).
    # The dK/dV kernel's tile is S^T, so there rows are keys (in the forward and the dQ
    # kernel, which are right, rows are queries). `calls` says the patch was traced.
    outer, calls = R.outer_equal, []

    def only(side):
        def f(rows, cols):
            calls.append(side)
            return outer(rows, jnp.zeros_like(cols)) if side == "rows'" else outer(
                jnp.zeros_like(rows), cols)
        return f
    for side in ("rows'", "columns'"):
        R.outer_equal = only(side)
        try:
            case(f"T{t} one segment, only the {side} ids compared", t=t, segs="one")
        finally:
            R.outer_equal = outer
    print(f"seg_probe outer_equal patched calls: {len(calls)}")


def main():
    if sys.argv[1:2] in (["variants"], ["fix"]):
        (variants if sys.argv[1] == "variants" else fix)()
        _timing.save(sys.argv[2])
        return
    fwd_plain = HopperAttnTiles(overlap=False)
    case("T4160 default (the failing check)")
    case("T4160 det=False", det=False)
    case("T4160 portable backward", hopper=HopperAttnTiles(backward=False))
    case("T4160 forward overlap=False", hopper=fwd_plain)
    case("T4160 one segment", segs="one")
    case("T4160 aligned segments", segs="aligned")
    case("T4160 no segments", segs=None)
    case("T4160 not causal", causal=False)
    case("T4096", t=4096)
    case("T4032", t=4032)
    case("T2048", t=2048)
    case("T1024", t=1024)
    case("T4160 D128", d=128)
    case("T4160 GQA 4/1", hq=4, hkv=1)
    case("T4160 f16", dtype=jnp.float16)
    if len(sys.argv) > 1:
        _timing.save(sys.argv[1])


if __name__ == "__main__":
    main()
