"""The Hopper (sm90, Mosaic GPU) FlashAttention backward, run on a CPU in Mosaic GPU's interpreter.

The interpreter runs the kernels' bodies (the producer's TMA ring of Q, dO, lse and delta, the
barriers, the GQA loop inside a dK/dV CTA, the dQ kernel or the fused dQ); the products are
plain dots there and the fused dQ's reducing TMA store a read-add-write
(`attention_hopper_bwd` docstring). The wgmma forms, the reducing stores and every mask
variant are checked by the sm90 lowering test (tests/test_gpu_lowering.py) and compiled on the
GPU (benchmarks/attention.py `check`). Few masked tiles here: with a causal edge or a window the
interpreter's simulated threads stall on a 2-core machine (the producer of a later CTA never
starts; see tests/test_attention_hopper.py for the forward's same limit).

Consumers: the kernels run here with two consumer warpgroups (three threads), the forward
included. The interpreter runs each simulated thread as an XLA:CPU program, and on the 2-core
machine the dK/dV kernel with three consumers (`HopperBwdTiles(consumers=3)`, four threads)
stalled on every try: the interpreter's barrier log showed consumers 0 and 2 waiting on the
ring while consumer 1 and the producer never started (not all four ran at once). On the
device machine's 16-core CPU the same tests pass (run s10-4), so they run where there are
cores enough (`needs_cores`), and compiled on the GPU (benchmarks/attention_d64_tiles.py).
"""
import functools
import os

import jax
import jax.numpy as jnp
import pytest

import jaxfuse
from jaxfuse import AttnBlocks
from jaxfuse.reference import attention as ref

from _util import keys, randn

F32 = lambda x: x.astype(jnp.float32)
DET = ("jaxfuse_flash_bwd_dkv_hopper", "jaxfuse_flash_bwd_dq_hopper")
FUSED = ("jaxfuse_flash_bwd_dkv_dq_hopper",)
FIXED = ("jaxfuse_flash_bwd_dkv_dq_fixed_hopper",)
FIX = dict(fixed_dq=True)       # the deterministic fused dQ in fixed point (opt-in)


ONE = "jaxfuse_flash_bwd_hopper"      # the kernel pair in one launch (`one_launch`)


def _pair(groups: int, one_launch=None, consumers: int = 2):
    """The kernel pair's launches: one (`HopperBwdTiles.launches_once`: by default with
    GQA, never with three dK/dV consumers) where the interpreter runs it (jax >= 0.11,
    `_hopper.INTERPRETER_010`), else two."""
    from jaxfuse.pallas import _hopper as H
    one = (groups > 1 if one_launch is None else one_launch) and consumers == 2
    return (ONE,) if one and not H.INTERPRETER_010 else DET


def _kernels(d: int, deterministic: bool, fused_dq=None, fixed_dq=False, segments=False,
             groups: int = 1, consumers: int = 2):
    """The backward kernels `HopperBwdTiles` picks (its docstring): the fused dQ at D = 64
    (or where forced, never at 256), float32 with deterministic=False, int32 fixed point
    with the default if `fixed_dq` and no segment ids; else the kernel pair (`_pair`)."""
    fused = d <= 128 and (d <= 64 if fused_dq is None else fused_dq)
    if not fused or (deterministic and (not fixed_dq or segments)):
        return _pair(groups, consumers=consumers)
    return FIXED if deterministic else FUSED
TWO = dict(consumers=2)     # see the module docstring
# Four simulated threads at once (three consumers and the producer), see the module docstring:
# stalled on 2 cores, passed on 16; 8 is a margin between them, not a measured edge.
needs_cores = pytest.mark.skipif(
    (os.cpu_count() or 1) < 8,
    reason="Mosaic GPU's interpreter did not run the four threads of a three-consumer kernel "
           "at once on 2 cores (it stalled; it passed on 16): needs 8 cores")


def _operands(seed, tk, hkv, hq=2, tq=128, d=64):
    """q, k, v, do: random bf16 [1, T, H, D] operands of a backward test."""
    kq, kk, kv, kd = keys(seed, 4)
    return (randn(kq, (1, tq, hq, d), jnp.bfloat16), randn(kk, (1, tk, hkv, d), jnp.bfloat16),
            randn(kv, (1, tk, hkv, d), jnp.bfloat16), randn(kd, (1, tq, hq, d), jnp.bfloat16))


def _grads(q, k, v, do, tiles, kernel=None, **opts):
    """dq, dk, dv of `flash_attention(q, k, v, **opts)` on the Hopper kernels with backward
    tiles `tiles` (`_blocks`' keywords) against the cotangent do, interpreted; `kernel`: the
    name of a backward kernel the program must run."""
    f = lambda q, k, v: jaxfuse.flash_attention(q, k, v, block_sizes=_blocks(**tiles), **opts)
    # jitted: one compile of the whole vjp (eagerly each primitive compiled on its own)
    run = jax.jit(lambda q, k, v, do: jax.vjp(f, q, k, v)[1](do))
    if kernel is not None:
        assert kernel in str(jax.make_jaxpr(run)(q, k, v, do))
    return run(q, k, v, do)


def _spec(g=1, d=64, **opts):
    """An AttnSpec of a compiled 256 x 256 problem (causal unless opts say otherwise) with g
    query heads a KV head, for the tiles' rules."""
    from jaxfuse.pallas._attn import AttnSpec
    return AttnSpec.make(n_q=256, n_k=256, head_dim=d, groups=g, dtype=jnp.bfloat16,
                         scale=None, interpret=False, **{"causal": True, **opts})


