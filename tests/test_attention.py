import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

import jaxfuse
from jaxfuse import AttnBlocks
from jaxfuse.reference.attention import merge_states
from tests._util import DTYPES, assert_close, keys, randn

# (B, Tq, Tk, Hq, Hkv, D, options). Lengths 1, 17, 100, 257; Tq < Tk; MHA, GQA 4, MQA.
CASES = [
    (2, 17, 17, 4, 4, 16, dict()),
    (2, 17, 17, 4, 1, 16, dict(causal=True)),                       # MQA
    (1, 1, 17, 8, 2, 8, dict(causal=True)),                         # one query over a cache
    (1, 17, 100, 4, 1, 16, dict(causal=True, sliding_window=9)),    # Tq < Tk, window
    (1, 100, 100, 2, 2, 8, dict(logits_soft_cap=3.0)),
    (2, 17, 30, 4, 2, 8, dict(causal=True, segments=True)),
    (1, 257, 257, 2, 1, 8, dict(causal=True)),
]
# Default (folded, one interpreted step) and the GPU layout with small tiles, in interpret mode.
LAYOUTS = {"folded": None, "gpu_layout": AttnBlocks(16, 8, 8, 16, 8, 16, folded=False)}


def _make(case, dtype, seed):
    b, tq, tk, hq, hkv, d, opts = case
    opts = dict(opts)
    k = keys(seed, 7)
    q, kk, v = (randn(k[0], (b, tq, hq, d), dtype), randn(k[1], (b, tk, hkv, d), dtype),
                randn(k[2], (b, tk, hkv, d), dtype))
    if opts.pop("segments", False):
        opts["q_segment_ids"] = jax.random.randint(k[3], (b, tq), 0, 3)
        opts["kv_segment_ids"] = jax.random.randint(k[4], (b, tk), 0, 3)
    return (q, kk, v), opts, k


# Every case in both layouts, each layout in another dtype, the dtypes rotating over the cases:
# each case runs in two of the three dtypes and every (dtype, layout) pair runs, in a third of
# the full product's time (the suite's time budget; the kernels take the dtype only at loads,
# stores and the cast of P).
COMBOS = [dict(case=c, layout=lay, dtype=DTYPES[(i + j) % len(DTYPES)])
          for i, c in enumerate(CASES) for j, lay in enumerate(LAYOUTS)]


