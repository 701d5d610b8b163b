"""Regressions of the randomized differential run of issue 19, one test class per bug class.

Each input here once broke an op (NaN, a crash, a wrong count, a silent disagreement between
the two implementations); each test pins the documented behaviour in both implementations.
"""
import functools

import jax
import jax.extend.core
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
        loss, g = jax.jit(jax.value_and_grad(lambda x: jaxfuse.cross_entropy(
            x, labels, reduction="sum", impl=impl)))(x)
        per = jax.jit(lambda x: jaxfuse.cross_entropy(x, labels, reduction="none", impl=impl))(x)
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
        loss = jax.jit(functools.partial(jaxfuse.linear_cross_entropy, impl=impl))(x, w, labels)
        ref = jaxfuse.cross_entropy(x @ w, labels, impl="reference")
        np.testing.assert_allclose(loss, ref, rtol=1e-5)


class TestLabelDtypes:
    """Class 6: one rule for labels of any integer dtype: compare as (wide) signed integers,
    so a uint8 label never equals ignore_index=-100; ignore_index must be an int."""

    # The three reductions as one compiled program for each implementation and labels dtype,
    # shared by the cases (an eager call traced the kernel afresh and compiled it again).
    _losses = staticmethod(jax.jit(lambda x, labels, impl: [
        jaxfuse.cross_entropy(x, labels, reduction=r, impl=impl)
        for r in ("mean", "sum", "none")], static_argnames="impl"))

    @pytest.mark.parametrize("impl", IMPLS)
    @pytest.mark.parametrize("dtype", [jnp.uint8, jnp.int8, jnp.uint32])
    def test_label_dtypes_agree_with_int32(self, impl, dtype):
        k = keys(12, 2)
        v = 120
        x = randn(k[0], (6, v), scale=2.0)
        labels = jnp.array([100, 3, 7, 119, 0, 50])
        if dtype in (jnp.uint8, jnp.uint16, jnp.uint32):
            big = {jnp.uint8: 156, jnp.uint16: 65436, jnp.uint32: 4294967196}[dtype]
            # -100 wraps to `big` in this dtype: it is a label out of range (NaN), not ignored.
            lab = jnp.array([big, 3, 7, 119, 0, 50], dtype)
            per = self._losses(x, lab, impl=impl)[2]          # reduction="none"
            assert np.isnan(per[0]) and np.all(np.isfinite(per[1:]))
            lab = lab.at[0].set(5)
            labels = labels.at[0].set(5)
        else:
            lab = labels.astype(dtype).at[2].set(-100)
            labels = labels.at[2].set(-100)
        for got, want in zip(self._losses(x, lab, impl=impl),
                             self._losses(x, labels, impl="reference")):
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


