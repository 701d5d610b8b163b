"""Runs tests/multidevice (every op under jax.sharding) in its own process with 8 virtual CPU
devices: XLA reads the device count when its backend starts, so it cannot be set here."""
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_multidevice_suite():
    env = dict(os.environ, JAXFUSE_MULTIDEVICE="1",
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "")
                          + " --xla_force_host_platform_device_count=8").strip(),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.pop("PYTEST_XDIST_WORKER", None)
    try:
        # -vv (over the -q of pyproject's addopts): each test's name is printed as it starts,
        # so a hang names its test.
        run = subprocess.run([sys.executable, "-m", "pytest", "-vv", "-x", "-p", "no:xdist",
                              "tests/multidevice"], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=900)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes)
               else e.stdout or "")
        pytest.fail("tests/multidevice ran past 900 s; its last lines:\n" + out[-3000:])
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
