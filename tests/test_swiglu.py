"""swiglu: silu(gate) * up, one kernel forward, one backward (recomputing silu); swiglu_linear:
the same followed by the down projection, its backward rebuilding the product."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

import jaxfuse
from jaxfuse import RowBlocks
from tests._util import DTYPES, assert_close, keys, randn, saved_residuals

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


# (gate shape, weight's output columns, row tiles): one element, primes, tiles not dividing
LINEAR_CASES = [((1, 1), 1, None), ((5, 37), 11, RowBlocks(2, 8)), ((2, 3, 131), 7, None)]


class SwiGLULinearTest(chex.TestCase):

    @chex.variants(with_jit=True)   # eager dispatch of the same kernels: SwiGLUTest
    @parameterized.product(case=LINEAR_CASES, dtype=DTYPES)
    def test_matches_reference_with_grads(self, case, dtype):
        shape, d, blocks = case
        k = keys(shape[-1] + 7 * DTYPES.index(dtype), 4)
        gate, up = randn(k[0], shape, dtype, scale=3.0), randn(k[1], shape, dtype)
        w = randn(k[2], (shape[-1], d), dtype, scale=shape[-1] ** -0.5)
        ct = randn(k[3], (*shape[:-1], d), dtype)
        f = self.variant(lambda g, u, w: jaxfuse.swiglu_linear(g, u, w, block_sizes=blocks))
        y, vjp = jax.vjp(f, gate, up, w)
        yr, vjpr = jax.vjp(lambda g, u, w: jaxfuse.swiglu_linear(g, u, w, impl="reference"),
                           gate, up, w)
        self.assertEqual(y.dtype, dtype)
        assert_close(y, yr, dtype)
        assert_close(vjp(ct), vjpr(ct), dtype, scale=2.0)

    @parameterized.parameters(*DTYPES)
    def test_backward_rebuilds_the_forward_product_bitwise(self, dtype):
        # dW = swiglu(gate, up)^T dout is formed from the product the backward kernel writes:
        # it must be the forward's own, bit for bit, or the weight gradient drifts from the
        # unfused ops'.
        k = keys(3, 3)
        gate, up, dy = (randn(k[i], (6, 45), dtype, scale=2.0) for i in range(3))
        blocks = RowBlocks(4, 16)
        dg, du, product = jaxfuse.pallas.swiglu.swiglu_grads(gate, up, dy, block_sizes=blocks)
        np.testing.assert_array_equal(np.asarray(product, np.float32), np.asarray(
            jaxfuse.swiglu(gate, up, block_sizes=blocks), np.float32))
        grads = jax.vjp(lambda g, u: jaxfuse.swiglu(g, u, block_sizes=blocks), gate, up)[1](dy)
        assert_close((dg, du), grads, dtype, scale=0.0)

    @parameterized.parameters(jnp.bfloat16, jnp.float16)
    def test_hopper_kernels_equal_triton(self, dtype):
        # The Mosaic GPU kernels (`swiglu_hopper.py`, in its interpreter here) compute what the
        # Triton ones do: forward, gradients and the rebuilt product. Interpreted, both are
        # XLA:CPU arithmetic, so they agree bit for bit and a wrong tile shows as a mismatch
        # (compiled, their exp differs by an ulp: benchmarks/swiglu_tiles.py). [2, 32, 512] is
        # 2 x 4 tiles of theirs.
        k = keys(6, 4)
        gate, up = randn(k[0], (2, 32, 512), dtype, scale=3.0), randn(k[1], (2, 32, 512), dtype)
        w = randn(k[2], (512, 24), dtype, scale=0.05)
        ct = randn(k[3], (2, 32, 24), dtype)
        outs = []
        for hopper in (True, False):
            blocks = RowBlocks(8, 512, hopper=hopper)
            y, vjp = jax.vjp(lambda g, u, w: jaxfuse.swiglu_linear(g, u, w, block_sizes=blocks),
                             gate, up, w)
            outs.append((y, vjp(ct), jaxfuse.swiglu(gate, up, block_sizes=blocks)))
        chex.assert_trees_all_equal(*outs)
        # and under vmap (Mosaic GPU's kernel batches with a grid axis of its own)
        f = lambda b: jax.vmap(lambda g, u: jaxfuse.swiglu(g, u, block_sizes=b))(gate, up)
        chex.assert_trees_all_equal(f(RowBlocks(8, 512, hopper=True)),
                                    f(RowBlocks(8, 512, hopper=False)))

    def test_hopper_kernels_run_under_jit(self):
        # Mosaic GPU's interpreter keeps memory and barriers in ordered IO callbacks, which
        # custom_partitioning could not lower inside a jit (a KeyError naming OrderedIOEffect):
        # forced Hopper kernels in interpret mode now run unpartitioned there, giving the bits
        # the eager call gives, gradients included.
        k = keys(7, 4)
        gate, up = randn(k[0], (32, 512), jnp.bfloat16), randn(k[1], (32, 512), jnp.bfloat16)
        w = randn(k[2], (512, 24), jnp.bfloat16, scale=0.05)
        ct = randn(k[3], (32, 24), jnp.bfloat16)
        blocks = RowBlocks(8, 512, hopper=True)

        def f(g, u, w):
            y, vjp = jax.vjp(lambda g, u, w: jaxfuse.swiglu_linear(g, u, w, block_sizes=blocks),
                             g, u, w)
            s, vjp_s = jax.vjp(lambda g, u: jaxfuse.swiglu(g, u, block_sizes=blocks), g, u)
            return y, vjp(ct), s, vjp_s(s)
        chex.assert_trees_all_equal(jax.jit(f)(gate, up, w), f(gate, up, w))

    def test_hopper_kernels_take_whole_tiles_only(self):
        g = jnp.ones((31, 512), jnp.bfloat16)
        with self.assertRaisesRegex(ValueError, "rows a multiple of 32 and cols of 128, got "
                                                "bfloat16 \\(31, 512\\)"):
            jaxfuse.swiglu(g, g, block_sizes=RowBlocks(8, 512, hopper=True))
        with self.assertRaisesRegex(ValueError, "got float32"):
            f = jnp.ones((32, 512))
            jaxfuse.swiglu(f, f, block_sizes=RowBlocks(8, 512, hopper=True))
        # an op without Hopper kernels refuses the flag instead of ignoring it
        with self.assertRaisesRegex(ValueError, "this op has no Hopper kernels"):
            jaxfuse.rms_norm(g, block_sizes=RowBlocks(8, 512, hopper=True))

    def test_keeps_only_gate_up_and_weight(self):
        # The point of the op: the [..., F] product is not a residual (the unfused pair keeps
        # it for the matmul's weight gradient).
        k = keys(4, 3)
        gate, up = randn(k[0], (4, 24)), randn(k[1], (4, 24))
        w = randn(k[2], (24, 8))
        saved = {name: saved_residuals(f, gate, up, w) for name, f in (
            ("fused", lambda g, u, w: jaxfuse.swiglu_linear(g, u, w)),
            ("unfused", lambda g, u, w: jaxfuse.swiglu(g, u) @ w))}
        self.assertEqual(saved["fused"], ["f32[24,8]", "f32[4,24]", "f32[4,24]"])
        self.assertIn("f32[4,24]", saved["unfused"])
        self.assertEqual(len(saved["unfused"]), 4)

    def test_vmap(self):
        k = keys(5, 3)
        gate, up, w = randn(k[0], (3, 4, 10)), randn(k[1], (3, 4, 10)), randn(k[2], (3, 10, 5))
        assert_close(jax.vmap(jaxfuse.swiglu_linear)(gate, up, w),
                     jnp.einsum("bti,bio->bto", jax.nn.silu(gate) * up, w), jnp.float32)

    def test_bad_input(self):
        g = jnp.ones((3, 8))
        with self.assertRaisesRegex(ValueError, "weight \\(shape=\\(7, 4\\)\\) must be \\[F, D\\]"):
            jaxfuse.swiglu_linear(g, g, jnp.ones((7, 4)))
        with self.assertRaisesRegex(ValueError, "weight \\(shape=\\(8,\\)\\)"):
            jaxfuse.swiglu_linear(g, g, jnp.ones((8,)))
        with self.assertRaisesRegex(ValueError, "weight.dtype=bfloat16 must match gate.dtype="
                                                "float32"):
            jaxfuse.swiglu_linear(g, g, jnp.ones((8, 4), jnp.bfloat16))
        with self.assertRaisesRegex(ValueError, "up \\(shape=\\(3, 7\\)"):
            jaxfuse.swiglu_linear(g, jnp.ones((3, 7)), jnp.ones((8, 4)))


if __name__ == "__main__":
    pytest.main([__file__])
