"""add_norm: h = residual + dropout(x), y = norm(h), one kernel each way (`pallas/add_norm.py`);
add_norm_linear: the same with the matmuls that read y, y rebuilt by the backward's kernel."""
import math
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

import jaxfuse
from jaxfuse import RowBlocks
from tests._util import DTYPES, assert_close, keys, randn, saved_residuals

# Whole rows in one tile (one pass), rows split over column tiles (the add and norm kernels),
# one column, a 3-D input.
CASES = [((5, 37), None), ((7, 131), RowBlocks(4, 32, rows_per_program=8)), ((3, 1), None),
         ((2, 3, 16), RowBlocks(2, 16))]


class AddNormTest(chex.TestCase):

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.product(dtype=DTYPES, norm=["rms", "layer"], rate=[0.0, 0.3])
    def test_matches_reference_with_grads(self, dtype, norm, rate):
        shape, blocks = CASES[(DTYPES.index(dtype) + 2 * int(rate > 0)) % len(CASES)]
        k = keys(shape[-1] + 3 * DTYPES.index(dtype), 7)
        x, res = randn(k[0], shape, dtype), randn(k[1], shape, dtype, scale=2.0, shift=0.5)
        w = randn(k[2], shape[-1:], dtype)
        b = randn(k[3], shape[-1:], dtype) if norm == "layer" else None
        ct = (randn(k[4], shape, dtype), randn(k[5], shape, dtype))

        def f(impl, **kw):
            return lambda x, res, w: jaxfuse.add_norm(x, res, w, b, norm=norm, rate=rate,
                                                      key=k[6], impl=impl, **kw)
        (h, y), vjp = jax.vjp(self.variant(f("pallas", block_sizes=blocks)), x, res, w)
        (hr, yr), vjpr = jax.vjp(f("reference"), x, res, w)
        self.assertEqual((h.dtype, y.dtype), (dtype, dtype))
        assert_close(h, hr, dtype)
        assert_close(y, yr, dtype, scale=2.0)
        # dweight sums over rows.
        assert_close(vjp(ct), vjpr(ct), dtype, scale=4.0)

    def test_bias_gradient_and_only_h_or_only_y_used(self):
        k = keys(1, 5)
        x, res = randn(k[0], (6, 40)), randn(k[1], (6, 40))
        w, b = randn(k[2], (40,)), randn(k[3], (40,))
        for pick in (0, 1):
            def loss(impl):
                return lambda x, res, w, b: jnp.sum(jaxfuse.add_norm(
                    x, res, w, b, norm="layer", rate=0.2, key=k[4], impl=impl)[pick] ** 2)
            g = jax.grad(loss("pallas"), argnums=(0, 1, 2, 3))(x, res, w, b)
            gr = jax.grad(loss("reference"), argnums=(0, 1, 2, 3))(x, res, w, b)
            assert_close(g, gr, jnp.float32, scale=4.0)

    def test_mask_is_dropouts_and_vmap(self):
        k = keys(2, 3)
        x, res = randn(k[0], (3, 4, 24)), randn(k[1], (3, 4, 24))
        h, _ = jaxfuse.add_norm(x, res, None, rate=0.5, key=k[2])
        np.testing.assert_array_equal(
            np.asarray(h), np.asarray(jaxfuse.bias_dropout_add(x, None, res, rate=0.5, key=k[2])))
        f = lambda x, r: jaxfuse.add_norm(x, r, None, rate=0.5, key=k[2])
        out = jax.vmap(f)(x, res)
        for i in range(3):
            chex.assert_trees_all_equal(jax.tree.map(lambda a: a[i], out), f(x[i], res[i]))

    def test_bad_input(self):
        x = jnp.ones((3, 8))
        with self.assertRaisesRegex(ValueError, "norm='batch'"):
            jaxfuse.add_norm(x, x, None, norm="batch")
        with self.assertRaisesRegex(ValueError, "bias must be None for norm='rms'"):
            jaxfuse.add_norm(x, x, jnp.ones(8), jnp.ones(8))
        with self.assertRaisesRegex(ValueError, "weight.shape=\\(7,\\) must be \\(8,\\)"):
            jaxfuse.add_norm(x, x, jnp.ones(7))
        with self.assertRaisesRegex(ValueError, "residual"):
            jaxfuse.add_norm(x, jnp.ones((3, 9)), None)
        with self.assertRaisesRegex(ValueError, "rate=1.0"):
            jaxfuse.add_norm(x, x, None, rate=1.0, key=jax.random.key(0))
        with self.assertRaisesRegex(ValueError, "eps=-1"):
            jaxfuse.add_norm(x, x, None, eps=-1)


