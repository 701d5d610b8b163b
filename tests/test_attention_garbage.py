"""Masked keys may hold garbage: whatever a key or value that the masks hide holds (NaN, inf:
the padding of packed sequences, keys outside a window) never reaches an output or a gradient
of the queries that do not see it; a query that does see a non-finite key or value gets a NaN
row, as the maths says. Both impls, the interpret layout and the GPU layout (run in interpret
mode), forward and gradients through jax.vjp with a random cotangent."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfuse
from jaxfuse import AttnBlocks

from _util import keys, randn

SMALL = AttnBlocks(folded=False, block_q=16, block_k=16, block_q_dq=16, block_k_dq=16,
                   block_k_dkv=16, block_q_dkv=16)
IMPLS = [("reference", None), ("pallas", None), ("pallas", SMALL)]


def _inputs(b=2, t=37, hq=4, hkv=2, d=16):
    kq, kk, kv, kd = keys(11, 4)
    return (randn(kq, (b, t, hq, d)), randn(kk, (b, t, hkv, d)), randn(kv, (b, t, hkv, d)),
            randn(kd, (b, t, hq, d)))


def _run(impl, blocks, q, k, v, do, **kw):
    bs = {} if blocks is None else dict(block_sizes=blocks)
    f = lambda q, k, v: jaxfuse.flash_attention(q, k, v, impl=impl, **kw, **bs)
    o, vjp = jax.vjp(f, q, k, v)
    return o, vjp(do)


@pytest.mark.parametrize("impl,blocks", IMPLS)
@pytest.mark.parametrize("junk", [jnp.nan, jnp.inf, -jnp.inf])
def test_packed_padding_never_reaches_valid_rows(impl, blocks, junk):
    """Segment 0 (30 tokens) is real, segment 1 (7 tokens) padding whose K and V are junk: the
    real rows' outputs and every real key's gradient equal those of clean padding; the
    padding rows, which see the junk, are NaN."""
    q, k, v, do = _inputs()
    seg = jnp.where(jnp.arange(37) < 30, 0, 1)[None].repeat(2, 0)
    kw = dict(q_segment_ids=seg, kv_segment_ids=seg)
    o0, g0 = _run(impl, blocks, q, k, v, do, **kw)
    o, g = _run(impl, blocks, q, k.at[:, 30:].set(junk), v.at[:, 30:].set(junk), do, **kw)
    np.testing.assert_array_equal(o[:, :30], o0[:, :30])
    for a, b in zip(g, g0):
        np.testing.assert_array_equal(a[:, :30], b[:, :30])
    assert bool(jnp.isnan(o[:, 30:]).all())


@pytest.mark.parametrize("impl,blocks", IMPLS)
def test_keys_outside_the_window_and_past_the_causal_edge(impl, blocks):
    """Window 8 with causal: key 3 is seen by queries 3..10 only. NaN in its value reaches
    exactly those rows; every other row and every gradient of the other rows' keys is clean."""
    q, k, v, do = _inputs()
    kw = dict(causal=True, sliding_window=8)
    o0, g0 = _run(impl, blocks, q, k, v, do, **kw)
    o, g = _run(impl, blocks, q, k, v.at[:, 3].set(jnp.nan), do, **kw)
    rows = np.zeros(37, bool)
    rows[3:11] = True
    np.testing.assert_array_equal(o[:, ~rows], o0[:, ~rows])
    assert bool(jnp.isnan(o[:, rows]).all())
    # dq of rows that never see key 3 is untouched.
    np.testing.assert_array_equal(g[0][:, ~rows], g0[0][:, ~rows])


@pytest.mark.parametrize("impl,blocks", IMPLS)
def test_visible_nan_key_gives_nan_row_only(impl, blocks):
    """A NaN key that every query sees (no mask) makes every row NaN; with causal, the same
    NaN as the last key reaches only the last query."""
    q, k, v, do = _inputs(b=1, t=20)
    o = jaxfuse.flash_attention(q, k.at[:, -1].set(jnp.nan), v, causal=True, impl=impl,
                                **({} if blocks is None else dict(block_sizes=blocks)))
    assert bool(jnp.isfinite(o[:, :-1]).all()) and bool(jnp.isnan(o[:, -1]).all())


