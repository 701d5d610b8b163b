"""Test-wide settings: float32 matmuls at full precision so tolerances mean what they say, and
the hypothesis profiles of tests/test_properties.py, and tests/multidevice left to its own
process.

* "ci" (default): derandomized (a fixed seed: the same examples on every run), few examples
  per test, no deadline (interpret-mode kernels compile on first use), no example database.
* "deep": `HYPOTHESIS_PROFILE=deep [HYPOTHESIS_MAX_EXAMPLES=N] pytest tests/test_properties.py`
  searches with fresh randomness for N examples per test (default 500) and keeps failures in
  hypothesis' example database (.hypothesis/), which replays them first on the next run; pin
  each one as an `@example` too.
"""
import os

import jax
from hypothesis import HealthCheck, settings

jax.config.update("jax_default_matmul_precision", "highest")

_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile("ci", derandomize=True, max_examples=6, deadline=None,
                          database=None, suppress_health_check=_SLOW_OK, print_blob=True)
settings.register_profile("deep", max_examples=int(os.environ.get("HYPOTHESIS_MAX_EXAMPLES", 500)),
                          deadline=None, suppress_health_check=_SLOW_OK, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# tests/multidevice needs 8 virtual CPU devices, which XLA fixes when the backend starts: it runs
# in a process of its own, started by tests/test_sharding.py with JAXFUSE_MULTIDEVICE=1.
if os.environ.get("JAXFUSE_MULTIDEVICE") != "1":
    collect_ignore = ["multidevice"]
