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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc")
def test_xla_cpu_pool_outnumbers_a_ctas_warpgroups():
    if jax.default_backend() != "cpu":
        pytest.skip("the interpreter's pool matters where tests run on the CPU")
    jax.block_until_ready(jax.jit(lambda x: x @ x)(jnp.ones((64, 64))))   # the client is up
    names = [open(f).read().strip() for f in glob.glob(f"/proc/{os.getpid()}/task/*/comm")]
    pool = sum(name.endswith("XLAEigen") for name in names)
    # 4 warpgroups a CTA (a producer and three consumers) all waiting at once, twice over.
    assert pool >= 8, (pool, os.environ.get("PJRT_NPROC"))