class TestDecodeBlocksAndLengths:
    """Class 7: `DecodeBlocks` validates like the other `*Blocks`; lengths of any integer dtype
    are clipped to [0, S] in their own dtype (uint32 2^31 + 5 means S, not a negative length)."""

    def _inputs(self, b=3, s=11, hq=4, hkv=2, d=8):
        k = keys(14, 3)
        return randn(k[0], (b, hq, d)), randn(k[1], (b, s, hkv, d)), randn(k[2], (b, s, hkv, d))

    @pytest.mark.parametrize("blocks", [jaxfuse.DecodeBlocks(block_k=0),
                                        jaxfuse.DecodeBlocks(block_k=-4),
                                        jaxfuse.DecodeBlocks(block_k=24, folded=False),
                                        jaxfuse.DecodeBlocks(num_warps=0)])
    def test_bad_blocks_raise(self, blocks):
        q, kc, vc = self._inputs()
        with pytest.raises(ValueError, match="block_k|num_warps"):
            jaxfuse.decode_attention(q, kc, vc, jnp.array([1, 2, 3]), block_sizes=blocks)

    @pytest.mark.parametrize("impl", IMPLS)
    @pytest.mark.parametrize("dtype", [jnp.uint32, jnp.int8])
    def test_lengths_clip_in_their_own_dtype(self, impl, dtype):
        q, kc, vc = self._inputs()
        big = {jnp.uint32: 2 ** 31 + 5, jnp.uint8: 200, jnp.int8: 100, jnp.uint16: 40000}[dtype]
        lengths = jnp.array([big, 4, 0], dtype)
        got = jaxfuse.decode_attention(q, kc, vc, lengths, return_lse=True, impl=impl)
        want = jaxfuse.decode_attention(q, kc, vc, jnp.array([11, 4, 0]), return_lse=True,
                                        impl="reference")
        np.testing.assert_allclose(got[0], want[0], atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(got[1], want[1], atol=1e-5, rtol=1e-5)


class TestNarrowIndexDtypes:
    """Class 8 (s33's randomized run): integer index arrays of any dtype are clipped within
    their dtype's range: S = 300 taken as a uint8 bound is 44, which moved 44 positions of the
    caches instead of 100 (`_checks.clip_int32`)."""

    @pytest.mark.parametrize("impl", IMPLS)
    @pytest.mark.parametrize("dtype", [jnp.uint8, jnp.int8])
    def test_reorder_beams_positions(self, impl, dtype):
        c = jnp.arange(2 * 2 * 300, dtype=jnp.float32).reshape(2, 2, 300)
        parent = jnp.array([[1, 1], [0, 0]], dtype)
        start, stop = jnp.array([0, 7], dtype), jnp.array([100, 120], dtype)
        (got,) = jaxfuse.reorder_beams((c,), parent, start, stop, impl=impl)
        (want,) = jaxfuse.reorder_beams((c,), parent.astype(jnp.int32), start.astype(jnp.int32),
                                        stop.astype(jnp.int32), impl="reference")
        np.testing.assert_array_equal(got, want)
        assert int((want[0, 0] != c[0, 0]).sum()) == 100     # beam 0 took beam 1's [0, 100)
        assert int((want[1, 1] != c[1, 1]).sum()) == 113     # beam 1 took beam 0's [7, 120)

    def test_prefill_prompt_lengths(self):
        from jaxfuse import model as M
        cfg = M.Config(vocab_size=11, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=16,
                       max_len=300)
        params = M.init(jax.random.key(0), cfg)
        prompts = jax.random.randint(jax.random.key(1), (2, 300), 0, 11)
        run = lambda n: M.prefill(params, M.init_cache(cfg, 2, 300), prompts, n, cfg,
                                  impl="reference")
        logits, cache = run(jnp.array([200, 3], jnp.uint8))
        want_logits, _ = run(jnp.array([200, 3]))
        np.testing.assert_array_equal(cache["lengths"], [200, 3])
        np.testing.assert_array_equal(logits, want_logits)


class TestNonFinite:
    """Class 8: non-finite parameters raise `ValueError`; a NaN in the data gives NaN in its
    row (and only there) in both implementations."""

    @pytest.mark.parametrize("impl", IMPLS)
    @pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
    def test_non_finite_parameters_raise(self, impl, bad):
        x = jnp.ones((2, 8))
        q = jnp.ones((1, 2, 1, 8))
        cases = [
            ("scale", lambda: jaxfuse.softmax(x, scale=bad, impl=impl)),
            ("scale", lambda: jaxfuse.flash_attention(q, q, q, scale=bad, impl=impl)),
            ("logits_soft_cap", lambda: jaxfuse.flash_attention(q, q, q, logits_soft_cap=bad,
                                                                impl=impl)),
            ("scale", lambda: jaxfuse.decode_attention(q[:, 0], q, q, jnp.array([2]),
                                                       scale=bad, impl=impl)),
            ("eps", lambda: jaxfuse.layer_norm(x, eps=bad, impl=impl)),
            ("eps", lambda: jaxfuse.rms_norm(x, eps=bad, impl=impl)),
            ("z_loss", lambda: jaxfuse.linear_cross_entropy(x, x.T, jnp.array([0, 1]),
                                                            z_loss=bad, impl=impl)),
            ("label_smoothing", lambda: jaxfuse.cross_entropy(x, jnp.array([0, 1]),
                                                              label_smoothing=bad, impl=impl)),
        ]
        for name, call in cases:
            with pytest.raises(ValueError, match=name):
                call()

    @pytest.mark.parametrize("impl", IMPLS)
    def test_nan_in_a_softmax_row(self, impl):
        x = randn(keys(15, 1)[0], (3, 5)).at[1, 2].set(jnp.nan)
        y = jaxfuse.softmax(x, impl=impl)
        assert np.all(np.isnan(y[1]))
        rows = jnp.array([0, 2])
        np.testing.assert_allclose(y[rows], jax.nn.softmax(x[rows], axis=-1), rtol=1e-6)

    @pytest.mark.parametrize("impl", IMPLS)
    def test_nan_in_a_query(self, impl):
        k = keys(16, 3)
        q, kk, v = randn(k[0], (1, 4, 2, 8)), randn(k[1], (1, 6, 1, 8)), randn(k[2], (1, 6, 1, 8))
        q = q.at[0, 1, 0, 3].set(jnp.nan)
        o, lse = jax.jit(functools.partial(jaxfuse.flash_attention, return_lse=True,
                                           impl=impl))(q, kk, v)
        nan_o = np.isnan(np.asarray(o)).any(-1)[0]            # [Tq, Hq]
        expected = np.zeros((4, 2), bool)
        expected[1, 0] = True
        np.testing.assert_array_equal(nan_o, expected)
        np.testing.assert_array_equal(np.isnan(np.asarray(lse))[0].T, expected)
        od, lsed = jax.jit(functools.partial(jaxfuse.decode_attention, return_lse=True,
                                             impl=impl))(q[:, 1], kk, v, jnp.array([6]))
        np.testing.assert_array_equal(np.isnan(np.asarray(od)).any(-1)[0], [True, False])
        np.testing.assert_array_equal(np.isnan(np.asarray(lsed))[0], [True, False])


LAYOUTS = {"folded": None, "gpu_layout": jaxfuse.AttnBlocks(16, 8, 8, 16, 8, 16, folded=False)}


def _vjp_jit(f, args, ct):
    """(f(*args), its input cotangents for ct) as one compiled program, each pass run once
    (eagerly each op around the kernels compiled on its own)."""
    def fwd_bwd(args, ct):
        y, vjp = jax.vjp(f, *args)
        return y, vjp(ct)
    return jax.jit(fwd_bwd)(args, ct)


class TestLargeLogits:
    """Class 3: large finite logits keep o and lse finite (the running max and the exponent
    are formed from the same rounded score, so a fused multiply-add cannot make s - m large).
    Class 4: the backward recomputes P from a statistic in its own units, so one visible key
    gives P = 1 exactly (o = v, dv = do), and P stays bounded where the reference is finite."""

    @pytest.mark.parametrize("layout", list(LAYOUTS))
    def test_forward_with_logits_near_4e9(self, layout):
        k = keys(17, 3)
        q = randn(k[0], (1, 5, 1, 256), scale=1e4)
        kk = randn(k[1], (1, 7, 1, 256), scale=1e4)
        v = randn(k[2], (1, 7, 1, 256))
        o, lse = jaxfuse.flash_attention(q, kk, v, scale=1.0, return_lse=True,
                                         block_sizes=LAYOUTS[layout])
        o_r, lse_r = jaxfuse.flash_attention(q, kk, v, scale=1.0, return_lse=True,
                                             impl="reference")
        assert np.all(np.isfinite(lse_r)) and np.all(np.isfinite(lse))
        # A float32 score q.k of 256 terms near 1e8 each is only known to about
        # eps * sum|q_d k_d| (~1e3 here; rounding in another order, as another CPU's dot
        # kernels sum, moves it by that much): lse agrees to that, not to rtol 1e-6 of a row
        # whose scores cancel down to ~2e7 (row 3). A wrong exponent base or a missing max
        # shift would miss it by 1e6 or more.
        bound = 2 * np.finfo(np.float32).eps * np.einsum(
            "btd,bsd->bts", np.abs(q[:, :, 0]), np.abs(kk[:, :, 0])).max(-1)      # [1, 5]
        np.testing.assert_array_less(np.abs(lse - lse_r)[:, 0], bound)
        np.testing.assert_allclose(o, o_r, atol=1e-5)
        o_d, lse_d = jaxfuse.decode_attention(q[:, 0], kk, v, jnp.array([7]), scale=1.0,
                                              return_lse=True)
        np.testing.assert_array_less(np.abs(lse_d - lse_r[:, :, 0]), bound[:, :1])
        np.testing.assert_allclose(o_d, o_r[:, 0], atol=1e-5)

    @pytest.mark.parametrize("layout", list(LAYOUTS))
    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
    def test_one_visible_key_is_exact(self, layout, dtype):
        # Each query sees one key (Tk = 1) whose logit is about `logit`: P = 1 exactly.
        k = keys(18, 4)
        d = 16
        @jax.jit
        def f(q, k, v, do):   # (dq, dk, dv, o): o from the same forward the gradients take
            o, vjp = jax.vjp(lambda q, k, v: jaxfuse.flash_attention(
                q, k, v, block_sizes=LAYOUTS[layout]), q, k, v)
            return vjp(do) + (o,)

        for logit in (1e5, 1e7, 3e8, 3e9):
            q = randn(k[0], (2, 3, 4, d), dtype, scale=float(np.sqrt(logit)))
            kk = randn(k[1], (2, 1, 2, d), dtype, scale=float(np.sqrt(logit)))
            v = randn(k[2], (2, 1, 2, d), dtype)
            do = randn(k[3], (2, 3, 4, d), dtype)
            dq, dk, dv, o = f(q, kk, v, do)
            np.testing.assert_array_equal(o, jnp.broadcast_to(jnp.repeat(v, 2, axis=2), o.shape))
            want_dv = jnp.sum(do.astype(jnp.float32).reshape(2, 3, 2, 2, d), axis=(1, 3))
            t = 2e-2 if dtype == jnp.bfloat16 else 1e-6   # a sum of 6 terms in another order
            np.testing.assert_allclose(np.asarray(dv, np.float32)[:, 0], want_dv, rtol=t, atol=t)
            # dS = P (dP - delta) = 0 in exact arithmetic; delta is computed apart (noise).
            for g in (dq, dk):
                assert np.all(np.isfinite(np.asarray(g, np.float32)))

    def test_one_visible_key_dv_equals_do_exactly(self):
        k = keys(19, 4)
        # One compiled (o, dv) a layout, run for every logit (traced afresh for each call it
        # compiled the kernels six times).
        def o_and_dv(layout):
            def f(q, kk, v, do):
                o, vjp = jax.vjp(lambda v: jaxfuse.flash_attention(q, kk, v, block_sizes=layout),
                                 v)
                return o, vjp(do)[0]
            return jax.jit(f)

        fs = [o_and_dv(layout) for layout in LAYOUTS.values()]
        for logit in (1e5, 1e7, 3e8):
            q = randn(k[0], (1, 1, 1, 16), scale=float(np.sqrt(logit)))
            kk = randn(k[1], (1, 1, 1, 16), scale=float(np.sqrt(logit)))
            v, do = randn(k[2], (1, 1, 1, 16)), randn(k[3], (1, 1, 1, 16))
            for f in fs:
                o, dv = f(q, kk, v, do)
                np.testing.assert_array_equal(o, v)
                np.testing.assert_array_equal(dv, do)

    @pytest.mark.parametrize("layout", list(LAYOUTS))
    def test_gradients_bounded_with_large_inputs(self, layout):
        k = keys(20, 4)
        q = randn(k[0], (1, 9, 2, 32), scale=1e4)
        kk = randn(k[1], (1, 9, 1, 32), scale=1e4)
        v = randn(k[2], (1, 9, 1, 32))
        do = randn(k[3], (1, 9, 2, 32))
        f = lambda q, k, v: jaxfuse.flash_attention(q, k, v, causal=True,
                                                    block_sizes=LAYOUTS[layout])
        fr = lambda q, k, v: jaxfuse.flash_attention(q, k, v, causal=True, impl="reference")
        o, grads = _vjp_jit(f, (q, kk, v), do)
        o_r, grads_r = _vjp_jit(fr, (q, kk, v), do)
        np.testing.assert_allclose(o, o_r, atol=1e-5)
        for g, g_r in zip(grads, grads_r):
            assert np.all(np.isfinite(g))
            # |P| <= 1: each gradient is bounded by the reference's scale of the problem.
            bound = 10 * (float(jnp.max(jnp.abs(g_r))) + 1.0)
            assert float(jnp.max(jnp.abs(g))) <= bound
        np.testing.assert_allclose(grads[2], grads_r[2], atol=1e-4)


class TestBeamTopKNaN:
    """Class 5: NaN candidates follow `lax.top_k`'s order in both implementations (+NaN above
    +inf, -NaN below -inf): HARS retrieves by a key in that order, so a NaN neither poisons its
    row nor hides a candidate that ranks below it."""

    # Compiled once for each k and implementation and shared by the six cases (an eager call
    # traced the kernel afresh and compiled it again in each).
    _top_k = staticmethod(jax.jit(jaxfuse.beam_top_k, static_argnums=2, static_argnames="impl"))

    @pytest.mark.parametrize("where", [[(0, 1, 3)], [(0, 0, 0), (1, 2, 9)], [(1, 1, 5), (1, 1, 6)]])
    @pytest.mark.parametrize("neg", [False, True])
    def test_nan_matches_lax_top_k(self, where, neg):
        k = keys(21, 2)
        lp = jax.nn.log_softmax(randn(k[0], (2, 3, 11), scale=2.0), axis=-1)
        for b, i, j in where:
            lp = lp.at[b, i, j].set(-jnp.nan if neg else jnp.nan)
        scores = randn(k[1], (2, 3))
        for kk in (1, 3, 5):
            got = self._top_k(lp, scores, kk)
            want = self._top_k(lp, scores, kk, impl="reference")
            for a, b in zip(got, want):
                np.testing.assert_array_equal(a, b)

    def test_nan_rows_stay_apart(self):
        lp = jnp.zeros((3, 2, 7)).at[1].set(jnp.nan)
        got = jaxfuse.beam_top_k(lp, jnp.zeros((3, 2)), 4)
        want = jaxfuse.beam_top_k(lp, jnp.zeros((3, 2)), 4, impl="reference")
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)
        s = np.asarray(got[0])
        assert np.all(np.isnan(s[1])) and np.all(s[[0, 2]] == 0.0)


