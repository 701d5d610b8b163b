"""The model at scale, in small configs: mixed precision (bf16 training and decoding), the fused
loss, scanned and rematerialized layers, dropout, and the presets' shapes (abstractly)."""
import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

import jaxfuse
from jaxfuse import model as M
from tests._util import apply_jit, assert_close, kernel_names, keys

CFG = M.Config(vocab_size=13, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=40,
               max_len=20)
# The loss and layer tests' base: label smoothing on, so every loss and gradient they compare
# covers it too, and one config whose memoized gradients (`_grads`) they all share.
BASE = dataclasses.replace(CFG, label_smoothing=0.1)


def _batch(seed, b=2, t=9, vocab=13):
    k = keys(seed, 2)
    tokens = jax.random.randint(k[0], (b, t), 0, vocab)
    targets = jax.random.randint(k[1], (b, t), 0, vocab).at[:, :3].set(-100)
    return tokens, targets


def _count(tree) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


# Jitted like tests/_util.py's apply_jit.
_value_and_grad = jax.jit(jax.value_and_grad(M.loss), static_argnums=3, static_argnames="impl")


@functools.cache
def _grads(cfg, impl, seed=5):
    """(loss, grads) of M.loss at seed's parameters and batch. Memoized: the baselines that
    several tests compare against (the plain scanned and unrolled models, per impl) compile and
    run once per process instead of once per test. jax arrays are immutable: sharing is safe."""
    params = M.init(jax.random.key(seed), cfg)
    tokens, targets = _batch(seed)
    return _value_and_grad(params, tokens, targets, cfg, impl=impl)


class PrecisionTest(chex.TestCase):

    def test_bf16_training_follows_float32(self):
        tokens, targets = _batch(1)
        opt = M.optimizer(3e-3, 4, warmup_steps=1)
        losses = {}
        for dtype in ("float32", "bfloat16"):
            cfg = dataclasses.replace(CFG, dtype=dtype)
            params = M.init(jax.random.key(0), cfg)
            state = opt.init(params)
            losses[dtype] = []
            for _ in range(4):
                params, state, loss = M.train_step(params, state, tokens, targets, cfg=cfg, opt=opt)
                losses[dtype].append(float(loss))
            # Master weights stay float32 whatever the compute dtype.
            self.assertTrue(all(x.dtype == jnp.float32 for x in jax.tree.leaves(params)))
        self.assertLess(losses["float32"][-1], losses["float32"][0])     # it trains
        np.testing.assert_allclose(losses["bfloat16"], losses["float32"], rtol=3e-2)

    def test_bf16_logits_and_dtypes(self):
        cfg = dataclasses.replace(CFG, dtype="bfloat16")
        params = M.init(jax.random.key(2), cfg)
        tokens, _ = _batch(2)
        logits = apply_jit(params, tokens, cfg)
        self.assertEqual(logits.dtype, jnp.bfloat16)
        # Against the float32 reference (a fraction of the kernels' compile time; the float32
        # kernels equal it within 1e-4, test_model.py): bf16 rounding through 3 blocks of
        # width 32, a few bf16 ulps of the logit scale.
        ref = apply_jit(params, tokens, dataclasses.replace(cfg, dtype="float32"), impl="reference")
        assert_close(logits, ref, jnp.bfloat16, scale=6.0)
        cache = M.init_cache(cfg, 2)
        self.assertEqual({c.dtype for c in cache["k"] + cache["v"]}, {jnp.dtype(jnp.bfloat16)})

    # Beam search runs in bf16 once, with the float32 master weights: the parameters reach it
    # only through the cast and prefill it shares with greedy (`decode_params`, `prefill`),
    # which both parameter dtypes check; what is beam search's own (top-k over the bf16 logits,
    # the bf16 caches' reorder) sees the compute dtype, bf16 in both.
    @parameterized.parameters(("bfloat16", "float32", True), ("bfloat16", "bfloat16", False))
    def test_decoding(self, dtype, param_dtype, beam):
        cfg = dataclasses.replace(CFG, dtype=dtype, param_dtype=param_dtype)
        params = M.init(jax.random.key(3), cfg)
        prompts = jax.random.randint(keys(3, 1)[0], (3, 6), 0, 13)
        lengths = jnp.array([6, 2, 4], jnp.int32)
        g = M.greedy(params, cfg, prompts, lengths, max_new_tokens=4, eos_id=12)
        if beam:
            b, _ = M.beam_search(params, cfg, prompts, lengths, beam_size=2, max_new_tokens=4,
                                 eos_id=12)
            self.assertEqual(b.shape, (3, 2, 4))
        # The cached steps equal recomputing the whole sequence, in the compute dtype, and
        # greedy picks their argmax.
        cache = M.init_cache(cfg, 3)
        logits, cache = jax.jit(M.prefill, static_argnums=4)(params, cache, prompts, lengths, cfg)
        step = jax.jit(M.decode_step, static_argnums=3)
        seqs = [list(np.asarray(prompts[i, :lengths[i]])) for i in range(3)]
        for t in range(2):
            tok = jnp.argmax(logits, -1).astype(jnp.int32)
            np.testing.assert_array_equal(tok, g[:, t])
            for i in range(3):
                seqs[i].append(int(tok[i]))
            logits, cache = step(params, cache, tok, cfg)
            self.assertEqual(logits.dtype, jnp.dtype(dtype))
            # Recomputed from scratch on the right-padded sequences (causal: the padding after a
            # sequence never reaches its last position): one compiled shape [3, 6 + 2] for every
            # sequence and step, where each sequence's own length took six compiles.
            padded = np.zeros((3, 8), np.int32)
            for i in range(3):
                padded[i, :len(seqs[i])] = seqs[i]
            full = apply_jit(params, jnp.asarray(padded), cfg, impl="reference")
            for i in range(3):
                assert_close(logits[i], full[i, len(seqs[i]) - 1], jnp.dtype(dtype), scale=10.0)