class AddNormLinearTest(chex.TestCase):

    @chex.variants(with_jit=True)   # eager dispatch of the same kernels: AddNormTest
    @parameterized.product(dtype=DTYPES, norm=["rms", "layer"], rate=[0.0, 0.3])
    def test_matches_reference_with_grads(self, dtype, norm, rate):
        # Every CASES shape (one pass, column tiles, one column, 3-D), one or three
        # projections of prime widths.
        shape, blocks = CASES[(DTYPES.index(dtype) + 2 * int(rate > 0) + int(norm == "layer"))
                              % len(CASES)]
        widths = (7,) if rate else (11, 5, 3)
        k = keys(shape[-1] + 5 * DTYPES.index(dtype), 8)
        x, res = randn(k[0], shape, dtype), randn(k[1], shape, dtype, scale=2.0, shift=0.5)
        w = randn(k[2], shape[-1:], dtype)
        b = randn(k[3], shape[-1:], dtype) if norm == "layer" else None
        ps = tuple(randn(kk, (shape[-1], n), dtype, scale=shape[-1] ** -0.5)
                   for kk, n in zip(jax.random.split(k[4], 3), widths))
        cts = (randn(k[5], shape, dtype),
               tuple(randn(kk, (*shape[:-1], n), dtype)
                     for kk, n in zip(jax.random.split(k[6], 3), widths)))

        def f(impl, **kw):
            return lambda x, res, w, b, ps: jaxfuse.add_norm_linear(
                x, res, w, b, projections=ps, norm=norm, rate=rate, key=k[7], impl=impl, **kw)
        out, vjp = jax.vjp(self.variant(f("pallas", block_sizes=blocks)), x, res, w, b, ps)
        outr, vjpr = jax.vjp(f("reference"), x, res, w, b, ps)
        chex.assert_trees_all_equal_dtypes(out, outr)
        assert_close(out, outr, dtype, scale=2.0)
        assert_close(vjp(cts), vjpr(cts), dtype, scale=4.0)

    @parameterized.product(dtype=DTYPES, case=CASES[:2])
    def test_backward_rebuilds_y_bitwise(self, dtype, case):
        # The projections' gradients read the y the backward kernel writes: it must be the
        # forward's, bit for bit (one pass and column tiles), else dW drifts from add_norm's.
        shape, blocks = case
        k = keys(7, 5)
        x, res = randn(k[0], shape, dtype), randn(k[1], shape, dtype, shift=0.5)
        w, b = randn(k[2], shape[-1:], dtype), randn(k[3], shape[-1:], dtype)
        eye = jnp.eye(shape[-1], dtype=dtype)     # y @ I = y, and dI = y^T dout
        # dout one-hot in each column c, at row c % rows: dI[:, c] = y[c % rows] exactly,
        # whatever order a matmul sums in (every other term is a zero), so dI shows the
        # backward's rebuilt y itself, bit for bit.
        rows, cols = math.prod(shape[:-1]), shape[-1]
        assert cols >= rows       # every row of y appears in some column
        pick = np.arange(cols) % rows
        dout = jnp.zeros((rows, cols), dtype).at[pick, np.arange(cols)].set(1).reshape(shape)

        def f(ps):
            return jaxfuse.add_norm_linear(x, res, w, b, projections=ps, norm="layer",
                                           block_sizes=blocks)[1][0]
        y, vjp = jax.vjp(f, (eye,))
        _, y_kept = jaxfuse.add_norm(x, res, w, b, norm="layer", block_sizes=blocks)
        y_kept = np.asarray(y_kept, np.float32).reshape(rows, cols)
        np.testing.assert_array_equal(np.asarray(y, np.float32).reshape(rows, cols), y_kept)
        np.testing.assert_array_equal(np.asarray(vjp(dout)[0][0], np.float32),
                                      y_kept[pick].T)

    def test_keeps_h_and_statistics_not_y(self):
        k = keys(8, 4)
        x, res, w = randn(k[0], (4, 24)), randn(k[1], (4, 24)), randn(k[2], (24,))
        p = randn(k[3], (24, 6))
        saved = saved_residuals(
            lambda x, r, w, p: jaxfuse.add_norm_linear(x, r, w, projections=(p,)), x, res, w, p)
        # h [4, 24], mean and rstd [4], w [24], p [24, 6]: no second [4, 24] (y)
        self.assertEqual(saved, ["f32[24,6]", "f32[24]", "f32[4,24]", "f32[4]", "f32[4]"])

    def test_bad_input(self):
        x = jnp.ones((3, 8))
        with self.assertRaisesRegex(ValueError, "projections must be a non-empty tuple"):
            jaxfuse.add_norm_linear(x, x, None, projections=())
        with self.assertRaisesRegex(ValueError, "projections must be a non-empty tuple"):
            jaxfuse.add_norm_linear(x, x, None, projections=jnp.ones((8, 2)))
        with self.assertRaisesRegex(ValueError, "projections\\[1\\] \\(shape=\\(7, 2\\)\\) must be "
                                                "\\[D, N\\] with D = x.shape\\[-1\\] = 8"):
            jaxfuse.add_norm_linear(x, x, None, projections=(jnp.ones((8, 2)), jnp.ones((7, 2))))
        with self.assertRaisesRegex(ValueError, "projections\\[0\\].dtype=bfloat16 must match "
                                                "x.dtype=float32"):
            jaxfuse.add_norm_linear(x, x, None, projections=(jnp.ones((8, 2), jnp.bfloat16),))
        with self.assertRaisesRegex(ValueError, "bias must be None for norm='rms'"):
            jaxfuse.add_norm_linear(x, x, jnp.ones(8), jnp.ones(8), projections=(x.T,))


if __name__ == "__main__":
    pytest.main([__file__])
