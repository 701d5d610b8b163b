"""flash_attention with attention-probability dropout: the mask generated in the kernels
(forward, dQ and dK/dV) equals `jaxfuse.dropout`'s over P [B, Hq, Tq, Tk]."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

import jaxfuse
from jaxfuse import AttnBlocks
from jaxfuse.reference.dropout import keep_mask
from tests._util import assert_close, keys, randn

# Small tiles in the GPU layout (run in interpret mode): programs per (batch, head) and query
# block, key blocks in a loop, the dK/dV kernel walking a GQA group's heads.
GPU_LAYOUT = AttnBlocks(block_q=4, block_k=4, block_q_dq=4, block_k_dq=4, block_k_dkv=4,
                        block_q_dkv=4, folded=False)
# (B, Tq, Tk, Hq, Hkv, D), options
CASES = [((2, 9, 9, 4, 2, 8), dict(causal=True)),
         ((1, 5, 13, 2, 1, 16), dict(causal=True, sliding_window=4)),
         ((2, 7, 7, 2, 2, 8), dict(logits_soft_cap=3.0, segments=True))]


def _inputs(shape, dtype, seed):
    b, tq, tk, hq, hkv, d = shape
    k = keys(seed, 5)
    return (randn(k[0], (b, tq, hq, d), dtype), randn(k[1], (b, tk, hkv, d), dtype),
            randn(k[2], (b, tk, hkv, d), dtype), randn(k[3], (b, tq, hq, d), dtype), k[4])


class AttentionDropoutTest(chex.TestCase):

    @chex.variants(with_jit=True)
    @parameterized.product(case=list(range(len(CASES))), layout=["folded", "gpu"])
    def test_matches_reference_with_grads(self, case, layout):
        self._check(case, layout)

    # Eagerly once, in the GPU layout, on the case with the most options (segment ids, soft
    # cap, f16): the jitted cases above run the same kernel bodies at a third of the time
    # (the suite's time budget); this one checks that nothing needs a trace.
    @chex.variants(without_jit=True)
    def test_eager_matches_reference_with_grads(self):
        self._check(len(CASES) - 1, "gpu")

    def _check(self, case, layout):
        shape, opts = CASES[case]
        dtype = (jnp.float32, jnp.bfloat16, jnp.float16)[case]
        opts = dict(opts)
        q, k, v, do, key = _inputs(shape, dtype, case)
        if opts.pop("segments", False):
            seg = jnp.array([[0] * 4 + [1] * (shape[1] - 4)] * shape[0])
            opts.update(q_segment_ids=seg, kv_segment_ids=seg)
        blocks = GPU_LAYOUT if layout == "gpu" else None

        def f(impl, **kw):
            return lambda q, k, v: jaxfuse.flash_attention(q, k, v, dropout_rate=0.3,
                                                           dropout_key=key, impl=impl,
                                                           **opts, **kw)
        o, vjp = jax.vjp(self.variant(f("pallas", block_sizes=blocks)), q, k, v)
        o_r, vjp_r = jax.vjp(f("reference"), q, k, v)
        tol = 4.0 if dtype == jnp.float32 else 2.0     # bf16/f16: P rounded for P V
        assert_close(o, o_r, dtype, scale=tol)
        assert_close(vjp(do), vjp_r(do), dtype, scale=2 * tol)

    def test_mask_is_dropouts_bitwise(self):
        """q = 0 makes P uniform (1/Tk) and V the identity makes o's rows P's rows: o != 0 is
        exactly the keep-mask of `jaxfuse.dropout` over [B, Hq, Tq, Tk], in both layouts."""
        b, tq, hq, hkv, tk = 2, 6, 4, 2, 16
        q = jnp.zeros((b, tq, hq, tk))
        v = jnp.broadcast_to(jnp.eye(tk)[None, :, None, :], (b, tk, hkv, tk))
        key = jax.random.key(3)
        mask = np.asarray(keep_mask(key, (b, hq, tq, tk), 0.5)).transpose(0, 2, 1, 3)
        for blocks in (None, GPU_LAYOUT):
            o = jaxfuse.flash_attention(q, v, v, dropout_rate=0.5, dropout_key=key,
                                        block_sizes=blocks)
            np.testing.assert_array_equal(np.asarray(o) != 0, mask)
            np.testing.assert_allclose(np.asarray(o)[mask], 2.0 / tk, rtol=1e-6)

    def test_lse_rate_zero_no_key_and_vmap(self):
        q, k, v, _, key = _inputs((2, 5, 5, 2, 2, 8), jnp.float32, 9)
        o0, lse0 = jaxfuse.flash_attention(q, k, v, causal=True, return_lse=True)
        o, lse = jaxfuse.flash_attention(q, k, v, causal=True, return_lse=True,
                                         dropout_rate=0.5, dropout_key=key)
        np.testing.assert_array_equal(lse, lse0)          # lse of the undropped scores
        self.assertGreater(float(jnp.abs(o - o0).max()), 0.1)
        for kw in (dict(dropout_rate=0.0, dropout_key=key), dict(dropout_rate=0.5)):
            np.testing.assert_array_equal(jaxfuse.flash_attention(q, k, v, causal=True, **kw), o0)
        f = lambda q, k, v: jaxfuse.flash_attention(q, k, v, dropout_rate=0.5, dropout_key=key)
        out = jax.vmap(f)(q[:, None], k[:, None], v[:, None])
        for i in range(2):
            assert_close(out[i], f(q[i:i + 1], k[i:i + 1], v[i:i + 1]), jnp.float32)

    def test_bad_rate_and_key(self):
        q = jnp.ones((1, 4, 2, 8))
        with self.assertRaisesRegex(ValueError, "dropout_rate=1.0"):
            jaxfuse.flash_attention(q, q, q, dropout_rate=1.0, dropout_key=jax.random.key(0))
        with self.assertRaisesRegex(ValueError, "key \\(dtype=int32"):
            jaxfuse.flash_attention(q, q, q, dropout_rate=0.1, dropout_key=jnp.zeros(2, int))


if __name__ == "__main__":
    pytest.main([__file__])