class LossTest(chex.TestCase):

    @parameterized.parameters(("pallas", False), ("reference", False), ("pallas", True))
    def test_fused_loss_equals_logits_loss(self, impl, tie):
        cfg = dataclasses.replace(BASE, tie_embeddings=tie)
        params = M.init(jax.random.key(5), cfg)        # the parameters and batch of `_grads`
        self.assertEqual("unembed" in params, not tie)
        tokens, targets = _batch(5)

        @jax.jit                                       # see `apply_jit`
        @jax.value_and_grad
        def logits_loss(params, tokens, targets):
            return jaxfuse.cross_entropy(M.apply(params, tokens, cfg, impl=impl), targets,
                                         label_smoothing=cfg.label_smoothing, impl=impl)

        assert_close(_grads(cfg, impl), logits_loss(params, tokens, targets), jnp.float32,
                     scale=5.0)


class LayersTest(chex.TestCase):

    # The kernels' own path under scan and remat is tested with impl="pallas" once each; the
    # other variants use the references (same model code, a fraction of the compile time). The
    # plain models they compare against (BASE, scanned and unrolled, per impl) are memoized by
    # `_grads`: computed once, not once per test.
    @parameterized.parameters(("rms", "pallas"), ("layer", "reference"))
    def test_scan_equals_unrolled(self, norm, impl):
        cfg = dataclasses.replace(BASE, norm=norm)
        assert_close(_grads(cfg, impl), _grads(dataclasses.replace(cfg, scan_layers=False), impl),
                     jnp.float32, scale=5.0)

    @parameterized.parameters(("block", True, "pallas"),
                              ("block+attention", True, "pallas"),
                              ("dots_with_no_batch_dims_saveable", True, "reference"),
                              ("dots_with_no_batch_dims_saveable+attention+swiglu", False,
                               "pallas"),
                              ("block", False, "reference"))
    def test_remat_same_grads(self, remat, scan, impl):
        cfg = dataclasses.replace(BASE, scan_layers=scan)
        assert_close(_grads(dataclasses.replace(cfg, remat=remat), impl), _grads(cfg, impl),
                     jnp.float32, scale=5.0)

    @parameterized.parameters(("none", 1), ("block", 2), ("block+attention", 1),
                              ("dots_with_no_batch_dims_saveable", 2),
                              ("dots_with_no_batch_dims_saveable+attention", 1))
    def test_named_residuals_skip_recompute(self, remat, forwards):
        # The scanned body holds one layer: "+attention" keeps attention's named residuals and
        # outputs, so the backward no longer runs the forward kernel a second time.
        cfg = dataclasses.replace(CFG, remat=remat)
        params = M.init(jax.random.key(0), cfg)
        tokens, targets = _batch(0)
        jaxpr = jax.make_jaxpr(jax.grad(lambda p: M.loss(p, tokens, targets, cfg)))(params)
        self.assertEqual(kernel_names(jaxpr.jaxpr).count("jaxfuse_flash_fwd"), forwards)

    def test_attention_inputs_are_kept_by_name(self):
        # "+attention" keeps q, k, v (named by the model) and o and both lse arrays (named by
        # the op): six named residuals, so neither attention nor its inputs are recomputed.
        import contextlib
        import io
        cfg = dataclasses.replace(CFG, n_layers=1, scan_layers=False)  # a scan reports its own
        params = M.init(jax.random.key(0), cfg)                         # outputs instead
        tokens, _ = _batch(0)
        counts = {}
        for remat in ("block", "block+attention"):
            f = lambda p, c=dataclasses.replace(cfg, remat=remat): M.hidden(p, tokens, c)[0]
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                jax.ad_checkpoint.print_saved_residuals(f, params)
            counts[remat] = out.getvalue().count("named 'jaxfuse.attention'")
        self.assertEqual(counts, {"block": 0, "block+attention": 6})

    def test_loss_token_slab_same_loss_and_grads(self):
        # The loss's gradient formed in the forward, 5 tokens at a time (18 targets: a padded
        # last slab), against the fused loss.
        cfg = dataclasses.replace(BASE, loss_token_slab=5)
        assert_close(_grads(cfg, "pallas"), _grads(BASE, "pallas"), jnp.float32, scale=5.0)
        params = M.init(jax.random.key(0), cfg)
        tokens, targets = _batch(0)
        names = kernel_names(jax.make_jaxpr(jax.grad(
            lambda p: M.loss(p, tokens, targets, cfg)))(params).jaxpr)
        self.assertNotIn("jaxfuse_linear_cross_entropy_bwd", names)
        self.assertIn("jaxfuse_cross_entropy_loss_grad", names)

    @parameterized.parameters("none", "block+attention")
    def test_stacked_weights_are_cast_inside_the_layer_loop(self, remat):
        # bf16 compute on float32 master weights: a cast of the whole [n_layers, ...] stack
        # before the scan (and of its gradient after) is a copy of every weight that the loop
        # then slices through another copy; cast per layer, XLA fuses slice and cast. So no
        # convert outside the scan may touch a stacked weight, forward or backward.
        cfg = dataclasses.replace(CFG, dtype="bfloat16", remat=remat)
        params = M.init(jax.random.key(0), cfg)
        tokens, targets = _batch(0)
        jaxpr = jax.make_jaxpr(jax.grad(lambda p: M.loss(p, tokens, targets, cfg)))(params)
        stacked = {x.shape for x in jax.tree.leaves(params["blocks"])}

        def outer_converts(jaxpr):      # converts outside any scan, inside jits and custom rules
            for e in jaxpr.eqns:
                if e.primitive.name == "convert_element_type":
                    yield e.invars[0].aval.shape
                elif e.primitive.name != "scan":
                    for sub in jax.extend.core.jaxprs_in_params(e.params):
                        yield from outer_converts(sub)

        shapes = list(outer_converts(jaxpr.jaxpr))
        self.assertTrue(shapes)                          # the walk sees the embedding's casts
        self.assertEqual([s for s in shapes if s in stacked], [])
        grads = jax.grad(lambda p: M.loss(p, tokens, targets, cfg))(params)
        self.assertEqual({x.dtype for x in jax.tree.leaves(grads)}, {jnp.dtype(jnp.float32)})

    def test_params_are_stacked(self):
        params = M.init(jax.random.key(0), CFG)
        self.assertEqual(params["blocks"]["wq"].shape, (2, 32, 32))
        self.assertEqual(params["blocks"]["wk"].shape, (2, 32, 16))
        self.assertEqual(params["blocks"]["attn_norm"]["weight"].shape, (2, 32))


