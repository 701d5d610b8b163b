"""embedding: dropout(scale * table[tokens] + pos_table[positions]), deterministic backward."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

import jaxfuse
from jaxfuse import RowBlocks, _philox
from jaxfuse.reference.dropout import keep_mask
from tests._util import DTYPES, assert_close, keys, randn

# (tokens shape, V, D, P, blocks): one token; T = 7 with rows and columns split over programs
# and D not a multiple of the tile; a 1-D batch of tokens with a vocabulary of one row.
CASES = [((1,), 5, 8, 3, None), ((3, 7), 11, 37, 9, RowBlocks(2, 16)),
         ((13,), 1, 24, 13, RowBlocks(4, 8))]


def _tokens(key, shape, v):
    """Random tokens in [0, v), with repeats guaranteed (token 0 twice when there is room)."""
    t = jax.random.randint(key, shape, 0, v)
    flat = t.reshape(-1)
    if flat.size > 2:
        flat = flat.at[1].set(flat[0])
    return flat.reshape(shape)


class EmbeddingTest(chex.TestCase):

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.product(dtype=DTYPES, rate=[0.0, 0.3])
    def test_matches_reference_with_grads(self, dtype, rate):
        # Over the (dtype, rate) pairs every case meets both rates.
        shape, v, d, p, blocks = CASES[(DTYPES.index(dtype) + int(rate > 0)) % len(CASES)]
        k = keys(v + d + DTYPES.index(dtype), 5)
        tokens = _tokens(k[0], shape, v)
        table, pos_table = randn(k[1], (v, d), dtype), randn(k[2], (p, d), dtype)
        ct = randn(k[3], (*shape, d), dtype)

        def f(impl, **kw):
            return lambda t, pt: jaxfuse.embedding(tokens, t, scale=1.7, pos_table=pt,
                                                   rate=rate, key=k[4], impl=impl, **kw)
        y, vjp = jax.vjp(self.variant(f("pallas", block_sizes=blocks)), table, pos_table)
        yr, vjpr = jax.vjp(f("reference"), table, pos_table)
        self.assertEqual(y.dtype, dtype)
        assert_close(y, yr, dtype, scale=2.0)
        # A table row sums its tokens' rows: rounding grows with the repeats.
        assert_close(vjp(ct), vjpr(ct), dtype, scale=4.0)

    def test_gradient_is_np_add_at_and_bitwise_repeatable(self):
        k = keys(1, 4)
        v, d, rate, scale = 13, 20, 0.25, 0.5
        tokens = jax.random.randint(k[0], (6, 50), 0, v)          # 300 tokens: many repeats
        table = randn(k[1], (v, d))
        dy = randn(k[2], (6, 50, d))
        grad = jax.jit(lambda t: jax.vjp(lambda t: jaxfuse.embedding(
            tokens, t, scale=scale, rate=rate, key=k[3]), t)[1](dy)[0])
        g1, g2 = np.asarray(grad(table)), np.asarray(grad(table + 1.0))
        np.testing.assert_array_equal(g1, g2)
        # The same products, added in token order from zero: np.add.at's float32 sums.
        keep = np.asarray(keep_mask(k[3], (300, d), rate))
        contrib = (np.asarray(dy).reshape(300, d)
                   * np.where(keep, np.float32(_philox.scale(rate)), np.float32(0.0))
                   * np.float32(scale))
        expected = np.zeros((v, d), np.float32)
        np.add.at(expected, np.asarray(tokens).reshape(-1), contrib)
        np.testing.assert_array_equal(g1, expected)

    def test_out_of_range_tokens_and_positions_give_nan_and_no_gradient(self):
        k = keys(2, 3)
        v, d = 6, 8
        tokens = jnp.array([[0, 6, 2, -1, 2], [5, 1, 100, 3, 0]])
        positions = jnp.array([[0, 1, 2, 3, 9], [0, 1, 2, 3, 4]])    # 9 >= P = 5
        table, pos_table = randn(k[0], (v, d)), randn(k[1], (5, d))
        bad = np.array([[0, 1, 0, 1, 1], [0, 0, 1, 0, 0]], bool)
        for impl in ("pallas", "reference"):
            f = lambda t, pt: jaxfuse.embedding(tokens, t, pos_table=pt, positions=positions,
                                                rate=0.5, key=k[2], impl=impl)
            y, vjp = jax.vjp(f, table, pos_table)
            np.testing.assert_array_equal(np.isnan(np.asarray(y)).all(-1), bad)
            self.assertFalse(np.isnan(np.asarray(y)[~bad]).any())
            dt, dp = vjp(jnp.ones_like(y))
            self.assertTrue(np.isfinite(np.asarray(dt)).all() and np.isfinite(np.asarray(dp)).all())
            # Only in-range rows count: token 2 appears in range once (row 0, col 2), token 4 never.
            np.testing.assert_array_equal(np.asarray(dt)[4], 0.0)
            np.testing.assert_allclose(np.asarray(dt)[2],
                                       np.where(keep_mask(k[2], (10, d), 0.5)[2], 2.0, 0.0))

    def test_wide_integer_ids_are_judged_before_their_cast(self):
        """Under jax_enable_x64 an int64 token or position past int32's range (2^32 + 1) gave
        row 1 (cast to int32 before the range check: tokens on the Pallas path, with their
        gradient on row 1, positions on both); now a NaN row and no gradient, as any id
        outside the table. uint32 ids past 2^31 likewise."""
        k = keys(4, 2)
        table, pos_table = randn(k[0], (5, 8)), randn(k[1], (4, 8))
        with jax.enable_x64(True):
            cases = ((jnp.array([1, 2 ** 32 + 1, 2]), jnp.array([0, 1, 2])),
                     (jnp.array([1, 3, 2]), jnp.array([0, 2 ** 32 + 1, -2 ** 32 + 2])),
                     (jnp.array([1, 2 ** 31 + 1, 2], jnp.uint32),
                      jnp.array([0, 1, 2 ** 32 - 1], jnp.uint32)))
            for tokens, positions in cases:
                bad = np.array([t >= 5 or t < 0 or p >= 4 or p < 0
                                for t, p in zip(tokens.tolist(), positions.tolist())])
                for impl in ("pallas", "reference"):
                    f = lambda t: jaxfuse.embedding(tokens, t, pos_table=pos_table,
                                                    positions=positions, impl=impl)
                    y, vjp = jax.vjp(f, table)
                    np.testing.assert_array_equal(np.isnan(np.asarray(y)).any(-1), bad)
                    (dt,) = vjp(jnp.ones_like(y))
                    used = np.zeros(5)
                    for t, b in zip(tokens.tolist(), bad):
                        if not b:
                            used[t] += 1
                    np.testing.assert_array_equal(np.asarray(dt)[:, 0], used)

    def test_0d_token_with_position_table(self):
        k = keys(5, 2)
        table, pos_table = randn(k[0], (5, 8)), randn(k[1], (4, 8))
        for impl in ("pallas", "reference"):
            y = jaxfuse.embedding(jnp.int32(3), table, pos_table=pos_table, impl=impl)
            assert_close(y, table[3] + pos_table[0], jnp.float32)

    def test_default_positions_and_vmap(self):
        k = keys(3, 3)
        tokens = jax.random.randint(k[0], (2, 3, 5), 0, 7)
        table, pos_table = randn(k[1], (7, 4)), randn(k[2], (5, 4))
        y = jaxfuse.embedding(tokens, table, pos_table=pos_table)
        assert_close(y, table[tokens] + pos_table[jnp.arange(5)], jnp.float32)
        f = lambda t: jaxfuse.embedding(t, table, pos_table=pos_table, rate=0.5,
                                        key=jax.random.key(0))
        out = jax.vmap(f)(tokens)
        for i in range(2):
            np.testing.assert_array_equal(out[i], f(tokens[i]))

    def test_bad_input(self):
        table = jnp.ones((5, 8))
        tokens = jnp.zeros((2, 3), jnp.int32)
        with self.assertRaisesRegex(ValueError, "tokens.dtype=float32"):
            jaxfuse.embedding(tokens.astype(jnp.float32), table)
        with self.assertRaisesRegex(ValueError, "table.shape=\\(5, 8, 1\\)"):
            jaxfuse.embedding(tokens, jnp.ones((5, 8, 1)))
        with self.assertRaisesRegex(ValueError, "pos_table \\(shape=\\(4, 7\\)"):
            jaxfuse.embedding(tokens, table, pos_table=jnp.ones((4, 7)))
        with self.assertRaisesRegex(ValueError, "positions.shape=\\(2, 2\\)"):
            jaxfuse.embedding(tokens, table, pos_table=table, positions=tokens[:, :2])
        with self.assertRaisesRegex(ValueError, "positions were given without a pos_table"):
            jaxfuse.embedding(tokens, table, positions=tokens)
        with self.assertRaisesRegex(ValueError, "rate=2"):
            jaxfuse.embedding(tokens, table, rate=2, key=jax.random.key(0))
        # (an internal gather error or a silent inf/NaN output before)
        with self.assertRaisesRegex(ValueError, "table.shape=\\(0, 8\\): the table must"):
            jaxfuse.embedding(tokens, jnp.ones((0, 8)))
        with self.assertRaisesRegex(ValueError, "pos_table.shape=\\(0, 8\\)"):
            jaxfuse.embedding(tokens, table, pos_table=jnp.ones((0, 8)))
        np.testing.assert_array_equal(jaxfuse.embedding(tokens, table, scale=np.float32(2.0)),
                                      jaxfuse.embedding(tokens, table, scale=2.0))
        with self.assertRaisesRegex(ValueError, "scale=True must be a Python"):
            jaxfuse.embedding(tokens, table, scale=True)
        for scale in (float("inf"), float("nan")):
            with self.assertRaisesRegex(ValueError, f"scale={scale} must be a finite"):
                jaxfuse.embedding(tokens, table, scale=scale)
        with self.assertRaisesRegex(ValueError, "key=0 must be a JAX PRNG key"):
            jaxfuse.embedding(tokens, table, rate=0.1, key=0)


if __name__ == "__main__":
    pytest.main([__file__])
