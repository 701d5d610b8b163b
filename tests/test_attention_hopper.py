"""The Hopper (sm90, Mosaic GPU) FlashAttention forward, run on a CPU in Mosaic GPU's interpreter.

The interpreter runs the same kernel body: the producer warpgroup's TMA ring, the barriers, the
two consumer warpgroups' online softmax and the ping-pong rendezvous; only the two matrix
products are plain dots there (`attention_hopper._Mma`). The wgmma forms and every mask
variant are checked by the sm90 lowering test (tests/test_gpu_lowering.py) and compiled on the
GPU (benchmarks/attention.py). Causal cases once stalled the interpreter's simulated threads on
a 2-core machine (XLA:CPU's pool, since s23 sized in tests/conftest.py); one runs here now,
with the windows of the tests below.
"""
import dataclasses
import pathlib

import chex
import jax
import jax.numpy as jnp
import pytest

import jaxfuse
from jaxfuse import AttnBlocks
from jaxfuse.pallas._attn import AttnSpec
from jaxfuse.pallas.attention_hopper import HopperAttnTiles
from jaxfuse.reference import attention as ref

from _util import keys, randn

F32 = lambda x: x.astype(jnp.float32)


_CASES = [
    (HopperAttnTiles(backward=False), dict(logits_soft_cap=30.0)),
    (HopperAttnTiles(block_k=64, stages=2, pingpong=False, backward=False), dict(scale=0.3)),
    # two consumers taking turns (the default above D = 64; at 64 three: the two cases
    # above, whose third consumer is past the last of the 128 rows and only releases the ring)
    (HopperAttnTiles(consumers=2, backward=False), dict()),
    # the intra-warpgroup overlap (S_j and P_{j-1} V_{j-1} issued together): two consumers
    # running free on a ring of 4 slots, then taking turns on a ring of 2 (V held a step, edge
    # tiles cleaned as they land, the held tile released before the turn passes) with a
    # window whose every tile is an edge for some rows. Three consumers with the overlap stall
    # the interpreter's threads on 2 cores (the callbacks that simulate barrier waits hold
    # XLA's CPU threads); the sm90 lowering test and the GPU check cover them.
    (HopperAttnTiles(overlap=True, consumers=2, pingpong=False, backward=False),
     dict(logits_soft_cap=30.0)),
    (HopperAttnTiles(overlap=True, consumers=2, stages=2, backward=False),
     dict(sliding_window=40)),
    # both products waited for before the softmax (the interpreter runs each product when
    # issued: this checks the schedule's bookkeeping, the wait is the sm90 lowering's)
    (HopperAttnTiles(overlap="issue", consumers=2, pingpong=False, backward=False),
     dict(causal=True)),
]


# Both dtypes for the schedules before the overlap; bf16 alone for the overlap's (its products
# are the same wgmma forms).
@pytest.mark.parametrize("dtype,tiles,opts", [
    (dtype, tiles, opts) for tiles, opts in _CASES
    for dtype in ((jnp.bfloat16,) if tiles.overlap else (jnp.bfloat16, jnp.float16))])
def test_hopper_forward_matches_reference(dtype, tiles, opts):
    """GQA (4 query heads on 1 KV head), Tk > Tq, a soft cap or a custom scale: o, lse and
    (through the portable backward, fed by the Hopper forward's o and lse) dq, dk, dv. The
    Hopper backward has its own tests (test_attention_hopper_bwd.py)."""
    kq, kk, kv, kd = keys(3, 4)
    q = randn(kq, (1, 128, 4, 64), dtype)
    k = randn(kk, (1, 256, 1, 64), dtype)
    v = randn(kv, (1, 256, 1, 64), dtype)
    do = randn(kd, (1, 128, 4, 64), dtype)
    f = lambda q, k, v: jaxfuse.flash_attention(q, k, v, return_lse=True,
                                                block_sizes=AttnBlocks(hopper=tiles), **opts)
    (o, lse), vjp = jax.vjp(f, q, k, v)
    g = vjp((do, jnp.zeros_like(lse)))
    (ro, rlse), rvjp = jax.vjp(lambda q, k, v: ref.attention(q, k, v, return_lse=True, **opts),
                               F32(q), F32(k), F32(v))
    rg = rvjp((F32(do), jnp.zeros_like(rlse)))
    tol = 2e-2 if dtype == jnp.bfloat16 else 4e-3
    assert float(jnp.abs(F32(o) - ro).max()) < tol
    assert float(jnp.abs(lse - rlse).max()) < 1e-4
    for a, b in zip(g, rg):
        assert float(jnp.abs(F32(a) - b).max()) < 2 * tol


