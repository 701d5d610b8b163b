"""rope_qkv: the grouped q/k/v projection split into heads, q and k turned by RoPE."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

import jaxfuse
from jaxfuse import RowBlocks
from jaxfuse.reference import rope_qkv as ref
from tests._util import DTYPES, reference_tests, assert_close, keys, randn, wide_positions

# [B, T, Hkv, G + 2, D]: one token, one KV head and one query head of D = 2; a prime T with G = 3
# (no power of two) and a head dim that is not one, tokens split over programs; the models'
# G = 4 with two KV heads; a leading batch of two axes.
CASES = [((1, 1, 1, 3, 2), None), ((1, 7, 1, 5, 6), RowBlocks(4, 8)),
         ((2, 5, 2, 6, 8), RowBlocks(2, 8)), ((2, 2, 3, 2, 4, 4), None)]


def _inputs(shape, dtype, seed):
    k = keys(seed, 5)
    *lead, hkv, s, d = shape
    x = randn(k[0], shape, dtype)
    pos = jax.random.randint(k[1], tuple(lead), 0, 4096)     # long-context positions
    cts = tuple(randn(kk, (*lead, h, d), dtype) for kk, h in zip(k[2:], (hkv * (s - 2), hkv, hkv)))
    return x, pos, cts


class RopeQkvTest(chex.TestCase):

    def _check(self, case, dtype, interleaved):
        shape, blocks = case
        x, pos, cts = _inputs(shape, dtype, sum(shape) + DTYPES.index(dtype))
        f = lambda impl, **kw: (lambda x: jaxfuse.rope_qkv(x, pos, interleaved=interleaved,
                                                           impl=impl, **kw))
        out, vjp = jax.vjp(self.variant(f("pallas", block_sizes=blocks)), x)
        rout, vjpr = jax.vjp(f("reference"), x)
        *lead, hkv, s, d = shape
        self.assertEqual([o.shape for o in out],
                         [(*lead, hkv * (s - 2), d), (*lead, hkv, d), (*lead, hkv, d)])
        self.assertEqual({o.dtype for o in out}, {jnp.dtype(dtype)})
        assert_close(out, rout, dtype)
        assert_close(vjp(cts), vjpr(cts), dtype)

    test_matches_reference_with_grads, test_eager_matches_reference_with_grads = reference_tests(
        _check, case=CASES, interleaved=[True, False])

    @parameterized.parameters(True, False)
    def test_is_rope_of_the_slices_bit_for_bit(self, interleaved):
        """The same arithmetic as `jaxfuse.rope` on q and k sliced out (the model's path before
        rope_qkv): bitwise equal outputs and gradient, v an exact copy; query head n G + i is
        slot i of KV head n."""
        for dtype in (jnp.float32, jnp.bfloat16):
            x, pos, cts = _inputs((2, 9, 2, 5, 8), dtype, 3)
            out, vjp = jax.vjp(lambda x: jaxfuse.rope_qkv(x, pos, interleaved=interleaved), x)

            def sliced(x):
                q = jnp.concatenate([x[:, :, n, :3] for n in range(2)], axis=2)
                turn = lambda y: jaxfuse.rope(y, pos, interleaved=interleaved)
                return turn(q), turn(x[:, :, :, 3]), x[:, :, :, 4]

            want, vjp_want = jax.vjp(sliced, x)
            for a, b in zip((*out, *vjp(cts)), (*want, *vjp_want(cts))):
                np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))

    def test_vmap_and_linearity(self):
        x, pos, cts = _inputs((3, 2, 5, 2, 4, 4), jnp.bfloat16, 4)
        got = jax.vmap(jaxfuse.rope_qkv)(x, pos)
        assert_close(got, ref.rope_qkv(x, pos), jnp.bfloat16)
        # A rotation keeps norms, and the backward of the forward's own output gives qkv back.
        x32 = x.astype(jnp.float32)
        out, vjp = jax.vjp(lambda x: jaxfuse.rope_qkv(x, pos), x32)
        q, k, v = ref.split(x32)
        for a, b in zip(out, (q, k, v)):
            assert_close(jnp.linalg.norm(a, axis=-1), jnp.linalg.norm(b, axis=-1), jnp.float32)
        assert_close(vjp(out)[0], x32, jnp.float32, scale=2.0)

    def test_wide_position_types(self):
        """Positions of a type wider than int32 reach the kernel as float32 (as `rope`'s):
        uint32 past 2^31, and int64 under jax_enable_x64, forward and gradient (whose position
        cotangent is then zeros, not float0)."""
        x, _, cts = _inputs((1, 5, 2, 4, 8), jnp.float32, 5)
        for interleaved in (True, False):
            for pos in wide_positions():
                f = lambda impl: (lambda x: jaxfuse.rope_qkv(
                    x, pos, interleaved=interleaved, impl=impl))
                out, vjp = jax.vjp(f("pallas"), x)
                rout, vjpr = jax.vjp(f("reference"), x)
                assert_close(out, rout, jnp.float32)
                assert_close(vjp(cts), vjpr(cts), jnp.float32)

    def test_bad_input(self):
        x = jnp.ones((2, 5, 2, 4, 8))
        pos = jnp.zeros((2, 5), jnp.int32)
        with self.assertRaisesRegex(ValueError, "positions.shape=\\(2, 4\\) must be "
                                    "qkv.shape\\[:-3\\]=\\(2, 5\\)"):
            jaxfuse.rope_qkv(x, pos[:, :4])
        with self.assertRaisesRegex(ValueError, "positions.dtype=float32"):
            jaxfuse.rope_qkv(x, pos.astype(jnp.float32))
        with self.assertRaisesRegex(ValueError, "qkv.shape\\[-2\\]=2 must be G \\+ 2 >= 3"):
            jaxfuse.rope_qkv(x[..., :2, :], pos)
        with self.assertRaisesRegex(ValueError, "qkv.shape\\[-1\\]=7 must be even"):
            jaxfuse.rope_qkv(x[..., :7], pos)
        with self.assertRaisesRegex(ValueError, "qkv.shape=\\(5, 4, 8\\)"):
            jaxfuse.rope_qkv(jnp.ones((5, 4, 8)), pos[0])
        with self.assertRaisesRegex(ValueError, "qkv.dtype=int32"):
            jaxfuse.rope_qkv(x.astype(jnp.int32), pos)
        with self.assertRaisesRegex(ValueError, "base=0"):
            jaxfuse.rope_qkv(x, pos, base=0)
        with self.assertRaisesRegex(ValueError, "block_cols=4 must cover the head dim D=8"):
            jaxfuse.rope_qkv(x, pos, block_sizes=RowBlocks(2, 4))


if __name__ == "__main__":
    pytest.main([__file__])