def _grad_shapes(f, *args):
    """Gradients of sum(f) in float32, for every float argument."""
    idx = [i for i, a in enumerate(args) if jnp.issubdtype(a.dtype, jnp.floating)]
    def total(*fa):
        full = list(args)
        for i, a in zip(idx, fa):
            full[i] = a
        return sum(jnp.sum(o.astype(jnp.float32)) for o in jax.tree.leaves(f(*full)))
    return jax.jit(jax.grad(total, argnums=tuple(range(len(idx)))))(*[args[i] for i in idx])


class TestZeroSize:
    """Class 2: an empty batch returns an empty result, as jnp does, with empty gradients; a
    query over zero keys sees nothing (zeros, lse = -inf); what cannot be empty raises a
    ValueError that names the input. Both implementations, handled once in the public op.
    The calls run compiled (jax.jit, also in `_grad_shapes`): eagerly each jnp op on each empty
    shape compiled a program of its own, most of these tests' time; the public op routes the
    empty input while tracing as it did while dispatching."""

    @pytest.mark.parametrize("impl", IMPLS)
    @pytest.mark.parametrize("shape", [(0, 5), (3, 0), (2, 0, 4), (0,)])
    def test_row_ops(self, impl, shape):
        x = jnp.zeros(shape, jnp.bfloat16)
        w = jnp.ones(shape[-1:], jnp.bfloat16)
        for f in (lambda x: jaxfuse.softmax(x, impl=impl),
                  lambda x: jaxfuse.softmax(x, causal=x.ndim > 1, mask=x > 0, impl=impl),
                  lambda x: jaxfuse.layer_norm(x, w, w, impl=impl),
                  lambda x: jaxfuse.rms_norm(x, w, impl=impl)):
            y = jax.jit(f)(x)
            assert y.shape == x.shape and y.dtype == x.dtype
            (g,) = _grad_shapes(f, x)
            assert g.shape == x.shape

    @pytest.mark.parametrize("impl", IMPLS)
    def test_losses(self, impl):
        x, lab = jnp.zeros((0, 5)), jnp.zeros((0,), jnp.int32)
        ce, lce = (jax.jit(functools.partial(op, impl=impl), static_argnames="reduction")
                   for op in (jaxfuse.cross_entropy, jaxfuse.linear_cross_entropy))
        for red, shape in (("mean", ()), ("sum", ()), ("none", (0,))):
            loss = ce(x, lab, reduction=red)
            assert loss.shape == shape and loss.dtype == jnp.float32
            assert shape or float(loss) == 0.0
            loss = lce(jnp.zeros((2, 0, 8)), jnp.ones((8, 5)), jnp.zeros((2, 0), jnp.int32),
                       reduction=red)
            assert loss.shape == ((2, 0) if red == "none" else ())
        (g,) = _grad_shapes(lambda x: jaxfuse.cross_entropy(x, lab, impl=impl), x)
        assert g.shape == (0, 5)
        with pytest.raises(ValueError, match="logits.shape"):
            jaxfuse.cross_entropy(jnp.zeros((3, 0)), jnp.zeros((3,), jnp.int32), impl=impl)
        with pytest.raises(ValueError, match="weight.shape"):
            jaxfuse.linear_cross_entropy(jnp.zeros((3, 4)), jnp.zeros((4, 0)),
                                         jnp.zeros((3,), jnp.int32), impl=impl)
        with pytest.raises(ValueError, match="x.shape"):
            jaxfuse.linear_cross_entropy(jnp.zeros((3, 0)), jnp.zeros((0, 5)),
                                         jnp.zeros((3,), jnp.int32), impl=impl)

    @pytest.mark.parametrize("impl", IMPLS)
    @pytest.mark.parametrize("dims", [(0, 5, 7, 4, 2), (2, 0, 7, 4, 2), (2, 5, 0, 4, 2),
                                      (2, 0, 0, 2, 1)])
    def test_flash_attention(self, impl, dims):
        b, tq, tk, hq, hkv = dims
        k = keys(22, 3)
        q, kk, v = (randn(k[0], (b, tq, hq, 8)), randn(k[1], (b, tk, hkv, 8)),
                    randn(k[2], (b, tk, hkv, 8)))
        f = lambda q, k, v: jaxfuse.flash_attention(q, k, v, causal=True, return_lse=True,
                                                    impl=impl)
        o, lse = jax.jit(f)(q, kk, v)
        assert o.shape == q.shape and lse.shape == (b, hq, tq) and lse.dtype == jnp.float32
        np.testing.assert_array_equal(o, 0.0)
        assert np.all(np.isneginf(lse))
        f0 = lambda q, k, v: f(q, k, v)[0]
        for g, a in zip(_grad_shapes(f0, q, kk, v), (q, kk, v)):
            assert g.shape == a.shape
            np.testing.assert_array_equal(g, 0.0)

    @pytest.mark.parametrize("impl", IMPLS)
    def test_decode_attention(self, impl):
        q = randn(keys(23, 1)[0], (2, 4, 8))
        f = jax.jit(functools.partial(jaxfuse.decode_attention, impl=impl),
                    static_argnames="return_lse")
        o, lse = f(q, jnp.zeros((2, 0, 2, 8)), jnp.zeros((2, 0, 2, 8)), jnp.array([3, 0]),
                   return_lse=True)
        np.testing.assert_array_equal(o, 0.0)
        assert o.shape == q.shape and np.all(np.isneginf(lse))
        o = f(q[:0], jnp.ones((0, 5, 2, 8)), jnp.ones((0, 5, 2, 8)), jnp.zeros((0,), jnp.int32))
        assert o.shape == (0, 4, 8)

    @pytest.mark.parametrize("impl", IMPLS)
    def test_cannot_be_empty(self, impl):
        q = jnp.zeros((1, 3, 2, 8))
        with pytest.raises(ValueError, match="k.shape"):
            jaxfuse.flash_attention(q, jnp.zeros((1, 3, 0, 8)), jnp.zeros((1, 3, 0, 8)),
                                    impl=impl)
        with pytest.raises(ValueError, match="head_dim|q.shape"):
            jaxfuse.flash_attention(q[..., :0], q[..., :0], q[..., :0], impl=impl)
        with pytest.raises(ValueError, match="k_cache.shape"):
            jaxfuse.decode_attention(q[:, 0], jnp.zeros((1, 3, 0, 8)), jnp.zeros((1, 3, 0, 8)),
                                     jnp.array([1]), impl=impl)
        with pytest.raises(ValueError, match="log_probs.shape"):
            jaxfuse.beam_top_k(jnp.zeros((2, 3, 0)), jnp.zeros((2, 3)), 1, impl=impl)
        out = jaxfuse.beam_top_k(jnp.zeros((0, 3, 5)), jnp.zeros((0, 3)), 2, impl=impl)
        assert [a.shape for a in out] == [(0, 2)] * 3