@pytest.mark.parametrize("opts", [dict(), dict(sliding_window=40)])
def test_persistent_walk_matches_reference(opts):
    """Persistent CTAs (two in the interpreter) walking three work tiles (3 query heads on one
    KV head): one CTA takes two, the other one, and a CTA's ring of 4 slots (three 64-key
    blocks a tile, so its second tile starts on the last slot and wraps) runs on across its
    tiles, as do its consumers' Q loads (the next one issued after the last
    S) and O stores; under a window too, where persistence is forced (the producer cleans edge
    tiles at slots offset by the earlier tiles' steps)."""
    kq, kk, kv = keys(5, 3)
    q = randn(kq, (1, 128, 3, 64), jnp.bfloat16)
    k = randn(kk, (1, 192, 1, 64), jnp.bfloat16)
    v = randn(kv, (1, 192, 1, 64), jnp.bfloat16)
    tiles = HopperAttnTiles(block_k=64, stages=4, consumers=2, persistent=True, backward=False)
    o, lse = jaxfuse.flash_attention(q, k, v, return_lse=True,
                                     block_sizes=AttnBlocks(hopper=tiles), **opts)
    ro, rlse = ref.attention(F32(q), F32(k), F32(v), return_lse=True, **opts)
    assert float(jnp.abs(F32(o) - ro).max()) < 2e-2
    assert float(jnp.abs(lse - rlse).max()) < 1e-4


def test_split_tail_matches_reference_and_the_whole_walk():
    """`HopperAttnTiles.split_tail` (None, the default): two persistent CTAs (the
    interpreter's) and three equal work tiles, so the last round's one tile is split over its
    three 64-key blocks into two parts (one on each CTA), each writing its rows' (o, lse),
    merged after the kernel. Within the reference's tolerance like the unsplit walk, lse to
    float32 rounding, o within one bf16 rounding of the unsplit walk (the parts' o round once
    more), and gradients through the split forward against the reference's; a merge that
    dropped a part, or a part that saw the wrong keys, moves the split tile's rows by far
    more."""
    import numpy as np
    kq, kk, kv, kd = keys(5, 4)
    q = randn(kq, (1, 128, 3, 64), jnp.bfloat16)
    k = randn(kk, (1, 192, 1, 64), jnp.bfloat16)
    v = randn(kv, (1, 192, 1, 64), jnp.bfloat16)
    do = randn(kd, (1, 128, 3, 64), jnp.bfloat16)
    (ro, rlse), rvjp = jax.vjp(lambda q, k, v: ref.attention(q, k, v, return_lse=True),
                               F32(q), F32(k), F32(v))
    got = {}
    for split in (False, None):     # None: the default, split where it applies
        tiles = HopperAttnTiles(block_k=64, stages=4, consumers=2, persistent=True,
                                backward=False, split_tail=split)
        f = lambda q, k, v: jaxfuse.flash_attention(q, k, v, return_lse=True,
                                                    block_sizes=AttnBlocks(hopper=tiles))
        got[split] = o, lse = f(q, k, v)
        assert float(jnp.abs(F32(o) - ro).max()) < 2e-2
        assert float(jnp.abs(lse - rlse).max()) < 1e-4
    (o1, lse1), (o0, lse0) = got[None], got[False]
    np.testing.assert_allclose(F32(o1), F32(o0), atol=4e-3, rtol=8e-3)
    np.testing.assert_allclose(lse1, lse0, atol=1e-5)
    # Gradients through the split forward (the backward reads its merged o and lse).
    _, vjp = jax.vjp(f, q, k, v)
    for a, b in zip(vjp((do, jnp.zeros_like(lse1))), rvjp((F32(do), jnp.zeros_like(rlse)))):
        assert float(jnp.abs(F32(a) - b).max()) < 4e-2


def test_hopper_kernels_run_under_jit():
    """Mosaic GPU's interpreter keeps memory and barriers in ordered IO callbacks, which
    custom_partitioning could not lower inside a jit (a KeyError naming OrderedIOEffect, so a
    forced Hopper path ran only eagerly): it now runs unpartitioned there, with the bits of the
    eager call, forward and gradients (the backward test also runs under jit, with vmap)."""
    kq, kk, kv, kc = keys(11, 4)
    q, k, v = (randn(x, (1, 128, 2, 64), jnp.bfloat16) for x in (kq, kk, kv))
    ct = randn(kc, (1, 128, 2, 64), jnp.bfloat16)
    blocks = AttnBlocks(hopper=True)

    def f(q, k, v):
        o, vjp = jax.vjp(lambda q, k, v: jaxfuse.flash_attention(
            q, k, v, causal=True, block_sizes=blocks), q, k, v)
        return o, vjp(ct)
    assert "jaxfuse_flash_fwd_hopper" in str(jax.make_jaxpr(f)(q, k, v))
    chex.assert_trees_all_equal(jax.jit(f)(q, k, v), f(q, k, v))