class DropoutTest(chex.TestCase):

    def test_keys_and_determinism(self):
        cfg = dataclasses.replace(CFG, dropout=0.2)
        params = M.init(jax.random.key(6), cfg)
        tokens, targets = _batch(6)
        loss = jax.jit(functools.partial(M.loss, impl="reference"), static_argnums=3)
        k1, k2 = keys(6, 2)
        a, a2, b = (loss(params, tokens, targets, cfg, key=k) for k in (k1, k1, k2))
        self.assertEqual(float(a), float(a2))                 # same key, same masks
        self.assertNotEqual(float(a), float(b))               # another key, other masks
        # Each layer's masks come from (key, layer): the same under remat and unrolled layers.
        for other in (dataclasses.replace(cfg, remat="block"),
                      dataclasses.replace(cfg, scan_layers=False)):
            assert_close(loss(params, tokens, targets, other, key=k1), a, jnp.float32)
        plain = dataclasses.replace(cfg, dropout=0.0)
        no_key = loss(params, tokens, targets, cfg)
        self.assertNotEqual(float(a), float(no_key))
        # Evaluation (no key) is deterministic and equals the model without dropout.
        self.assertEqual(float(no_key), float(loss(params, tokens, targets, cfg)))
        assert_close(no_key, loss(params, tokens, targets, plain), jnp.float32)
        assert_close(apply_jit(params, tokens, cfg, impl="reference"),
                     apply_jit(params, tokens, plain, impl="reference"), jnp.float32)

    def test_train_step_with_key(self):
        cfg = dataclasses.replace(CFG, dropout=0.1)
        params = M.init(jax.random.key(7), cfg)
        opt = M.optimizer(1e-3, 2, warmup_steps=1)
        tokens, targets = _batch(7)
        out = [M.train_step(jax.tree.map(jnp.copy, params), opt.init(params), tokens, targets, k,
                            cfg=cfg, opt=opt, impl="reference")[2]
               for k in (keys(7, 1)[0], keys(8, 1)[0])]
        self.assertTrue(np.isfinite(float(out[0])))
        self.assertNotEqual(float(out[0]), float(out[1]))

    def test_dropout_op_keeps_expected_fraction(self):
        from jaxfuse.model import _block_ops
        x = jnp.ones((200, 500))
        y = _block_ops.dropout(x, 0.3, jax.random.key(0))
        kept = float(jnp.mean(y != 0))
        self.assertLess(abs(kept - 0.7), 5 * (0.3 * 0.7 / x.size) ** 0.5)
        # Kept elements are scaled by 1 / P(keep), P(keep) being 0.7 to 16 bits (`_philox`).
        from jaxfuse import _philox
        np.testing.assert_allclose(np.unique(np.asarray(y)), [0.0, 1 / _philox.keep_prob(0.3)],
                                   rtol=1e-6)
        self.assertLess(abs(_philox.keep_prob(0.3) - 0.7), 2.0 ** -17)
        with self.assertRaisesRegex(ValueError, "rate=1.0"):
            _block_ops.dropout(x, 1.0, jax.random.key(0))


