"""Dropout's counter-based generator and the three ops built on it: dropout, bias_dropout_add,
bias_act_dropout (one kernel, `pallas/_dropout.py`)."""
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

import jaxfuse
from jaxfuse import RowBlocks, _philox
from jaxfuse.pallas import _dropout
from jaxfuse.reference.dropout import keep_mask
from tests._util import DTYPES, assert_close, keys, randn

# Random123's known-answer vectors (tests/kat_vectors): counter, key -> Philox-4x32-10 output.
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]
# One row; a prime width with rows split over two programs and columns over 32-wide tiles (one
# Philox call per 8 elements, a tail tile hanging over); 3-D with 4-wide tiles (a call per
# element), rows split over programs.
CASES = [((1, 7), None), ((5, 37), RowBlocks(2, 32, rows_per_program=4)),
         ((2, 3, 16), RowBlocks(2, 4, rows_per_program=4))]


def _slice_cols(n_cols, k, h):
    """The columns that take half h of word k of their Philox call."""
    c = np.arange(n_cols)
    return c[((c % 32) // 8 == k) & (c % 2 == h)]


def _u32(words):
    return [jnp.asarray(np.uint32(w)) for w in words]


def test_philox_known_answers():
    for ctr, key, expected in KAT:
        out = jax.jit(lambda c, k: _philox.philox4x32(c, k))(_u32(ctr), _u32(key))
        assert [int(o) for o in out] == list(expected)


def test_philox_known_answers_in_a_kernel():
    """The same function inside a Pallas kernel (interpret mode), vectorized over counters."""
    from jax.experimental import pallas as pl
    from jaxfuse.pallas import _rng
    ctr = np.array([c for c, _, _ in KAT], np.uint32).T          # [4 words, 3 vectors]
    key = np.array([k for _, k, _ in KAT], np.uint32).T          # [2 words, 3 vectors]

    def kernel(c_ref, k_ref, o_ref):
        c, k = c_ref[...], k_ref[...]
        out = _philox.philox4x32(tuple(c[i] for i in range(4)), (k[0], k[1]),
                                 mulhi=_rng.mulhi(True))
        o_ref[...] = jnp.stack(out)
    out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((4, 3), jnp.uint32),
                         interpret=True)(ctr, key)
    np.testing.assert_array_equal(np.asarray(out).T, np.array([e for _, _, e in KAT], np.uint32))


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_keep_fraction_of_a_million(rate):
    m = np.asarray(keep_mask(jax.random.key(11), (1000, 1000), rate))
    p = 1.0 - rate
    assert abs(m.mean() - p) < 5 * np.sqrt(p * (1 - p) / m.size)
    # Per 16-bit slice of the Philox call (word k, half h).
    for k in range(4):
        for h in range(2):
            q = m[:, _slice_cols(m.shape[1], k, h)]
            assert abs(q.mean() - p) < 5 * np.sqrt(p * (1 - p) / q.size)


def test_mask_definition_known_bits():
    """Element (r, c) keeps iff half c % 2 of word (c % 32) // 8 of
    Philox((4 (c // 32) + (c % 8) // 2, r, stream, 0)) falls below round((1 - rate) 2^16):
    spelled out here with Python integers."""
    key = jax.random.key(3)
    kw = np.asarray(_philox.key_words(key))
    rate = 0.37
    m = np.asarray(keep_mask(key, (3, 45), rate, stream=2))
    t = int(round((1 - rate) * 65536))
    r, c = np.meshgrid(np.arange(3), np.arange(45), indexing="ij")
    words = np.stack([np.asarray(w) for w in _philox.philox4x32(
        (np.uint32(4 * (c // 32) + (c % 8) // 2), np.uint32(r), np.uint32(2), np.uint32(0)),
        _u32(kw))])                                                    # [4 words, 3, 45]
    w = np.take_along_axis(words, ((c % 32) // 8)[None], axis=0)[0].astype(np.int64)
    np.testing.assert_array_equal(m, ((w >> (16 * (c % 2))) & 0xFFFF) < t)


def test_per_element_and_grouped_masks_agree_bitwise():
    """`keep` (a call per element, any tile) and `keep_block` (a call per 8, aligned tiles),
    also with leading axes (attention's folded slabs)."""
    kw = _philox.key_words(jax.random.key(8))
    rows = jnp.array([[[0], [5], [1 << 20]], [[7], [8], [9]]], jnp.int32)
    block = jax.jit(lambda col0: _philox.keep_block(kw, rows, col0, 96, 0.3, stream=1))
    each = jax.jit(lambda col0: _philox.keep(
        kw, rows, col0 + jnp.arange(96, dtype=jnp.int32)[None, None, :], 0.3, stream=1))
    for col0 in (0, 32, 4096):            # a traced start, as in a kernel
        np.testing.assert_array_equal(block(col0), each(col0))


def test_rate_is_quantized_to_sixteen_bits_and_scaled_unbiased():
    for rate in (0.1, 0.3, 1e-6, 0.99999):
        p = _philox.keep_prob(rate)
        assert abs(p - (1 - rate)) <= 2.0 ** -17 and p * 65536 == round(p * 65536)
        assert _philox.scale(rate) == 1.0 / p
    assert _philox.keep_prob(1e-6) == 1.0           # rounds to keep-all: scale 1, no bias
    with pytest.raises(ValueError, match="rate=0.999999 rounds to keep probability 0"):
        jaxfuse.dropout(jnp.ones((2, 8)), 0.999999, jax.random.key(0))
    # E[dropout(1)] = 1 exactly in expectation: the mean over 10^6 elements within 5 sigma.
    rate = 0.1
    y = np.asarray(jaxfuse.dropout(jnp.ones((1000, 1000)), rate, jax.random.key(4),
                                   impl="reference"), np.float64)
    p = _philox.keep_prob(rate)
    assert abs(y.mean() - 1.0) < 5 * np.sqrt((1 - p) / p / y.size)
    np.testing.assert_array_equal(np.unique(y), np.float32([0.0, 1.0 / p]))


def _agreement_ok(a, b, p):
    """Two independent Bernoulli(p) masks agree with probability p^2 + (1-p)^2."""
    a, b = np.asarray(a).ravel(), np.asarray(b).ravel()
    e = p * p + (1 - p) * (1 - p)
    return abs(np.mean(a == b) - e) < 5 * np.sqrt(e * (1 - e) / a.size)


def test_masks_of_keys_rows_and_group_members_are_uncorrelated():
    p = 0.5
    key = jax.random.key(5)
    m = np.asarray(keep_mask(key, (1000, 1000), 1 - p))
    assert _agreement_ok(m[:-1], m[1:], p)                   # neighbouring rows
    assert _agreement_ok(m[:, :-1], m[:, 1:], p)             # neighbouring columns
    n = m.shape[1] // 32 * 32                               # whole blocks of 32 columns
    assert _agreement_ok(m[:, 0::2], m[:, 1::2], p)          # two halves of one word
    for k in (1, 2, 3):                                      # two words of one Philox call
        assert _agreement_ok(m[:, _slice_cols(n, 0, 0)], m[:, _slice_cols(n, k, 0)], p)
    for other in (jax.random.key(6), jax.random.fold_in(key, 1)):
        assert _agreement_ok(m, keep_mask(other, (1000, 1000), 1 - p), p)
    assert _agreement_ok(keep_mask(jax.random.fold_in(key, 1), (1000, 1000), 1 - p),
                         keep_mask(jax.random.fold_in(key, 2), (1000, 1000), 1 - p), p)
    assert _agreement_ok(m, keep_mask(key, (1000, 1000), 1 - p, stream=1), p)


def test_gelu_is_float32_accurate():
    """The kernels' gelu and its derivative against float64 (`_dropout.normal_cdf2`: A and S
    7.1.26, exact reciprocal and exp2 as interpreted) on a fixed grid: gelu within 4 ulps of
    max(1, |z|) and 1% relative on z in [-6, 0) (1 + an erf near -1 was 86% off at z = -5 with
    the rational fit before), its derivative within 4 ulps of 1, 1 + erf(z / sqrt 2) within 3
    ulps of 2. Measured here 1.4 ulps, 0.36%, 2.5 ulps, 1.9 ulps; over 40M random float32
    points 1.6, 3.0 and 2.8 ulps (s27 review)."""
    import math
    eps = np.finfo(np.float32).eps
    z = np.linspace(-9.0, 9.0, 18001, dtype=np.float32)
    zd = z.astype(np.float64)
    cdf2 = np.array([math.erfc(-v / math.sqrt(2.0)) for v in zd])       # 1 + erf(z / sqrt 2)
    got = np.asarray(_dropout.normal_cdf2(jnp.asarray(z))[0], np.float64)
    assert np.abs(got - cdf2).max() < 6 * eps
    gelu = np.asarray(_dropout.act("gelu", jnp.asarray(z)), np.float64)
    want = 0.5 * zd * cdf2
    assert (np.abs(gelu - want) / np.maximum(1.0, np.abs(zd))).max() < 4 * eps
    tail = (zd < 0) & (zd >= -6)
    assert (np.abs(gelu - want)[tail] / np.abs(want[tail])).max() < 1e-2
    grad = np.asarray(_dropout.act_grad("gelu", jnp.asarray(z)), np.float64)
    want_grad = 0.5 * cdf2 + zd * np.exp(-0.5 * zd * zd) / math.sqrt(2.0 * math.pi)
    assert np.abs(grad - want_grad).max() < 4 * eps


def test_gelu_tanh_is_float32_accurate():
    """gelu_tanh as the kernels compute it, 0.5 (1 + tanh y) = sigmoid(2 y) (`_dropout.
    _tanh_gate`), against float64: within 4 ulps of max(1, |z|) (measured 1.1), relative in the
    negative tail on z in [-6, 0) within 1e-4 (measured 4e-6; 1 + tanh near -1, as jax.nn.gelu
    computes it, is 100% off there), and its derivative no further from float64 than XLA's
    autodiff of jax.nn.gelu(approximate=True) (measured 16.5 against 29.7 ulps of 1: the exp
    of a cubic argument)."""
    eps = np.finfo(np.float32).eps
    z = np.linspace(-12.0, 10.0, 22001, dtype=np.float32)
    zd = z.astype(np.float64)
    y = np.sqrt(2.0 / np.pi) * (zd + 0.044715 * zd ** 3)
    gate = 1.0 / (1.0 + np.exp(-2.0 * y))                  # 0.5 (1 + tanh y), no cancellation
    want = zd * gate
    got = np.asarray(_dropout.act("gelu_tanh", jnp.asarray(z)), np.float64)
    assert (np.abs(got - want) / np.maximum(1.0, np.abs(zd))).max() < 4 * eps
    tail = (zd < 0) & (zd >= -6)
    assert (np.abs(got - want)[tail] / np.abs(want[tail])).max() < 1e-4
    want_grad = gate + 2 * zd * gate * (1 - gate) * np.sqrt(2 / np.pi) * (1 + 3 * 0.044715 * zd**2)
    grad = np.asarray(_dropout.act_grad("gelu_tanh", jnp.asarray(z)), np.float64)
    xla = np.asarray(jax.vmap(jax.grad(lambda v: jax.nn.gelu(v, approximate=True)))(
        jnp.asarray(z)), np.float64)
    assert np.abs(grad - want_grad).max() <= np.abs(xla - want_grad).max()


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "silu", "relu"])
def test_activation_gradients_stay_finite_at_huge_inputs(activation):
    """Finite inputs give finite gradients, however large: gelu_tanh's were NaN at |z| ~ 1e19
    on both paths (its slope's z^2 overflowed to inf, times a gate slope of 0), as autodiff of
    jax.nn.gelu(approximate=True) still is. At such z every activation's slope is its limit,
    0 on the left and 1 on the right; in between, kernel and reference agree."""
    z = jnp.array([[-3e38, -1e30, -1e19, -100.0, -20.5, -19.5, -3.0, 0.5, 19.5, 20.5, 100.0, 1e19,
                    1e30, 3e38]], jnp.float32)
    grads = {impl: np.asarray(jax.grad(lambda x: jaxfuse.bias_act_dropout(
        x, None, activation=activation, impl=impl).sum())(z)) for impl in ("pallas", "reference")}
    for impl, g in grads.items():
        assert np.isfinite(g).all(), (impl, g)
        np.testing.assert_array_equal(g[0, :3], 0.0, err_msg=impl)
        np.testing.assert_array_equal(g[0, -3:], 1.0, err_msg=impl)
    np.testing.assert_allclose(grads["pallas"], grads["reference"], rtol=1e-5, atol=1e-6)


def _ops(op, blocks, rate, key, activation="gelu"):
    """(pallas fn, reference fn) over the op's array arguments."""
    kw = dict(rate=rate, key=key)
    if op == "dropout":
        return [lambda x, impl, **b: jaxfuse.dropout(x, rate, key, impl=impl, **b)], 1
    if op == "bias_dropout_add":
        return [lambda x, bias, res, impl, **b: jaxfuse.bias_dropout_add(
            x, bias, res, impl=impl, **kw, **b)], 3
    return [lambda x, bias, impl, **b: jaxfuse.bias_act_dropout(
        x, bias, activation=activation, impl=impl, **kw, **b)], 2


# (op, dtype); each dtype meets one shape (CASES by dtype). dropout and bias_dropout_add (their
# own inputs: none, or a bias and a residual) with every dtype, so on every shape. The four
# activations of bias_act_dropout run on float32 tiles whatever the dtype (`_rows` loads every
# input as float32 and the activation and its derivative are float32 code), so
# bias_act_dropout meets every dtype and shape, each activation at least one (gelu, the
# default, three with the eager case).
_OPS = [(jnp.float32, "dropout"), (jnp.float32, "bias_dropout_add"), (jnp.float32, "gelu_tanh"),
        (jnp.bfloat16, "dropout"), (jnp.bfloat16, "bias_dropout_add"), (jnp.bfloat16, "gelu"),
        (jnp.bfloat16, "silu"),
        (jnp.float16, "dropout"), (jnp.float16, "bias_dropout_add"), (jnp.float16, "gelu"),
        (jnp.float16, "relu")]
# Eager dispatch runs the same kernels (the activation is a static choice inside them): each of
# the three ops once, each dtype (and shape) once.
_OPS_EAGER = [(jnp.float16, "dropout"), (jnp.bfloat16, "bias_dropout_add"),
              (jnp.float32, "gelu")]


class DropoutOpsTest(chex.TestCase):

    def _check_matches_reference_with_grads(self, op, dtype):
        # Each (op, dtype) pair meets one shape: CASES by dtype (see _OPS).
        shape, blocks = CASES[DTYPES.index(dtype)]
        k = keys(shape[-1] * 7 + len(op), 5)
        rate = 0.3
        act = op if op not in ("dropout", "bias_dropout_add") else None
        (f,), n = _ops(op if act is None else "bias_act_dropout", blocks, rate, k[4], act)
        args = [randn(k[0], shape, dtype), randn(k[1], shape[-1:], dtype),
                randn(k[2], shape, dtype)][:n]
        ct = randn(k[3], shape, dtype)
        y, vjp = jax.vjp(self.variant(lambda *a: f(*a, impl="pallas", block_sizes=blocks)),
                         *args)
        # The reference, only the oracle, jitted: one program, not an executable per op.
        yr, vjpr = jax.vjp(jax.jit(lambda *a: f(*a, impl="reference")), *args)
        self.assertEqual(y.dtype, dtype)
        # Dropped elements are exactly where the reference dropped them (a mask bit off would
        # be an O(1) error); both are exactly zero there for dropout.
        if op == "dropout":
            np.testing.assert_array_equal(np.asarray(y) == 0, np.asarray(yr) == 0)
        assert_close(y, yr, dtype)
        assert_close(vjp(ct), vjpr(ct), dtype, scale=4.0)

    @chex.variants(with_jit=True)
    @parameterized.parameters(*_OPS)
    def test_matches_reference_with_grads(self, dtype, op):
        self._check_matches_reference_with_grads(op, dtype)

    @chex.variants(without_jit=True)
    @parameterized.parameters(*_OPS_EAGER)
    def test_matches_reference_with_grads_eager(self, dtype, op):
        self._check_matches_reference_with_grads(op, dtype)

    def test_kernel_mask_is_the_reference_mask_bitwise(self):
        key = jax.random.key(2)
        # 131 columns whole (interpret mode): Philox per element; 160: one call per 8; tiles
        # of 32 columns: per 8, the last tile hanging over; 16 and 4: per element.
        for n_cols in (131, 160):
            x = jnp.ones((37, n_cols), jnp.float32)
            want = np.asarray(keep_mask(key, x.shape, 0.25))     # once for the four tilings
            for blocks in (None, RowBlocks(4, 32), RowBlocks(1, 16, rows_per_program=2),
                           RowBlocks(3, 4)):
                y = jaxfuse.dropout(x, 0.25, key, block_sizes=blocks)
                np.testing.assert_array_equal(np.asarray(y) != 0, want)

    def test_same_key_same_output_also_under_vmap(self):
        k = keys(3, 2)
        x = randn(k[0], (3, 4, 24))
        f = lambda x: jaxfuse.bias_act_dropout(x, None, activation="relu", rate=0.5, key=k[1])
        np.testing.assert_array_equal(f(x), f(x))
        # vmap over examples with one key: each example is the unbatched call.
        y = jax.vmap(f)(x)
        np.testing.assert_array_equal(y, jnp.stack([f(xi) for xi in x]))
        # A batch of keys under vmap: each example with its own key, as called one by one.
        ks = jax.random.split(k[1], 3)
        g = lambda x, key: jaxfuse.dropout(x, 0.5, key)
        yg = jax.vmap(g)(x, ks)                  # once, for both comparisons
        np.testing.assert_array_equal(yg, jnp.stack([g(*a) for a in zip(x, ks)]))
        gr = lambda x, key: jaxfuse.dropout(x, 0.5, key, impl="reference")
        np.testing.assert_array_equal(yg, jax.vmap(gr)(x, ks))

    def test_rate_zero_or_no_key_is_the_identity(self):
        x = randn(keys(4, 1)[0], (3, 10), jnp.bfloat16)
        res = randn(keys(5, 1)[0], (3, 10), jnp.bfloat16)
        np.testing.assert_array_equal(jaxfuse.dropout(x, 0.0, jax.random.key(0)), x)
        np.testing.assert_array_equal(jaxfuse.dropout(x, 0.5, None), x)
        assert_close(jaxfuse.bias_dropout_add(x, None, res), x.astype(jnp.float32) + res,
                     jnp.bfloat16)

    def test_backward_keeps_only_what_it_reads(self):
        """What the forward hands the backward (the vjp's residuals): dropout its key,
        bias_dropout_add its key and bias (x and the residual are never read: the mask comes
        from the key, d residual = dy), bias_act_dropout also x (act' needs it); with dropout
        off, no key. Gradients against the reference with a random cotangent."""
        kx, kr, kb, kd = keys(6, 4)
        x = randn(kx, (33, 64), jnp.bfloat16)
        res, b, dy = randn(kr, x.shape, x.dtype), randn(kb, (64,), x.dtype), randn(kd, x.shape)
        key = jax.random.key(3)
        cases = [(lambda impl, x: jaxfuse.dropout(x, 0.1, key, impl=impl), (x,), [(2,)]),
                 (lambda impl, x, b, r: jaxfuse.bias_dropout_add(x, b, r, rate=0.1, key=key,
                                                                 impl=impl), (x, b, res),
                  [(64,), (2,)]),
                 (lambda impl, x, b, r: jaxfuse.bias_dropout_add(x, b, r, impl=impl),
                  (x, b, res), [(64,)]),
                 (lambda impl, x, b: jaxfuse.bias_act_dropout(x, b, rate=0.1, key=key,
                                                              impl=impl),
                  (x, b), [(33, 64), (64,), (2,)])]
        for f, args, kept in cases:
            y, vjp = jax.vjp(functools.partial(f, "pallas"), *args)
            self.assertEqual([a.shape for a in jax.tree.leaves(vjp)], kept)
            grads = vjp(dy.astype(y.dtype))
            want = jax.vjp(functools.partial(f, "reference"),
                           *[a.astype(jnp.float32) for a in args])[1](dy)
            for g, w in zip(grads, want):
                assert_close(g, w, jnp.bfloat16)

    def test_bad_input(self):
        x, key = jnp.ones((3, 8)), jax.random.key(0)
        for rate in (1.0, -0.1, 1.5):
            with self.assertRaisesRegex(ValueError, f"rate={rate}"):
                jaxfuse.dropout(x, rate, key)
        with self.assertRaisesRegex(ValueError, "x.dtype=int32"):
            jaxfuse.dropout(jnp.ones((3, 8), jnp.int32), 0.1, key)
        with self.assertRaisesRegex(ValueError, "key \\(dtype=float32"):
            jaxfuse.dropout(x, 0.1, jnp.ones((2,)))
        with self.assertRaisesRegex(ValueError, "key.shape=\\(2,\\)"):
            jaxfuse.dropout(x, 0.1, jax.random.split(key))
        with self.assertRaisesRegex(ValueError, "bias.shape=\\(7,\\) must be \\(8,\\)"):
            jaxfuse.bias_dropout_add(x, jnp.ones((7,)), x)
        with self.assertRaisesRegex(ValueError, "residual"):
            jaxfuse.bias_dropout_add(x, None, jnp.ones((3, 8), jnp.bfloat16))
        with self.assertRaisesRegex(ValueError, "activation='tanh'"):
            jaxfuse.bias_act_dropout(x, None, activation="tanh")
        with self.assertRaisesRegex(ValueError, "x.shape=\\(\\)"):
            jaxfuse.dropout(jnp.float32(1.0), 0.1, key)
        with self.assertRaisesRegex(ValueError, "key=0 must be a JAX PRNG key"):   # not an
            jaxfuse.dropout(x, 0.1, 0)                                  # AttributeError
        # A legacy key is the default generator's raw data: [4] uint32 under "rbg" (it was
        # refused), and its mask is the typed key's.
        with jax.default_prng_impl("rbg"):
            raw = jax.random.PRNGKey(3)
            np.testing.assert_array_equal(jaxfuse.dropout(x, 0.5, raw),
                                          jaxfuse.dropout(x, 0.5, jax.random.wrap_key_data(raw)))
            with self.assertRaisesRegex(ValueError, "legacy uint32 key of shape \\(4,\\)"):
                jaxfuse.dropout(x, 0.1, jnp.zeros((2,), jnp.uint32))


if __name__ == "__main__":
    pytest.main([__file__])