def test_causal_forward_matches_reference():
    """The default D = 128 tiles with a causal mask: two consumers taking turns on a 2-slot
    ring, the diagonal blocks masked and cleaned of garbage by the producer, blocks above it
    never loaded; GQA (2 query heads on 1 KV head), three CTAs of 128 rows."""
    kq, kk, kv = keys(9, 3)
    q = randn(kq, (1, 384, 2, 128), jnp.bfloat16)
    k = randn(kk, (1, 384, 1, 128), jnp.bfloat16)
    v = randn(kv, (1, 384, 1, 128), jnp.bfloat16)
    o, lse = jaxfuse.flash_attention(q, k, v, causal=True, return_lse=True,
                                     block_sizes=AttnBlocks(hopper=HopperAttnTiles(
                                         backward=False)))
    ro, rlse = ref.attention(F32(q), F32(k), F32(v), causal=True, return_lse=True)
    assert float(jnp.abs(F32(o) - ro).max()) < 2e-2
    assert float(jnp.abs(lse - rlse).max()) < 1e-4


_MIDDLE_EDGES = """
import jax, jax.numpy as jnp
import jaxfuse
from jaxfuse.pallas.attention_hopper import HopperAttnTiles
from jaxfuse.reference import attention as ref
ks = jax.random.split(jax.random.key(0), 3)
q = jax.random.normal(ks[0], (1, 256, 2, 64), jnp.bfloat16)
k, v = (jax.random.normal(kk, (1, 256, 1, 64), jnp.bfloat16) for kk in ks[1:])
r = ref.attention(*(x.astype(jnp.float32) for x in (q, k, v)), causal=True, sliding_window=100)
for persistent in (False, True):
    tiles = HopperAttnTiles(block_k=64, stages=2, consumers=2, persistent=persistent,
                            backward=False)
    o = jaxfuse.flash_attention(q, k, v, causal=True, sliding_window=100,
                                block_sizes=jaxfuse.AttnBlocks(hopper=tiles))
    print(float(jnp.abs(o.astype(jnp.float32) - r).max()))
"""


def test_window_with_edge_blocks_in_the_middle_does_not_hang():
    """A 2-slot ring, two consumers taking turns and a window whose edge blocks (keys some of
    the CTA's rows do not see, which the producer cleans of garbage) are followed by more
    blocks: the producer had deferred each edge block's cleaning until the next block's copy
    was issued, that copy waited for a slot the consumers release only after starting on the
    edge block, and the kernel hung (s28: in the interpreter, and the D = 128 default on an
    H200 has a 2-slot ring). Run in a subprocess under a timeout, so that a hang fails the
    test rather than the suite; a CTA a tile, then persistent CTAs (slots running on across
    work tiles)."""
    import subprocess
    import sys
    # The suite's compile settings in the child too (conftest: each interpreted body compiled
    # once; on a CPU, XLA's cheap passes as `_fast_cpu_compiles` sets them): 23 s -> 8 s on 2
    # cores, the same kernel run.
    prelude = (f"import sys; sys.path.insert(0, {str(pathlib.Path(__file__).parent)!r})\n"
               "import conftest, jax\n"
               "if jax.default_backend() == 'cpu':\n"
               "    jax.config.update('jax_disable_most_optimizations', True)")
    try:
        out = subprocess.run([sys.executable, "-c", prelude + "\n" + _MIDDLE_EDGES],
                             capture_output=True, text=True, timeout=300,
                             check=True).stdout.split()
    except subprocess.TimeoutExpired:
        pytest.fail("the Hopper forward hung (a window with edge blocks in the middle)")
    assert len(out) == 2 and all(float(e) < 2e-2 for e in out), out


@pytest.mark.parametrize("shape,kw,what", [
    ((1, 128, 2, 80), {}, "head_dim in"),
])
def test_forced_hopper_rejects_what_it_cannot_take(shape, kw, what):
    q = jnp.zeros(shape, jnp.bfloat16)
    with pytest.raises(ValueError, match=what):
        jaxfuse.flash_attention(q, q, q, block_sizes=AttnBlocks(hopper=True), **kw)


