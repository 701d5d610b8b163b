import functools

import chex
import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

import jaxfuse
from jaxfuse import LCEBlocks, RowBlocks
from jaxfuse.pallas import _hopper_gemm
from jaxfuse.pallas._hopper_gemm import Tiles
from jaxfuse.pallas.linear_cross_entropy import HopperTiles, whole_waves
from tests._util import assert_close, host_randn, kernel_names, keys, randn, vjp_both

# (N, D, V, blocks): one whole-vocabulary slab by default; slabs with a narrower tail (301 =
# 4 x 64 + 45) walked by row tiles that split both axes; a slab of one column.
CASES = [(37, 24, 301, None), (37, 24, 301, LCEBlocks(64, RowBlocks(5, 16))), (1, 8, 17, None),
         (2, 3, 16, LCEBlocks(1)), (13, 7, 40, LCEBlocks(16))]
OPTIONS = [dict(), dict(label_smoothing=0.1), dict(z_loss=1e-2),
           dict(logits_soft_cap=2.0, label_smoothing=0.2, z_loss=1e-3)]


def _inputs(n, d, v, dtype=jnp.float32, seed=0, labels_at=None):
    """x, w, labels; `labels_at` {token: label} sets some labels. Drawn by NumPy on the host
    (normal x, normal w scaled by 0.3, uniform labels, one of them ignored): jax.random's eager
    draws, and eager `.at[].set`, compiled an XLA program per new shape (~0.3 s a call)."""
    rng = np.random.default_rng(seed)
    x, w = host_randn(rng, (n, d), dtype), host_randn(rng, (d, v), dtype, scale=0.3)
    labels = rng.integers(0, v, n, dtype=np.int32)
    if n > 2:
        labels[1] = -100
    for i, label in (labels_at or {}).items():
        labels[i] = label
    return x, w, jnp.asarray(labels)


# The reference is only the oracle: the tests jit it (one compiled program, where eager
# dispatch compiled an executable per jnp op and shape); the kernels under test run as before.
@functools.lru_cache(maxsize=None)
def _bf16_case():
    """The inputs of `_check_bf16_against_float32` and the float32 reference's loss and
    gradients, computed once for both of its callers."""
    x, w, labels = _inputs(64, 32, 1000, jnp.bfloat16, seed=2)
    fr = lambda x, w: jaxfuse.linear_cross_entropy(x, w, labels, label_smoothing=0.1,  # noqa: E731
                                                   impl="reference")
    ref = jax.jit(jax.value_and_grad(fr, argnums=(0, 1)))(x.astype(jnp.float32),
                                                          w.astype(jnp.float32))
    return (x, w, labels), ref


def _check_bf16_against_float32(test, blocks):
    """bf16 inputs: gradients in bf16, within 1e-2 of the float32 reference's."""
    (x, w, labels), (loss_r, (dx_r, dw_r)) = _bf16_case()
    f = lambda x, w: jaxfuse.linear_cross_entropy(x, w, labels, label_smoothing=0.1,
                                                  block_sizes=blocks)
    loss, (dx, dw) = jax.value_and_grad(f, argnums=(0, 1))(x, w)
    test.assertEqual((dx.dtype, dw.dtype), (jnp.bfloat16, jnp.bfloat16))
    rel = lambda a, b: float(jnp.linalg.norm(a.astype(jnp.float32) - b) / jnp.linalg.norm(b))
    test.assertLess(abs(float(loss) - float(loss_r)) / abs(float(loss_r)), 1e-3)
    test.assertLess(rel(dx, dx_r), 1e-2)
    test.assertLess(rel(dw, dw_r), 1e-2)


# (case, options) pairs: every case with no option and with all three together (the soft cap
# on every tiling: its fill-0 padding, slabs, one column, one token); label smoothing alone
# (without the cap) where row tiles split a slab's columns (a padded column in its sum of
# logits shows there), z-loss alone where slabs leave a narrower tail (its lse merged over
# slabs). The reduction rotates over the list: every case meets at least two of the three,
# every option the three or, alone, one.
_CASE_OPTIONS = [(c, o) for c in range(len(CASES)) for o in (0, 3)] + [(1, 1), (4, 2)]


