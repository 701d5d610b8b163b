"""The Mosaic GPU interpreter's threads against XLA:CPU's intra-op pool (tests/conftest.py).

A CTA's warpgroups run as Python threads whose barrier waits are io_callbacks that block until
every warpgroup arrives; XLA:CPU runs some of those callbacks on its intra-op pool. With one
pool thread a core, a 2-core machine hung the suite (s23): two waits filled the pool and the
third warpgroup's callback queued behind them. With PJRT_NPROC=1 the hang is certain."""
import glob
import os
import sys

import jax
import jax.numpy as jnp
import pytest
from conftest import _release_before


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc")
def test_xla_cpu_pool_outnumbers_a_ctas_warpgroups():
    if jax.default_backend() != "cpu":
        pytest.skip("the interpreter's pool matters where tests run on the CPU")
    jax.block_until_ready(jax.jit(lambda x: x @ x)(jnp.ones((64, 64))))   # the client is up
    names = [open(f).read().strip() for f in glob.glob(f"/proc/{os.getpid()}/task/*/comm")]
    pool = sum(name.endswith("XLAEigen") for name in names)
    # 4 warpgroups a CTA (a producer and three consumers) all waiting at once, twice over.
    assert pool >= 8, (pool, os.environ.get("PJRT_NPROC"))


@pytest.mark.skipif(not _release_before("jax", 0, 11),
                    reason="conftest hands the interpreter NumPy arrays on jax 0.10 only (0.11's "
                           "interpreter needs jax arrays): nothing patched to check")
def test_only_the_interpreters_callbacks_skip_the_device_copy():
    """conftest hands the Mosaic GPU interpreter's host callbacks XLA's NumPy arrays as they
    come (jax would first put them on the device as jax Arrays, which the callbacks then read
    back element by element). Any other io_callback keeps jax's path: a user's callback still
    gets jax Arrays, under jit and eagerly, and the interpreter's callbacks are still the ones
    the patch recognizes (their module's name)."""
    from jax._src import callback
    from jax.experimental import io_callback

    gpu_callbacks = pytest.importorskip(
        "jax._src.pallas.mosaic_gpu.interpret.gpu_callbacks",
        reason="this jax has no Mosaic GPU interpreter at that path: conftest patches nothing")

    assert getattr(callback.io_callback_impl, "_jaxfuse_numpy", False)
    assert gpu_callbacks.__name__ == "jax._src.pallas.mosaic_gpu.interpret.gpu_callbacks"
    assert gpu_callbacks._get.__module__ == gpu_callbacks.__name__
    seen = []

    def record(x):
        seen.append(type(x))
        return x + 1

    f = lambda x: io_callback(record, jax.ShapeDtypeStruct((3,), jnp.int32), x)
    x = jnp.arange(3, dtype=jnp.int32)
    assert (jax.jit(f)(x) == x + 1).all() and (f(x) == x + 1).all()
    assert seen and all(issubclass(t, jax.Array) for t in seen), seen