@pytest.mark.parametrize("block_k", [32, 96, 192, 512])
def test_key_tiles_other_than_64_128_256_rejected(block_k):
    with pytest.raises(ValueError, match=f"block_k={block_k} must be 64, 128 or 256"):
        HopperAttnTiles(block_k=block_k)


@pytest.mark.parametrize("d,consumers", [(64, None), (64, 3), (256, 2)])
def test_256_key_tiles_need_registers(d, consumers):
    """256-key tiles at head_dim 64 with three consumers failed in ptxas on an H200 (s28): a
    ValueError naming the fix instead; at head_dim 256 S and O alone would take 256 registers
    a thread (232 at most)."""
    q = jnp.zeros((1, 256, 2, d), jnp.bfloat16)
    tiles = HopperAttnTiles(block_k=256, consumers=consumers, backward=False)
    with pytest.raises(ValueError, match="block_k=256"):
        jaxfuse.flash_attention(q, q, q, block_sizes=AttnBlocks(hopper=tiles))
    HopperAttnTiles(block_k=256, consumers=2).check_head_dim(64)     # the fix named: taken
    HopperAttnTiles(block_k=256).check_head_dim(128)


@pytest.mark.parametrize("dtype,tiles,opts", [
    (dtype, HopperAttnTiles(sum_mma=True, backward=False), dict(logits_soft_cap=30.0))
    for dtype in (jnp.bfloat16, jnp.float16)] + [          # three consumers, above two
    (jnp.bfloat16, HopperAttnTiles(sum_mma=True, consumers=2, stages=2, backward=False),
     dict(sliding_window=40)),
    # persistent (the walk of `test_persistent_walk_matches_reference`): l starts again at
    # zero for each work tile, the ones tile loaded once for all of them
    (jnp.bfloat16, HopperAttnTiles(sum_mma=True, block_k=64, stages=4, consumers=2,
                                   persistent=True, backward=False), dict()),
])
def test_row_sums_on_the_tensor_cores(dtype, tiles, opts):
    """`HopperAttnTiles(sum_mma=True)`: l += P 1 by a product beside P V. o as the default's
    tolerance; lse within the rounding of P to the input dtype (each p off by at most the
    unit roundoff u, so their sum too: |d lse| <= log(1 + u)), which the default's float32
    sum does not have (its lse is held to 1e-4 above). A step's P 1 missed or doubled would
    move lse by ~log 2."""
    kq, kk, kv = keys(5, 3)
    q = randn(kq, (1, 128, 3, 64), dtype)
    k, v = randn(kk, (1, 320, 1, 64), dtype), randn(kv, (1, 320, 1, 64), dtype)
    o, lse = jaxfuse.flash_attention(q, k, v, return_lse=True,
                                     block_sizes=AttnBlocks(hopper=tiles), **opts)
    ro, rlse = ref.attention(F32(q), F32(k), F32(v), return_lse=True, **opts)
    u = float(jnp.finfo(dtype).eps) / 2
    assert float(jnp.abs(F32(o) - ro).max()) < (2e-2 if dtype == jnp.bfloat16 else 4e-3)
    assert float(jnp.abs(lse - rlse).max()) < jnp.log1p(u) + 1e-4


def test_overlap_takes_true_false_or_issue():
    for bad in ("yes", 2, "true"):
        with pytest.raises(ValueError, match=r"HopperAttnTiles.overlap=.* must be False, True"):
            HopperAttnTiles(overlap=bad)
    # "issue" holds a V tile a step as True does: a 1-slot ring is refused by name
    with pytest.raises(ValueError, match=r"\(the overlap holds each V tile a step longer\)"):
        HopperAttnTiles(overlap="issue", stages=1, backward=False).stages_for(64, 2)


def test_sum_mma_refuses_the_overlap():
    with pytest.raises(ValueError, match="overlap=False"):
        HopperAttnTiles(sum_mma=True, overlap=True)


def test_overlap_needs_two_slots():
    """The overlap holds a V tile a step longer: a ring of one slot is refused by name."""
    q = jnp.zeros((1, 128, 2, 64), jnp.bfloat16)
    tiles = HopperAttnTiles(overlap=True, stages=1, backward=False)
    with pytest.raises(ValueError, match=r"stages=1 is fewer than the 2 slots the kernel needs "
                                         r"\(the overlap holds each V tile a step longer\)"):
        jaxfuse.flash_attention(q, q, q, block_sizes=AttnBlocks(hopper=tiles))