@pytest.mark.parametrize("stages,overlap", [(None, False), (1, False), (None, True),
                                            (2, True)])
def test_hopper_forward_hides_masked_garbage(stages, overlap):
    """The Hopper forward (Mosaic GPU's interpreter) reads K and V tiles from shared memory, so
    P V would multiply a hidden key's zero probability by its NaN value: the producer's cleaning
    of the CTA's edge tiles (`_hopper_ring.hide_masked_garbage`) must keep every row that
    does not see the junk bitwise equal to the clean run's, and make every row that sees it NaN
    (o and lse). Window 40, Tk 256 >
    Tq 128 (bottom-right; no causal mask, so no upper bound): query i sees keys i + 89 and
    above. Key 60's value (NaN) is seen by no query but sits in a tile that rows 0..38 partly
    see (an edge tile; without the cleaning rows 0..63, the first consumer's, turn NaN); key 150
    is seen by rows 0..61. Only windows run here: causal tiles stall the
    interpreter's threads on 2 cores (test_attention_hopper.py); the GPU check
    (`benchmarks/attention_bwd.py garbage`) runs causal cases and the Hopper backward.
    Both producer schedules (`_hopper_ring.produce_kv`): with a ring of two slots or more
    an edge tile is cleaned after the next tile's copy is issued, with one as soon as it lands;
    with the overlap (V held a step longer) deferral needs 3 slots, so 2 clean as they land."""
    from jaxfuse.pallas.attention_hopper import HopperAttnTiles
    kq, kk, kv = keys(12, 3)
    q = randn(kq, (1, 128, 1, 64), jnp.bfloat16)
    k = randn(kk, (1, 256, 1, 64), jnp.bfloat16)
    v = randn(kv, (1, 256, 1, 64), jnp.bfloat16)
    blocks = AttnBlocks(hopper=HopperAttnTiles(consumers=2, stages=stages, overlap=overlap,
                                               backward=False))
    f = lambda q, k, v: jaxfuse.flash_attention(q, k, v, sliding_window=40, return_lse=True,
                                                block_sizes=blocks)
    o0, lse0 = f(q, k, v)
    o, lse = f(q, k, v.at[:, 60].set(jnp.nan))          # seen by no query
    np.testing.assert_array_equal(o, o0)
    np.testing.assert_array_equal(lse, lse0)
    # Key 150, seen by rows 0..61 on an edge tile: one +inf entry of K (the raw score is
    # +-inf by q's sign: a NaN row or a silently dropped key) or a NaN value (raw: a NaN o but
    # a finite lse). Cleaned, each makes those rows' o and lse NaN and leaves the rest alone.
    sees = np.arange(128) < 62
    for junk in (dict(k=k.at[:, 150, :, 0].set(jnp.inf)), dict(v=v.at[:, 150].set(jnp.nan))):
        o, lse = f(q, junk.get("k", k), junk.get("v", v))
        np.testing.assert_array_equal(o[:, ~sees], o0[:, ~sees])
        np.testing.assert_array_equal(lse[..., ~sees], lse0[..., ~sees])
        assert bool(jnp.isnan(o[:, sees]).all()) and bool(jnp.isnan(lse[..., sees]).all())


