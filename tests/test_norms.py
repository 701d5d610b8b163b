"""LayerNorm and RMSNorm (one kernel file, `_norm.py`, behind two ops)."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

import jaxfuse
from jaxfuse import RowBlocks
from jaxfuse.reference.layer_norm import scaled_merge, welford_merge
from tests._util import reference_tests, assert_close, keys, randn, vjp_both

# Whole rows; rows and columns split at awkward places (dweight summed over 2 groups of rows);
# one row; a prime column count.
CASES = [((1, 1), None), ((5, 37), RowBlocks(2, 8, rows_per_program=4)),
         ((2, 7, 13), None), ((9, 131), RowBlocks(4, 32))]


def _ops(kind, blocks, params):
    if kind == "layer_norm":
        f = lambda x, w, b: jaxfuse.layer_norm(x, w, b, block_sizes=blocks)
        fr = lambda x, w, b: jaxfuse.layer_norm(x, w, b, impl="reference")
    else:
        f = lambda x, w, b: jaxfuse.rms_norm(x, w, block_sizes=blocks)
        fr = lambda x, w, b: jaxfuse.rms_norm(x, w, impl="reference")
    # Close over the parameters that are absent so jax.vjp sees only arrays.
    keep = [i for i, p in enumerate(params) if p is not None]

    def pick(fn):
        def g(x, *ps):
            full = [None, None]
            for i, p in zip(keep, ps):
                full[i] = p
            return fn(x, *full)
        return g
    return pick(f), pick(fr), [params[i] for i in keep]


class NormTest(chex.TestCase):

    def _check(self, case, dtype, kind):
        shape, blocks = case
        # Half the cases run with weight (and bias), half without.
        params = "weight_bias" if CASES.index(case) % 2 else "none"
        k = keys(len(shape) * 31 + shape[-1], 4)
        x = randn(k[0], shape, dtype, scale=2.0, shift=0.5)
        w = randn(k[1], shape[-1:], dtype) if params == "weight_bias" else None
        b = randn(k[2], shape[-1:], dtype) if params == "weight_bias" and kind == "layer_norm" \
            else None
        f, fr, ps = _ops(kind, blocks, [w, b])
        ct = randn(k[3], shape, dtype)
        (y, g), (yr, gr) = vjp_both(self.variant(f), fr, (x, *ps), ct)
        self.assertEqual(y.dtype, dtype)
        assert_close(y, yr, dtype)
        # dweight sums over rows: its rounding grows with the row count.
        assert_close(g, gr, dtype, scale=4.0)

    test_matches_reference_with_grads, test_eager_matches_reference_with_grads = reference_tests(
        _check, case=CASES, kind=["layer_norm", "rms_norm"])

    def test_large_mean_variance_stays_accurate(self):
        """Rows ~ N(10000, 1) in float32: the tiled Welford merge keeps the variance within 1e-3
        relative, where E[x^2] - E[x]^2 in float32 is far off (lecture 10, sec. 4.2)."""
        x = randn(keys(5, 1)[0], (4, 4096), shift=10000.0)
        x64 = np.asarray(x, np.float64)
        mean64 = x64.mean(-1, keepdims=True)
        var64 = x64.var(-1, keepdims=True)
        y64 = (x64 - mean64) / np.sqrt(var64 + 1e-5)
        naive = jnp.mean(x * x, -1, keepdims=True) - jnp.mean(x, -1, keepdims=True) ** 2
        naive_err = np.max(np.abs(np.asarray(naive, np.float64) / var64 - 1))
        self.assertGreater(naive_err, 1e-1)
        for blocks in (None, RowBlocks(2, 512), RowBlocks(1, 100)):
            y = np.asarray(jaxfuse.layer_norm(x, block_sizes=blocks), np.float64)
            # y = (x - mean) / std, so a variance off by (1 + e) scales y by (1 + e)^-1/2.
            ratio = np.sum(y * y64, -1) / np.sum(y * y, -1)      # = sqrt(var_kernel/var_true)
            var_err = np.max(np.abs(ratio ** 2 - 1))
            self.assertLess(var_err, 1e-3)

    def test_one_column_rms_norm_gradient_is_as_exact_as_float32_allows(self):
        """With one column, dx = w dy eps / (x^2 + eps)^1.5 (~1e-7): the difference of two O(1)
        terms. Against the exact float64 value the error must stay at a few ulps of those
        terms (the float32 reference measured 2.4e-7 over these draws), not grow with them."""
        @jax.jit                                  # one compile serves the 30 draws
        def grads(x, w, dy):
            dx = jax.vjp(lambda x: jaxfuse.rms_norm(x, w), x)[1](dy)[0]
            dxr = jax.vjp(lambda x: jaxfuse.rms_norm(x, w, impl="reference"), x)[1](dy)[0]
            return dx, dxr

        errs, refs = [], []
        for seed in range(30):
            k = keys(seed, 3)
            x, w, dy = randn(k[0], (1, 1), scale=3.0), randn(k[1], (1,)), randn(k[2], (1, 1))
            dx, dxr = grads(x, w, dy)
            x64, w64, dy64 = (float(np.asarray(a).ravel()[0]) for a in (x, w, dy))
            exact = dy64 * w64 * 1e-6 / (x64 * x64 + 1e-6) ** 1.5
            # The size of the cancelling terms, w dy / |x|, sets the ulp scale.
            scale = abs(w64 * dy64) / max(abs(x64), 1e-3)
            errs.append(abs(float(dx[0, 0]) - exact) / scale)
            refs.append(abs(float(dxr[0, 0]) - exact) / scale)
        self.assertLess(max(errs), 8 * np.finfo(np.float32).eps)
        self.assertLess(max(errs), 2 * max(refs) + np.finfo(np.float32).eps)

    def test_rows_of_262144_columns(self):
        k = keys(6, 3)
        x = randn(k[0], (2, 262144), scale=3.0, shift=1.0)
        w, b = randn(k[1], (262144,)), randn(k[2], (262144,))
        ct = randn(k[0], x.shape)
        for blocks in (None, RowBlocks(1, 65536)):
            f = lambda x, w, b: jaxfuse.layer_norm(x, w, b, block_sizes=blocks)
            fr = lambda x, w, b: jaxfuse.layer_norm(x, w, b, impl="reference")
            (y, g), (yr, gr) = vjp_both(f, fr, (x, w, b), ct)
            assert_close(y, yr, jnp.float32, scale=5.0)
            assert_close(g, gr, jnp.float32, scale=5.0)
            y = jaxfuse.rms_norm(x, w, block_sizes=blocks)
            assert_close(y, jaxfuse.rms_norm(x, w, impl="reference"), jnp.float32, scale=5.0)

    @parameterized.product(kind=["layer_norm", "rms_norm"], dtype=[jnp.float32, jnp.bfloat16],
                           blocks=[None, RowBlocks(2, 8)])
    def test_huge_rows_are_normalized_not_zeroed(self, kind, dtype, blocks):
        """Rows whose squares overflow float32 (max|x| 1e19 to 1e33) are normalized like any
        other (they were all zeros: rsqrt(inf) = 0). With 8-column tiles, the last row is huge
        in one tile only: states at different scales merge at the larger one. Gradients
        against the reference, compared after multiplying by the row's magnitude (they are
        ~1/|x|: an absolute tolerance would pass anything). Not 1e37: its gradients, ~1e-37,
        lose bits to float32's subnormal range in both impls."""
        kx, kw, kc = keys(41, 3)
        mags = np.array([1e19, 1e25, 1e33, 1.0, 1.0], np.float32)[:, None]
        x = np.asarray(randn(kx, (5, 37), shift=0.5)) * mags
        x[4, 8:16] *= np.float32(1e30)
        x = jnp.asarray(x).astype(dtype)
        w = randn(kw, (37,), dtype)
        b = randn(kc, (37,), dtype) if kind == "layer_norm" else None
        x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
        mean = x64.mean(-1, keepdims=True) if kind == "layer_norm" else 0.0
        var = ((x64 - mean) ** 2).mean(-1, keepdims=True)
        want = (x64 - mean) / np.sqrt(var + (1e-5 if kind == "layer_norm" else 1e-6)) * w64
        if b is not None:
            want = want + np.asarray(b, np.float64)
        f, fr, ps = _ops(kind, blocks, [w, b])
        ct = randn(keys(42, 1)[0], (5, 37), dtype)
        (y, g), (yr, gr) = vjp_both(f, fr, (x, *ps), ct)
        assert_close(y, want, dtype)
        assert_close(yr, want, dtype)
        row_mag = np.abs(x64).max(-1, keepdims=True)
        self.assertTrue(np.all(np.isfinite(np.asarray(g[0], np.float64) * row_mag)))
        assert_close(np.asarray(g[0], np.float64) * row_mag,
                     np.asarray(gr[0], np.float64) * row_mag, dtype, scale=4.0)
        assert_close(g[1:], gr[1:], dtype, scale=4.0)

    def test_rows_below_2_41_are_not_rescaled(self):
        """max|x| < 2^41: s = 1 and the reference is today's formula bit for bit."""
        x = randn(keys(43, 1)[0], (6, 33), scale=3e11)
        self.assertLess(float(jnp.abs(x).max()), 2.0 ** 41)
        y = jaxfuse.rms_norm(x, impl="reference")
        np.testing.assert_array_equal(
            y, x * jax.lax.rsqrt(jnp.mean(jnp.square(x), -1, keepdims=True) + 1e-6))
        mean = jnp.mean(x, -1, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), -1, keepdims=True)
        np.testing.assert_array_equal(jaxfuse.layer_norm(x, impl="reference"),
                                      (x - mean) * jax.lax.rsqrt(var + 1e-5))

    def test_welford_merge(self):
        x = np.asarray(randn(keys(7, 1)[0], (50,), shift=3.0), np.float64)
        def state(v):
            return (float(len(v)), float(v.mean()) if len(v) else 0.0,
                    float(((v - v.mean()) ** 2).sum()) if len(v) else 0.0)
        for cut in (0, 1, 17, 50):
            n, mean, m2 = welford_merge(state(x[:cut]), state(x[cut:]))
            np.testing.assert_allclose([n, mean, m2 / n], [50, x.mean(), x.var()], rtol=1e-6)
        # Associative: ((a, b), c) == (a, (b, c)).
        a, b, c = state(x[:10]), state(x[10:33]), state(x[33:])
        np.testing.assert_allclose(welford_merge(welford_merge(a, b), c),
                                   welford_merge(a, welford_merge(b, c)), rtol=1e-6)
        # An empty side leaves the other unchanged (exactly, in the working precision).
        a32 = np.asarray(a, np.float32)
        np.testing.assert_array_equal(np.asarray(welford_merge(a32, (0.0, 0.0, 0.0)), np.float32), a32)
        np.testing.assert_array_equal(np.asarray(welford_merge((0.0, 0.0, 0.0), a32), np.float32), a32)
        # Scaled states (count, mean / s, m2 / s^2, s) merge at the larger s to the same state.
        x32 = np.asarray(x, np.float32)
        def scaled(v, s):
            n, mean, m2 = state(np.asarray(v, np.float64))
            return (np.float32(n), np.float32(mean / s), np.float32(m2 / s / s), np.float32(s))
        n, mean, m2, s = scaled_merge(scaled(x32[:20], 2.0 ** 50), scaled(x32[20:], 1.0))
        self.assertEqual(float(s), 2.0 ** 50)
        np.testing.assert_allclose([n, mean * s, m2 * s * s / n], [50, x.mean(), x.var()],
                                   rtol=1e-5)

    def test_vmap_and_jit_grad(self):
        x = randn(keys(8, 1)[0], (3, 4, 9))
        w = randn(keys(9, 1)[0], (9,))
        y = jax.vmap(lambda r: jaxfuse.rms_norm(r, w))(x)
        assert_close(y, jaxfuse.rms_norm(x, w, impl="reference"), jnp.float32)
        g = jax.jit(jax.grad(lambda w: jaxfuse.layer_norm(x, w).sum()))(w)
        gr = jax.grad(lambda w: jaxfuse.layer_norm(x, w, impl="reference").sum())(w)
        assert_close(g, gr, jnp.float32, scale=4.0)

    def test_backward_keeps_x_and_row_statistics_not_y(self):
        """What the forward hands the backward (the vjp's residuals): x, the parameters and the
        float32 row statistics; not y, which the backward never reads (under `lax.scan` every
        residual is copied into a stacked buffer). Gradients against the reference with a
        random cotangent."""
        kx, kw, kd = keys(10, 3)
        x, w, dy = randn(kx, (5, 3, 40), jnp.bfloat16), randn(kw, (40,), jnp.bfloat16), randn(
            kd, (5, 3, 40))
        for norm in (lambda x, w, impl: jaxfuse.rms_norm(x, w, impl=impl),
                     lambda x, w, impl: jaxfuse.layer_norm(x, w, w, impl=impl)):
            y, vjp = jax.vjp(lambda x, w: norm(x, w, "pallas"), x, w)
            self.assertEqual([a.shape for a in jax.tree.leaves(vjp)],
                             [(5, 3, 40), (40,), (5, 3), (5, 3)])
            want = jax.vjp(lambda x, w: norm(x, w, "reference"), x.astype(jnp.float32),
                           w.astype(jnp.float32))[1](dy)
            for g, r in zip(vjp(dy.astype(y.dtype)), want):
                assert_close(g, r, jnp.bfloat16, scale=4.0)

    def test_bad_input(self):
        x = jnp.ones((3, 8))
        with self.assertRaisesRegex(ValueError, "weight.shape=\\(7,\\) must be \\(8,\\)"):
            jaxfuse.layer_norm(x, jnp.ones((7,)))
        with self.assertRaisesRegex(ValueError, "bias.shape=\\(3, 8\\)"):
            jaxfuse.layer_norm(x, None, jnp.ones((3, 8)))
        with self.assertRaisesRegex(ValueError, "weight.shape=\\(9,\\)"):
            jaxfuse.rms_norm(x, jnp.ones((9,)))
        with self.assertRaisesRegex(ValueError, "x.dtype=int32"):
            jaxfuse.rms_norm(jnp.ones((3, 8), jnp.int32))
        with self.assertRaisesRegex(ValueError, "rows_per_program=3"):
            jaxfuse.layer_norm(x, block_sizes=RowBlocks(2, 8, rows_per_program=3))

    def test_rows_per_program_only_where_rows_are_summed(self):
        # rows_per_program is for the passes that sum over rows (dweight, dbias): a forward
        # given the same tile keeps one chunk of rows per program, the backward walks them.
        from jaxfuse.pallas import _rows
        bl = RowBlocks(2, 8, rows_per_program=4)
        fwd = _rows.resolve_blocks(bl, 37, 8, interpret=True)
        bwd = _rows.resolve_blocks(bl, 37, 8, interpret=True, accumulate_rows=True)
        self.assertIsNone(fwd.rows_per_program)
        self.assertEqual(bwd.rows_per_program, 4)
        self.assertEqual(_rows.resolve_blocks(RowBlocks(2, 8), 37, 8, interpret=True,
                                              accumulate_rows=True).rows_per_program, 38)

    def test_programs_per_multiprocessor_of_row_summing_passes(self):
        # The GPU rule (decided on any host): `programs_per_sm` programs a multiprocessor, each
        # summing a whole number of row blocks; the norms keep 2, the dropout family's dbias 8.
        from jaxfuse.pallas import _common as C
        from jaxfuse.pallas import _rows
        sms = C.num_multiprocessors()
        for n_rows, n_cols in ((16384, 4096), (16384, 1024), (1000, 96)):
            for per_sm in (2, 8):
                b = _rows.resolve_blocks(None, n_rows, n_cols, interpret=False,
                                         accumulate_rows=True, programs_per_sm=per_sm)
                self.assertEqual(b.rows_per_program % b.block_rows, 0)
                groups = max(1, per_sm * sms // C.cdiv(n_cols, b.block_cols))
                self.assertEqual(b.rows_per_program,
                                 b.block_rows * C.cdiv(C.cdiv(n_rows, groups), b.block_rows))
            # a given tile without rows_per_program takes the same rule's count
            given = _rows.resolve_blocks(RowBlocks(2, 512), n_rows, n_cols, interpret=False,
                                         accumulate_rows=True, programs_per_sm=8)
            self.assertEqual(given.rows_per_program % 2, 0)
            self.assertGreaterEqual(given.rows_per_program, 2)
        two, eight = (_rows.resolve_blocks(None, 16384, 4096, interpret=False,
                                           accumulate_rows=True, programs_per_sm=k)
                      for k in (2, 8))
        self.assertLess(eight.rows_per_program, two.rows_per_program)


if __name__ == "__main__":
    pytest.main([__file__])