# Tiles whose shared memory the chip does not have were once left to Mosaic GPU's lowering
# ("kernel exceeds available shared memory") or to the interpreter (a ring of 0 slots): each is
# now refused when the call is planned, naming the tiles and what would fit (s33's sweep of the
# options' sm90 lowering).
@pytest.mark.parametrize("d,kw,message", [
    (64, dict(stages=0), r"HopperAttnTiles.stages=0 must be a positive int"),
    (64, dict(backward=None), r"HopperAttnTiles.backward=None must be True .*, False .* or a "
     r"HopperBwdTiles"),
    (64, dict(split_tail="yes"), r"HopperAttnTiles.split_tail='yes' must be True, False or "
     r"None"),
    (128, dict(stages=3), r"HopperAttnTiles\(stages=3, backward=False\) at head_dim 128 "
     r"\(2 consumers\): stages=3 of 65536 bytes beside 33792 bytes of other buffers: 2 "
     r"slots fit the 229376 bytes .*; pass stages=None or block_k=64$"),
    (256, dict(block_k=64, consumers=3, pingpong=False, persistent=True),
     r"one slot of 65536 bytes .*: 0 slots fit .*; pass consumers=2 or persistent=False$"),
    (256, dict(overlap=True, pingpong=False), r"\(2 consumers\): 2 slots of 131072 bytes \(the "
     r"overlap holds each V tile a step longer\) .*: 1 slot fits .*; pass block_k=64 or "
     r"overlap=False$"),
])
def test_tiles_that_do_not_fit_are_refused_by_name(d, kw, message):
    """Refused when the call is planned (`attention.plan`), before any kernel is traced."""
    from jaxfuse.pallas import attention
    q = jnp.zeros((1, 128, 2, d), jnp.bfloat16)
    with pytest.raises(ValueError, match=message):
        tiles = HopperAttnTiles(**{"backward": False, **kw})
        attention.plan(q.shape, q.shape, q.dtype, causal=False, scale=None, segments=False,
                       sliding_window=None, logits_soft_cap=None, interpret=True,
                       block_sizes=AttnBlocks(hopper=tiles))


def test_persistence_needs_two_slots_beside_o():
    """By default a CTA persists where its O buffer leaves room for two ring slots: at
    head_dim 128 with two consumers, not with three (which before took a one-slot ring)."""
    spec = AttnSpec.make(n_q=1024, n_k=1024, head_dim=128, groups=1, dtype=jnp.bfloat16,
                         scale=None, interpret=False)
    assert HopperAttnTiles().persists(spec)
    assert not HopperAttnTiles(consumers=3).persists(spec)
    assert HopperAttnTiles(consumers=3).stages_for(128, 2, False) == 2


def test_float32_rejected_when_forced_and_not_taken_by_default():
    q = jnp.zeros((1, 128, 2, 64), jnp.float32)
    with pytest.raises(ValueError, match="bf16/f16"):
        jaxfuse.flash_attention(q, q, q, block_sizes=AttnBlocks(hopper=True))
    # Default (hopper=None) on a CPU: the portable path, no error.
    assert jaxfuse.flash_attention(q, q, q).shape == q.shape


def _spec(n, d=128, groups=1, **kw):
    from jaxfuse.pallas._attn import AttnSpec
    return AttnSpec.make(n_q=n, n_k=n, head_dim=d, groups=groups, dtype=jnp.bfloat16,
                         scale=None, interpret=False, folded=False, **kw)