class LinearCrossEntropyTest(chex.TestCase):

    @chex.variants(with_jit=True)
    @parameterized.parameters(*[dict(case=CASES[c], options=OPTIONS[o],
                                     reduction=("mean", "sum", "none")[i % 3])
                                for i, (c, o) in enumerate(_CASE_OPTIONS)])
    def test_matches_reference(self, case, options, reduction):
        n, d, v, blocks = case
        x, w, labels = _inputs(n, d, v, seed=n + v)
        kw = dict(options, reduction=reduction)
        f = self.variant(lambda x, w: jaxfuse.linear_cross_entropy(x, w, labels,
                                                                   block_sizes=blocks, **kw))
        fr = jax.jit(lambda x, w: jaxfuse.linear_cross_entropy(x, w, labels, impl="reference",
                                                               **kw))
        y, vjp = jax.vjp(f, x, w)
        y_r, vjp_r = jax.vjp(fr, x, w)
        assert_close(y, y_r, jnp.float32, scale=10.0)
        ct = randn(keys(1, 1)[0], y.shape)
        assert_close(vjp(ct), vjp_r(ct), jnp.float32, scale=10.0)

    def test_bf16_inputs_against_float32_reference(self):
        _check_bf16_against_float32(self, LCEBlocks(256))

    def test_ignored_tokens_and_bad_labels(self):
        x, w, _ = _inputs(4, 8, 11)
        labels = jnp.array([3, -100, 11, -2])
        loss = jaxfuse.linear_cross_entropy(x, w, labels, reduction="none")
        self.assertEqual(float(loss[1]), 0.0)
        self.assertTrue(bool(jnp.isnan(loss[2])) and bool(jnp.isnan(loss[3])))
        g = jax.grad(lambda x: jaxfuse.linear_cross_entropy(
            x, w, jnp.array([3, -100, 5, -100])))(x)
        np.testing.assert_array_equal(g[1], 0.0)

    def test_leading_batch_axes(self):
        x, w, labels = _inputs(12, 8, 30)
        y = jaxfuse.linear_cross_entropy(x.reshape(3, 4, 8), w, labels.reshape(3, 4),
                                         reduction="none")
        self.assertEqual(y.shape, (3, 4))
        assert_close(y.reshape(-1), jaxfuse.linear_cross_entropy(x, w, labels, reduction="none"),
                     jnp.float32)

    def test_temporary_memory_stays_far_below_the_logits(self):
        # Compiled only, never run: 4096 tokens x 32768 classes would be 512 MiB of logits.
        n, d, v = 4096, 32, 32768
        x = jax.ShapeDtypeStruct((n, d), jnp.float32)
        w = jax.ShapeDtypeStruct((d, v), jnp.float32)
        labels = jnp.zeros((n,), jnp.int32)
        logits_bytes = n * v * 4
        def temp(impl):
            f = jax.value_and_grad(lambda x, w: jaxfuse.linear_cross_entropy(
                x, w, labels, impl=impl), argnums=(0, 1))
            return jax.jit(f).lower(x, w).compile().memory_analysis().temp_size_in_bytes
        self.assertLess(temp("pallas"), logits_bytes / 8)
        self.assertGreater(temp("reference"), logits_bytes)

    def test_bad_input(self):
        x, w, labels = _inputs(4, 8, 11)
        with self.assertRaisesRegex(ValueError,
                                    r"x.shape\[-1\]=8 must equal weight.shape\[0\]=7"):
            jaxfuse.linear_cross_entropy(x, w[:7], labels)
        with self.assertRaisesRegex(ValueError, "labels.shape=\\(3,\\)"):
            jaxfuse.linear_cross_entropy(x, w, labels[:3])
        with self.assertRaisesRegex(ValueError, "weight.dtype=bfloat16"):
            jaxfuse.linear_cross_entropy(x, w.astype(jnp.bfloat16), labels)
        with self.assertRaisesRegex(ValueError, "z_loss=-1"):
            jaxfuse.linear_cross_entropy(x, w, labels, z_loss=-1)
        with self.assertRaisesRegex(ValueError, "slab=0 must be a positive number"):
            jaxfuse.linear_cross_entropy(x, w, labels, block_sizes=LCEBlocks(0))