class TestIntegerOptions:
    """Class 3: an int option computed with NumPy (`np.int64(k)`) is the int it holds: the same
    result as the Python int (it was refused as "must be an int in [1, 6]" with k = 2); a
    bool is refused (True was taken as 1)."""

    @pytest.mark.parametrize("impl", IMPLS)
    def test_numpy_ints_are_ints(self, impl):
        lp = jax.nn.log_softmax(randn(keys(24, 1)[0], (2, 3, 5)))
        for a, b in zip(jaxfuse.beam_top_k(lp, jnp.zeros((2, 3)), np.int64(4), impl=impl),
                        jaxfuse.beam_top_k(lp, jnp.zeros((2, 3)), 4, impl=impl)):
            np.testing.assert_array_equal(a, b)
        q = randn(keys(25, 1)[0], (1, 9, 2, 8))
        attn = lambda w: jaxfuse.flash_attention(q, q, q, causal=True, sliding_window=w,
                                                 impl=impl)
        np.testing.assert_array_equal(attn(np.int32(3)), attn(3))
        dec = lambda n: jaxfuse.decode_attention(q[:, 0], q, q, jnp.array([7]), num_splits=n,
                                                 impl=impl)
        np.testing.assert_array_equal(dec(np.int64(2)), dec(2))

    @pytest.mark.parametrize("impl", IMPLS)
    def test_bools_are_not_ints(self, impl):
        q = jnp.zeros((1, 4, 2, 8))
        with pytest.raises(ValueError, match="k=True must be an int"):
            jaxfuse.beam_top_k(jnp.zeros((1, 2, 3)), jnp.zeros((1, 2)), True, impl=impl)
        with pytest.raises(ValueError, match="sliding_window=True must be a positive int"):
            jaxfuse.flash_attention(q, q, q, sliding_window=True, impl=impl)
        with pytest.raises(ValueError, match="num_splits=True must be an int"):
            jaxfuse.decode_attention(q[:, 0], q, q, jnp.array([3]), num_splits=True, impl=impl)


