import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

import jaxfuse
from jaxfuse import RowBlocks
from tests._util import DTYPES, assert_close, keys, randn, vjp_both

# (shape, blocks): whole-row tiles (the interpret-mode rule) and tiles that split rows and
# columns at awkward places, so the multi-tile online (m, l) path runs too.
CASES = [((1, 1), None), ((5, 37), RowBlocks(2, 8)), ((2, 3, 17, 29), None),
         ((2, 3, 17, 29), RowBlocks(3, 16)), ((4, 130), RowBlocks(4, 64))]


class SoftmaxTest(chex.TestCase):

    @chex.variants(with_jit=True)
    @parameterized.product(case=CASES, dtype=DTYPES, masking=["none", "both"])
    def test_matches_reference_with_grads(self, case, dtype, masking):
        shape, blocks = case
        k = keys(hash((shape, masking)) % 1000, 3)
        x = randn(k[0], shape, dtype, scale=3.0)
        mask = jax.random.bernoulli(k[1], 0.7, shape) if masking == "both" else None
        causal = masking == "both" and len(shape) >= 2
        kw = dict(scale=0.7, mask=mask, causal=causal)
        f = self.variant(lambda x: jaxfuse.softmax(x, block_sizes=blocks, **kw))
        fr = lambda x: jaxfuse.softmax(x, impl="reference", **kw)
        ct = randn(k[2], shape, dtype)
        (y, g), (yr, gr) = vjp_both(f, fr, (x,), ct)
        self.assertEqual(y.dtype, dtype)
        assert_close(y, yr, dtype)
        assert_close(g, gr, dtype, scale=2.0)

    @parameterized.parameters(*DTYPES)
    def test_fully_masked_rows_give_zeros_and_zero_grads(self, dtype):
        x = randn(keys(1, 1)[0], (4, 19), dtype)
        mask = jnp.ones((4, 19), bool).at[1].set(False).at[3].set(False)
        for blocks in (None, RowBlocks(2, 8)):
            f = lambda x: jaxfuse.softmax(x, mask=mask, block_sizes=blocks)
            y, vjp = jax.vjp(f, x)
            (g,) = vjp(jnp.ones_like(y))
            self.assertTrue(bool(jnp.all(jnp.isfinite(y))) and bool(jnp.all(jnp.isfinite(g))))
            np.testing.assert_array_equal(np.asarray(y[1], np.float32), 0.0)
            np.testing.assert_array_equal(np.asarray(g[3], np.float32), 0.0)
            np.testing.assert_allclose(np.asarray(y[0], np.float32).sum(), 1.0, rtol=2e-2)

    def test_causal_is_bottom_right_aligned(self):
        # 2 new queries over 5 keys: query 0 sees keys 0..3, query 1 sees all five.
        x = randn(keys(2, 1)[0], (2, 5))
        y = jaxfuse.softmax(x, causal=True)
        np.testing.assert_array_equal(np.asarray(y) > 0, [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])

    def test_long_rows_262144_columns(self):
        x = randn(keys(3, 1)[0], (2, 262144), scale=4.0)
        yr = jaxfuse.softmax(x, impl="reference")
        for blocks in (None, RowBlocks(1, 32768)):
            y = jaxfuse.softmax(x, block_sizes=blocks)
            np.testing.assert_allclose(y, yr, rtol=1e-5, atol=1e-9)

    def test_vmap(self):
        x = randn(keys(4, 1)[0], (3, 4, 9))
        y = jax.vmap(lambda r: jaxfuse.softmax(r, causal=True))(x)
        assert_close(y, jaxfuse.softmax(x, causal=True, impl="reference"), jnp.float32)

    @parameterized.parameters(None, RowBlocks(2, 16))
    def test_rows_whose_max_is_infinite_match_the_reference(self, blocks):
        """A row with an inf score, or whose scale * x overflows to inf, is NaN where the inf is
        and 0 elsewhere, as in the reference (its shift is 0 where the max is not finite): the
        kernel gave an all-zero row there (it looked masked) or an all-NaN one. One tile and
        the multi-tile online (m, l) path; the other rows unchanged."""
        x = jnp.array([[0.1, jnp.inf, -0.5, 0.2], [0.1, 1e30, -0.5, 0.2],
                       [0.3, -1.0, 2.0, 0.0], [-jnp.inf] * 4])
        x = jnp.concatenate([x, jnp.zeros((4, 30))], axis=1)
        for scale in (1.0, 1e10):
            y = jaxfuse.softmax(x, scale=scale, block_sizes=blocks)
            r = jaxfuse.softmax(x, scale=scale, impl="reference")
            np.testing.assert_array_equal(np.isnan(np.asarray(y)), np.isnan(np.asarray(r)))
            np.testing.assert_allclose(np.nan_to_num(np.asarray(y)),
                                       np.nan_to_num(np.asarray(r)), atol=1e-6)
            if scale == 1.0:    # (at 1e10 the finite 0.1 overflows too: NaN in both)
                self.assertTrue(np.isnan(np.asarray(y)[0, 1]) and np.asarray(y)[0, 0] == 0)

    def test_backward_keeps_y_alone(self):
        """What the forward hands the backward: y (dx = y (dy - rowsum(dy y))), neither x nor
        the mask. Gradient against the reference with a random cotangent."""
        kx, kd = keys(5, 2)
        x, dy = randn(kx, (4, 6, 33), jnp.bfloat16), randn(kd, (4, 6, 33))
        f = lambda x, impl: jaxfuse.softmax(x, scale=0.7, mask=x > -1.0, causal=True, impl=impl)
        y, vjp = jax.vjp(lambda x: f(x, "pallas"), x)
        self.assertEqual([a.shape for a in jax.tree.leaves(vjp)], [(4, 6, 33)])
        (g,) = vjp(dy.astype(y.dtype))
        (r,) = jax.vjp(lambda x: f(x, "reference"), x.astype(jnp.float32))[1](dy)
        assert_close(g, r, jnp.bfloat16)

    def test_bad_input(self):
        x = jnp.ones((3, 4))
        with self.assertRaisesRegex(ValueError, "x.dtype=int32"):
            jaxfuse.softmax(jnp.ones((3, 4), jnp.int32))
        with self.assertRaisesRegex(ValueError, "mask.shape=\\(5,\\)"):
            jaxfuse.softmax(x, mask=jnp.ones((5,), bool))
        with self.assertRaisesRegex(ValueError, "mask.dtype=float32"):
            jaxfuse.softmax(x, mask=jnp.ones((3, 4)))
        with self.assertRaisesRegex(ValueError, "impl='cuda'"):
            jaxfuse.softmax(x, impl="cuda")
        with self.assertRaisesRegex(ValueError, "causal=True"):
            jaxfuse.softmax(jnp.ones((4,)), causal=True)
        with self.assertRaisesRegex(ValueError, "block_cols=6"):
            jaxfuse.softmax(x, block_sizes=RowBlocks(1, 6), interpret=False)


if __name__ == "__main__":
    pytest.main([__file__])
