"""Helpers shared by the tests: random inputs and per-dtype tolerances."""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import parameterized

from jaxfuse import model as M

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
# Absolute/relative tolerance of one output element against the reference run on the same
# (rounded) inputs: a few units in the last place of the dtype.
TOL = {jnp.dtype(jnp.float32): 2e-5, jnp.dtype(jnp.bfloat16): 2e-2, jnp.dtype(jnp.float16): 3e-3}


def reference_tests(check, **axes):
    """Two test methods of a `chex.TestCase` from check(self, dtype=..., **params): the op against
    its reference over the product of `axes` and every dtype under jit, and eagerly over `axes`
    in bf16 alone (eagerly the same kernel bodies run with each op dispatched apart, at about
    twice the time: the suite's time budget; this checks that nothing needs a trace). The
    tests take their names from the functions here (the parameterized and chex decorators
    name what they generate so), whatever the class calls them:

        test_matches_reference_with_grads, test_eager_matches_reference_with_grads = \
            reference_tests(_check, case=CASES, interleaved=[True, False])
    """
    @chex.variants(with_jit=True)
    @parameterized.product(dtype=DTYPES, **axes)
    def test_matches_reference_with_grads(self, dtype, **params):
        check(self, dtype=dtype, **params)

    @chex.variants(without_jit=True)
    @parameterized.product(**axes)
    def test_eager_matches_reference_with_grads(self, **params):
        check(self, dtype=jnp.bfloat16, **params)
    return test_matches_reference_with_grads, test_eager_matches_reference_with_grads


def tol(dtype, scale: float = 1.0) -> dict:
    t = TOL[jnp.dtype(dtype)] * scale
    return dict(atol=t, rtol=t)


def randn(key, shape, dtype=jnp.float32, scale=1.0, shift=0.0):
    return (jax.random.normal(key, shape, jnp.float32) * scale + shift).astype(dtype)


def host_randn(rng: np.random.Generator, shape, dtype=jnp.float32, scale=1.0, shift=0.0):
    """`randn` drawn by NumPy on the host: an eager jax.random draw compiles an XLA program per
    new shape and dtype, much of a test's time where every case has its own shape."""
    return jnp.asarray((rng.standard_normal(shape, np.float32) * scale + shift).astype(dtype))


def keys(seed: int, n: int):
    return list(jax.random.split(jax.random.key(seed), n))


def assert_close(actual, expected, dtype, scale: float = 1.0):
    """Trees close within the dtype's tolerance; NaN only where the reference has NaN."""
    chex.assert_trees_all_close(
        jax.tree.map(lambda a: np.asarray(a, np.float32), actual),
        jax.tree.map(lambda a: np.asarray(a, np.float32), expected), **tol(dtype, scale))


def vjp_both(f_pallas, f_ref, args, ct):
    """Outputs and input cotangents of both implementations for the same random cotangent."""
    y, vjp = jax.vjp(f_pallas, *args)
    y_ref, vjp_ref = jax.vjp(f_ref, *args)
    return (y, vjp(ct)), (y_ref, vjp_ref(ct))


def saved_residuals(f, *args) -> list[str]:
    """The types of the residuals jax.vjp(f, *args) keeps ("f32[4,24]", ...), sorted."""
    import contextlib
    import io
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        jax.ad_checkpoint.print_saved_residuals(f, *args)
    return sorted(line.split(" ")[0] for line in out.getvalue().splitlines())


def kernel_names(jaxpr) -> list[str]:
    """The names of the pallas_calls in a jaxpr and all its sub-jaxprs, in order."""
    import jax.extend
    names = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            names.append(eqn.params["jaxpr"].debug_info.func_name)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            names += kernel_names(sub)
    return names


# jaxfuse.model.apply under one jax.jit (Config and impl static), shared by the model tests:
# one compile per program and config, where eager dispatch compiled each op and each scan
# apart (about twice the CPU).
apply_jit = jax.jit(M.apply, static_argnums=2, static_argnames="impl")


def wide_positions():
    """Yields positions [1, 5] of each type wider than int32, inside the jax_enable_x64 setting
    it needs: uint32 with one past 2^31 (which wraps negative as int32: another angle), then
    int64 under x64 (int64 index literals too). RoPE's kernels read both as float32."""
    for values, dtype in (([0, 1, 2, 3, 2 ** 31 + 5], jnp.uint32), ([0, 7, 2, 900, 5], None)):
        with jax.enable_x64(dtype is None):
            yield jnp.asarray([values], jnp.int64 if dtype is None else dtype)