class TokenSlabTest(chex.TestCase):
    """`LCEBlocks(token_slab=n)`: the gradient formed in the forward, n tokens at a time."""

    @chex.variants(with_jit=True)
    @parameterized.product(case=[(37, 24, 301, 16), (1, 8, 17, 4), (13, 7, 40, 13),
                                 (30, 16, 64, 64)],
                           settings=[(dict(), "mean"), (dict(label_smoothing=0.1), "sum")])
    def test_matches_reference(self, case, settings):
        # N not a multiple of the slab (padded tokens), one token, exactly one slab, a slab
        # larger than N; a random scalar cotangent (the backward scales dx and dW by it).
        n, d, v, token_slab = case
        options, reduction = settings
        x, w, labels = _inputs(n, d, v, seed=n + v)
        kw = dict(options, reduction=reduction)
        f = self.variant(lambda x, w: jaxfuse.linear_cross_entropy(
            x, w, labels, block_sizes=LCEBlocks(token_slab=token_slab), **kw))
        fr = jax.jit(lambda x, w: jaxfuse.linear_cross_entropy(x, w, labels, impl="reference",
                                                               **kw))
        (y, grads), (y_r, grads_r) = vjp_both(f, fr, (x, w), randn(keys(3, 1)[0], ()))
        assert_close(y, y_r, jnp.float32, scale=10.0)
        assert_close(grads, grads_r, jnp.float32, scale=10.0)

    def test_bf16_against_float32_reference(self):
        _check_bf16_against_float32(self, LCEBlocks(token_slab=24))

    def test_float16_under_loss_scaling(self):
        # Mean over 8192 tokens: dz = (q - p) / 8192 would sit under float16's smallest normal;
        # the weight goes on in float32, so a scaled loss keeps the fused op's accuracy.
        x, w, labels = _inputs(8192, 16, 2048, seed=5)
        def grads(blocks, dtype):
            g = jax.grad(lambda x, w: 1024 * jaxfuse.linear_cross_entropy(
                x, w, labels, block_sizes=blocks,
                impl="reference" if dtype == jnp.float32 else "pallas"), argnums=(0, 1))
            # The float32 reference jitted (see `_bf16_case`); the float16 op as before.
            return (jax.jit(g) if dtype == jnp.float32 else g)(x.astype(dtype), w.astype(dtype))
        ref = grads(None, jnp.float32)
        for got in grads(LCEBlocks(token_slab=2048), jnp.float16):
            self.assertLess(_rel_err(got.astype(jnp.float32), ref[0] if got.shape == x.shape
                                     else ref[1]), 2e-3)

    def test_gradient_comes_from_the_forward(self):
        # Differentiated: one cross-entropy kernel (loss and dz) on each slab's logits, no fused
        # LCE kernel (the logits are not computed a second time); a forward alone is the fused
        # op's.
        x, w, labels = _inputs(37, 24, 50)
        f = lambda x, w: jaxfuse.linear_cross_entropy(x, w, labels,
                                                      block_sizes=LCEBlocks(token_slab=16))
        grad = kernel_names(jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(x, w).jaxpr)
        self.assertEqual(sorted(set(grad)), ["jaxfuse_cross_entropy_loss_grad"])
        self.assertEqual(kernel_names(jax.make_jaxpr(f)(x, w).jaxpr),
                         ["jaxfuse_linear_cross_entropy_fwd"])

    def test_other_settings_take_the_fused_op(self):
        # A per-token loss, z_loss and a soft cap: the fused op's results exactly.
        x, w, labels = _inputs(13, 8, 30)
        for kw in (dict(reduction="none"), dict(z_loss=1e-2), dict(logits_soft_cap=3.0)):
            def f(x, w, bs):
                return jnp.sum(jaxfuse.linear_cross_entropy(x, w, labels, block_sizes=bs, **kw))
            got = jax.value_and_grad(f, argnums=(0, 1))(x, w, LCEBlocks(token_slab=4))
            want = jax.value_and_grad(f, argnums=(0, 1))(x, w, None)
            chex.assert_trees_all_equal(got, want)

    def test_ignored_tokens_and_bad_labels(self):
        x, w, _ = _inputs(4, 8, 11)
        bs = LCEBlocks(token_slab=3)
        loss, (dx, dw) = jax.value_and_grad(lambda x, w: jaxfuse.linear_cross_entropy(
            x, w, jnp.array([3, -100, 5, -100]), block_sizes=bs), argnums=(0, 1))(x, w)
        np.testing.assert_array_equal(dx[1], 0.0)
        np.testing.assert_array_equal(dx[3], 0.0)
        self.assertTrue(bool(jnp.all(jnp.isfinite(dw))))
        loss, dx = jax.value_and_grad(lambda x: jaxfuse.linear_cross_entropy(
            x, w, jnp.array([3, -100, 11, 5]), block_sizes=bs))(x)
        self.assertTrue(bool(jnp.isnan(loss)) and bool(jnp.isnan(dx[2]).all()))

    def test_bad_token_slab(self):
        for bad in (0, -3, 2.5, True):
            with self.assertRaisesRegex(ValueError, f"token_slab={bad!r} must be None"):
                LCEBlocks(token_slab=bad)