class TestScalarOptions:
    """Class 5: a scalar option given as a concrete jax scalar is the number it holds (a soft
    cap of jnp.float32(5.0) was refused as "must be a positive finite number"); a traced one,
    which the kernels cannot bake in, raises a ValueError naming it and the fix (it was a
    ConcretizationTypeError from deep inside, or the same false message)."""

    def test_concrete_jax_scalars(self):
        x, w, lab = jnp.ones((3, 9)), jnp.ones((9, 20)) * 0.1, jnp.zeros((3,), jnp.int32)
        for impl in IMPLS:
            a = jaxfuse.linear_cross_entropy(x, w, lab, logits_soft_cap=jnp.float32(5.0),
                                             impl=impl)
            b = jaxfuse.linear_cross_entropy(x, w, lab, logits_soft_cap=5.0, impl=impl)
            np.testing.assert_array_equal(a, b)

    def test_concrete_jax_rate_and_ignore_index(self):
        """dropout's positional rate and the losses' ignore_index as concrete jax scalars were
        refused ("must be a Python number", "must be an int"; s52's bug hunt), though the
        README's options take them and NumPy's were taken."""
        x, key = randn(keys(66, 1)[0], (4, 8)), jax.random.key(0)
        lab = jnp.array([2, 0, 2, 5], jnp.int32)
        for impl in IMPLS:
            np.testing.assert_array_equal(jaxfuse.dropout(x, jnp.float32(0.5), key, impl=impl),
                                          jaxfuse.dropout(x, 0.5, key, impl=impl))
            for op in (lambda **kw: jaxfuse.cross_entropy(x, lab, impl=impl, **kw),
                       lambda **kw: jaxfuse.linear_cross_entropy(x, x.T, lab, impl=impl,
                                                                 **kw)):
                np.testing.assert_array_equal(op(ignore_index=jnp.int32(2)),
                                              op(ignore_index=2))
        with pytest.raises(ValueError, match="rate is a traced value"):
            jax.jit(lambda r: jaxfuse.dropout(x, r, key))(0.5)

    def test_traced_options_are_named(self):
        x, lab = jnp.ones((2, 3)), jnp.zeros((2,), jnp.int32)
        q = jnp.ones((1, 4, 2, 8))
        cases = [("scale", lambda s: jaxfuse.softmax(x, scale=s)),
                 ("eps", lambda s: jaxfuse.layer_norm(x, eps=s)),
                 ("label_smoothing", lambda s: jaxfuse.cross_entropy(x, lab, label_smoothing=s)),
                 ("z_loss", lambda s: jaxfuse.linear_cross_entropy(x, x.T, lab, z_loss=s)),
                 ("logits_soft_cap", lambda s: jaxfuse.flash_attention(q, q, q,
                                                                       logits_soft_cap=s)),
                 # the references branch on these two as well
                 ("label_smoothing", lambda s: jaxfuse.cross_entropy(
                     x, lab, label_smoothing=s, impl="reference")),
                 ("z_loss", lambda s: jaxfuse.linear_cross_entropy(x, x.T, lab, z_loss=s,
                                                                   impl="reference"))]
        for name, f in cases:
            with pytest.raises(ValueError, match=f"{name} is a traced value.*Python number"):
                jax.jit(f)(0.1)
        # what the references compute with a traced value is still theirs to compute
        y = jax.jit(lambda s: jaxfuse.softmax(x, scale=s, impl="reference"))(2.0)
        np.testing.assert_allclose(y, jaxfuse.softmax(x, scale=2.0), rtol=1e-6)


