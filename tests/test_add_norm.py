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
from tests._util import DTYPES, assert_close, host_randn, keys, randn, saved_residuals

# Whole rows in one tile (one pass), rows split over column tiles (the add and norm kernels),
# one column, a 3-D input.
CASES = [((5, 37), None), ((7, 131), RowBlocks(4, 32, rows_per_program=8)), ((3, 1), None),
         ((2, 3, 16), RowBlocks(2, 16))]


# (dtype, norm, rate), each on the shape it always met (CASES by dtype and rate). Every pair
# of dtype, norm and rate (a norm and the dropout each change the kernel's code, a dtype its
# loads, stores and rounding) and every shape with both norms: bfloat16 with all four
# (norm, rate), float32 and float16 with (rms, 0) and (layer, 0.3). The four left out of the
# full product (float32 and float16 with (layer, 0) and (rms, 0.3)) held no pair of values
# that is not in this list.
_ADD_NORM = [(jnp.float32, "rms", 0.0), (jnp.float32, "layer", 0.3),
             (jnp.bfloat16, "rms", 0.0), (jnp.bfloat16, "layer", 0.0),
             (jnp.bfloat16, "rms", 0.3), (jnp.bfloat16, "layer", 0.3),
             (jnp.float16, "rms", 0.0), (jnp.float16, "layer", 0.3)]
# Eager dispatch runs the same kernels: every dtype, norm, rate and shape once is enough.
_ADD_NORM_EAGER = [_ADD_NORM[i] for i in (1, 2, 5, 7)]


class AddNormTest(chex.TestCase):

    def _check_matches_reference_with_grads(self, dtype, norm, rate):
        shape, blocks = CASES[(DTYPES.index(dtype) + 2 * int(rate > 0)) % len(CASES)]
        seed = shape[-1] + 3 * DTYPES.index(dtype)
        rng = np.random.default_rng(seed)
        x, res = host_randn(rng, shape, dtype), host_randn(rng, shape, dtype, scale=2.0, shift=0.5)
        w = host_randn(rng, shape[-1:], dtype)
        b = host_randn(rng, shape[-1:], dtype) if norm == "layer" else None
        ct = (host_randn(rng, shape, dtype), host_randn(rng, shape, dtype))
        key = jax.random.key(seed)

        def f(impl, **kw):
            return lambda x, res, w: jaxfuse.add_norm(x, res, w, b, norm=norm, rate=rate,
                                                      key=key, impl=impl, **kw)
        (h, y), vjp = jax.vjp(self.variant(f("pallas", block_sizes=blocks)), x, res, w)
        # The reference, only the oracle, jitted: one program, not an executable per op.
        (hr, yr), vjpr = jax.vjp(jax.jit(f("reference")), x, res, w)
        self.assertEqual((h.dtype, y.dtype), (dtype, dtype))
        assert_close(h, hr, dtype)
        assert_close(y, yr, dtype, scale=2.0)
        # dweight sums over rows.
        assert_close(vjp(ct), vjpr(ct), dtype, scale=4.0)

    @chex.variants(with_jit=True)
    @parameterized.parameters(*_ADD_NORM)
    def test_matches_reference_with_grads(self, dtype, norm, rate):
        self._check_matches_reference_with_grads(dtype, norm, rate)

    @chex.variants(without_jit=True)
    @parameterized.parameters(*_ADD_NORM_EAGER)
    def test_matches_reference_with_grads_eager(self, dtype, norm, rate):
        self._check_matches_reference_with_grads(dtype, norm, rate)

    def test_bias_gradient_and_only_h_or_only_y_used(self):
        k = keys(1, 5)
        x, res = randn(k[0], (6, 40)), randn(k[1], (6, 40))
        w, b = randn(k[2], (40,)), randn(k[3], (40,))
        for pick in (0, 1):
            def loss(impl):
                return lambda x, res, w, b: jnp.sum(jaxfuse.add_norm(
                    x, res, w, b, norm="layer", rate=0.2, key=k[4], impl=impl)[pick] ** 2)
            g = jax.grad(loss("pallas"), argnums=(0, 1, 2, 3))(x, res, w, b)
            gr = jax.jit(jax.grad(loss("reference"), argnums=(0, 1, 2, 3)))(x, res, w, b)
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


