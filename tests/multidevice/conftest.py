"""Fails loudly if this directory runs without its 8 virtual devices (see tests/test_sharding.py)."""
import jax


def pytest_collection_modifyitems(config, items):
    if jax.device_count() < 8:
        raise RuntimeError(f"tests/multidevice needs 8 devices, found {jax.device_count()}: run "
                           "it through tests/test_sharding.py (or set XLA_FLAGS="
                           "--xla_force_host_platform_device_count=8 before jax starts)")