def _uses_hopper_kernel(f, *args) -> bool:
    # The fused Hopper GEMM is a Mosaic GPU kernel; in interpret mode its pallas_call carries
    # Mosaic GPU's interpreter parameters, which no Triton-path kernel has.
    return "InterpretGPUParams" in str(jax.make_jaxpr(f)(*args))


_BACKWARD_KERNELS = ("jaxfuse_lce_bwd_dz", "jaxfuse_lce_bwd_dx", "jaxfuse_lce_bwd_dw")


def _rel_err(a, b) -> float:
    a, b = (np.asarray(t, np.float64) for t in (a, b))
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


class HopperTest(chex.TestCase):
    """The Hopper GEMMs (Pallas Mosaic GPU) of the forward and the backward, run by Mosaic GPU's
    interpreter."""

    # N = 256 (two token tiles), D = 128 (two k steps: the backward is not Hopper's, D is not a
    # multiple of 256), V = 576: 512 columns (two 256-column CTA tiles, so each of the 2 CTAs of
    # the interpreter, or each warpgroup ping-ponged, takes two tiles) through the fused kernel,
    # the last 64 through a cuBLAS-path slab. The forward's default schedule is ping-pong; one
    # case runs it cooperative. The bf16 case without options that ran here too is in
    # test_backward_matches_the_slab_path_and_the_reference: bf16 ping-ponged without a soft
    # cap (its third case) and with reduction="sum" (its first), each forward checked there
    # against the cuBLAS path and the reference.
    @parameterized.parameters(
        (jnp.float16, dict(reduction="sum"), True),
        (jnp.bfloat16, dict(label_smoothing=0.1, z_loss=1e-3, logits_soft_cap=3.0), True),
        (jnp.float16, dict(label_smoothing=0.1, z_loss=1e-3, logits_soft_cap=3.0),
         Tiles(schedule="cooperative")))
    def test_matches_the_slab_path_and_the_reference(self, dtype, options, hopper):
        n, d, v = 256, 128, 576
        x, w, labels = _inputs(n, d, v, dtype, seed=7,
                               labels_at={5: v - 3, 6: 511, 7: 512})   # around the seam
        f = lambda hopper: lambda x, w: jaxfuse.linear_cross_entropy(  # noqa: E731
            x, w, labels, block_sizes=LCEBlocks(slab=128, hopper=hopper), **options)
        f_hopper = f(hopper)
        self.assertTrue(_uses_hopper_kernel(f_hopper, x, w))
        self.assertFalse(_uses_hopper_kernel(f(False), x, w))
        y, vjp = jax.vjp(f_hopper, x, w)
        y_s, vjp_s = jax.vjp(jax.jit(f(False)), x, w)     # the cuBLAS path, one program
        # The same logits rounded the same way; only the float32 summation order differs.
        np.testing.assert_allclose(float(y), float(y_s), rtol=1e-5)
        ct = jnp.asarray(1.7, jnp.float32)
        assert_close(vjp(ct), vjp_s(ct), dtype)
        fr = lambda x, w: jaxfuse.linear_cross_entropy(x, w, labels, impl="reference",  # noqa: E731
                                                       **options)
        y_r = jax.jit(fr)(x.astype(jnp.float32), w.astype(jnp.float32))
        self.assertLess(abs(float(y) - float(y_r)) / abs(float(y_r)), 1e-3)

    # D = 256 (whole [128, 256] dx tiles): the backward runs its dz, dx and dW GEMMs as well.
    # Slabs of 256 columns (two trips of the loop, the offset read by the kernel), of 512 (one
    # trip, then the 256 columns left in a call of their own) or of 512 with nothing left; the
    # last 64 of V = 576 or 832 take the cuBLAS path in both directions. Every call keeps at
    # least two tiles per CTA (the interpreter runs 2), and a ping-ponged GEMM of a 512-column
    # slab deals each warpgroup two. The backward's default ping-pongs dz and runs dx and dW
    # cooperative; one case runs every GEMM cooperative, one every GEMM ping-pong.
    @parameterized.parameters(
        (256, 576, jnp.bfloat16, dict(reduction="sum"), Tiles(schedule="cooperative")),
        (512, 832, jnp.float16, dict(label_smoothing=0.1, z_loss=1e-3, logits_soft_cap=3.0),
         True),
        (512, 576, jnp.bfloat16, dict(label_smoothing=0.1, z_loss=1e-3),
         Tiles(schedule="pingpong")))
    def test_backward_matches_the_slab_path_and_the_reference(self, slab, v, dtype, options,
                                                             hopper):
        n, d = 256, 256
        v_h = v // 256 * 256                     # the columns the Hopper GEMMs take
        x, w, labels = _inputs(n, d, v, dtype, seed=slab + v,
                               labels_at={5: v - 3, 6: v_h - 1, 7: v_h, 8: slab})
        f = lambda hopper: lambda x, w: jaxfuse.linear_cross_entropy(  # noqa: E731
            x, w, labels, block_sizes=LCEBlocks(slab=slab, hopper=hopper), **options)
        program = str(jax.make_jaxpr(jax.grad(f(hopper), argnums=(0, 1)))(x, w))
        for name in ("jaxfuse_linear_cross_entropy_fwd_hopper", *_BACKWARD_KERNELS):
            self.assertIn(name, program)
        ct = jax.random.uniform(keys(slab, 1)[0], (), jnp.float32, 0.5, 2.0)
        # The cuBLAS path jitted: one program.
        (y, g), (y_s, g_s) = vjp_both(f(hopper), jax.jit(f(False)), (x, w), ct)
        np.testing.assert_allclose(float(y), float(y_s), rtol=1e-5)
        # The same dz rounded the same way; the float32 sums of dx and dW in another order.
        assert_close(g, g_s, dtype)
        fr = lambda x, w: jaxfuse.linear_cross_entropy(x, w, labels, impl="reference",  # noqa: E731
                                                       **options)
        # The reference once (vjp_both ran it twice), jitted.
        y_r, vjp_r = jax.vjp(jax.jit(fr), *[a.astype(jnp.float32) for a in (x, w)])
        # The forward against the float32 reference too, as test_matches_the_slab_path_...
        self.assertLess(abs(float(y) - float(y_r)) / abs(float(y_r)), 1e-3)
        for a, b in zip(g, vjp_r(ct)):
            self.assertLess(_rel_err(a, b), 1e-2)

    # The interpreter's numpy matmul says that the products overflow: they are meant to.
    @pytest.mark.filterwarnings("ignore:overflow encountered in matmul:RuntimeWarning")
    def test_a_product_past_float32s_range_gives_an_infinite_loss(self):
        """Logits x w past float32's range (+inf) make lse +inf and the loss +inf, as the
        reference's logsumexp; the stats' online merge shifted by a max of +inf, exp(inf -
        inf) = NaN. Rows 0 and 2 overflow at columns 100 (the first 256-column tile) and 300
        (the second: the merge of tiles); row 4 has a finite ~1e20 logit at column 100 and
        overflows at 300 alone (a large finite max, then +inf); the Hopper kernels and the
        cuBLAS slab path, against the reference; the other rows unchanged."""
        n, d, v = 256, 128, 576
        x, w, labels = _inputs(n, d, v, jnp.bfloat16, seed=11, labels_at={0: 5, 2: 7, 4: 9})
        big = jnp.bfloat16(1e19)           # 128 products of 1e38: past 3.4e38 in float32
        x = x.at[0].set(big).at[2].set(big).at[4, :64].set(big)
        w = w.at[64:, 100].set(big).at[:64, 300].set(big).at[64:, 300].set(0)
        want = np.asarray(jaxfuse.linear_cross_entropy(x, w, labels, reduction="none",
                                                       impl="reference"))
        np.testing.assert_array_equal(np.isposinf(want[[0, 2, 4]]), True)
        for hopper in (True, False):
            f = lambda x, w, h=hopper: jaxfuse.linear_cross_entropy(
                x, w, labels, reduction="none", block_sizes=LCEBlocks(slab=128, hopper=h))
            self.assertEqual(_uses_hopper_kernel(f, x, w), hopper)
            got = np.asarray(f(x, w))
            np.testing.assert_array_equal(got[[0, 2, 4]], want[[0, 2, 4]], err_msg=f"{hopper=}")
            rest = np.setdiff1d(np.arange(n), [0, 2, 4])
            np.testing.assert_allclose(got[rest], want[rest], rtol=2e-2, atol=2e-2)

    def test_backward_with_fewer_columns_than_a_tile(self):
        # V = 192: no whole 256-column CTA tile, everything on the cuBLAS path (the default
        # slab). One tile through the kernels and 64 columns after (V = 320) is
        # test_backward_under_vmap_runs_example_by_example's shape, checked there.
        v = 192
        x, w, labels = _inputs(128, 256, v, jnp.bfloat16, seed=v)
        g = [jax.grad(lambda x, w, h=h: jaxfuse.linear_cross_entropy(
            x, w, labels, block_sizes=LCEBlocks(hopper=h)), argnums=(0, 1))(x, w)
            for h in (True, False)]
        assert_close(g[0], g[1], jnp.bfloat16)

    def test_backward_under_vmap_runs_example_by_example(self):
        # The backward's refs do not batch: under vmap its custom_vmap rule maps over the batch.
        # V = 320: one 256-column slab through the kernels, 64 columns on the cuBLAS path.
        x, w, labels = _inputs(2 * 128, 256, 320, jnp.bfloat16, seed=3)
        x, labels = x.reshape(2, 128, 256), labels.reshape(2, 128)
        f = lambda hopper: jax.value_and_grad(  # noqa: E731
            lambda x, w, y: jaxfuse.linear_cross_entropy(
                x, w, y, block_sizes=LCEBlocks(slab=256, hopper=hopper)), argnums=(0, 1))
        batched = jax.jit(jax.vmap(f(True), in_axes=(0, None, 0)))(x, w, labels)
        one_by_one = [jax.jit(f(True))(x[i], w, labels[i]) for i in range(2)]
        chex.assert_trees_all_equal(batched, jax.tree.map(lambda *a: jnp.stack(a), *one_by_one))
        # Each example's Hopper gradients are the cuBLAS path's (what the V = 320 case of
        # test_backward_with_fewer_columns_than_a_tile checked on its own run of the kernels).
        cublas = jax.jit(f(False))                                   # compiled once
        for i in range(2):
            assert_close(one_by_one[i], cublas(x[i], w, labels[i]), jnp.bfloat16)

    def test_shape_rules(self):
        x, w, labels = _inputs(256, 128, 1088, jnp.bfloat16)
        auto = lambda x, w: jaxfuse.linear_cross_entropy(x, w, labels)  # noqa: E731
        self.assertFalse(_uses_hopper_kernel(auto, x, w))     # None: only on a Hopper GPU
        for bad, what in [((x[:100], w, labels[:100]), r"x \(100, 128\)"),
                          ((x, w[:, :1000], labels), r"weight \(128, 1000\)"),
                          ((x.astype(jnp.float32), w.astype(jnp.float32), labels), "float32")]:
            with self.assertRaisesRegex(ValueError, r"LCEBlocks\(hopper=True\) needs.*" + what):
                jaxfuse.linear_cross_entropy(*bad, block_sizes=LCEBlocks(hopper=True))
        with self.assertRaisesRegex(ValueError, "Tiles\\(order='diagonal'\\) must be"):
            jaxfuse.linear_cross_entropy(x, w, labels,
                                         block_sizes=LCEBlocks(hopper=Tiles(order="diagonal")))
        with self.assertRaisesRegex(ValueError, "must give every GEMM the same m and n"):
            jaxfuse.linear_cross_entropy(
                x, w, labels, block_sizes=LCEBlocks(hopper=HopperTiles(dx=Tiles(n=64))))
        with self.assertRaisesRegex(ValueError, "Tiles\\(epi=48\\) must divide n=128"):
            Tiles(epi=48)
        # An epilogue stores its chunks in whole [64, piece] pieces: a chunk narrower than a
        # piece would leave part of dz unwritten, so the tiles refuse it up front.
        with self.assertRaisesRegex(ValueError, "Tiles\\(piece=64\\) must be a multiple of 16 "
                                                "that divides epi=32"):
            Tiles(epi=32, piece=64)
        with self.assertRaisesRegex(ValueError, "Tiles\\(piece=48\\) must be a multiple of 16"):
            Tiles(piece=48)
        # store_tile itself (for direct callers) refuses a tile that is not whole pieces.
        with self.assertRaisesRegex(ValueError, "a \\[64, 48\\] tile is not whole \\[64, 32\\]"):
            _hopper_gemm.store_tile(jnp.zeros((64, 48)),
                               jax.ShapeDtypeStruct((2, 64, 32), jnp.bfloat16), None, 0, 0)
        with self.assertRaisesRegex(ValueError, "Tiles\\(schedule='serial'\\) must be"):
            jaxfuse.linear_cross_entropy(x, w, labels,
                                         block_sizes=LCEBlocks(hopper=Tiles(schedule="serial")))

    # (budget slab, N, D, SMs, expected): 132 SMs = 4 x 33, so 33 column tiles of 256 make
    # N/128 x 33 dz tiles (twice as many ping-ponged) and D/128 x 33 dW tiles, whole waves;
    # where 33 tiles would exceed the budget by more than 1/8 (N = 32768) or the waves are
    # whole already (128 SMs), it stays.
    @parameterized.parameters((8192, 8192, 4096, 132, 8448), (16384, 4096, 4096, 132, 16896),
                              (2048, 32768, 4096, 132, 2048), (8192, 8192, 4096, 128, 8192))
    def test_backward_slab_fills_whole_waves(self, budget, n, d, sms, expected):
        t = HopperTiles()
        slab = whole_waves(budget, n, d, t, sms)
        self.assertEqual(slab, expected)
        self.assertLessEqual(slab, budget * 9 // 8)
        if slab != budget:
            for rows in (n, d):                      # dz and dW tiles per slab
                self.assertEqual(rows // 128 * (slab // 256) % sms, 0)
        # A ping-ponged dz deals [m, n] tiles: twice as many per slab column tile.
        pp = HopperTiles(dz=Tiles(schedule="pingpong"))
        self.assertEqual(whole_waves(8192, 8192, 4096, pp, 132) % (33 * 256), 0)

    @parameterized.product(schedule=["cooperative", "pingpong"],
                           scratch=[((2, 4, 128), jnp.float32), ((2, 2, 64, 64), jnp.bfloat16),
                                    ((2, 2, 64, 64), jnp.float32), ((2, 2, 64, 32), jnp.float32)],
                           n_rows=[0, 3])
    def test_stages_fill_shared_memory(self, schedule, scratch, n_rows):
        # As many pipeline stages as the 227 KiB of shared memory hold beside the epilogue's
        # slots and the per-row values, and no more (checked against bytes counted here).
        t = Tiles(schedule=schedule, stages=16)
        rows = n_rows * t.m * 4
        if schedule == "pingpong":
            per_stage, fixed = (t.m + t.n) * t.k * 2, 2 * max(rows, t.m * 4)
        else:
            per_stage, fixed = (t.m + 2 * t.n) * t.k * 2 + rows, 0
        fixed += int(np.prod(scratch[0])) * jnp.dtype(scratch[1]).itemsize
        s = _hopper_gemm._stages(t, 2, plgpu.SMEM(*scratch), n_rows)
        self.assertLessEqual(fixed + s * per_stage, 227 * 1024 - 1024)
        self.assertGreater(fixed + (s + 1) * per_stage, 227 * 1024 - 1024)
        self.assertGreaterEqual(s, 3)

    def test_default_backward_gemms_keep_four_stages(self):
        # The default [64, 32] store pieces leave every backward GEMM 4 pipeline stages beside
        # its epilogue slots (dz also carries 3 per-row values); with [64, 64] pieces a
        # cooperative dz (bf16 slots and per-row values on every stage) or dx (float32 slots)
        # had 3.
        t = HopperTiles()
        for tiles, dtype, n_rows in ((t.dz, jnp.bfloat16, 3), (t.dx, jnp.float32, 0),
                                     (t.dw, jnp.bfloat16, 0)):
            slots = _hopper_gemm.tile_smem(dtype, tiles)
            self.assertEqual(_hopper_gemm._stages(tiles, 2, slots, n_rows), 4)
        wide = Tiles(piece=64)
        for dtype, n_rows in ((jnp.bfloat16, 3), (jnp.float32, 0)):
            self.assertEqual(
                _hopper_gemm._stages(wide, 2, _hopper_gemm.tile_smem(dtype, wide), n_rows), 3)


if __name__ == "__main__":
    pytest.main([__file__])