@pytest.mark.parametrize("n,rows,n_bh,kw", [
    (4096, 128, 128, dict(causal=True)),           # B4 H32 T4096 D128, 132 CTAs
    (2048, 192, 128, dict(causal=True)),           # three consumers: 11 tiles, the last short
    (4096, 128, 128, dict(causal=True, window=1000)),
    (1000, 128, 5, dict(causal=True)),             # fewer tiles than CTAs
])
def test_work_schedule_deals_every_tile_once_and_balances(n, rows, n_bh, kw):
    """The persistent forward's schedule (`work_schedule`): every work tile exactly once; each
    CTA's tiles heaviest first within a head group; loads (key blocks) balanced to the
    greedy bound: no CTA's load exceeds the mean by more than the heaviest tile."""
    import numpy as np
    from jaxfuse.pallas import _attn as A
    from jaxfuse.pallas.attention_hopper import work_schedule
    spec, ctas, n_q_tiles = _spec(n, **kw), 132, -(-n // rows)
    table = work_schedule(spec, n_bh, n_q_tiles, rows, 128, ctas)
    counts, items = table[:, 0], table[:, 1:]
    assert table.shape[1] >= counts.max() + 2      # a walk reads item i + 1 at its last
    dealt = np.concatenate([items[c, :counts[c]] for c in range(ctas)])
    np.testing.assert_array_equal(np.sort(dealt), np.arange(n_bh * n_q_tiles))
    lo, _, _, hi = A.key_blocks(spec, jnp.arange(n_q_tiles) * rows, rows, 128)
    blocks = np.broadcast_to(np.asarray(hi - lo), (n_q_tiles,))
    heads = (16 << 20) // (2 * n * 128 * 2)        # heads a group (16 MiB of K and V)
    for c in range(ctas):                          # each CTA: heaviest first within a group
        mine = items[c, :counts[c]]
        group, cost = mine // n_q_tiles // max(heads, 1), blocks[mine % n_q_tiles]
        assert (np.diff(group) >= 0).all()
        assert all((np.diff(cost[group == g]) <= 0).all() for g in np.unique(group))
    loads = np.array([blocks[items[c, :counts[c]] % n_q_tiles].sum() for c in range(ctas)])
    assert loads.max() <= blocks.sum() * n_bh / ctas + blocks.max(), (loads.max(), loads.mean())
    if kw.get("window") is None and n_bh == 128 and rows == 128:
        # 32 tiles of 1..32 blocks a head, 8 heads a group (16 MiB of K and V): within 1%
        # (round robin: ~10% over the mean).
        assert loads.max() <= 1.01 * loads.mean(), (loads.max(), loads.mean())


@pytest.mark.parametrize("n,rows,n_bh,ctas", [
    (4096, 128, 128, 132),        # B4 H32 T4096: 31 rounds and 4 tiles, 32 one-block parts
    (2048, 192, 16 * 8, 132),     # three consumers: 11 tiles a head, 1408 = 10 x 132 + 88
    (1000, 128, 5, 36),           # 40 tiles over 36 CTAs: 4 tiles of 8 blocks in 8 parts
])
def test_tail_schedule_splits_the_last_round(n, rows, n_bh, ctas):
    """`tail_schedule`: every tile once, whole or as parts that cover its key blocks in order
    without overlap; the parts of the last round spread over the CTAs, so that the busiest
    CTA's load (key blocks plus a quarter a work item) is within one part of the mean; None
    where the last round is more than half full, or the tiles are unequal (causal)."""
    import numpy as np
    from jaxfuse.pallas import _attn as A
    from jaxfuse.pallas.attention_hopper import tail_schedule
    spec, n_q_tiles = _spec(n), -(-n // rows)
    n_items = n_bh * n_q_tiles
    split = tail_schedule(spec, n_bh, n_q_tiles, rows, 128, ctas)
    if n_items % ctas > ctas // 2:
        assert split is None
        return
    table, parts = split
    lo, _, _, hi = A.key_blocks(spec, jnp.arange(n_q_tiles) * rows, rows, 128)
    blocks = int(np.max(hi - lo))
    counts, items = table[:, 0], table[:, 1:]
    dealt = np.concatenate([items[c, :counts[c]] for c in range(ctas)])
    assert len(dealt) == len(set(dealt.tolist()))
    whole = dealt[dealt < n_items]
    part_ids = dealt[dealt >= n_items] - n_items
    np.testing.assert_array_equal(np.sort(part_ids), np.arange(len(parts)))
    split_tiles = np.unique(parts[:, 0])
    assert len(split_tiles) == n_items % ctas
    np.testing.assert_array_equal(np.sort(np.concatenate([whole, split_tiles])),
                                  np.arange(n_items))
    for t in split_tiles:
        mine = parts[parts[:, 0] == t]
        np.testing.assert_array_equal(mine[1:, 1], mine[:-1, 2])    # contiguous, in order
        assert mine[0, 1] == 0 and mine[-1, 2] == blocks and (mine[:, 2] > mine[:, 1]).all()
    cost = lambda i: (blocks if i < n_items else parts[i - n_items, 2]
                      - parts[i - n_items, 1]) + 0.25
    loads = np.array([sum(cost(i) for i in items[c, :counts[c]]) for c in range(ctas)])
    biggest_part = (parts[:, 2] - parts[:, 1]).max() + 0.25
    assert loads.max() <= loads.mean() + biggest_part, (loads.max(), loads.mean())
    assert tail_schedule(_spec(n, causal=True), n_bh, n_q_tiles, rows, 128, ctas) is None


def test_list_schedule_deals_equal_items_round_robin():
    """Equal costs: the greedy deals round robin (as `_hopper.cta_share` counts them)."""
    import numpy as np
    from jaxfuse.pallas import _hopper as H
    table = H.list_schedule(np.ones(10), 4)
    for c in range(4):
        assert table[c, 0] == H.cta_share(10, 4, c)
        np.testing.assert_array_equal(table[c, 1:1 + table[c, 0]], np.arange(c, 10, 4))


@pytest.mark.parametrize("n,d,kw,want", [
    (4096, 128, dict(causal=True), True), (2048, 64, dict(causal=True), True),
    (4096, 128, {}, True), (8192, 64, dict(causal=True), False), (32768, 128, {}, False),
    (4096, 256, dict(causal=True), False)])
def test_persistent_by_default_where_measured_faster(n, d, kw, want):
    """Persistent CTAs by default up to 4096 keys at head_dim <= 128, masks or not (H200:
    faster there; slower at 8192 and 32768 keys with causal masks, unmasked rows that long
    untimed; D = 256's O buffer does not fit)."""
    assert HopperAttnTiles().persists(_spec(n, d, **kw)) == want


def test_cta_a_tile_launch_in_head_groups_matches_reference(monkeypatch):
    """The forward's CTA-a-tile grid launched in head groups (`_FWD_GROUP_BYTES`; the default's
    16 MiB holds all 4 heads here, so a small budget makes the groups; the same `heavy_first`
    mapping as the backward's, unit-tested in test_attention_hopper_bwd.py): groups of 3 of 4
    heads, the last short, 3 query tiles each, GQA 2 query heads a KV head (a query head's
    share of K and V: 256 keys x 64 x 2 bytes)."""
    from jaxfuse.pallas import attention_hopper as AH
    group_bytes = 3 * 256 * 64 * 2
    assert [AH.launch_groups(4, 256 * 64 * 2, n) for n in (0, None, group_bytes)] == [1, 4, 3]
    monkeypatch.setattr(AH, "_FWD_GROUP_BYTES", group_bytes)
    kq, kk, kv = keys(13, 3)
    q = randn(kq, (1, 384, 4, 64), jnp.bfloat16)
    k = randn(kk, (1, 256, 2, 64), jnp.bfloat16)
    v = randn(kv, (1, 256, 2, 64), jnp.bfloat16)
    tiles = HopperAttnTiles(consumers=2, persistent=False, backward=False)
    o, lse = jaxfuse.flash_attention(q, k, v, return_lse=True,
                                     block_sizes=AttnBlocks(hopper=tiles))
    ro, rlse = ref.attention(F32(q), F32(k), F32(v), return_lse=True)
    assert float(jnp.abs(F32(o) - ro).max()) < 2e-2
    assert float(jnp.abs(lse - rlse).max()) < 1e-4


@pytest.mark.parametrize("tq,tk,d,opts,tiles", [
    (128, 256, 64, dict(), dict(consumers=2)),
    (100, 150, 128, dict(causal=True), dict()),            # lengths not whole tiles
    (128, 192, 64, dict(), dict(block_k=64, stages=4, consumers=2, persistent=True)),
    (128, 256, 64, dict(sliding_window=50), dict(overlap=True, consumers=2, stages=2)),
])
def test_segment_ids_on_the_hopper_forward(tq, tk, d, opts, tiles):
    """Segment ids (packed documents: sorted random ids, so some rows share no key's segment
    near the boundaries and causal rows may see none) on the Hopper forward: each consumer's
    rows' ids come with its Q, each key block's through a ring slot of their own (a
    persistent CTA's next tile's ids land while it works on this one's; the overlapped
    schedule releases a block's ids a step late, with its V). o, lse (-inf where the
    reference's is) and, through the portable backward fed by this forward's o and lse, dq,
    dk, dv against the float32 reference."""
    kq, kk, kv, kd, ka, kb = keys(13, 6)
    q, do = (randn(x, (1, tq, 2, d), jnp.bfloat16) for x in (kq, kd))
    k, v = (randn(x, (1, tk, 1, d), jnp.bfloat16) for x in (kk, kv))
    qs = jnp.sort(jax.random.randint(ka, (1, tq), 0, 3), axis=1)
    ks = jnp.sort(jax.random.randint(kb, (1, tk), 0, 3), axis=1)
    seg = dict(q_segment_ids=qs, kv_segment_ids=ks, **opts)
    f = lambda q, k, v: jaxfuse.flash_attention(
        q, k, v, return_lse=True, block_sizes=AttnBlocks(
            hopper=HopperAttnTiles(backward=False, **tiles)), **seg)
    assert "jaxfuse_flash_fwd_hopper" in str(jax.make_jaxpr(f)(q, k, v))
    (o, lse), vjp = jax.vjp(f, q, k, v)
    (ro, rlse), rvjp = jax.vjp(lambda q, k, v: ref.attention(q, k, v, return_lse=True, **seg),
                               F32(q), F32(k), F32(v))
    seen = jnp.isfinite(rlse)
    assert bool(jnp.array_equal(jnp.isfinite(lse), seen))
    assert float(jnp.abs(F32(o) - ro).max()) < 2e-2
    assert float(jnp.abs(jnp.where(seen, lse - rlse, 0.0)).max()) < 1e-4
    for a, b in zip(vjp((do, jnp.zeros_like(lse))), rvjp((F32(do), jnp.zeros_like(rlse)))):
        assert float(jnp.abs(F32(a) - b).max() / jnp.abs(b).max()) < 4e-2


def test_segment_ids_keep_the_other_documents_garbage_out():
    """Keys of another document holding NaN and inf (the padding of packed sequences) on the
    Hopper kernels with segment ids: the rows and keys of the first document keep their o,
    dq, dk and dv bit for bit (the forward's and the dQ kernel's producers clean every block,
    each one masked), the rows of the dirty one get NaN."""
    kq, kk, kv, kd = keys(17, 4)
    q, do = (randn(x, (1, 256, 2, 64), jnp.bfloat16) for x in (kq, kd))
    k, v = (randn(x, (1, 256, 1, 64), jnp.bfloat16) for x in (kk, kv))
    seg = jnp.where(jnp.arange(256) < 200, 0, 1)[None]

    def f(k, v):
        o, vjp = jax.vjp(lambda q, k, v: jaxfuse.flash_attention(
            q, k, v, q_segment_ids=seg, kv_segment_ids=seg,
            block_sizes=AttnBlocks(hopper=HopperAttnTiles(consumers=2))), q, k, v)
        return (o,) + vjp(do)
    clean, dirty = f(k, v), f(k.at[:, 200:].set(jnp.nan), v.at[:, 200:].set(jnp.inf))
    for a, b in zip(clean, dirty):
        assert bool(jnp.array_equal(a[:, :200], b[:, :200]))
    assert bool(jnp.isnan(F32(dirty[0][:, 200:])).all())


@pytest.mark.parametrize("n,d,kw,tiles,want", [
    (8192, 64, dict(causal=True), {}, "issue"), (4097, 64, {}, {}, "issue"),
    (4096, 64, {}, {}, False), (4096, 64, {}, dict(persistent=False), "issue"),
    (8192, 64, {}, dict(persistent=True), False), (8192, 64, {}, dict(consumers=2), False),
    (8192, 128, dict(causal=True), {}, False), (2048, 64, dict(causal=True), {}, False)])
def test_overlap_by_default_where_measured_faster(n, d, kw, tiles, want):
    """`overlap=None` (the default): "issue" at head_dim 64 with three consumers where each CTA
    walks one tile (by default past 4096 keys; H100, s55: the 1B model's forward 7-10%
    faster, T4096 a CTA a tile 7%; persistent 1% slower), else False; D = 256's default
    tiles overlap (`for_head_dim`); an explicit value, sum_mma, a 1-slot ring and the
    interpreter keep theirs. tiles_for resolves it before the kernel is built."""
    from jaxfuse.pallas import attention_hopper as AH
    spec = _spec(n, d, **kw)
    t = HopperAttnTiles(**tiles)
    assert t.overlap_for(spec) == want
    assert t.resolved(spec).overlap == want
    assert AH.tiles_for(t, jnp.bfloat16, (1, n, 2, d), spec).overlap == want
    assert HopperAttnTiles(overlap=True).overlap_for(spec) is True
    assert HopperAttnTiles(sum_mma=True).overlap_for(spec) is False
    assert HopperAttnTiles(stages=1).overlap_for(spec) is False
    assert HopperAttnTiles().overlap_for(dataclasses.replace(spec, interpret=True)) is False
    assert HopperAttnTiles.for_head_dim(256).overlap_for(_spec(n, 256, **kw)) is True
