"""rope: rotary embedding with in-kernel angles, interleaved pairs and halves."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfuse
from jaxfuse import RowBlocks
from jaxfuse.model import _block_ops
from tests._util import DTYPES, reference_tests, assert_close, keys, randn, wide_positions

# [B, T, H, D]: one token of one head with D = 2; T and H prime and a head dim that is not a
# power of two, rows split over programs; a leading batch of two axes.
CASES = [((3, 1, 1, 2), None), ((1, 7, 3, 6), RowBlocks(4, 8)), ((2, 2, 5, 2, 16), None)]


class RopeTest(chex.TestCase):

    def _check(self, case, dtype, interleaved):
        shape, blocks = case
        k = keys(shape[-1] + shape[-3] + DTYPES.index(dtype), 3)
        x = randn(k[0], shape, dtype)
        # Positions up to 4096, as in long-context training.
        pos = jax.random.randint(k[1], shape[:-2], 0, 4096)
        ct = randn(k[2], shape, dtype)
        f = lambda impl, **kw: (lambda x: jaxfuse.rope(x, pos, interleaved=interleaved,
                                                       impl=impl, **kw))
        y, vjp = jax.vjp(self.variant(f("pallas", block_sizes=blocks)), x)
        yr, vjpr = jax.vjp(f("reference"), x)
        self.assertEqual(y.dtype, dtype)
        assert_close(y, yr, dtype)
        assert_close(vjp(ct), vjpr(ct), dtype)

    test_matches_reference_with_grads, test_eager_matches_reference_with_grads = reference_tests(
        _check, case=CASES, interleaved=[True, False])

    def test_interleaved_is_the_models_rope_and_halves_a_permutation_of_it(self):
        k = keys(1, 2)
        x = randn(k[0], (2, 9, 3, 8))
        pos = jax.random.randint(k[1], (2, 9), 0, 500)
        y = jaxfuse.rope(x, pos, base=500.0)
        assert_close(y, _block_ops.rope(x, pos, base=500.0), jnp.float32)
        # Halves rotate (x[i], x[i + D/2]): the interleaved rotation of the permuted head dim.
        perm = np.array([0, 4, 1, 5, 2, 6, 3, 7])
        yh = jaxfuse.rope(x, pos, base=500.0, interleaved=False)
        assert_close(yh[..., perm], jaxfuse.rope(x[..., perm], pos, base=500.0), jnp.float32)
        # Rotations keep norms, and the backward undoes the forward.
        assert_close(jnp.linalg.norm(y, axis=-1), jnp.linalg.norm(x, axis=-1), jnp.float32)
        y, vjp = jax.vjp(lambda x: jaxfuse.rope(x, pos), x)
        assert_close(vjp(y)[0], x, jnp.float32, scale=2.0)

    def test_16bit_pairs_keep_their_order_and_bits(self):
        # 16-bit interleaved pairs travel as one 32-bit word each (the first element in the low
        # half-word). At position 0 the rotation is x * 1 -/+ partner * 0: on any bit pattern
        # (signed zeros, subnormals, the extremes, inf, NaN) the kernel gives the reference's
        # bits, and the finite elements keep their places (a swapped pair would not).
        for dtype in (jnp.bfloat16, jnp.float16):
            bits = jax.random.randint(keys(7, 1)[0], (3, 5, 3, 10), 0, 1 << 16, jnp.int32)
            x = jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), dtype)
            pos = jnp.zeros((3, 5), jnp.int32)
            y, yr = (jaxfuse.rope(x, pos, impl=impl) for impl in ("pallas", "reference"))
            nan = np.asarray(jnp.isnan(yr))
            np.testing.assert_array_equal(np.asarray(jnp.isnan(y)), nan)
            as_bits = lambda a: np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint16))
            np.testing.assert_array_equal(as_bits(y)[~nan], as_bits(yr)[~nan])
            normal = np.abs(np.asarray(x.astype(jnp.float32))) >= float(jnp.finfo(dtype).tiny)
            same = as_bits(y) == np.asarray(bits.astype(jnp.uint16))
            self.assertTrue(same[normal & ~nan].all())
            self.assertGreater((normal & ~nan).mean(), 0.5)

    def test_vmap(self):
        k = keys(2, 2)
        pos = jax.random.randint(k[1], (3, 2, 5), 0, 100)
        for dtype in (jnp.float32, jnp.bfloat16):      # strided pairs and 32-bit words
            x = randn(k[0], (3, 2, 5, 2, 4), dtype)
            assert_close(jax.vmap(jaxfuse.rope)(x, pos), jaxfuse.rope(x, pos, impl="reference"),
                         dtype)

    def test_wide_position_types(self):
        """Positions of a type wider than int32 reach the kernel as the float32 the reference's
        angles start from (`kernel_positions`): uint32 past 2^31 wrapped negative as int32
        (another angle), and under jax_enable_x64 (int64 positions, int64 index literals)
        the interpreted kernel failed to trace at all."""
        k = keys(3, 2)
        x = randn(k[0], (1, 5, 2, 8))
        for interleaved in (True, False):
            f = lambda x, p, impl: jaxfuse.rope(x, p, interleaved=interleaved, impl=impl)
            cts = randn(k[1], x.shape)
            for pos in wide_positions():
                y, vjp = jax.vjp(lambda x: f(x, pos, "pallas"), x)
                yr, vjpr = jax.vjp(lambda x: f(x, pos, "reference"), x)
                assert_close(y, yr, jnp.float32)
                assert_close(vjp(cts), vjpr(cts), jnp.float32)

    def test_bad_input(self):
        x = jnp.ones((2, 5, 3, 8))
        pos = jnp.zeros((2, 5), jnp.int32)
        with self.assertRaisesRegex(ValueError, "positions.shape=\\(2, 4\\)"):
            jaxfuse.rope(x, pos[:, :4])
        with self.assertRaisesRegex(ValueError, "positions.dtype=float32"):
            jaxfuse.rope(x, pos.astype(jnp.float32))
        with self.assertRaisesRegex(ValueError, "x.shape\\[-1\\]=7 must be even"):
            jaxfuse.rope(jnp.ones((2, 5, 3, 7)), pos)
        with self.assertRaisesRegex(ValueError, "x.shape=\\(5, 8\\)"):
            jaxfuse.rope(jnp.ones((5, 8)), pos)
        with self.assertRaisesRegex(ValueError, "base=0"):
            jaxfuse.rope(x, pos, base=0)
        with self.assertRaisesRegex(ValueError, "block_cols=4 must cover the head dim D=8"):
            jaxfuse.rope(x, pos, block_sizes=RowBlocks(2, 4))


if __name__ == "__main__":
    pytest.main([__file__])