class TestAttentionOptions:
    """Class 6 (s31 audit of the attention family): options the kernels bake in or branch on."""

    @pytest.mark.parametrize("window", [2 ** 31 - 1, 2 ** 31 - 5, 2 ** 31, 7])
    @pytest.mark.parametrize("layout", ["folded", "gpu"])
    def test_a_window_wider_than_the_keys_is_none(self, window, layout):
        # Tq 12 > Tk 7: a window of w >= Tk hides no key. Near int32's largest value the masks'
        # int32 bounds overflowed: 2^31 - 1 hid every key (zeros, lse -inf) in both impls,
        # 2^31 - 5 gave wrong dk/dv in the GPU layout, 2^31 an OverflowError.
        k = keys(61, 4)
        q, kv = randn(k[0], (1, 12, 2, 16)), randn(k[1], (1, 7, 1, 16))
        blocks = (jaxfuse.AttnBlocks(16, 16, 16, 16, 16, 16, folded=False)
                  if layout == "gpu" else None)
        ct = (randn(k[2], (1, 12, 2, 16)), randn(k[3], (1, 2, 12)))
        for impl in IMPLS:
            def run(w):
                f = lambda q, kv: jaxfuse.flash_attention(
                    q, kv, kv * 0.5, sliding_window=w, return_lse=True, impl=impl,
                    block_sizes=blocks if impl == "pallas" else None)
                out, vjp = jax.vjp(f, q, kv)
                return out, vjp(ct)
            np.testing.assert_allclose(np.asarray(run(window)[0][0]), np.asarray(run(None)[0][0]),
                                       rtol=1e-6, atol=1e-6)
            chex_close = lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b),
                                                                 rtol=1e-5, atol=1e-5)
            jax.tree.map(chex_close, run(window), run(None))

    def test_concrete_jax_scalars(self):
        # flash_attention's scale and soft cap and decode_attention's rope_base as concrete jax
        # scalars: a TypeError (unhashable, the kernels' cache key) and a bare AssertionError
        # (a constant closed over by custom_partitioning), the reference took them.
        q = randn(keys(62, 1)[0], (1, 8, 2, 16))
        for impl in IMPLS:
            a = jaxfuse.flash_attention(q, q, q, scale=jnp.float32(0.5),
                                        logits_soft_cap=jnp.float32(2.0), impl=impl)
            b = jaxfuse.flash_attention(q, q, q, scale=0.5, logits_soft_cap=2.0, impl=impl)
            np.testing.assert_array_equal(a, b)
        qd, kc = randn(keys(63, 1)[0], (2, 2, 16)), randn(keys(64, 1)[0], (2, 9, 1, 16))
        kn = qd[:, :1]
        for impl in IMPLS:
            a = jaxfuse.decode_attention(qd, kc, kc, jnp.array([3, 8]), k_new=kn, v_new=kn,
                                         rope_base=jnp.float32(100.0), impl=impl)
            b = jaxfuse.decode_attention(qd, kc, kc, jnp.array([3, 8]), k_new=kn, v_new=kn,
                                         rope_base=100.0, impl=impl)
            jax.tree.map(np.testing.assert_array_equal, a, b)

    def test_traced_scale_in_the_reference(self):
        q = randn(keys(65, 1)[0], (1, 5, 2, 8))
        f = jax.jit(lambda s: jaxfuse.flash_attention(q, q, q, scale=s, impl="reference"))
        np.testing.assert_allclose(f(0.3), jaxfuse.flash_attention(q, q, q, scale=0.3),
                                   rtol=1e-5, atol=1e-6)

    def test_a_nan_key_seen_by_one_query(self):
        # Causal, a NaN in key 5: only query 5 sees it. The kernel's gradients are NaN where
        # the maths puts them (dq of row 5, dk and dv of every key row 5 sees); the
        # reference's dq row 5 was 0 (a select cut its scores' gradient) and dk of key 5 too.
        k = keys(66, 4)
        q, kk, v = (randn(kx, (1, 6, 1, 16)) for kx in k[:3])
        kk = kk.at[0, 5].set(jnp.nan)
        ct = randn(k[3], (1, 6, 1, 16))
        pattern = {}
        for impl in IMPLS:
            o, vjp = jax.vjp(lambda q, k, v: jaxfuse.flash_attention(q, k, v, causal=True,
                                                                     impl=impl), q, kk, v)
            pattern[impl] = [np.isnan(np.asarray(a)).any(axis=(0, 2, 3)).tolist()
                             for a in (o, *vjp(ct))]
        assert pattern["reference"] == pattern["pallas"], pattern
        assert pattern["reference"][:2] == [[False] * 5 + [True]] * 2     # o and dq: row 5

    @pytest.mark.parametrize("impl", IMPLS)
    def test_flags_are_bools(self, impl):
        # causal="False" was causal (a truthy string), a traced flag a TracerBoolConversionError
        q = jnp.ones((1, 4, 2, 8))
        qd, kc, n = jnp.ones((1, 2, 8)), jnp.ones((1, 5, 1, 8)), jnp.array([3])
        cases = [("causal", lambda f: jaxfuse.flash_attention(q, q, q, causal=f, impl=impl)),
                 ("return_lse", lambda f: jaxfuse.flash_attention(q, q, q, return_lse=f,
                                                                  impl=impl)),
                 ("deterministic", lambda f: jaxfuse.flash_attention(q, q, q, deterministic=f,
                                                                     impl=impl)),
                 ("causal", lambda f: jaxfuse.softmax(q, causal=f, impl=impl)),
                 ("partial_sums", lambda f: jaxfuse.decode_attention(
                     qd, kc, kc, n, partial_sums=f, impl=impl)),
                 ("rope_interleaved", lambda f: jaxfuse.decode_attention(
                     qd, kc, kc, n, k_new=qd[:, :1], v_new=qd[:, :1], rope_base=10.0,
                     rope_interleaved=f, impl=impl)),
                 ("interleaved", lambda f: jaxfuse.rope(q, jnp.arange(4)[None], interleaved=f,
                                                        impl=impl)),
                 ("interleaved", lambda f: jaxfuse.rope_qkv(
                     q.reshape(1, 4, 1, 2, 8)[:, :, :, [0, 1, 0]], jnp.arange(4)[None],
                     interleaved=f, impl=impl))]
        for name, f in cases:
            with pytest.raises(ValueError, match=f"{name}='False' must be True or False"):
                f("False")
            with pytest.raises(ValueError, match=f"{name}=.*must be True or False.*traced"):
                jax.jit(f)(True)
            f(np.bool_(False))                                  # NumPy and jax bools,
            f(jnp.array(False))                                 # 0 and 1, are bools
            f(0)
        with pytest.raises(ValueError, match="causal=2 must be True or False"):
            jaxfuse.flash_attention(q, q, q, causal=2, impl=impl)

    def test_arrays_not_lists(self):
        q, kc = jnp.ones((2, 2, 8)), jnp.ones((2, 5, 1, 8))
        with pytest.raises(ValueError, match="kv_lengths must be an array, got list"):
            jaxfuse.decode_attention(q, kc, kc, [3, 4])
        qq = jnp.ones((1, 4, 2, 8))
        with pytest.raises(ValueError, match="q_segment_ids must be an array, got list"):
            jaxfuse.flash_attention(qq, qq, qq, q_segment_ids=[[0, 0, 1, 1]],
                                    kv_segment_ids=jnp.zeros((1, 4), jnp.int32))
        with pytest.raises(ValueError, match=r"AttnBlocks\(block_k=8.0\).*positive int"):
            jaxfuse.flash_attention(qq, qq, qq, block_sizes=jaxfuse.AttnBlocks(block_k=8.0))


@pytest.mark.parametrize("qs_dtype,ks_dtype", [(jnp.uint32, jnp.int32), (jnp.int8, jnp.uint8),
                                               (jnp.uint32, jnp.uint32)])
def test_segment_id_dtypes_compare_as_the_reference_does(qs_dtype, ks_dtype):
    """Segment ids of two dtypes are equal where the reference's comparison (in their
    promoted dtype) says so, on the public op and on the Pallas module's own entry point."""
    from jaxfuse.pallas import attention as pallas_attention
    q = randn(keys(72, 1)[0], (1, 6, 2, 8))
    qs = jnp.array([[2 ** 31 + 1, 2 ** 31 + 1, 1, 1, 3, 3]], jnp.uint32).astype(qs_dtype)
    ks = jnp.array([[2 ** 31 + 1, 1, 1, 3, 3, 5]], jnp.uint32).astype(ks_dtype)
    want = jaxfuse.flash_attention(q, q, q, q_segment_ids=qs, kv_segment_ids=ks,
                                   return_lse=True, impl="reference")
    for got in (jaxfuse.flash_attention(q, q, q, q_segment_ids=qs, kv_segment_ids=ks,
                                        return_lse=True),
                pallas_attention.flash_attention(q, q, q, q_segment_ids=qs, kv_segment_ids=ks,
                                                 return_lse=True)):
        np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), atol=2e-6)
        np.testing.assert_array_equal(np.isneginf(got[1]), np.isneginf(want[1]))


