"""Regressions of the randomized differential run of issue 19, one test class per bug class.

Each input here once broke an op (NaN, a crash, a wrong count, a silent disagreement between
the two implementations); each test pins the documented behaviour in both implementations.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfuse
from tests._util import keys, randn

IMPLS = ("pallas", "reference")


class TestMaskedLogits:
    """Class 1: a -inf logit (a masked vocabulary entry) must not turn 0 * -inf into NaN."""

    @pytest.mark.parametrize("impl", IMPLS)
    def test_minus_inf_logits_without_smoothing(self, impl):
        x = jnp.array([[0.3, -jnp.inf, -jnp.inf, -jnp.inf], [1.0, 2.0, -jnp.inf, 0.5]])
        labels = jnp.array([0, 1])
        loss, g = jax.value_and_grad(lambda x: jaxfuse.cross_entropy(
            x, labels, reduction="sum", impl=impl))(x)
        per = jaxfuse.cross_entropy(x, labels, reduction="none", impl=impl)
        expected = float(jax.nn.logsumexp(jnp.array([1.0, 2.0, 0.5])) - 2.0)
        np.testing.assert_allclose(per, [0.0, expected], rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(loss, expected, rtol=1e-6)
        q = jax.nn.softmax(x, axis=-1)
        np.testing.assert_allclose(g, q - jax.nn.one_hot(labels, 4), atol=1e-6)

    @pytest.mark.parametrize("impl", IMPLS)
    def test_minus_inf_logit_with_smoothing_is_plus_inf(self, impl):
        x = jnp.array([[0.3, -jnp.inf, 1.0, 0.0]])
        loss = jaxfuse.cross_entropy(x, jnp.array([0]), label_smoothing=0.1, impl=impl)
        assert float(loss) == np.inf

    @pytest.mark.parametrize("impl", IMPLS)
    def test_full_smoothing_ignores_the_label_logit(self, impl):
        # a = 1: (1 - a) * x_y must not be 0 * -inf either; the loss is +inf by the formula.
        x = jnp.array([[0.3, 1.0, 0.0], [0.3, 1.0, 0.0]])
        loss = jaxfuse.cross_entropy(x, jnp.array([0, 2]), label_smoothing=1.0,
                                     reduction="none", impl=impl)
        expected = float(jax.nn.logsumexp(x[0]) - jnp.mean(x[0]))
        np.testing.assert_allclose(loss, [expected, expected], rtol=1e-6)

    @pytest.mark.parametrize("impl", IMPLS)
    def test_linear_cross_entropy_with_all_options_zero(self, impl):
        # The same shared formula: z_loss = 0 and a = 0 add nothing, even to a -inf lse.
        k = keys(11, 2)
        x, w = randn(k[0], (5, 8)), randn(k[1], (8, 7))
        labels = jnp.array([0, 3, -100, 6, 2])
        loss = jaxfuse.linear_cross_entropy(x, w, labels, impl=impl)
        ref = jaxfuse.cross_entropy(x @ w, labels, impl="reference")
        np.testing.assert_allclose(loss, ref, rtol=1e-5)


class TestLabelDtypes:
    """Class 6: one rule for labels of any integer dtype: compare as (wide) signed integers,
    so a uint8 label never equals ignore_index=-100; ignore_index must be an int."""

    @pytest.mark.parametrize("impl", IMPLS)
    @pytest.mark.parametrize("dtype", [jnp.uint8, jnp.int8, jnp.uint16, jnp.uint32, jnp.int32])
    def test_label_dtypes_agree_with_int32(self, impl, dtype):
        k = keys(12, 2)
        v = 120
        x = randn(k[0], (6, v), scale=2.0)
        labels = jnp.array([100, 3, 7, 119, 0, 50])
        if dtype in (jnp.uint8, jnp.uint16, jnp.uint32):
            big = {jnp.uint8: 156, jnp.uint16: 65436, jnp.uint32: 4294967196}[dtype]
            # -100 wraps to `big` in this dtype: it is a label out of range (NaN), not ignored.
            lab = jnp.array([big, 3, 7, 119, 0, 50], dtype)
            per = jaxfuse.cross_entropy(x, lab, reduction="none", impl=impl)
            assert np.isnan(per[0]) and np.all(np.isfinite(per[1:]))
            lab = lab.at[0].set(5)
            labels = labels.at[0].set(5)
        else:
            lab = labels.astype(dtype).at[2].set(-100)
            labels = labels.at[2].set(-100)
        for reduction in ("mean", "sum", "none"):
            got = jaxfuse.cross_entropy(x, lab, reduction=reduction, impl=impl)
            want = jaxfuse.cross_entropy(x, labels, reduction=reduction, impl="reference")
            np.testing.assert_allclose(got, want, rtol=1e-6)
        w = randn(k[1], (8, v))
        got = jaxfuse.linear_cross_entropy(x[:, :8], w, lab, impl=impl)
        want = jaxfuse.linear_cross_entropy(x[:, :8], w, labels, impl="reference")
        np.testing.assert_allclose(got, want, rtol=1e-5)

    @pytest.mark.parametrize("impl", IMPLS)
    def test_uint8_label_is_not_the_wrapped_ignore_index(self, impl):
        # The case: V = 200, uint8 label 156 with ignore_index=-100.
        x = randn(keys(13, 1)[0], (2, 200))
        lab = jnp.array([156, 10], jnp.uint8)
        mean = jaxfuse.cross_entropy(x, lab, impl=impl)
        per = jaxfuse.cross_entropy(x, lab, reduction="none", impl=impl)
        np.testing.assert_allclose(mean, jnp.sum(per) / 2, rtol=1e-6)
        ign = jaxfuse.cross_entropy(x, lab, ignore_index=156, impl=impl)
        np.testing.assert_allclose(ign, per[1], rtol=1e-6)

    @pytest.mark.parametrize("impl", IMPLS)
    def test_ignore_index_must_be_an_int(self, impl):
        x, lab = jnp.zeros((2, 5)), jnp.array([1, 2])
        for bad in (1.5, 2.0, "x", None, True, 2 ** 40):
            with pytest.raises(ValueError, match="ignore_index"):
                jaxfuse.cross_entropy(x, lab, ignore_index=bad, impl=impl)
            with pytest.raises(ValueError, match="ignore_index"):
                jaxfuse.linear_cross_entropy(x, jnp.zeros((5, 3)), lab, ignore_index=bad,
                                             impl=impl)
        np.testing.assert_allclose(  # numpy integers are ints
            jaxfuse.cross_entropy(x, lab, ignore_index=np.int64(1), reduction="sum", impl=impl),
            np.log(5.0), rtol=1e-6)
