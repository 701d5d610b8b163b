"""jaxfuse.reorder_beams: beam search's in-place cache reorder, against a numpy loop."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfuse
from jaxfuse import RowBlocks
from jaxfuse.model import _block_ops
from tests._util import keys, randn

SMALL = RowBlocks(block_rows=4, block_cols=4, num_warps=4)   # many tiles, ragged at both edges


def _numpy(caches, parent, start, stop):
    out = []
    b, k = parent.shape
    for c in caches:
        c = np.asarray(c)
        o = c.copy()
        s = c.shape[2]
        for i in range(b):
            lo, hi = np.clip(start[i], 0, s), np.clip(stop[i], 0, s)
            for j in range(k):
                o[i, j, lo:hi] = c[i, np.clip(parent[i, j], 0, k - 1), lo:hi]
        out.append(o)
    return out


def _caches(seed, b, k, s):
    ks = keys(seed, 3)
    return (randn(ks[0], (b, k, s, 2, 3), jnp.bfloat16),            # features 6: ragged tiles
            randn(ks[1], (b, k, s, 5)),                             # float32, prime width
            jax.random.randint(ks[2], (b, k, s, 1), -50, 50))      # int32, one feature


@pytest.mark.parametrize("blocks", [None, SMALL], ids=["default", "small_tiles"])
@pytest.mark.parametrize("b,k,s", [(3, 4, 37), (1, 1, 5), (2, 3, 1), (2, 5, 13)])
def test_matches_numpy(b, k, s, blocks):
    caches = _caches(b * 100 + k * 10 + s, b, k, s)
    rng = np.random.default_rng(s)
    parent = rng.integers(0, k, (b, k))
    start = rng.integers(0, s + 1, (b,))
    stop = start + rng.integers(0, s + 1, (b,))                     # past S is clipped
    start[0], stop[0] = 0, s                                        # one row entirely
    if b > 1:
        start[1], stop[1] = 3, 2                                    # an empty range: untouched
    want = _numpy(caches, parent, start, stop)
    args = (jnp.asarray(parent), jnp.asarray(start), jnp.asarray(stop))
    ref = jaxfuse.reorder_beams(caches, *args, impl="reference")
    got = jax.jit(lambda c, *a: jaxfuse.reorder_beams(c, *a, block_sizes=blocks))(caches, *args)
    for g, r, w, c in zip(got, ref, want, caches):
        assert g.dtype == c.dtype and g.shape == c.shape
        np.testing.assert_array_equal(np.asarray(r), w)
        np.testing.assert_array_equal(np.asarray(g), w)


def test_out_of_range_parent_and_positions_are_clipped():
    caches = _caches(5, 2, 3, 9)
    parent = jnp.array([[-1, 7, 1], [2, 0, 99]])
    start, stop = jnp.array([-4, 8]), jnp.array([3, 40])
    want = _numpy(caches, np.asarray(parent), np.asarray(start), np.asarray(stop))
    for impl in ("pallas", "reference"):
        got = jaxfuse.reorder_beams(caches, parent, start, stop, impl=impl)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g), w)


def test_in_a_donating_loop():
    # As beam search uses it: caches carried through a jitted loop, reordered in place.
    b, k, s = 2, 3, 11
    caches = _caches(6, b, k, s)[:2]
    parents = jax.random.randint(jax.random.key(7), (5, b, k), 0, k)

    def run(caches, impl):
        def body(t, cs):
            return jaxfuse.reorder_beams(cs, parents[t], jnp.full((b,), 2), jnp.full((b,), 2 + t),
                                         impl=impl)
        return jax.lax.fori_loop(0, 5, body, caches)
    want = run(caches, "reference")
    got = jax.jit(lambda cs: run(cs, "pallas"), donate_argnums=0)(
        tuple(jnp.copy(c) for c in caches))
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_vmap_and_no_gradient():
    c = randn(keys(8, 1)[0], (2, 3, 4, 5, 6))                  # vmapped over the first axis
    p = jax.random.randint(jax.random.key(1), (2, 3, 4), 0, 4)
    a, z = jnp.array([[0, 1, 2], [1, 1, 5]]), jnp.array([[5, 3, 4], [2, 5, 5]])
    f = lambda impl: jax.vmap(lambda c, p, a, z: jaxfuse.reorder_beams((c,), p, a, z, impl=impl))
    np.testing.assert_array_equal(np.asarray(jax.jit(f("pallas"))(c, p, a, z)[0]),
                                  np.asarray(f("reference")(c, p, a, z)[0]))
    with pytest.raises(ValueError, match="reorder_beams .* has no gradient"):
        jax.grad(lambda c: jnp.sum(jaxfuse.reorder_beams((c,), p[0], a[0], z[0])[0]))(c[0])


def test_bad_input():
    c = jnp.zeros((2, 3, 5, 4))
    p, n = jnp.zeros((2, 3), jnp.int32), jnp.zeros((2,), jnp.int32)
    with pytest.raises(ValueError, match="caches must be a non-empty tuple"):
        jaxfuse.reorder_beams(c, p, n, n)
    with pytest.raises(ValueError, match=r"caches\[1\].shape=\(2, 4, 5, 4\) must be \[B=2, K=3"):
        jaxfuse.reorder_beams((c, jnp.zeros((2, 4, 5, 4))), p, n, n)
    with pytest.raises(ValueError, match=r"caches\[1\].shape=\(2, 3, 6\).*one S=5"):
        jaxfuse.reorder_beams((c, jnp.zeros((2, 3, 6))), p, n, n)
    with pytest.raises(ValueError, match="parent.dtype=float32 must be an integer"):
        jaxfuse.reorder_beams((c,), p.astype(jnp.float32), n, n)
    with pytest.raises(ValueError, match=r"stop.shape=\(3,\) must be \(2,\)"):
        jaxfuse.reorder_beams((c,), p, n, jnp.zeros((3,), jnp.int32))


def test_beam_search_with_the_kernel_equals_reference(monkeypatch):
    # The model takes the reference on a CPU (speed); here the kernel runs inside beam search.
    import jaxfuse.model as M
    cfg = M.Config(vocab_size=40, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48,
                   max_len=24)
    params = M.init(jax.random.key(1), cfg)
    prompts = jax.random.randint(jax.random.key(2), (2, 5), 0, 40)
    lengths = jnp.array([5, 3])
    kw = dict(beam_size=3, max_new_tokens=6, eos_id=-1)
    want = M.beam_search(params, cfg, prompts, lengths, impl="reference", **kw)
    calls = []

    def kernel(caches, parent, start, stop, *, impl="pallas"):
        calls.append(impl)
        return jaxfuse.reorder_beams(caches, parent, start, stop, impl=impl,
                                     block_sizes=SMALL)
    monkeypatch.setattr(_block_ops, "reorder_beams", kernel)
    M.beam_search._clear_cache()
    got = M.beam_search(params, cfg, prompts, lengths, impl="pallas", **kw)
    M.beam_search._clear_cache()
    assert calls and set(calls) == {"pallas"}
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-5, atol=1e-5)