def _blocks(fwd_consumers=2, fwd_sum_mma=False, **bwd):
    from jaxfuse.pallas.attention_hopper import HopperAttnTiles
    from jaxfuse.pallas.attention_hopper_bwd import HopperBwdTiles
    return AttnBlocks(hopper=HopperAttnTiles(consumers=fwd_consumers, sum_mma=fwd_sum_mma,
                                             backward=HopperBwdTiles(**bwd)))


@pytest.mark.parametrize("dtype,hq,hkv,tk,deterministic,opts,vmapped,tiles", [
    (jnp.bfloat16, 2, 1, 128, True, dict(logits_soft_cap=5.0), False, TWO),  # GQA in one CTA
    # the dQ kernel's overlapped key loop over 3 steps through a 2-slot ring, and the
    # schedule without overlap
    (jnp.bfloat16, 2, 2, 384, True, dict(), False, dict(stages=2, **TWO)),
    (jnp.float16, 2, 2, 384, True, dict(), False, dict(stages=2, overlap=False, **TWO)),
    # the fixed-point fused dQ (`fixed_dq=True`, D = 64): 3 key tiles, GQA, the soft cap,
    # vmap; at D = 128 with the fused dQ forced (each consumer its half of the columns)
    (jnp.bfloat16, 2, 1, 384, True, dict(logits_soft_cap=5.0), True, FIX),
    (jnp.float16, 2, 2, 256, True, dict(head_dim=128, scale=0.3), False,
     dict(fused_dq=True, **FIX)),
    # fused dQ: 2 key tiles, GQA (4 steps per CTA: both dS^T slots reused), vmap; at D = 64
    # the consumers take turns, at D = 128 each forms its half of the columns every step
    (jnp.float16, 2, 1, 256, False, dict(scale=0.3), True, {}),
    (jnp.bfloat16, 2, 1, 256, False, dict(head_dim=128), False, dict(fused_dq=True)),
    # D = 256: the consumers of a 64-key CTA split dK's and dV's columns (4 CTAs here),
    # exchanging P^T and dS^T, 32-key dQ steps; GQA; deterministic=False runs the same pair
    (jnp.bfloat16, 2, 1, 256, True, dict(head_dim=256, logits_soft_cap=5.0), False, {}),
    (jnp.float16, 2, 2, 128, False, dict(head_dim=256), True, dict(fused_dq=True)),
    # D = 256 without the exchange: each consumer forms the whole S^T and dP^T of 32-row
    # steps itself
    (jnp.bfloat16, 2, 1, 256, True, dict(head_dim=256, logits_soft_cap=5.0), False,
     dict(exchange=False)),
    # three dK/dV consumers: one CTA of 192 keys whose third is past Tk = 128, GQA
    pytest.param(jnp.bfloat16, 2, 1, 128, True, dict(logits_soft_cap=5.0), False,
                 dict(consumers=3), marks=needs_cores),
])
def test_hopper_backward_matches_reference(dtype, hq, hkv, tk, deterministic, opts, vmapped,
                                           tiles):
    """dq, dk, dv of the Hopper backward against the float32 reference's, through jax.vjp
    with random cotangents of o and of the returned lse (dlse enters as delta -= dlse); the
    jaxpr must hold the Hopper backward's kernels, so a silent fallback fails the test. The
    fused dQ (a ref the kernel adds into) runs under jax.vmap (its rule folds the mapped
    axis into the batch)."""
    kq, kk, kv, kd, kl = keys(7, 5)
    lead = (2, 1) if vmapped else (1,)
    opts = dict(opts)
    d = opts.pop("head_dim", 64)
    q = randn(kq, lead + (128, hq, d), dtype)
    k = randn(kk, lead + (tk, hkv, d), dtype)
    v = randn(kv, lead + (tk, hkv, d), dtype)
    do = randn(kd, lead + (128, hq, d), dtype)
    dlse = randn(kl, lead + (hq, 128))

    def grads(attn, *args):
        (o, lse), vjp = jax.vjp(attn, *args[:3])
        return vjp(args[3:])
    f = lambda q, k, v: jaxfuse.flash_attention(
        q, k, v, return_lse=True, deterministic=deterministic, block_sizes=_blocks(**tiles),
        **opts)
    r = lambda q, k, v: ref.attention(q, k, v, return_lse=True, **opts)
    run, run_ref = jax.tree.map(lambda h: jax.jit(jax.vmap(h) if vmapped else h),
                                (functools.partial(grads, f), functools.partial(grads, r)))
    jaxpr = str(jax.make_jaxpr(run)(q, k, v, do, dlse))
    want = _kernels(d, deterministic, tiles.get("fused_dq"), tiles.get("fixed_dq", False),
                    groups=hq // hkv, consumers=tiles.get("consumers", 2))
    for name in DET + FUSED + FIXED + (ONE,):
        assert (name in jaxpr) == (name in want), name
    g = run(q, k, v, do, dlse)
    rg = run_ref(F32(q), F32(k), F32(v), F32(do), dlse)
    tol = 4e-2 if dtype == jnp.bfloat16 else 8e-3
    for name, a, b in zip("qkv", g, rg):
        assert a.dtype == dtype
        err = float(jnp.abs(F32(a) - b).max() / jnp.abs(b).max())
        assert err < tol, (name, err)


def test_d256_refuses_dq_steps_that_failed_on_the_gpu():
    """64-key dQ steps at D = 256 gave a wrong dq compiled on the H200 (benchmarks/NOTES.md,
    s19-2): a forced tile of that kind raises, naming the value and the fix; 32 and None run."""
    from jaxfuse.pallas.attention_hopper_bwd import HopperBwdTiles
    q = jnp.zeros((1, 128, 2, 256), jnp.bfloat16)
    f = lambda q, tiles: jaxfuse.flash_attention(q, q, q, causal=True,
                                                 block_sizes=_blocks(**tiles))
    with pytest.raises(ValueError, match="block_k_dq=64 at head_dim=256.*32"):
        jax.eval_shape(jax.grad(lambda q: f(q, dict(block_k_dq=64)).sum().astype(float)), q)
    for ok in (None, 32):
        assert HopperBwdTiles(block_k_dq=ok).k_dq(256) == 32
    assert HopperBwdTiles(block_k_dq=128).k_dq(128) == 128     # other head dims: as asked


# Backward tiles the chip or the kernels cannot take, refused by name when the call is
# planned (before, Mosaic GPU's lowering refused them: "kernel exceeds available shared
# memory", a wgmma tiling error, a TMA copy of 64 bytes; s33's sweep of the options).
@pytest.mark.parametrize("d,deterministic,kw,message", [
    (64, True, dict(stages=0), r"HopperBwdTiles.stages=0 must be a positive int"),
    (64, True, dict(block_q=48), r"HopperBwdTiles.block_q=48 must be 32, 64 or 128"),
    (128, True, dict(block_k_dq=96), r"HopperBwdTiles.block_k_dq=96 must be 32, 64 or 128"),
    (256, True, dict(block_q=128), r"HopperBwdTiles\(block_q=128\) in the dK/dV kernel at "
     r"head_dim 256: one slot of \d+ bytes .*: 0 slots fit .*; pass block_q=64 or block_q=32\b"),
    (128, True, dict(stages=5), r"HopperBwdTiles\(stages=5\) in the dK/dV kernel at head_dim "
     r"128: stages=5 .*: 4 slots fit .*; pass stages=None or block_q=32\b"),
    (128, False, dict(fused_dq=True, block_q=128), r"in the dK/dV kernel with the fused dQ at "
     r"head_dim 128: one slot .*; pass block_q=64 or fused_dq=False\b"),
    (64, False, dict(fused_dq=True, block_q=32), r"the fused dQ takes block_q 64 or 128, not "
     r"32; pass block_q=None or fused_dq=False"),
])
def test_backward_tiles_that_cannot_run_are_refused_by_name(d, deterministic, kw, message):
    q = jnp.zeros((1, 128, 2, d), jnp.bfloat16)
    with pytest.raises(ValueError, match=message):
        jaxfuse.flash_attention(q, q, q, deterministic=deterministic,
                                block_sizes=_blocks(**kw))


def test_hopper_backward_off_runs_the_portable_one():
    """backward=False runs the portable backward after the Hopper forward."""
    from jaxfuse.pallas.attention_hopper import HopperAttnTiles
    q = jnp.zeros((1, 128, 2, 64), jnp.bfloat16)
    f = lambda q, k, v: jaxfuse.flash_attention(
        q, k, v, block_sizes=AttnBlocks(hopper=HopperAttnTiles(backward=False)))
    jaxpr = str(jax.make_jaxpr(lambda q, k, v: jax.vjp(f, q, k, v)[1](q))(q, q, q))
    assert "jaxfuse_flash_fwd_hopper" in jaxpr
    assert "jaxfuse_flash_bwd_dkv" in jaxpr and not any(n in jaxpr for n in DET + FUSED)


@pytest.mark.parametrize("tq,tk,hq,hkv,d,deterministic,opts", [
    (100, 150, 2, 1, 64, True, dict()),                     # GQA, both lengths ragged
    (100, 150, 2, 1, 64, True, FIX),                        # the same in fixed point
    (70, 200, 2, 1, 64, False, dict(scale=0.3)),            # the fused dQ
    (130, 130, 2, 2, 128, True, dict(causal=True)),         # the causal edge and the tails
    # Tk % 128 <= 64: a 64-key consumer whose keys are all padding (it must still work them:
    # the fused dQ reads its K, the D = 256 exchange needs its steps; both hung before)
    (64, 150, 2, 1, 64, False, dict()),
    (64, 150, 2, 1, 256, True, dict()),
])
def test_lengths_that_are_not_whole_tiles(tq, tk, hq, hkv, d, deterministic, opts):
    """Tq and Tk that are not whole tiles run on the Hopper kernels, forward and backward,
    padded with zeros up to whole tiles while the masks keep the true lengths
    (`_attn.pad_length`): o, lse, and dq, dk, dv through jax.vjp with random cotangents of o
    and lse, against the float32 reference. Masks that took the padded lengths would give
    the zero keys probability and fail it. (`FIX` in opts: the fixed-point dQ's tiles, whose
    rows' scales are padded beside lse and delta.)"""
    kq, kk, kv, kd, kl = keys(11, 5)
    q, do = (randn(kk_, (1, tq, hq, d), jnp.bfloat16) for kk_ in (kq, kd))
    k, v = (randn(kk_, (1, tk, hkv, d), jnp.bfloat16) for kk_ in (kk, kv))
    dlse = randn(kl, (1, hq, tq))
    opts = dict(opts)
    tiles = {n: opts.pop(n) for n in FIX if n in opts}
    f = lambda q, k, v: jaxfuse.flash_attention(
        q, k, v, return_lse=True, deterministic=deterministic, block_sizes=_blocks(**tiles),
        **opts)
    jaxpr = str(jax.make_jaxpr(lambda *a: jax.vjp(f, *a)[1]((do, dlse)))(q, k, v))
    for name in ("jaxfuse_flash_fwd_hopper",) + _kernels(d, deterministic, groups=hq // hkv,
                                                          **tiles):
        assert name in jaxpr
    (o, lse), vjp = jax.vjp(f, q, k, v)
    (ro, rlse), rvjp = jax.vjp(lambda q, k, v: ref.attention(q, k, v, return_lse=True, **opts),
                               F32(q), F32(k), F32(v))
    assert o.shape == q.shape and lse.shape == (1, hq, tq)
    assert float(jnp.abs(F32(o) - ro).max()) < 2e-2
    assert float(jnp.abs(lse - rlse).max()) < 1e-4
    for name, a, b in zip("qkv", vjp((do, dlse)), rvjp((F32(do), dlse))):
        assert a.shape == b.shape
        err = float(jnp.abs(F32(a) - b).max() / jnp.abs(b).max())
        assert err < 4e-2, (name, err)


def test_deterministic_is_a_keyword_of_every_path():
    """The reference and the portable kernels take `deterministic` and ignore it."""
    kq, kk = keys(8, 2)
    q = randn(kq, (1, 8, 2, 16))
    k = randn(kk, (1, 8, 2, 16))
    for impl in ("reference", "pallas"):
        a = jaxfuse.flash_attention(q, k, k, deterministic=False, impl=impl)
        b = jaxfuse.flash_attention(q, k, k, impl=impl)
        assert jnp.array_equal(a, b)


def test_hopper_dq_overlap_adds_in_the_plain_order():
    """The overlapped dQ loop (dQ += dS K issued behind the next step's S and dP) adds the same
    products in the same order as the plain schedule: bitwise equal dq in the interpreter, over
    3 key steps through a 2-slot ring. With a 1-slot ring the overlap would hold two K tiles
    at once and wait forever; there the plain schedule runs (same bits again). The consumers'
    ping-pong (`HopperBwdTiles.pingpong`: by default in the dQ kernel; True: in the dK/dV
    kernel too) only orders when each consumer runs: dq, dk, dv bitwise equal with it in
    both kernels and without it (a 1-slot ring turns it off: it would deadlock there). Every
    kernel here runs two consumers (module docstring)."""
    q, k, v, do = _operands(9, 384, 2)
    grads = lambda **tiles: _grads(q, k, v, do, tiles)
    overlapped = grads(stages=2, **TWO)
    for other in (grads(stages=2, overlap=False, pingpong=True, **TWO),
                  grads(stages=1, **TWO)):
        for a, b in zip(overlapped, other):
            assert jnp.array_equal(a, b)


@pytest.mark.parametrize("d,fused", [(64, False), (128, False), (128, True), (64, True),
                                     (64, "fixed")])
def test_hopper_dkv_overlap_adds_in_the_plain_order(d, fused):
    """The dK/dV kernel's overlapped steps (the default, `HopperBwdTiles.dkv_overlap`: S^T and dP^T
    issued together, P and dS formed under the products) run the plain schedule's products on
    the same operands: dq, dk, dv bitwise equal to it, with GQA (two query heads walked by each
    CTA: 4 steps through a 2-slot ring) and the soft cap (its tanh carried from P to dS). With
    the fused dQ (float32, or "fixed": the deterministic int32 fixed point) the overlapped
    steps also hand dS^T to dQ's product: its reducing adds (read-add-writes here) keep their
    order too."""
    q, k, v, do = _operands(11, 256, 1, d=d)
    kernel = (FIXED if fused == "fixed" else FUSED if fused else _pair(2))[0]
    grads = lambda **tiles: _grads(q, k, v, do, tiles, kernel, logits_soft_cap=5.0,
                                   deterministic=fused in (False, "fixed"))
    tiles = (dict(stages=2, fused_dq=True, **(FIX if fused == "fixed" else {})) if fused
             else dict(stages=2, **TWO))
    for a, b in zip(grads(dkv_overlap=True, **tiles), grads(dkv_overlap=False, **tiles)):
        assert jnp.array_equal(a, b)


@pytest.mark.parametrize("d,hq,hkv,tk,opts", [
    (64, 2, 1, 256, dict(logits_soft_cap=5.0)),       # GQA: 2 dK/dV CTAs, then 2 dQ CTAs
    (256, 2, 2, 128, dict()),                          # D = 256: the split columns
])
def test_hopper_one_launch_gives_the_two_launches_bits(d, hq, hkv, tk, opts):
    """`HopperBwdTiles(one_launch=True)`: the kernel pair as one launch, its first CTAs
    running the dK/dV body and the rest the dQ body (each CTA after the last dK/dV one counts
    its query tile from there): dq, dk, dv bitwise equal to two launches'. Mosaic GPU's
    interpreter in jax 0.10 cannot run a kernel whose branches each allocate shared memory
    (`_hopper.INTERPRETER_010`): there the interpreted call runs two launches, which the
    jaxpr must say (the sm90 lowering test lowers the one launch on every version)."""
    q, k, v, do = _operands(13, tk, hkv, hq=hq, d=d)
    f = lambda q, k, v: jaxfuse.flash_attention(
        q, k, v, block_sizes=_blocks(one_launch=True), **opts)
    jaxpr = str(jax.make_jaxpr(lambda *a: jax.vjp(f, *a[:3])[1](a[3]))(q, k, v, do))
    launches = _pair(hq // hkv, one_launch=True)
    for name in DET + (ONE,):
        assert (name in jaxpr) == (name in launches), name
    if launches == DET:        # jax 0.10's interpreter: the two launches against themselves
        return
    one = jax.vjp(f, q, k, v)[1](do)
    two = _grads(q, k, v, do, dict(one_launch=False), DET[0], **opts)
    for x, y in zip(one, two):
        assert jnp.array_equal(x, y)


def test_hopper_one_launch_rule():
    """The pair runs as one launch by default with GQA/MQA only (`launches_once`, measured
    there), as asked with one_launch=True/False, and never where three dK/dV consumers
    would not share the dQ body's two; one_launch takes True, False or None."""
    from jaxfuse.pallas.attention_hopper_bwd import HopperBwdTiles as T
    spec = lambda g: _spec(g, causal=False)
    assert T().launches_once(spec(4)) and not T().launches_once(spec(1))
    assert T(one_launch=True).launches_once(spec(1))
    assert not T(one_launch=False).launches_once(spec(4))
    assert not T(one_launch=True, consumers=3).launches_once(spec(4))
    with pytest.raises(ValueError, match=r"HopperBwdTiles.one_launch=1 must be True, False"):
        T(one_launch=1)


# The pair's overlapped steps (the default) with K and V in registers run in every D = 64
# test of this file against the reference; here the fused dQ's overlapped steps and the
# pair's plain ones against K and V from shared memory.
@pytest.mark.parametrize("fused,overlap", [(True, True), (False, False)])
def test_hopper_kv_regs_gives_the_same_bits(fused, overlap):
    """`HopperBwdTiles(kv_regs=True)`: K and V held in registers as the A operands of S^T and
    dP^T (loaded once a CTA) are the same products of the same values as from shared memory:
    dq, dk, dv bitwise equal, on the overlapped steps (the pair's dK/dV kernel, and with the
    fused dQ) and the plain ones, GQA (two query heads a CTA) and the soft cap. A K or V
    swapped or read before its copy landed would differ."""
    q, k, v, do = _operands(12, 256, 1, d=64)
    kernel = (FUSED if fused else _pair(2))[0]
    grads = lambda **tiles: _grads(q, k, v, do, tiles, kernel, logits_soft_cap=5.0,
                                   deterministic=not fused)
    tiles = dict(stages=2, dkv_overlap=overlap, **(dict(fused_dq=True) if fused else TWO))
    for a, b in zip(grads(kv_regs=True, **tiles), grads(kv_regs=False, **tiles)):
        assert jnp.array_equal(a, b)


def test_hopper_kv_regs_rule():
    """`HopperBwdTiles.kv_in_regs`, the rule the test above relies on to run both: at D = 64
    by default or with True (measured faster, s42-1), never above (slower at 128, and a
    wider register operand is not checked compiled: True there is refused when the call is
    planned); False turns it off; anything else is refused."""
    from jaxfuse.pallas.attention_hopper import HopperAttnTiles
    from jaxfuse.pallas.attention_hopper_bwd import HopperBwdTiles as T
    assert T().kv_in_regs(_spec()) and not any(T().kv_in_regs(_spec(d=d)) for d in (128, 256))
    assert T(kv_regs=True).kv_in_regs(_spec()) and not T(kv_regs=False).kv_in_regs(_spec())
    with pytest.raises(ValueError, match="kv_regs=1 must be True, False or None"):
        T(kv_regs=1)
    q = jnp.zeros((1, 128, 2, 128), jnp.bfloat16)
    tiles = jaxfuse.AttnBlocks(hopper=HopperAttnTiles(backward=T(kv_regs=True)))
    with pytest.raises(ValueError, match=r"kv_regs=True\) at head_dim 128"):
        jax.grad(lambda q: jaxfuse.flash_attention(q, q, q, block_sizes=tiles).sum())(q)


@pytest.mark.parametrize("d", [64, 128])
def test_hopper_dkv_overlap_rule(d):
    """`HopperBwdTiles.dkv_overlaps`, the rule the test above relies on to run both schedules:
    by default the overlapped steps, with the fused dQ or without (with it since checked
    compiled, NOTES s41); False forces the plain ones; the consumers' ping-pong and D = 256's
    split columns keep their own steps; None (once "the default") is refused, not taken as
    off."""
    from jaxfuse.pallas.attention_hopper_bwd import HopperBwdTiles as T
    assert T().dkv_overlaps(d) and T(dkv_overlap=True).dkv_overlaps(d)
    assert not T(dkv_overlap=False).dkv_overlaps(d)
    assert not T(dkv_overlap=True, pingpong=True).dkv_overlaps(d)
    assert not T().dkv_overlaps(256)                  # D = 256's split columns
    with pytest.raises(ValueError, match="dkv_overlap=None must be True or False"):
        T(dkv_overlap=None)


@needs_cores
def test_hopper_dkv_three_consumers():
    """The dK/dV kernel's three consumers (`HopperBwdTiles(consumers=3)`: CTAs of 192 keys,
    160 registers a consumer) give dk and dv bitwise equal to two consumers' (CTAs of 128 keys):
    each key row's sums run over the same query tiles in the same order. Tk = 640: three CTAs
    of 192 keys, the last with two consumers past Tk; GQA 4/2."""
    q, k, v, do = _operands(10, 640, 2, hq=4)
    grads = lambda consumers: _grads(q, k, v, do, dict(consumers=consumers))
    for a, b in zip(grads(3), grads(2)):
        assert jnp.array_equal(a, b)


def test_heavy_first_launch_order_deals_every_tile_once():
    """`_hopper.heavy_first` (the backward's grids): a bijection from CTA index to (tile rank,
    head) when the last head group is short, each group's ranks in launch order (all its
    heads' rank 0 first), groups one after the other."""
    import numpy as np
    from jaxfuse.pallas import _hopper as H
    for n_tiles, n_bh, heads in [(5, 7, 3), (1, 4, 4), (4, 3, 8), (3, 5, 1)]:
        rank, bh = H.heavy_first(jnp.arange(n_tiles * n_bh), n_tiles, n_bh, heads)
        rank, bh = np.asarray(rank), np.asarray(bh)
        pairs = set(zip(rank.tolist(), bh.tolist()))
        assert pairs == {(r, h) for r in range(n_tiles) for h in range(n_bh)}
        group = bh // heads
        assert (np.diff(group) >= 0).all()                 # groups in order
        for g in np.unique(group):
            assert (np.diff(rank[group == g]) >= 0).all()  # heaviest ranks first in a group


def test_hopper_backward_in_head_groups(monkeypatch):
    """The backward's grids in head groups (`_hopper.heavy_first`; `_BWD_GROUP_BYTES`: the
    default's 16 MiB holds these 3 heads in one group) sized by a small byte budget: dK/dV in
    groups of 2 KV heads of 3 (the last short), dQ one head a group; gradients as the float32
    reference's."""
    from jaxfuse.pallas import attention_hopper_bwd as AHB
    from jaxfuse.pallas._attn import AttnSpec
    kq, kk, kv, kd = keys(11, 4)
    q = randn(kq, (1, 128, 3, 64), jnp.bfloat16)
    k = randn(kk, (1, 256, 3, 64), jnp.bfloat16)
    v = randn(kv, (1, 256, 3, 64), jnp.bfloat16)
    do = randn(kd, (1, 128, 3, 64), jnp.bfloat16)
    spec = AttnSpec.make(n_q=128, n_k=256, head_dim=64, groups=1, dtype=q.dtype, scale=None,
                         interpret=True)
    # The default's 16 MiB holds the three heads in one group.
    assert (AHB._dkv_heads(q, k), AHB._dq_heads(k, spec)) == (3, 3)
    monkeypatch.setattr(AHB, "_BWD_GROUP_BYTES", 65536)
    assert (AHB._dkv_heads(q, k), AHB._dq_heads(k, spec)) == (2, 1)
    f = lambda q, k, v: jaxfuse.flash_attention(q, k, v, block_sizes=_blocks(**TWO))
    _, vjp = jax.vjp(f, q, k, v)
    _, rvjp = jax.vjp(lambda q, k, v: ref.attention(q, k, v), F32(q), F32(k), F32(v))
    for name, a, b in zip("qkv", vjp(do), rvjp(F32(do))):
        err = float(jnp.abs(F32(a) - b).max() / jnp.abs(b).max())
        assert err < 4e-2, (name, err)


# Not here: the fused dQ with a causal mask, which stalls Mosaic GPU's interpreter with or
# without segment ids (the module docstring; it is checked compiled on the GPU).
@pytest.mark.parametrize("tq,tk,d,deterministic,opts", [
    (128, 256, 64, False, dict()),                         # the fused dQ
    (130, 200, 128, True, dict(causal=True)),              # the pair, ragged, causal
    (128, 128, 256, True, dict()),                         # D = 256: the exchange
])
def test_segment_ids_on_the_hopper_backward(tq, tk, d, deterministic, opts):
    """Segment ids (packed documents: sorted random ids) through the Hopper backward: the
    dK/dV kernel's queries' ids stream with each step's Q, its keys' come once with K; the
    dQ kernel's rows' with its Q, each key block's through a ring slot of their own. dq, dk,
    dv through jax.vjp with random cotangents of o and lse, against the float32 reference."""
    kq, kk, kv, kd, ka, kb, kl = keys(19, 7)
    q, do = (randn(x, (1, tq, 2, d), jnp.bfloat16) for x in (kq, kd))
    k, v = (randn(x, (1, tk, 1, d), jnp.bfloat16) for x in (kk, kv))
    seg = dict(q_segment_ids=jnp.sort(jax.random.randint(ka, (1, tq), 0, 3), axis=1),
               kv_segment_ids=jnp.sort(jax.random.randint(kb, (1, tk), 0, 3), axis=1), **opts)
    f = lambda q, k, v: jaxfuse.flash_attention(
        q, k, v, return_lse=True, deterministic=deterministic, block_sizes=_blocks(), **seg)
    (o, lse), vjp = jax.vjp(f, q, k, v)
    dlse = jnp.where(jnp.isfinite(lse), randn(kl, (1, 2, tq)), 0.0)   # rows that see no key
    jaxpr = str(jax.make_jaxpr(lambda *a: jax.vjp(f, *a)[1]((do, dlse)))(q, k, v))
    for name in ("jaxfuse_flash_fwd_hopper",) + _kernels(d, deterministic, segments=True,
                                                          groups=2):
        assert name in jaxpr
    (ro, rlse), rvjp = jax.vjp(lambda q, k, v: ref.attention(q, k, v, return_lse=True, **seg),
                               F32(q), F32(k), F32(v))
    assert float(jnp.abs(F32(o) - ro).max()) < 2e-2
    for name, a, b in zip("qkv", vjp((do, dlse)), rvjp((F32(do), dlse))):
        err = float(jnp.abs(F32(a) - b).max() / jnp.abs(b).max())
        assert err < 4e-2, (name, err)


def test_segment_ids_at_d64_without_one_launch_take_k_and_v_from_shared_memory(monkeypatch):
    """`regs_fault`: compiled, the kernel pair's dK/dV kernel with K and V in registers gave dk
    and dv wrong by 0.46-0.83 (relative) with segment ids at D = 64 without GQA (s56), and
    right with them read from shared memory (s58), while the interpreter gives both right, so
    no interpreted run can tell. There the default tiles take K and V from shared memory
    (`kv_in_regs` with the problem's spec), kv_regs=True is refused by name, and the Hopper
    backward runs; GQA's one launch, the fused dQ, D = 128 and problems without segment ids
    keep K and V in registers (checked compiled: attention_bwd.py matrix64, s58-3)."""
    from jaxfuse.pallas.attention_hopper_bwd import HopperBwdTiles as T, fits
    spec = lambda segments=True, **kw: _spec(segments=segments, **kw)
    regs = lambda s, **kw: T(**kw).kv_in_regs(s)
    assert not regs(spec())                                  # MHA: two launches
    assert not regs(spec(g=4), one_launch=False)             # GQA forced to two launches
    assert not regs(spec(), one_launch=True)                 # MHA in one launch
    assert not regs(spec(deterministic=False), fused_dq=False)   # the pair again
    assert regs(spec(g=4))                                   # GQA: one launch
    assert regs(spec(deterministic=False))                   # the fused dQ
    assert regs(spec(segments=False)) and not regs(spec(d=128))
    assert all(fits(jnp.bfloat16, spec(**kw), T())
               for kw in ({}, dict(g=4), dict(deterministic=False)))

    kq, kk, kv, kd = keys(23, 4)
    q, do = (randn(x, (1, 128, 2, 64), jnp.bfloat16) for x in (kq, kd))
    k, v = (randn(x, (1, 192, 2, 64), jnp.bfloat16) for x in (kk, kv))
    seg = dict(q_segment_ids=(jnp.arange(128) * 3 // 128)[None],
               kv_segment_ids=(jnp.arange(192) * 3 // 192)[None])
    with pytest.raises(ValueError, match=r"HopperBwdTiles\(.*\) with segment ids at head_dim "
                                         r"64 on the kernel pair \(groups=1, "
                                         r"deterministic=True\).*kv_regs=None"):
        jax.grad(lambda q: jaxfuse.flash_attention(
            q, k, v, block_sizes=_blocks(kv_regs=True), **seg).astype(jnp.float32).sum())(q)

    # Through flash_attention (interpreted): the Hopper forward and the kernel pair, whose
    # dK/dV kernel was told to read K and V from shared memory, with gradients that match
    # the float32 reference.
    asked, kv_in_regs = [], T.kv_in_regs
    monkeypatch.setattr(T, "kv_in_regs", lambda self, spec: asked.append(
        (spec.segments, kv_in_regs(self, spec))) or asked[-1][1])
    f = lambda q, k, v: jaxfuse.flash_attention(q, k, v, block_sizes=_blocks(), **seg)
    jaxpr = str(jax.make_jaxpr(lambda *a: jax.vjp(f, *a)[1](do))(q, k, v))
    assert "jaxfuse_flash_fwd_hopper" in jaxpr
    assert all(name in jaxpr for name in _pair(1)), jaxpr
    assert asked and asked[0] == (True, False), asked
    _, vjp = jax.vjp(f, q, k, v)
    _, rvjp = jax.vjp(lambda q, k, v: ref.attention(q, k, v, **seg), F32(q), F32(k), F32(v))
    for name, a, b in zip("qkv", vjp(do), rvjp(F32(do))):
        err = float(jnp.abs(F32(a) - b).max() / jnp.abs(b).max())
        assert err < 4e-2, (name, err)


def test_fixed_point_dq_agrees_with_the_kernel_pair():
    """The fixed-point fused dQ (`HopperBwdTiles(fixed_dq=True)`) against the deterministic
    kernel pair it may replace: dk and dv bitwise equal (the same products of the same
    operands in the same order), dq within one bfloat16 unit in the last place of each entry
    plus 2^-16 of its row's largest (both round a sum to bf16; the fixed point's differs from
    float32's by units of 2^-30 of each row's bound, an absolute error: entries far below
    their row's size may differ by more than their own ulp, `_fixed_sum`). GQA, the soft
    cap, 3 key tiles of 128 a CTA."""
    q, k, v, do = _operands(14, 384, 1)
    grads = lambda **tiles: _grads(q, k, v, do, tiles, logits_soft_cap=5.0)
    (dq, dk, dv), (dq0, dk0, dv0) = grads(**FIX), grads()
    assert jnp.array_equal(dk, dk0) and jnp.array_equal(dv, dv0)
    a, b = F32(dq), F32(dq0)
    big = jnp.maximum(jnp.abs(a), jnp.abs(b))
    ulp = jnp.exp2(jnp.floor(jnp.log2(jnp.where(big > 0, big, 1.0))) - 7)
    row = jnp.max(big, axis=-1, keepdims=True)
    assert bool((jnp.abs(a - b) <= ulp + row * 2.0 ** -16).all())
    assert not bool(jnp.array_equal(dq, dq0))     # (the two paths did run)


class TestLargeLogits:
    """tests/test_hardening.py's classes 3 and 4 on the Hopper kernels: scores near 4e9 keep o,
    lse and the gradients finite, and one visible key gives P = 1 exactly (o = v, dv = do).
    The kernels once formed exponents as one FMA, u c2 - m c2 (FlashAttention-3's form): the
    FMA subtracts the rounded m c2 from the exact product, so at |u c2| ~ 2^31 the largest key
    got exp2(+-128), o = NaN or lse = -inf (`_attn`'s docstring; GPU run s53-1)."""

    @pytest.mark.parametrize("deterministic", [True, False])
    def test_scores_near_4e9(self, deterministic):
        kq, kk, kv, kd = keys(41, 4)
        q = randn(kq, (1, 128, 2, 64), jnp.bfloat16, scale=2e4)
        k = randn(kk, (1, 128, 1, 64), jnp.bfloat16, scale=2e4)
        v = randn(kv, (1, 128, 1, 64), jnp.bfloat16)
        do = randn(kd, (1, 128, 2, 64), jnp.bfloat16)
        tiles = {} if deterministic else dict(fused_dq=True)
        f = lambda q, k, v: jaxfuse.flash_attention(
            q, k, v, scale=1.0, return_lse=True, deterministic=deterministic,
            block_sizes=_blocks(**tiles))
        (o, lse), vjp = jax.vjp(f, q, k, v)
        g = vjp((do, jnp.zeros_like(lse)))
        fr = lambda q, k, v: ref.attention(q, k, v, scale=1.0, return_lse=True)
        (o_r, lse_r), vjp_r = jax.vjp(fr, F32(q), F32(k), F32(v))
        g_r = vjp_r((F32(do), jnp.zeros_like(lse_r)))
        assert float(jnp.abs(lse_r).max()) > 2e9       # the scores are as large as meant
        for a in (o, lse, *g):
            assert bool(jnp.all(jnp.isfinite(F32(a))))
        # A float32 score of 64 terms is within gamma_64 sum|q_d k_d| of the exact one in any
        # order of summation (gamma_n ~ n u, u = 2^-24): the kernel's and the reference's lse
        # within twice that. (A wrong exponent moves lse by ~1e9 here.)
        bound = 2 * 64 * 2.0 ** -24 * jnp.einsum("bqhd,bkd->bhqk", jnp.abs(F32(q)),
                                                  jnp.abs(F32(k[:, :, 0]))).max(-1)
        assert bool(jnp.all(jnp.abs(lse - lse_r) <= bound))
        assert float(jnp.abs(F32(o) - o_r).max()) < 2e-2
        # dv = P^T dO sums rows of do (P is one-hot or nearly so at these scores)
        assert float(jnp.abs(F32(g[2]) - g_r[2]).max()) < 5e-2 * float(jnp.abs(g_r[2]).max())

    @pytest.mark.parametrize("sum_mma", [False, True])
    def test_one_visible_key_is_exact(self, sum_mma):
        """Each query sees one key (Tk = 1) of score ~1e5 .. 3e9: o = v and dv = do bitwise
        (also with the row sums on the tensor cores: P = 1 rounds to 1)."""
        kq, kk, kv, kd = keys(42, 4)
        blocks = _blocks(fwd_sum_mma=sum_mma)
        run = jax.jit(lambda q, k, v, do: (lambda o, vjp: (o, vjp(do)[0]))(*jax.vjp(
            lambda v: jaxfuse.flash_attention(q, k, v, block_sizes=blocks), v)))
        for logit in (1e5, 1e7, 3e8, 3e9):
            s = float(logit ** 0.5 / 8 ** 0.5)      # |q.k| ~ s^2 sqrt(64) = logit
            q = randn(kq, (1, 64, 1, 64), jnp.bfloat16, scale=s)
            k = randn(kk, (1, 1, 1, 64), jnp.bfloat16, scale=s)
            v, do = randn(kv, (1, 1, 1, 64), jnp.bfloat16), randn(kd, (1, 64, 1, 64),
                                                                  jnp.bfloat16)
            if logit == 1e5:
                assert "hopper" in str(jax.make_jaxpr(run)(q, k, v, do))
            o, dv = run(q, k, v, do)
            assert bool(jnp.array_equal(o, jnp.broadcast_to(v, o.shape))), logit
            # dv sums the 64 queries' do (P = 1 for each): float32 sums in another order
            want = jnp.sum(F32(do), axis=1, keepdims=True)
            assert float(jnp.abs(F32(dv) - want).max()) <= 1e-2 * float(jnp.abs(want).max())
            o1, dv1 = run(q[:, :1], k, v, do[:, :1])
            assert bool(jnp.array_equal(o1, v)), logit
            assert bool(jnp.array_equal(dv1, do[:, :1])), logit