class TestArgumentTypes:
    """Class 9 (s33's randomized run): a list where an array belongs, another op's tiles, or a
    tile size that is not a positive int raised AttributeError, TypeError or Pallas's own
    "Grid must be a tuple of integers": now a ValueError naming the argument and the fix."""

    @pytest.mark.parametrize("call,name", [
        (lambda x: jaxfuse.softmax(x.tolist()), "x"),
        (lambda x: jaxfuse.softmax(x, mask=[[True] * 8] * 4), "mask"),
        (lambda x: jaxfuse.layer_norm(x.tolist()), "x"),
        (lambda x: jaxfuse.rms_norm(x, [1.0] * 8), "weight"),
        (lambda x: jaxfuse.cross_entropy(x.tolist(), jnp.zeros(4, jnp.int32)), "logits"),
        (lambda x: jaxfuse.swiglu(x.tolist(), x), "gate"),
        (lambda x: jaxfuse.bias_dropout_add(x, None, x.tolist()), "residual"),
        (lambda x: jaxfuse.beam_top_k(x[None].tolist(), jnp.zeros((1, 4)), 2), "log_probs"),
    ])
    def test_lists_are_not_arrays(self, call, name):
        with pytest.raises(ValueError, match=rf"{name} must be an array, got list \(pass "
                                             rf"jnp.asarray\({name}\)\)"):
            call(jnp.ones((4, 8)))

    def test_another_ops_tiles(self):
        x, q = jnp.ones((4, 8)), jnp.ones((1, 4, 1, 8))
        with pytest.raises(ValueError, match="block_sizes of type AttnBlocks: this op takes a "
                                             "jaxfuse.RowBlocks"):
            jaxfuse.softmax(x, block_sizes=jaxfuse.AttnBlocks())
        with pytest.raises(ValueError, match="block_sizes of type RowBlocks: this op takes a "
                                             "jaxfuse.AttnBlocks"):
            jaxfuse.flash_attention(q, q, q, block_sizes=jaxfuse.RowBlocks(8, 8))
        with pytest.raises(ValueError, match="block_sizes of type tuple: this op takes a "
                                             "jaxfuse.LCEBlocks"):
            jaxfuse.linear_cross_entropy(x, x.T, jnp.zeros(4, jnp.int32), block_sizes=(8, 8))

    def test_interpret_is_a_bool_or_none(self):
        with pytest.raises(ValueError, match="interpret='yes' must be True or False"):
            jaxfuse.softmax(jnp.ones((4, 8)), interpret="yes")

    @pytest.mark.parametrize("kw,bad", [(dict(block_rows=2.5), "block_rows=2.5"),
                                        (dict(block_cols=8.0), "block_cols=8.0"),
                                        (dict(num_warps=0), "num_warps=0"),
                                        (dict(rows_per_program=0), "rows_per_program=0")])
    def test_row_tiles_are_positive_ints(self, kw, bad):
        with pytest.raises(ValueError, match=rf"RowBlocks\({bad}\): \w+ must be a positive int"):
            jaxfuse.RowBlocks(**{**dict(block_rows=2, block_cols=8), **kw})


def _x64_cases():
    """(name, f(impl)) of every op, on inputs made under jax_enable_x64 (int64 ids and
    positions, as `jnp.arange` gives there; float inputs float32, as the ops take)."""
    k = jax.random.split(jax.random.key(26), 6)
    x = randn(k[0], (5, 37))
    w = jnp.ones(37, jnp.float32)
    lab = jnp.arange(5) * 7                                   # int64
    q = randn(k[1], (1, 9, 2, 8))
    lp = jax.nn.log_softmax(randn(k[2], (2, 3, 5)))
    cache = randn(k[3], (1, 9, 2, 8))
    seg = jnp.array([[0, 0, 1, 1, 1, 2, 2, 2, 2]])             # int64
    kv_seg = seg + (seg == 0) * 2 ** 32
    return [
        ("softmax", lambda i: jaxfuse.softmax(x, causal=True, impl=i)),
        ("norms", lambda i: jax.grad(lambda x: (jaxfuse.layer_norm(x, w, w, impl=i)
                                                + jaxfuse.rms_norm(x, w, impl=i)).sum())(x)),
        ("cross_entropy", lambda i: jax.grad(lambda x: jaxfuse.cross_entropy(x, lab,
                                                                            impl=i))(x)),
        ("linear_cross_entropy", lambda i: jax.grad(lambda x: jaxfuse.linear_cross_entropy(
            x, jnp.full((37, 11), 0.1, jnp.float32), lab % 11, impl=i))(x)),
        ("flash_attention", lambda i: jax.grad(lambda q: jaxfuse.flash_attention(
            q, q, q, causal=True, sliding_window=4, dropout_rate=0.2, dropout_key=k[4],
            impl=i).sum())(q)),
        # int64 ids differing by 2^32 are different segments (an int32 cast made them one):
        # rows 0 and 1 see no key, which the kernels once let them see.
        ("flash_attention segment ids", lambda i: (
            jaxfuse.flash_attention(q, q, q, q_segment_ids=seg, kv_segment_ids=kv_seg,
                                    return_lse=True, impl=i),
            jax.grad(lambda q: jaxfuse.flash_attention(
                q, q, q, q_segment_ids=seg, kv_segment_ids=kv_seg, impl=i).sum())(q))),
        ("decode_attention", lambda i: jaxfuse.decode_attention(
            q[:, 0], cache, cache, jnp.array([6]), k_new=q[:, 0, :2], v_new=q[:, 0, :2],
            rope_base=100.0, impl=i)),
        ("beam_top_k", lambda i: jaxfuse.beam_top_k(lp, jnp.zeros((2, 3), jnp.float32), 3,
                                                    impl=i)),
        # Its kernel summed int32 parents' entries into int64 under x64, then bitcast them
        # to float32 pairs: "Invalid shape for 'swap'".
        ("beam_step", lambda i: jaxfuse.beam_step(
            randn(k[2], (2, 3, 5)), lp[..., 0], jnp.arange(6).reshape(2, 3),   # int64 lengths
            jnp.array([[False, True, False]] * 2), eos_id=1, impl=i)),
        ("reorder_beams", lambda i: jaxfuse.reorder_beams(
            (jnp.arange(36.0, dtype=jnp.float32).reshape(2, 3, 6),), jnp.array([[2, 0, 1]] * 2),
            jnp.array([1, 1]), jnp.array([3, 4]), impl=i)),
        ("dropout family", lambda i: jax.grad(lambda x: (
            jaxfuse.bias_dropout_add(x, w, x, rate=0.1, key=k[5], impl=i)
            + jaxfuse.bias_act_dropout(x, w, rate=0.1, key=k[5], impl=i)).sum())(x)),
        ("add_norm", lambda i: jax.grad(lambda x: jaxfuse.add_norm(
            x, x, w, rate=0.1, key=k[5], impl=i)[1].sum())(x)),
        ("swiglu", lambda i: jax.grad(lambda x: jaxfuse.swiglu(x, x, impl=i).sum())(x)),
        ("rope", lambda i: jaxfuse.rope(q, jnp.arange(9)[None] * 3, impl=i)),
        ("rope_qkv", lambda i: jax.grad(lambda x: sum(y.sum() for y in jaxfuse.rope_qkv(
            x, jnp.arange(9)[None] * 3, impl=i)))(q.reshape(1, 9, 1, -1, 2))),
        ("embedding", lambda i: jaxfuse.embedding(jnp.array([1, 2 ** 40, 4]), x,
                                                  pos_table=x[:3], impl=i)),
    ]