class FlashAttentionTest(chex.TestCase):

    @chex.variants(with_jit=True)
    @parameterized.parameters(*COMBOS)
    def test_matches_reference_with_grads(self, case, dtype, layout):
        (q, k, v), opts, ks = _make(case, dtype, case[1] + case[3])
        blocks = LAYOUTS[layout]
        f = self.variant(lambda q, k, v: jaxfuse.flash_attention(
            q, k, v, return_lse=True, block_sizes=blocks, **opts))
        fr = lambda q, k, v: jaxfuse.flash_attention(q, k, v, return_lse=True,
                                                     impl="reference", **opts)
        (o, lse), vjp = jax.vjp(f, q, k, v)
        (o_r, lse_r), vjp_r = jax.vjp(fr, q, k, v)
        self.assertEqual(o.dtype, dtype)
        self.assertEqual(lse.dtype, jnp.float32)
        assert_close(o, o_r, dtype)
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_r))
        finite = np.isfinite(np.asarray(lse_r))
        assert_close(np.asarray(lse)[finite], np.asarray(lse_r)[finite], dtype)
        do = randn(ks[5], o.shape, dtype)
        dlse = jnp.where(finite, randn(ks[6], lse.shape), 0.0)
        assert_close(vjp((do, dlse)), vjp_r((do, dlse)), dtype, scale=3.0)

    @parameterized.parameters(*LAYOUTS)
    def test_rows_that_see_nothing(self, layout):
        # Segment 5 exists only in the queries: those rows see no key.
        (q, k, v), _, _ = _make((1, 9, 12, 2, 1, 8, {}), jnp.float32, 3)
        qs = jnp.array([[0, 5, 1, 5, 0, 1, 1, 5, 0]])
        ks = jnp.array([[0, 1] * 6])
        f = lambda q, k, v: jaxfuse.flash_attention(q, k, v, q_segment_ids=qs, kv_segment_ids=ks,
                                                    return_lse=True, block_sizes=LAYOUTS[layout])
        (o, lse), vjp = jax.vjp(f, q, k, v)
        dq, dk, dv = vjp((jnp.ones_like(o), jnp.zeros_like(lse)))
        dead = np.asarray(qs[0] == 5)
        np.testing.assert_array_equal(np.asarray(o)[0, dead], 0.0)
        self.assertTrue(np.all(np.isneginf(np.asarray(lse)[0][:, dead])))
        np.testing.assert_array_equal(np.asarray(dq)[0, dead], 0.0)
        self.assertTrue(all(bool(jnp.all(jnp.isfinite(g))) for g in (dq, dk, dv)))

    def test_backward_is_deterministic(self):
        (q, k, v), _, ks = _make((1, 40, 40, 4, 2, 8, {}), jnp.float32, 4)
        blocks = LAYOUTS["gpu_layout"]
        f = jax.jit(jax.grad(lambda q, k, v: jnp.sum(jaxfuse.flash_attention(
            q, k, v, causal=True, block_sizes=blocks) ** 2), argnums=(0, 1, 2)))
        for a, b in zip(f(q, k, v), f(q, k, v)):
            np.testing.assert_array_equal(a, b)

    @parameterized.parameters(*LAYOUTS)
    def test_merging_halves_equals_attending_to_all(self, layout):
        (q, k, v), _, _ = _make((2, 5, 24, 4, 2, 8, {}), jnp.float32, 5)
        f = lambda k, v: jaxfuse.flash_attention(q, k, v, return_lse=True,
                                                 block_sizes=LAYOUTS[layout])
        o_a, lse_a = f(k[:, :10], v[:, :10])
        o_b, lse_b = f(k[:, 10:], v[:, 10:])
        o, lse = merge_states(o_a, lse_a, o_b, lse_b)
        o_all, lse_all = f(k, v)
        assert_close((o, lse), (o_all, lse_all), jnp.float32)

    def test_merge_states_associative_and_empty_side(self):
        k = keys(6, 6)
        parts = [(randn(k[i], (2, 3, 4)), randn(k[i + 3], (2, 3)) * 3) for i in range(3)]
        (a, la), (b, lb), (c, lc) = parts
        left = merge_states(*merge_states(a, la, b, lb), c, lc)
        right = merge_states(a, la, *merge_states(b, lb, c, lc))
        assert_close(left, right, jnp.float32)
        empty = jnp.full_like(la, -jnp.inf)
        o, lse = merge_states(a, la, jnp.zeros_like(a), empty)
        assert_close((o, lse), (a, la), jnp.float32)
        o, lse = merge_states(jnp.zeros_like(a), empty, jnp.zeros_like(a), empty)
        np.testing.assert_array_equal(o, 0.0)
        self.assertTrue(np.all(np.isneginf(lse)))

    def test_bad_input(self):
        q = jnp.zeros((1, 4, 4, 16))
        k = jnp.zeros((1, 4, 2, 16))
        with self.assertRaisesRegex(ValueError, "head dims differ"):
            jaxfuse.flash_attention(q, jnp.zeros((1, 4, 2, 8)), jnp.zeros((1, 4, 2, 8)))
        with self.assertRaisesRegex(ValueError, "query heads 4 .* multiple of the number of KV heads 3"):
            jaxfuse.flash_attention(q, jnp.zeros((1, 4, 3, 16)), jnp.zeros((1, 4, 3, 16)))
        with self.assertRaisesRegex(ValueError, "q_segment_ids.shape=\\(1, 5\\) must be \\(1, 4\\)"):
            jaxfuse.flash_attention(q, k, k, q_segment_ids=jnp.zeros((1, 5), jnp.int32),
                                    kv_segment_ids=jnp.zeros((1, 4), jnp.int32))
        with self.assertRaisesRegex(ValueError, "head_dim=12 is not supported"):
            jaxfuse.flash_attention(jnp.zeros((1, 4, 4, 12)), jnp.zeros((1, 4, 2, 12)),
                                    jnp.zeros((1, 4, 2, 12)))
        with self.assertRaisesRegex(ValueError, "head_dim=512"):
            jaxfuse.flash_attention(jnp.zeros((1, 4, 1, 512)), jnp.zeros((1, 4, 1, 512)),
                                    jnp.zeros((1, 4, 1, 512)))
        with self.assertRaisesRegex(ValueError, "sliding_window=0"):
            jaxfuse.flash_attention(q, k, k, sliding_window=0)
        with self.assertRaisesRegex(ValueError, "k.dtype=bfloat16"):
            jaxfuse.flash_attention(q, k.astype(jnp.bfloat16), k)


if __name__ == "__main__":
    pytest.main([__file__])
