import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

import jaxfuse
from jaxfuse import RowBlocks
from tests._util import DTYPES, assert_close, keys, randn

CASES = [((1, 1), None), ((6, 37), RowBlocks(4, 8)), ((2, 5, 29), None), ((3, 3, 100), RowBlocks(2, 16))]
OPTIONS = [(a, r) for a in (0.0, 0.1) for r in ("mean", "sum", "none")]
# Every (smoothing, reduction) pair on the two tiled cases in float32, and every case in every
# dtype with one pair each (rotating), so each option meets each dtype somewhere.
COMBOS = ([(c, jnp.float32, *o) for c in CASES[1::2] for o in OPTIONS]
          + [(c, d, *OPTIONS[(i + j) % 6]) for i, c in enumerate(CASES)
             for j, d in enumerate(DTYPES)])


def _labels(key, shape, n_cls, ignore_frac=0.25):
    labels = jax.random.randint(key, shape, 0, n_cls)
    drop = jax.random.bernoulli(jax.random.fold_in(key, 1), ignore_frac, shape)
    return jnp.where(drop, -100, labels)


class CrossEntropyTest(chex.TestCase):

    @chex.variants(with_jit=True)
    @parameterized.parameters(*COMBOS)
    def test_matches_reference_with_grads(self, case, dtype, smoothing, reduction):
        shape, blocks = case
        k = keys(shape[-1] + len(shape), 3)
        x = randn(k[0], shape, dtype, scale=3.0)
        labels = _labels(k[1], shape[:-1], shape[-1])
        kw = dict(label_smoothing=smoothing, reduction=reduction)
        f = self.variant(lambda x: jaxfuse.cross_entropy(x, labels, block_sizes=blocks, **kw))
        fr = lambda x: jaxfuse.cross_entropy(x, labels, impl="reference", **kw)
        y, vjp = jax.vjp(f, x)
        yr, vjpr = jax.vjp(fr, x)
        self.assertEqual(y.dtype, jnp.float32)
        ct = randn(k[2], y.shape)
        assert_close(y, yr, dtype, scale=float(np.sqrt(shape[-1])))
        assert_close(vjp(ct), vjpr(ct), dtype)

    def test_gradient_is_q_minus_p(self):
        x = randn(keys(1, 1)[0], (4, 11), scale=2.0)
        labels = jnp.array([3, 0, -100, 10])
        g = jax.grad(lambda x: jaxfuse.cross_entropy(x, labels, label_smoothing=0.2,
                                                     reduction="sum"))(x)
        q = jax.nn.softmax(x, -1)
        p = 0.8 * jax.nn.one_hot(jnp.clip(labels, 0), 11) + 0.2 / 11
        expected = jnp.where((labels == -100)[:, None], 0.0, q - p)
        np.testing.assert_allclose(g, expected, atol=1e-6)

    def test_bad_labels_give_nan_not_a_number(self):
        x = randn(keys(2, 1)[0], (3, 7))
        labels = jnp.array([7, -1, 2])
        for impl in ("pallas", "reference"):
            loss = jaxfuse.cross_entropy(x, labels, reduction="none", impl=impl)
            self.assertTrue(bool(jnp.isnan(loss[0])) and bool(jnp.isnan(loss[1])))
            self.assertTrue(bool(jnp.isfinite(loss[2])))
            self.assertTrue(bool(jnp.isnan(jaxfuse.cross_entropy(x, labels, impl=impl))))

    def test_all_ignored_mean_is_zero(self):
        x = randn(keys(3, 1)[0], (3, 7))
        labels = jnp.full((3,), -100)
        loss, g = jax.value_and_grad(lambda x: jaxfuse.cross_entropy(x, labels))(x)
        self.assertEqual(float(loss), 0.0)
        np.testing.assert_array_equal(g, 0.0)

    def test_long_rows(self):
        x = randn(keys(4, 1)[0], (3, 262144), scale=2.0)
        labels = jnp.array([5, 262143, -100])
        fr = lambda x: jaxfuse.cross_entropy(x, labels, label_smoothing=0.1, impl="reference")
        for blocks in (None, RowBlocks(2, 32768)):
            f = lambda x: jaxfuse.cross_entropy(x, labels, label_smoothing=0.1, block_sizes=blocks)
            assert_close(jax.value_and_grad(f)(x), jax.value_and_grad(fr)(x), jnp.float32, 10.0)

    def test_special_rows_over_several_tiles(self):
        # V = 100 in tiles of 16: six inner tiles (no column mask) and a ragged last one; 8
        # rows in blocks of 4 (rows tile exactly: nothing masked in the inner tiles) and of 3.
        # Rows: all -inf, a NaN logit, an ignored label, an out-of-range label, a -inf label
        # logit, ordinary rows; every smoothing regime (no sum of logits at a = 0; a = 1).
        x = randn(keys(5, 1)[0], (8, 100), scale=3.0)
        x = x.at[0].set(-jnp.inf).at[1, 37].set(jnp.nan).at[4, 9].set(-jnp.inf)
        labels = jnp.array([3, 50, -100, 100, 9, 99, 0, 64])
        for a in (0.0, 0.1, 1.0):
            fr = lambda x: jaxfuse.cross_entropy(x, labels, label_smoothing=a,
                                                 reduction="none", impl="reference")
            want = np.asarray(fr(x))
            for blocks in (RowBlocks(4, 16), RowBlocks(3, 16)):
                got = np.asarray(jaxfuse.cross_entropy(x, labels, label_smoothing=a,
                                                       reduction="none", block_sizes=blocks))
                np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"{a=}")
                np.testing.assert_array_equal(np.isinf(got), np.isinf(want), err_msg=f"{a=}")
                fin = np.isfinite(want)
                np.testing.assert_allclose(got[fin], want[fin], rtol=2e-6, atol=2e-6)

    def test_a_plus_inf_logit_gives_lse_plus_inf_as_the_reference(self):
        """A +inf logit makes lse +inf (jax.nn.logsumexp's rule), so the loss is +inf, or NaN
        where the label's own logit is +inf (inf - inf) and with smoothing (inf - inf in the sum
        of logits). The kernel shifted by the row max as it was, exp(inf - inf) = NaN (found by
        the deep hypothesis profile of test_properties, float16 logits past 65504). Rows: +inf
        in the first tile beside lanes of -inf; +inf in a later tile after a finite max large
        enough that exp(max) overflows; two +infs; +inf at the label; an ordinary row, unchanged. Row 1 is -inf but for a
        logit of 200 in the first lane and the label's: in 16-column tiles the other lanes
        hold 0 when the +inf comes (the clamp's case; without it, 0 * exp(200) = NaN)."""
        x = randn(keys(6, 1)[0], (5, 100), scale=3.0)
        x = (x.at[0, 2].set(jnp.inf).at[0, 3:16].set(-jnp.inf)
             .at[1].set(-jnp.inf).at[1, 0].set(200.0).at[1, 99].set(1.0).at[1, 70].set(jnp.inf)
             .at[2, 5].set(jnp.inf).at[2, 90].set(jnp.inf)
             .at[3, 64].set(jnp.inf))
        labels = jnp.array([50, 99, 0, 64, 7])
        for a in (0.0, 0.1):
            want = np.asarray(jaxfuse.cross_entropy(x, labels, label_smoothing=a,
                                                    reduction="none", impl="reference"))
            # +inf, +inf, +inf, NaN without smoothing; NaN with it (the sum of logits)
            np.testing.assert_array_equal(np.isposinf(want[:4]), [a == 0, a == 0, a == 0, 0])
            for blocks in (None, RowBlocks(4, 16), RowBlocks(3, 16)):
                got = np.asarray(jaxfuse.cross_entropy(x, labels, label_smoothing=a,
                                                       reduction="none", block_sizes=blocks))
                np.testing.assert_array_equal(got[:4], want[:4], err_msg=f"{a=} {blocks=}")
                np.testing.assert_allclose(got[4], want[4], rtol=2e-6)

    def test_long_rows_are_walked_in_narrow_tiles_on_the_gpu(self):
        # One program per row walks rows past 16384 columns in 4096-column tiles of 4 warps
        # (more programs per multiprocessor; BENCHMARKS.md, s8-1); shorter rows stay whole.
        rule = lambda n, v: RowBlocks.for_shape(n, v, interpret=False)
        self.assertEqual(rule(2048, 128256), RowBlocks(1, 4096, 4))
        self.assertEqual(rule(4, 16385), RowBlocks(1, 4096, 4))
        self.assertEqual(rule(4, 16384), RowBlocks(1, 16384, 16))
        self.assertEqual(rule(64, 1000), RowBlocks(4, 1024, 4))

    def test_loss_and_grad_is_the_pair_in_one_kernel(self):
        # `loss_and_grad` (the linear + cross-entropy slabs' kernel) against `token_loss` and
        # its backward with the same tiles: bitwise, in every dtype, on rows of one tile, of
        # whole tiles and of a ragged last tile, rows not a multiple of the row block, the
        # special rows (all -inf, a NaN logit, ignored, out of range, a -inf label logit).
        from jaxfuse.pallas import cross_entropy as pce
        ref = jaxfuse.reference.cross_entropy
        k = keys(6, 2)
        for (n, v, blocks), dtype, a in [
                ((8, 100, RowBlocks(4, 16)), jnp.float32, 0.1),
                ((8, 100, RowBlocks(3, 16)), jnp.bfloat16, 0.0),
                ((8, 96, RowBlocks(3, 32)), jnp.float16, 1.0),
                ((8, 97, None), jnp.bfloat16, 0.1),
                ((8, 10, RowBlocks(3, 16)), jnp.bfloat16, 0.1),    # a row of one ragged tile
                ((1, 1, None), jnp.float32, 0.0)]:
            x = randn(k[0], (n, v), dtype, scale=3.0)
            labels = jax.random.randint(k[1], (n,), 0, v)
            if n > 4:
                x = x.at[0].set(-jnp.inf).at[1, 37 % v].set(jnp.nan).at[4, 9].set(-jnp.inf)
                labels = labels.at[2].set(-100).at[3].set(v).at[4].set(9)
            labels = ref.canonical_labels(labels, v, -100)
            st = pce.static((n, v), label_smoothing=a, ignore_index=-100, interpret=None,
                            block_sizes=blocks)
            loss, dz = jax.jit(lambda x: pce.loss_and_grad(x, labels, st))(x)
            want, pull = jax.vjp(lambda x: pce.token_loss(x, labels, st), x)
            msg = f"{n=} {v=} {blocks=} {dtype=} {a=}"
            self.assertEqual((loss.dtype, dz.dtype, dz.shape), (jnp.float32, dtype, x.shape))
            np.testing.assert_array_equal(loss, want, err_msg=msg)
            np.testing.assert_array_equal(np.asarray(dz, np.float32),
                                          np.asarray(pull(jnp.ones_like(want))[0], np.float32),
                                          err_msg=msg)
            if n > 4:   # a bad label poisons its row of dz; an ignored one has none
                self.assertTrue(bool(jnp.isnan(dz[3]).all()) and bool((dz[2] == 0).all()), msg)

    @pytest.mark.skipif(jax.default_backend() != "gpu",
                        reason="interpret mode has no buffer aliasing to get wrong (the sm90 "
                               "lowering test checks the alias is asked for)")
    def test_loss_and_grad_leaves_a_live_logits_buffer_alone(self):
        # dz is written over the logits (in place); where the caller still holds the logits,
        # XLA must give the kernel a copy, not let it clobber them.
        from jaxfuse.pallas import cross_entropy as pce
        x = randn(keys(7, 1)[0], (5, 40), jnp.bfloat16)
        before = np.asarray(x, np.float32)
        labels = jnp.arange(5)
        st = pce.static((5, 40), label_smoothing=0.0, ignore_index=-100, interpret=None,
                        block_sizes=RowBlocks(2, 16))
        _, dz, kept = jax.jit(lambda x: (*pce.loss_and_grad(x, labels, st), x * 1))(x)
        for arr in (kept, x):
            np.testing.assert_array_equal(np.asarray(arr, np.float32), before)
        self.assertFalse(np.array_equal(np.asarray(dz, np.float32), before))

    def test_bad_input(self):
        x = jnp.ones((3, 7))
        with self.assertRaisesRegex(ValueError, "labels.shape=\\(4,\\) must equal"):
            jaxfuse.cross_entropy(x, jnp.zeros((4,), jnp.int32))
        with self.assertRaisesRegex(ValueError, "labels.dtype=float32"):
            jaxfuse.cross_entropy(x, jnp.zeros((3,)))
        with self.assertRaisesRegex(ValueError, "reduction='avg'"):
            jaxfuse.cross_entropy(x, jnp.zeros((3,), jnp.int32), reduction="avg")
        with self.assertRaisesRegex(ValueError, "label_smoothing=1.5"):
            jaxfuse.cross_entropy(x, jnp.zeros((3,), jnp.int32), label_smoothing=1.5)
        with self.assertRaisesRegex(ValueError, "logits.dtype=int32"):
            jaxfuse.cross_entropy(jnp.ones((3, 7), jnp.int32), jnp.zeros((3,), jnp.int32))


if __name__ == "__main__":
    pytest.main([__file__])
