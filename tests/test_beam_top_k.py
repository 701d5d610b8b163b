"""Beam top-k (HARS): the Pallas op is bit-identical to `lax.top_k` over the flat candidates,
ties and NaN included, for any group width; and it never branches on the data."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

import jaxfuse
from jaxfuse.pallas import beam_top_k as P
from jaxfuse.pallas._rows import RowBlocks
from jaxfuse.reference import beam_top_k as R

KINDS = ("normal", "ties", "equal", "neginf", "nonfinite", "zeros")
_LOWEST_NAN = np.uint32(0xFFFFFFFF).view(np.float32)   # last in lax.top_k's order


def _log_probs(seed: int, shape, kind: str) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32) * 3
    if kind == "ties":          # a handful of values: ties within and across groups and beams
        x = rng.integers(-2, 3, shape).astype(np.float32)
    elif kind == "equal":
        x = np.full(shape, x.flat[0], np.float32)
    elif kind == "neginf":      # mostly -inf, and the first batch row all -inf
        x[rng.random(shape) < 0.7] = -np.inf
        x[0] = -np.inf
    elif kind == "nonfinite":   # NaN of both signs and several payloads, infinities, signed zeros
        specials = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, _LOWEST_NAN,
                             np.uint32(0x7FC00123).view(np.float32)], np.float32)
        pick = rng.random(shape) < 0.6
        x[pick] = rng.choice(specials, pick.sum())
    elif kind == "zeros":       # lax.top_k ranks +0 above -0: only the sign breaks these ties
        x = rng.choice(np.array([-0.0, 0.0], np.float32), shape)
    return x


def _beam_scores(seed: int, shape, kind: str) -> np.ndarray:
    if kind in ("nonfinite", "zeros"):    # x + -0 is x bit for bit: the candidates keep -0
        return np.full(shape, -0.0, np.float32)
    return np.random.default_rng(seed).integers(-1, 2, shape).astype(np.float32)


def assert_identical(got, want):
    """Same dtypes, shapes and bits (scores compared as bits: NaN payloads and -0 count)."""
    for a, b in zip(got, want, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert (a.dtype, a.shape) == (b.dtype, b.shape), ((a.dtype, a.shape), (b.dtype, b.shape))
        if a.dtype == np.float32:
            a, b = a.view(np.uint32), b.view(np.uint32)
        np.testing.assert_array_equal(a, b)


class BeamTopKTest(parameterized.TestCase):

    @parameterized.product(shape=[(2, 4, 37), (1, 1, 13), (3, 5, 2), (2, 3, 16)],
                           k=[1, 4, "all"], width=[None, "narrow", "padded"])
    def test_equals_lax_top_k(self, shape, k, width):
        # V prime, beam_size 1, V < k, k = beam_size * V; one group per row (interpret mode's
        # default) or many, with the last group of a row part padding ("padded").
        n = shape[1] * shape[2]
        k = n if k == "all" else min(k, n)
        cols = {None: None, "narrow": max(k, 7), "padded": k + 3}[width]
        blocks = None if cols is None else RowBlocks(2, cols)
        f = jax.jit(lambda lp, s: P.beam_top_k(lp, s, k, block_sizes=blocks))
        for i, kind in enumerate(KINDS):
            lp = _log_probs(sum(shape) + i, shape, kind)
            s = _beam_scores(i, shape[:2], kind)
            with self.subTest(kind=kind):
                assert_identical(f(lp, s), R.beam_top_k(lp, s, k))

    def test_each_group_keeps_its_own_top_k(self):
        flat = _log_probs(3, (2, 45), "ties").reshape(2, 45)
        k, cols = 4, 8                                     # 6 groups, the last one 5 wide
        keys, idx = P.group_top_k(jnp.asarray(flat), k, interpret=True,
                                  block_sizes=RowBlocks(3, cols))
        keys, idx = np.asarray(keys).reshape(2, 6, k), np.asarray(idx).reshape(2, 6, k)
        for b in range(2):
            for g in range(6):
                part = jnp.asarray(flat[b, g * cols:(g + 1) * cols])
                want_key, want_pos = jax.lax.top_k(P.order_key(part), k)
                np.testing.assert_array_equal(keys[b, g], want_key)
                np.testing.assert_array_equal(idx[b, g], g * cols + np.asarray(want_pos))

    def test_padding_ranks_last(self):
        # Every candidate is the lowest NaN, whose key padding shares: the last group holds 2
        # real candidates and 2 slots of padding, which must come after them.
        flat = np.full((1, 10), _LOWEST_NAN, np.float32)
        keys, idx = P.group_top_k(jnp.asarray(flat), 4, interpret=True,
                                  block_sizes=RowBlocks(1, 4))
        np.testing.assert_array_equal(np.asarray(idx)[0], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11])
        assert np.all(np.asarray(keys) == np.iinfo(np.int32).min)
        lp = flat.reshape(1, 2, 5)
        assert_identical(P.beam_top_k(lp, np.zeros((1, 2), np.float32), 10,
                                      block_sizes=RowBlocks(1, 12)),
                         R.beam_top_k(lp, np.zeros((1, 2), np.float32), 10))

    def test_order_key_is_lax_top_k_order(self):
        x = np.array([_LOWEST_NAN, -np.nan, -np.inf, -3e38, -1.0, -1e-45, -0.0, 0.0, 1e-45,
                      1.0, 3e38, np.inf, np.nan, np.uint32(0x7FFFFFFF).view(np.float32)],
                     np.float32)
        x = x[np.random.default_rng(0).permutation(len(x))]
        _, want = jax.lax.top_k(jnp.asarray(x), len(x))
        _, got = jax.lax.top_k(P.order_key(jnp.asarray(x)), len(x))
        np.testing.assert_array_equal(got, want)
        # All distinct in the order: each key once, so only equal bits tie in the group passes.
        assert len(set(np.asarray(P.order_key(jnp.asarray(x))).tolist())) == len(x)

    @parameterized.product(lp_dtype=["float32", "bfloat16", "float16"],
                           s_dtype=["float32", "bfloat16"])
    def test_input_dtypes(self, lp_dtype, s_dtype):
        lp = jnp.asarray(_log_probs(5, (2, 3, 11), "normal"), lp_dtype)
        s = jnp.asarray(_log_probs(6, (2, 3), "normal"), s_dtype)
        assert_identical(P.beam_top_k(lp, s, 5, block_sizes=RowBlocks(2, 8)),
                         R.beam_top_k(lp, s, 5))

    def test_large_k_takes_the_row_whole(self):
        k = P._MAX_PASSES + 1
        lp, s = _log_probs(7, (2, 3, 30), "ties"), _beam_scores(7, (2, 3), "ties")
        assert_identical(P.beam_top_k(lp, s, k), R.beam_top_k(lp, s, k))

    def test_no_branch_on_the_data(self):
        # No cond/while in the op's own graph (the pallas_call's passes have a static count).
        jaxpr = jax.make_jaxpr(lambda lp, s: P.beam_top_k(lp, s, 4, interpret=True))(
            jnp.zeros((2, 4, 37)), jnp.zeros((2, 4)))
        prims = {e.primitive.name for e in jaxpr.jaxpr.eqns}
        assert "pallas_call" in prims and not prims & {"cond", "while"}, prims

    def test_group_width_below_k_raises(self):
        with self.assertRaisesRegex(ValueError, "block_cols=4 is the group width"):
            P.beam_top_k(jnp.zeros((1, 2, 5)), jnp.zeros((1, 2)), 5, block_sizes=RowBlocks(1, 4))


class BeamTopKTransformsTest(chex.TestCase):

    @chex.variants(with_jit=True, without_jit=True)
    def test_vmap(self):
        lp = np.stack([_log_probs(i, (2, 3, 9), kind) for i, kind in enumerate(KINDS)])
        s = np.stack([_beam_scores(i, (2, 3), kind) for i, kind in enumerate(KINDS)])
        f = self.variant(jax.vmap(lambda a, b: jaxfuse.beam_top_k(a, b, 4)))
        want = jax.vmap(lambda a, b: jaxfuse.beam_top_k(a, b, 4, impl="reference"))(lp, s)
        assert_identical(f(lp, s), want)


if __name__ == "__main__":
    pytest.main([__file__])