class TestX64:
    """Class 4: with jax_enable_x64 on every op runs as without it, kernel = reference: the
    interpreted RoPE kernel failed to trace (int64 index literals beside int32 starts), and
    int64 ids past int32's range read another row (`tests/test_embedding.py`)."""

    def test_every_op_matches_its_reference(self):
        with jax.enable_x64(True):
            for name, f in _x64_cases():
                # Under jit: one compile a case (eagerly, each op dispatched on its own took
                # 3x the time); the int64 inputs are the jitted function's constants.
                out, ref = (jax.jit(functools.partial(f, i))() for i in ("pallas", "reference"))
                for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
                    assert a.dtype == b.dtype, name
                    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5,
                                               atol=2e-5, err_msg=name)

    def test_decoding_follows_the_run_without_x64(self):
        """greedy and beam_search with x64 on give what they give without it: greedy's
        token write failed (lax refused an int64 0 beside the int32 step), beam search built
        float64 start scores (which beam_step refuses) and its kernel split int64 sums."""
        from jaxfuse import model as M
        cfg = M.Config(vocab_size=32, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64,
                       max_len=16)
        params = M.init(jax.random.key(3), cfg)
        lengths = np.array([4, 2])
        prompts = np.array([[3, 4, 5, 6], [7, 8, 0, 0]])

        def decode(impl):
            p, n = jnp.asarray(prompts), jnp.asarray(lengths)   # int64 with x64 on
            return (M.greedy(params, cfg, p, n, max_new_tokens=3, eos_id=2, impl=impl),
                    M.beam_search(params, cfg, p, n, beam_size=2, max_new_tokens=3, eos_id=2,
                                  impl=impl))
        # The Pallas path alone: the search loop is the same code with either impl, and
        # beam_step's reference ran under x64 already (the every-op test above).
        want = decode("pallas")
        with jax.enable_x64(True):
            got = decode("pallas")
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert a.dtype == b.dtype
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)

    def test_hopper_kernels_step_aside(self, monkeypatch):
        """The Mosaic GPU kernels' index arithmetic is int32, and their sm90 lowering failed
        under x64 (lax.rem of int32 and int64): on an sm90 GPU with x64 on they are not
        picked (the portable kernels run), and forcing one raises, naming the fix."""
        from jaxfuse.pallas import _hopper
        sm90 = type("Dev", (), dict(platform="gpu", compute_capability="9.0"))()
        monkeypatch.setattr(jax, "devices", lambda *a: [sm90])
        assert _hopper.available()
        x = jnp.zeros((128, 256), jnp.bfloat16)
        with jax.enable_x64(True):
            assert not _hopper.available()
            with pytest.raises(ValueError, match="AttnBlocks\\(hopper=True\\): the Hopper "
                                                 "kernels do not run with jax_enable_x64"):
                jaxfuse.flash_attention(x[None, :, None, :128], x[None, :, None, :128],
                                        x[None, :, None, :128], interpret=False,
                                        block_sizes=jaxfuse.AttnBlocks(hopper=True))
            with pytest.raises(ValueError, match="LCEBlocks\\(hopper=True\\)"):
                jaxfuse.linear_cross_entropy(x, x.T, jnp.zeros(128, jnp.int32),
                                             interpret=False,
                                             block_sizes=jaxfuse.LCEBlocks(hopper=True))
            with pytest.raises(ValueError, match="RowBlocks\\(hopper=True\\)"):
                jaxfuse.swiglu(x, x, interpret=False,
                               block_sizes=jaxfuse.RowBlocks(32, 128, hopper=True))


def _kernel_dot_precisions(jaxpr) -> list:
    """The `precision` of every dot_general inside the pallas_calls of a jaxpr."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(eqn.params["precision"])
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += _kernel_dot_precisions(sub)
    return found


@pytest.mark.parametrize("context", ["tensorfloat32", "float32"])
def test_attention_kernels_follow_jax_matmul_precision(context):
    # float32 attention on a GPU: the kernels' matmuls take JAX's matmul precision, as XLA's do
    # (TF32 by default on a GPU, which rounds v to 10 mantissa bits: o != v even with one
    # visible key; exact float32 under jax.default_matmul_precision("float32")). Checked in the
    # kernel jaxprs that lowering reads, forward and backward, against the precision a plain
    # jnp.dot gets in the same context.
    q = jnp.zeros((1, 8, 2, 16), jnp.float32)

    def f(q):
        o, vjp = jax.vjp(lambda q: jaxfuse.flash_attention(q, q, q, interpret=False), q)
        return vjp(o), q @ q[0, 0].T

    with jax.default_matmul_precision(context):
        precs = _kernel_dot_precisions(jax.make_jaxpr(f)(q).jaxpr)
    plain = precs.pop()  # the q @ q.T outside the kernels, traced last
    assert plain[0] == (jax.lax.Precision.HIGHEST if context == "float32"
                        else jax.lax.Precision.HIGH), plain
    assert len(precs) >= 7, precs  # forward 2 dots, backward 5
    assert all(p == plain for p in precs), precs
