"""swiglu: silu(gate) * up, one kernel forward, one backward (recomputing silu)."""
import chex
import jax
import jax.numpy as jnp
import pytest
from absl.testing import parameterized

import jaxfuse
from jaxfuse import RowBlocks
from tests._util import DTYPES, assert_close, keys, randn

CASES = [((1, 1), None), ((5, 37), RowBlocks(2, 8)), ((2, 3, 131), None)]


class SwiGLUTest(chex.TestCase):

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.product(case=CASES, dtype=DTYPES)
    def test_matches_reference_with_grads(self, case, dtype):
        shape, blocks = case
        k = keys(shape[-1] + DTYPES.index(dtype), 3)
        gate, up = randn(k[0], shape, dtype, scale=3.0), randn(k[1], shape, dtype)
        ct = randn(k[2], shape, dtype)
        y, vjp = jax.vjp(self.variant(lambda g, u: jaxfuse.swiglu(g, u, block_sizes=blocks)),
                         gate, up)
        yr, vjpr = jax.vjp(lambda g, u: jaxfuse.swiglu(g, u, impl="reference"), gate, up)
        self.assertEqual(y.dtype, dtype)
        assert_close(y, yr, dtype)
        assert_close(vjp(ct), vjpr(ct), dtype, scale=2.0)

    def test_reference_is_jax_nn_and_vmap(self):
        k = keys(1, 2)
        gate, up = randn(k[0], (3, 4, 10)), randn(k[1], (3, 4, 10))
        assert_close(jaxfuse.swiglu(gate, up, impl="reference"), jax.nn.silu(gate) * up,
                     jnp.float32)
        assert_close(jax.vmap(jaxfuse.swiglu)(gate, up), jax.nn.silu(gate) * up, jnp.float32)

    def test_bad_input(self):
        with self.assertRaisesRegex(ValueError, "up \\(shape=\\(3, 7\\)"):
            jaxfuse.swiglu(jnp.ones((3, 8)), jnp.ones((3, 7)))
        with self.assertRaisesRegex(ValueError, "gate.dtype=int32"):
            jaxfuse.swiglu(jnp.ones((3, 8), jnp.int32), jnp.ones((3, 8), jnp.int32))


if __name__ == "__main__":
    pytest.main([__file__])