# (dtype, norm, rate, CASES index): every shape with both norms and both rates (one or three
# projections), every pair of dtype, norm and rate; the column tiles with float32 and float16
# (bfloat16 meets them in AddNormTest).
_ADD_NORM_LINEAR = [(jnp.float32, "rms", 0.0, 1), (jnp.float32, "layer", 0.3, 0),
                    (jnp.float32, "rms", 0.3, 3),
                    (jnp.float16, "rms", 0.0, 0), (jnp.float16, "layer", 0.3, 1),
                    (jnp.float16, "layer", 0.0, 2),
                    (jnp.bfloat16, "rms", 0.3, 2), (jnp.bfloat16, "layer", 0.0, 3)]


class AddNormLinearTest(chex.TestCase):

    @chex.variants(with_jit=True)   # eager dispatch of the same kernels: AddNormTest
    @parameterized.parameters(*_ADD_NORM_LINEAR)
    def test_matches_reference_with_grads(self, dtype, norm, rate, case):
        # Every CASES shape (one pass, column tiles, one column, 3-D), one or three
        # projections of prime widths.
        shape, blocks = CASES[case]
        widths = (7,) if rate else (11, 5, 3)
        seed = shape[-1] + 5 * DTYPES.index(dtype)
        rng = np.random.default_rng(seed)
        x, res = host_randn(rng, shape, dtype), host_randn(rng, shape, dtype, scale=2.0, shift=0.5)
        w = host_randn(rng, shape[-1:], dtype)
        b = host_randn(rng, shape[-1:], dtype) if norm == "layer" else None
        ps = tuple(host_randn(rng, (shape[-1], n), dtype, scale=shape[-1] ** -0.5) for n in widths)
        cts = (host_randn(rng, shape, dtype),
               tuple(host_randn(rng, (*shape[:-1], n), dtype) for n in widths))
        key = jax.random.key(seed)

        def f(impl, **kw):
            return lambda x, res, w, b, ps: jaxfuse.add_norm_linear(
                x, res, w, b, projections=ps, norm=norm, rate=rate, key=key, impl=impl, **kw)
        out, vjp = jax.vjp(self.variant(f("pallas", block_sizes=blocks)), x, res, w, b, ps)
        outr, vjpr = jax.vjp(jax.jit(f("reference")), x, res, w, b, ps)   # jitted oracle
        chex.assert_trees_all_equal_dtypes(out, outr)
        assert_close(out, outr, dtype, scale=2.0)
        assert_close(vjp(cts), vjpr(cts), dtype, scale=4.0)

    # float32 (where any difference of the float32 values shows) on both paths, a 16-bit dtype
    # (where a y rebuilt from h before or after its rounding differs) on each.
    @parameterized.parameters((jnp.float32, CASES[0]), (jnp.float32, CASES[1]),
                              (jnp.float16, CASES[0]), (jnp.bfloat16, CASES[1]))
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

    @parameterized.parameters("rms", "layer")
    def test_vmap_over_projections_alone(self, norm):
        """Mapped over a stack of projections with x, residual, the norm's weights and the key
        shared (an ensemble of heads): h is the same for every member and the projections
        differ. The gradients must equal the reference's and a loop's; they came out with dh
        counted batch-size times (h unbatched beside batched outputs, `_batched_with`)."""
        k = keys(9, 7)
        x, res = randn(k[0], (5, 16)), randn(k[1], (5, 16), shift=0.5)
        w, b = randn(k[2], (16,)), randn(k[3], (16,)) if norm == "layer" else None
        ps = randn(k[4], (3, 16, 6))
        cts = (randn(k[5], (3, 5, 16)), randn(k[6], (3, 5, 6)))
        key = jax.random.key(2)

        def f(impl, loop=False):
            one = lambda x, res, w, b, p: (lambda h, outs: (h, outs[0]))(*jaxfuse.add_norm_linear(
                x, res, w, b, projections=(p,), norm=norm, rate=0.2, key=key, impl=impl))
            if loop:
                return lambda x, res, w, b, ps: jax.tree.map(
                    lambda *a: jnp.stack(a), *[one(x, res, w, b, p) for p in ps])
            return jax.vmap(one, in_axes=(None, None, None, None, 0))
        args = (x, res, w, b, ps)
        out, vjp = jax.vjp(f("pallas"), *args)
        for g in (f("reference"), f("pallas", loop=True)):
            outr, vjpr = jax.vjp(g, *args)
            assert_close(out, outr, jnp.float32)
            assert_close(vjp(cts), vjpr(cts), jnp.float32, scale=2.0)

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