class BlockOpsTest(chex.TestCase):

    def test_rope_layouts_and_relative_positions(self):
        from jaxfuse.model import _block_ops
        k = keys(9, 3)
        x = jax.random.normal(k[0], (2, 5, 3, 8))
        pos = jax.random.randint(k[1], (2, 5), 0, 50)
        # Halves layout = interleaved layout with the pairs (i, i + D/2) brought together.
        perm = np.stack([np.arange(4), np.arange(4) + 4], -1).reshape(-1)
        halves = _block_ops.rope(x, pos, interleaved=False)
        inter = _block_ops.rope(x[..., perm], pos)
        np.testing.assert_allclose(halves[..., perm], inter, rtol=1e-5, atol=1e-5)
        # q.k depends only on the position difference; the norm is kept.
        y = jax.random.normal(k[2], (2, 5, 3, 8))
        rot = _block_ops.rope
        dot = lambda shift: jnp.sum(rot(x, pos + shift) * rot(y, pos + 7 + shift), -1)
        np.testing.assert_allclose(dot(0), dot(13), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(jnp.linalg.norm(inter, axis=-1),
                                   jnp.linalg.norm(x[..., perm], axis=-1), rtol=1e-5)


class PresetTest(chex.TestCase):

    def test_1b_shapes_and_count(self):
        cfg = M.preset("1b")
        shapes = jax.eval_shape(lambda: M.init(jax.random.key(0), cfg))
        d, f, v, n = 2048, 8192, 128256, 16
        self.assertEqual(shapes["embed"].shape, (v, d))
        self.assertNotIn("unembed", shapes)                  # tied, as Llama 3.2 1B
        self.assertEqual(shapes["blocks"]["wq"].shape, (n, d, 32 * 64))
        self.assertEqual(shapes["blocks"]["wk"].shape, (n, d, 8 * 64))
        self.assertEqual(shapes["blocks"]["w2"].shape, (n, f, d))
        self.assertEqual(shapes["embed"].dtype, jnp.float32)
        per_layer = 2 * d + 2 * d * d + 2 * d * 512 + 3 * d * f
        self.assertEqual(_count(shapes), v * d + n * per_layer + d)
        self.assertEqual(round(_count(shapes) / 1e8), 12)      # 1.24B
        cache = jax.eval_shape(lambda: M.init_cache(cfg, 2, 8192))
        self.assertEqual(cache["k"][0].shape, (2, 8192, 8, 64))
        self.assertEqual(cache["k"][0].dtype, jnp.bfloat16)

    def test_157m_count_and_loss_shape(self):
        cfg = M.preset("157m")
        shapes = jax.eval_shape(lambda: M.init(jax.random.key(0), cfg))
        self.assertEqual(round(_count(shapes) / 1e6), 157)
        tokens = jax.ShapeDtypeStruct((2, 64), jnp.int32)
        out = jax.eval_shape(lambda p, t: M.loss(p, t, t, cfg, impl="reference"), shapes, tokens)
        self.assertEqual((out.shape, out.dtype), ((), jnp.float32))

    def test_gpu_presets_form_the_loss_gradient_in_token_slabs(self):
        # Measured faster on the H200 at both shapes (BENCHMARKS.md, run s8-1): the gradient of
        # either GPU preset's loss (1B: the tied embedding as W) takes the slab kernels, not the
        # fused op's backward; LikesWorld's keeps the fused op.
        self.assertIsNone(M.preset("likesworld").loss_token_slab)
        for name in ("157m", "1b"):
            cfg = M.preset(name)
            shapes = jax.eval_shape(lambda: M.init(jax.random.key(0), cfg))
            tokens = jax.ShapeDtypeStruct((1, 64), jnp.int32)
            names = kernel_names(jax.make_jaxpr(jax.grad(
                lambda p, t: M.loss(p, t, t, cfg)))(shapes, tokens).jaxpr)
            # each slab's loss and dz by one kernel (s37), not the forward + backward pair
            self.assertIn("jaxfuse_cross_entropy_loss_grad", names, name)
            self.assertNotIn("jaxfuse_cross_entropy_bwd", names, name)
            self.assertNotIn("jaxfuse_linear_cross_entropy_bwd", names, name)

    def test_config_passes_through_jax_transforms(self):
        """A Config given as a plain argument (not static_argnames, not a partial) goes through
        jax.eval_shape and jax.jit unchanged: it has no leaves. (Its `dtype` field made jax
        take it for a float32 scalar, and init failed on the tracer.)"""
        shapes = jax.eval_shape(M.init, jax.random.key(0), M.preset("157m"))
        self.assertEqual(shapes["embed"].shape, (32768, 1024))
        cfg = M.Config()
        self.assertEqual(jax.tree.leaves(cfg), [])
        width = jax.jit(lambda c, x: x * c.d_model)(cfg, jnp.float32(2.0))
        self.assertEqual(float(width), 2.0 * cfg.d_model)

    def test_head_dim_the_kernels_do_not_take(self):
        # Config takes any even head dim (the references run it); the Pallas path refused
        # head_dim 12 only deep in flash_attention's tracing, in the kernel's terms. Now each
        # model entry point says it in the Config's, before tracing; the reference runs.
        cfg = M.Config(vocab_size=37, d_model=48, n_heads=4, n_kv_heads=2, d_ff=80, max_len=24)
        params = M.init(jax.random.key(0), cfg)
        tokens = jnp.array([[5, 6, 7]])
        calls = (lambda impl: M.apply(params, tokens, cfg, impl=impl),
                 lambda impl: M.greedy(params, cfg, tokens, jnp.array([3]), max_new_tokens=2,
                                       eos_id=2, impl=impl),
                 lambda impl: M.decode_step(params, M.init_cache(cfg, 1), tokens[:, 0], cfg,
                                            impl=impl))
        for call in calls:
            with self.assertRaisesRegex(ValueError, "Config\\(d_model=48, n_heads=4\\): "
                                        "head_dim=12 .* or run impl='reference'"):
                call("pallas")
            self.assertTrue(all(bool(jnp.isfinite(x).all())
                                for x in jax.tree.leaves(call("reference"))
                                if jnp.issubdtype(x.dtype, jnp.floating)))

    def test_bad_config(self):
        with self.assertRaisesRegex(ValueError, "dtype='int32'"):
            M.Config(dtype="int32")
        with self.assertRaisesRegex(ValueError, "remat='sometimes'"):
            M.Config(remat="sometimes")
        with self.assertRaisesRegex(ValueError,
                                    "'none' rematerializes nothing.*'block\\+attention'"):
            M.Config(remat="none+attention")
        with self.assertRaisesRegex(ValueError, "'attn' is not one of the ops"):
            M.Config(remat="block+attn")
        with self.assertRaisesRegex(ValueError, "remat='save_only_these_names' must be"):
            M.Config(remat="save_only_these_names")     # a policy factory, not a policy
        with self.assertRaisesRegex(ValueError, "loss_token_slab=0 must be"):
            M.Config(loss_token_slab=0)
        with self.assertRaisesRegex(ValueError, "loss_token_slab=True must be"):
            M.Config(loss_token_slab=True)
        with self.assertRaisesRegex(ValueError, "dropout=1.5"):
            M.Config(dropout=1.5)
        with self.assertRaisesRegex(ValueError, "preset 'huge'"):
            M.preset("huge")
        self.assertEqual(M.Config(dtype=jnp.bfloat16), M.Config(dtype="bfloat16"))
        # Sizes are checked before the ratios that divide by them (n_heads=0 was a
        # ZeroDivisionError; negative or float sizes failed later, in init), and the options'
        # types before their ranges (None / a string were an AttributeError / a TypeError).
        for bad in (dict(n_heads=0), dict(n_kv_heads=0), dict(n_heads=-4, n_kv_heads=-4),
                    dict(n_heads=4.0), dict(d_model=0), dict(vocab_size=0), dict(n_layers=0),
                    dict(d_ff=-5), dict(max_len=0), dict(n_layers=True)):
            name, value = next(iter(bad.items()))
            with self.assertRaisesRegex(ValueError, f"{name}={value!r} must be a positive int"):
                M.Config(**bad)
        for bad, message in ((dict(tie_embeddings="False"), "tie_embeddings='False' must be"),
                             (dict(scan_layers="no"), "scan_layers='no' must be True or"),
                             (dict(deterministic_attention=2), "deterministic_attention=2"),
                             (dict(remat=None), "remat=None must be a string"),
                             (dict(dropout="0.1"), "dropout='0.1' must be a real number"),
                             (dict(dropout=float("nan")), "dropout=nan must be a finite"),
                             (dict(label_smoothing=2.0), "label_smoothing=2.0 must lie"),
                             (dict(rope_base=0.0), "rope_base=0.0 must be a positive")):
            with self.assertRaisesRegex(ValueError, message):
                M.Config(**bad)
        # NumPy sizes are the ints they hold: the same (hashable, static) Config.
        cfg = M.Config(n_layers=np.int64(2), d_model=np.int32(64))
        self.assertEqual(cfg, M.Config())
        self.assertIs(type(cfg.n_layers), int)
        self.assertEqual(hash(cfg), hash(M.Config()))


class ModelInputsTest(chex.TestCase):
    """Bad inputs to the model functions: a ValueError naming the value and the fix (s31
    audit). Before, out-of-range tokens and targets gave NaN losses and logits (on a mesh,
    NaN parameters), a full cache wrong logits, and the rest internal errors (unpacking,
    broadcasting, dtypes). (An eos_id outside the vocabulary is valid: no sequence ends
    early.)"""

    def setUp(self):
        super().setUp()
        self.params = M.init(jax.random.key(0), CFG)
        self.tokens, self.targets = _batch(40)

    def test_ids_are_judged_where_known(self):
        p, tok, tgt = self.params, self.tokens, self.targets
        with self.assertRaisesRegex(ValueError, r"targets\[0, 4\]=13 is outside \[0, 13\) or -100"):
            M.loss(p, tok, tgt.at[0, 4].set(13), CFG)
        with self.assertRaisesRegex(ValueError, r"tokens\[1, 0\]=-1 is outside \[0, 13\)"):
            M.apply(p, tok.at[1, 0].set(-1), CFG)
        with self.assertRaisesRegex(ValueError, r"prompts\[0, 2\]=13 is outside"):
            M.greedy(p, CFG, tok[:, :4].at[0, 2].set(13), jnp.array([4, 4]),
                     max_new_tokens=2, eos_id=0)
        # under the caller's jit they cannot be read: the NaN the ops document
        loss = jax.jit(M.loss, static_argnames="cfg")(p, tok, tgt.at[0, 4].set(13), cfg=CFG)
        self.assertTrue(np.isnan(float(loss)))

    def test_shapes_and_options(self):
        p, tok = self.params, self.tokens
        lengths = jnp.array([4, 1])
        cases = [
            (lambda: M.apply(p, tok[0], CFG), r"tokens.shape=\(9,\) must be \[B, T\]"),
            (lambda: M.apply(p, tok, CFG, head_mask=jnp.ones(4)),
             r"head_mask.shape=\(4,\) must be \[n_layers, n_heads\] = \(2, 4\)"),
            (lambda: M.greedy(p, CFG, tok[:, :4], [4, 1], max_new_tokens=2, eos_id=0),
             "prompt_lengths must be an array, got list"),
            (lambda: M.greedy(p, CFG, tok[:, :4], lengths.astype(jnp.float32),
                              max_new_tokens=2, eos_id=0), "prompt_lengths.dtype=float32"),
            (lambda: M.greedy(p, CFG, tok[:, :4], lengths, max_new_tokens=-1, eos_id=0),
             "max_new_tokens=-1 must be a positive int"),
            (lambda: M.greedy(p, CFG, tok[:, :4], lengths, max_new_tokens=2, eos_id=2.0),
             "eos_id=2.0 must be an int"),
            (lambda: M.beam_search(p, CFG, tok[:, :4], lengths, beam_size=0, max_new_tokens=2,
                                   eos_id=0), "beam_size=0 must be a positive int"),
            (lambda: M.beam_search(p, CFG, tok[:, :4], lengths, beam_size=2, max_new_tokens=2,
                                   eos_id=0, length_penalty=float("nan")),
             "length_penalty=nan must be a finite number"),
            (lambda: M.init_cache(CFG, 0, 8), "batch=0 must be a positive int"),
            (lambda: M.init_cache(CFG, 2, 8, dtype=jnp.int32), "must be a float dtype"),
            (lambda: M.prefill(p, M.init_cache(CFG, 2, 3), tok[:, :4], lengths, CFG),
             "the cache is too short: 3 positions, and the call writes 4"),
            (lambda: M.prefill(p, M.init_cache(CFG, 3, 8), tok[:, :4], lengths, CFG),
             "the cache holds 3 sequences .* and the call has 2"),
        ]
        for call, message in cases:
            with self.assertRaisesRegex(ValueError, message):
                call()

    def test_a_full_cache(self):
        p, tok = self.params, self.tokens
        _, cache = M.prefill(p, M.init_cache(CFG, 2, 4), tok[:, :4], jnp.array([4, 2]), CFG)
        with self.assertRaisesRegex(ValueError, "lengths up to 4 of 4 positions"):
            M.decode_step(p, cache, jnp.array([1, 2]), CFG)
        with self.assertRaisesRegex(ValueError, r"tokens.shape=\(2, 1\) must be \[B\]"):
            M.decode_step(p, cache, jnp.array([[1], [2]]), CFG)
        _, cache = M.prefill(p, M.init_cache(CFG, 2, 5), tok[:, :4], jnp.array([4, 2]), CFG)
        M.decode_step(p, cache, jnp.array([1, 2]), CFG)        # the last position is free


    def test_caches_and_lengths_that_do_not_fit_the_model(self):
        """s33 audit: a cache of another config or batch, and prompt lengths of another type or
        shape, were caught deep inside (broadcasting, a tuple index, dtype errors) or not at
        all (a cache of more layers lost its extra ones)."""
        p, tok = self.params, self.tokens
        other = dataclasses.replace(CFG, n_layers=1)
        mqa = dataclasses.replace(CFG, n_kv_heads=1)
        cases = [
            (lambda: M.prefill(p, M.init_cache(other, 2, 8), tok[:, :4], jnp.array([4, 2]), CFG),
             r"the cache holds \(1, 1\) layers .* cfg has n_layers=2"),
            (lambda: M.prefill(p, M.init_cache(mqa, 2, 8), tok[:, :4], jnp.array([4, 2]), CFG),
             r"a cache layer has shape \(2, 8, 1, 8\) where cfg's is .* = \(2, 8, 2, 8\)"),
            (lambda: M.prefill(p, M.init_cache(CFG, 2, 8), tok[:, :4], [4, 2], CFG),
             r"prompt_lengths must be an array, got list"),
            (lambda: M.prefill(p, M.init_cache(CFG, 2, 8), tok[:, :4], jnp.array([4.0, 2.0]),
                               CFG), r"prompt_lengths.dtype=float32 must be an integer type"),
            (lambda: M.prefill(p, M.init_cache(CFG, 2, 8), tok[:, :4], jnp.array([4, 2, 1]),
                               CFG), r"prompt_lengths.shape=\(3,\) must be \(2,\)"),
            (lambda: M.init_cache(CFG, 2, 8, dtype="foo"), r"dtype='foo' must be a float dtype"),
            (lambda: M.decode_step(p, dict(M.init_cache(CFG, 2, 8), lengths=[1, 1]),
                                   jnp.array([1, 2]), CFG),
             r"cache\['lengths'\] must be an array, got list"),
        ]
        for call, message in cases:
            with self.assertRaisesRegex(ValueError, message):
                call()


def test_search_options_as_jax_scalars():
    """A jax scalar option (length_penalty=jnp.float32(0.5)) is the number it holds: it was
    "Non-hashable static arguments" from the jitted search (s33 audit)."""
    params = M.init(jax.random.key(4), CFG)
    tok = _batch(42)[0][:, :4]
    run = lambda lp, k: M.beam_search(params, CFG, tok, jnp.array([4, 2]), beam_size=k,
                                      max_new_tokens=3, eos_id=0, length_penalty=lp)
    np.testing.assert_array_equal(np.asarray(run(jnp.float32(0.5), jnp.int32(2))[0]),
                                  np.asarray(run(0.5, 2)[0]))


@pytest.mark.parametrize("dtype,cache_dtype", [("bfloat16", "float32"), ("float16", "bfloat16"),
                                               ("float32", "bfloat16")])
def test_a_cache_of_another_dtype_than_the_model(dtype, cache_dtype):
    """`init_cache(dtype=)` sets the cache's own dtype: decoding a bf16 model on a float32
    cache failed inside the block (its attention output came back float32 and met a bf16
    residual); each step now equals `apply` at the same position, at the model's precision."""
    cfg = dataclasses.replace(CFG, dtype=dtype)
    params = M.init(jax.random.key(3), cfg)
    tok = _batch(41)[0][:, :6]
    _, cache = M.prefill(params, M.init_cache(cfg, 2, 8, dtype=cache_dtype), tok[:, :5],
                         jnp.array([5, 5]), cfg)
    logits, _ = M.decode_step(params, cache, tok[:, 5], cfg)
    want = M.apply(params, tok, cfg)[:, 5]
    assert logits.dtype == want.dtype
    # bf16 logits of size ~2 are 0.016 apart (0.023 off with a bf16 cache too); a bf16
    # cache costs the others ~0.005.
    np.testing.assert_allclose(np.asarray(logits, np.float32), np.asarray(want, np.float32),
                               atol=0.05 if dtype == "bfloat16" else 0.02, rtol=0)


def test_decoding_steps_leave_row_ops_to_xla(monkeypatch):
    """Compiled (traced with JAXFUSE_INTERPRET=0, not run), a decoding step's few rows take
    XLA's add + norm, RoPE and SwiGLU (fused with their neighbours: fewer launches) and keep
    decode attention; a training step's many rows take every kernel."""
    monkeypatch.setenv("JAXFUSE_INTERPRET", "0")
    cfg = M.Config(vocab_size=50, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=48,
                   max_len=80, dtype="bfloat16")
    params = M.init(jax.random.key(0), cfg)

    def kernels(f, *args):
        text = str(jax.make_jaxpr(f)(*args))
        # "jaxfuse_rope" is both RoPE kernels' prefix (rope's and rope_qkv's)
        return {n for n in ("jaxfuse_rope", "jaxfuse_rope_fwd", "jaxfuse_rope_qkv",
                            "jaxfuse_swiglu", "jaxfuse_add_rms_norm",
                            "jaxfuse_decode_attention") if n in text}

    cache = M.init_cache(cfg, 4)
    step = kernels(lambda p, c, t: M.decode_step(p, c, t, cfg), params, cache,
                   jnp.zeros((4,), jnp.int32))
    assert step == {"jaxfuse_decode_attention"}, step
    tokens = jnp.zeros((2, 40), jnp.int32)         # 80 rows > FEW_ROWS
    train = kernels(jax.grad(lambda p: M.loss(p, tokens, tokens, cfg)), params)
    assert {"jaxfuse_rope_qkv", "jaxfuse_swiglu", "jaxfuse_add_rms_norm"} <= train, train
    assert "jaxfuse_rope_fwd" not in train, "q and k are sliced out and turned apart again"


def test_deterministic_attention_reaches_flash_attention(monkeypatch):
    """Config.deterministic_attention is what every layer's flash_attention call gets (False:
    the Hopper backward's fused dQ at head_dim 64), traced through the gradient of the loss."""
    seen = []
    real = jaxfuse.flash_attention

    def spy(*args, **kwargs):
        seen.append(kwargs.get("deterministic"))
        return real(*args, **kwargs)
    monkeypatch.setattr(jaxfuse, "flash_attention", spy)
    tokens, targets = _batch(0)
    for det in (False, True):
        cfg = dataclasses.replace(CFG, deterministic_attention=det, scan_layers=False)
        seen.clear()
        jax.make_jaxpr(jax.grad(lambda p: M.loss(p, tokens, targets, cfg)))(
            M.init(jax.random.key(0), cfg))
        assert seen == [det] * cfg.n_layers, seen
