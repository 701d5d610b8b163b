"""Test-wide settings: float32 matmuls at full precision so tolerances mean what they say."""
import os

import jax

jax.config.update("jax_default_matmul_precision", "highest")

# tests/multidevice needs 8 virtual CPU devices, which XLA fixes when the backend starts: it runs
# in a process of its own, started by tests/test_sharding.py with JAXFUSE_MULTIDEVICE=1.
if os.environ.get("JAXFUSE_MULTIDEVICE") != "1":
    collect_ignore = ["multidevice"]