@pytest.mark.parametrize("clean,fixed", [(True, False), (False, False), (True, True)])
def test_hopper_backward_hides_masked_garbage(clean, fixed):
    """The Hopper backward's ways of keeping masked keys' garbage out: the kernel pair's dQ
    kernel's producer cleans its edge tiles (`clean=True`: no XLA pass over K and V; K's
    non-finite entries 0 for dS K, V NaN beside them so that a row that sees the key gets NaN;
    the dK/dV kernel reads the raw tiles, its products contracting over queries), or an XLA
    pass over K and V before the kernels (`clean=False`, `_attn.clean_keys`); the fixed-point
    fused dQ (`fixed`, opt-in) takes the XLA pass, and its rows' scales are
    maxima over the keys each row sees only, with the rows that see a non-finite key made
    NaN after the integer sum (`_fixed_sum`): bitwise the same elsewhere. Window 40, Tq
    128 < Tk 256 as in the forward's test: key 60 (K and V NaN) is seen by no query, key 150
    (one +inf entry of K) by rows 0..61, both on the dQ kernel's edge tiles. Rows 62.. keep o
    and dq bitwise, rows 0..61 get NaN dq, and the keys no query sees (< 89, key 60 among
    them) keep dk and dv."""
    from jaxfuse.pallas.attention_hopper import HopperAttnTiles
    from jaxfuse.pallas.attention_hopper_bwd import HopperBwdTiles
    kq, kk, kv, kd = keys(12, 4)
    q, do = randn(kq, (1, 128, 1, 64), jnp.bfloat16), randn(kd, (1, 128, 1, 64), jnp.bfloat16)
    k = randn(kk, (1, 256, 1, 64), jnp.bfloat16)
    v = randn(kv, (1, 256, 1, 64), jnp.bfloat16)
    blocks = AttnBlocks(hopper=HopperAttnTiles(
        consumers=2, backward=HopperBwdTiles(clean=clean, consumers=2, fixed_dq=fixed)))
    # jitted: one compile of the vjp for every call below (eagerly each primitive compiled alone)
    run = jax.jit(lambda k, v: _run("pallas", blocks, q, k, v, do, sliding_window=40))
    jaxpr = str(jax.make_jaxpr(lambda k, v: run(k, v))(k, v))
    assert ("jaxfuse_flash_bwd_dkv_dq_fixed_hopper" in jaxpr) == fixed
    assert ("jaxfuse_flash_bwd_dq_hopper" in jaxpr) != fixed
    assert ("is_finite" in jaxpr) == (fixed or not clean)                   # the XLA pass
    o0, (dq0, dk0, dv0) = run(k, v)
    o, (dq, dk, dv) = run(k.at[:, 60].set(jnp.nan).at[:, 150, :, 0].set(jnp.inf),
                          v.at[:, 60].set(jnp.nan))
    sees = np.arange(128) < 62
    np.testing.assert_array_equal(o[:, ~sees], o0[:, ~sees])
    np.testing.assert_array_equal(dq[:, ~sees], dq0[:, ~sees])
    assert bool(jnp.isnan(dq[:, sees]).all())
    np.testing.assert_array_equal(dk[:, :89], dk0[:, :89])
    np.testing.assert_array_equal(dv[:, :89], dv0[:, :89])


def test_fixed_point_dq_rows_ignore_finite_garbage_they_do_not_see():
    """The fixed-point dQ (`HopperBwdTiles(fixed_dq=True)`) scales each row by a bound taken
    over the keys that row sees (`_fixed_sum`): a huge but finite key and value (10^4) where
    no row looks (key 60 behind window 40, as above) leaves every row's dq bitwise as it was,
    and one seen by rows 0..61 (key 150) leaves rows 62.. bitwise as they were. A bound over
    all keys (or blocks of them) would change the rows' scales, hence their bits."""
    from jaxfuse.pallas.attention_hopper import HopperAttnTiles
    from jaxfuse.pallas.attention_hopper_bwd import HopperBwdTiles
    kq, kk, kv, kd = keys(13, 4)
    q, do = randn(kq, (1, 128, 1, 64), jnp.bfloat16), randn(kd, (1, 128, 1, 64), jnp.bfloat16)
    k = randn(kk, (1, 256, 1, 64), jnp.bfloat16)
    v = randn(kv, (1, 256, 1, 64), jnp.bfloat16)
    blocks = AttnBlocks(hopper=HopperAttnTiles(consumers=2,
                                               backward=HopperBwdTiles(fixed_dq=True)))
    # jitted: one compile of the vjp for every call below (eagerly each primitive compiled alone)
    run = jax.jit(lambda k, v: _run("pallas", blocks, q, k, v, do, sliding_window=40)[1][0])
    assert "jaxfuse_flash_bwd_dkv_dq_fixed_hopper" in str(jax.make_jaxpr(run)(k, v))
    dq0 = run(k, v)
    np.testing.assert_array_equal(run(k.at[:, 60].set(1e4), v.at[:, 60].set(1e4)), dq0)
    dq = run(k.at[:, 150].set(1e4), v.at[:, 150].set(-1e4))
    np.testing.assert_array_equal(dq[:, 62:], dq0[:, 62:])
    assert not bool(jnp.array_equal(dq[:, :62], dq0[:, :62]))
