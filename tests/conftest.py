"""Test-wide settings: float32 matmuls at full precision so tolerances mean what they say, the
hypothesis profiles of tests/test_properties.py, tests/multidevice left to its own process, and
compile-time savings for the interpreted kernels that leave what runs unchanged.

* "ci" (default): derandomized (a fixed seed: the same examples on every run), few examples
  per test, no deadline (interpret-mode kernels compile on first use), no example database.
* "deep": `HYPOTHESIS_PROFILE=deep [HYPOTHESIS_MAX_EXAMPLES=N] pytest tests/test_properties.py`
  searches with fresh randomness for N examples per test (default 500) and keeps failures in
  hypothesis' example database (.hypothesis/), which replays them first on the next run; pin
  each one as an `@example` too.
"""
import importlib.metadata
import importlib.util
import os
import pkgutil
import threading


def _no_accelerator_plugin() -> bool:
    """True where jax can only start its CPU backend: JAX_PLATFORMS=cpu, or no PJRT plugin (CUDA,
    ROCm, ...) installed, found the ways jax itself looks for them (the `jax_plugins`
    namespace package and the `jax_plugins` entry points)."""
    if os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
        return True
    spec = importlib.util.find_spec("jax_plugins")
    if spec is not None and any(pkgutil.iter_modules(spec.submodule_search_locations or [])):
        return False
    return not list(importlib.metadata.entry_points(group="jax_plugins"))


def _release_before(package: str, major: int, minor: int) -> bool:
    """Whether the installed `package` is older than major.minor, read without importing it
    (jaxlib's version decides an XLA flag before jax starts). False when unknown: the
    version-gated settings below are then left off."""
    try:
        version = importlib.metadata.version(package).split(".")
        return (int(version[0]), int(version[1])) < (major, minor)
    except (importlib.metadata.PackageNotFoundError, ValueError, IndexError):
        return False


# XLA:CPU compiles the interpreted kernels faster (see `_fast_cpu_compiles`). The emitter flag
# is read once, when jax starts its backend, so it is set here (the multidevice subprocess
# inherits it through the environment), and only where jax can start nothing but its CPU
# backend, so a GPU run of this suite compiles as it always did.
# jaxlib 0.11's XLA no longer has the flag, and XLA aborts the process on a flag it does not
# know ("Unknown flag in XLA_FLAGS", seen on the device machine's jax 0.11.2 with
# JAX_PLATFORMS=cpu: every test worker died): it is set for the jaxlib releases that read it.
_CPU_XLA_FLAGS = (("--xla_cpu_use_fusion_emitters=false",) if _release_before("jaxlib", 0, 11)
                  else ())
# Mosaic GPU's interpreter runs a CTA's warpgroups as Python threads, each executing its
# compiled body, whose barrier waits are io_callbacks that block until every warpgroup has
# arrived. XLA:CPU runs some of those callbacks on its intra-op thread pool, one thread a core
# by default: on a 2-core machine two blocked waits filled the pool, the third warpgroup's
# callback queued behind them and the suite hung (seen once in s23, test_attention_hopper's
# forward: 4 warpgroups, 2 waiting on the pool's 2 threads, 1 queued). A pool of 16 threads
# (read by XLA's CPU client when it starts, from PJRT_NPROC) leaves a free thread for every
# warpgroup of the largest CTA (4) twice over; idle threads cost nothing.
_CPU_POOL_THREADS = "16"
# A compilation cache for this run alone: a fresh folder made by the first process to load
# this file (pytest itself; with -n, before it starts its workers, which inherit it, as the
# multidevice subprocess does) and removed when that process exits. Tests compile many of the
# same programs (a kernel at the same shapes under different tests and processes), and XLA:CPU
# takes those from the folder instead of compiling them again. The key is the program with its
# compile options, so what runs is the executable a fresh compile gives. Measured on 2 cores
# (s43, -n 2): test_attention_hopper_bwd.py 118 -> 103 s, test_hardening.py and
# test_model_scale.py 142 -> 122 s. A JAX_COMPILATION_CACHE_DIR already set is used as it is.
if _no_accelerator_plugin():
    _flags = os.environ.get("XLA_FLAGS", "").split()
    os.environ["XLA_FLAGS"] = " ".join(_flags + [f for f in _CPU_XLA_FLAGS if f not in _flags])
    os.environ.setdefault("PJRT_NPROC", _CPU_POOL_THREADS)
    if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        import atexit
        import shutil
        import tempfile
        _cache = tempfile.mkdtemp(prefix="jaxfuse-test-compiles-")
        atexit.register(shutil.rmtree, _cache, ignore_errors=True)
        os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
        # Every program, however small or quick to compile (jax skips those by default).
        os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
        os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def _compile_interpreted_threads_once():
    """Mosaic GPU's interpreter (jax 0.10.2) runs each simulated thread of a kernel as a jitted
    program of the kernel body (`thread_map._run_jaxpr`), but jits a fresh closure each time, so
    every thread of every grid point of every call recompiled the same body: 107 XLA compiles
    (100 s of CPU) for one Hopper LCE backward. Here each body (the same jaxpr object, the same
    argument types) is compiled once and its executable reused by every thread, grid point and
    call; the thread id is an argument, so what runs is unchanged. If the private function is
    not there (another jax), the interpreter is left as it is: slower, not different."""
    try:
        from jax._src.pallas.mosaic.interpret import thread_map
    except ImportError:
        return
    if getattr(thread_map, "_run_jaxpr", None) is None:
        return
    cache, lock = {}, threading.Lock()

    def run_jaxpr(jaxpr, consts, *args):
        key = (jaxpr, tuple(jax.typeof(a) for a in jax.tree.leaves((consts, args))))
        with lock:
            entry = cache.setdefault(key, [threading.Lock(), None])
        with entry[0]:                    # the other threads wait for the one compile
            if entry[1] is None:
                def run(consts, *args):
                    jax.core.eval_jaxpr(jaxpr, consts, *args)
                entry[1] = jax.jit(run).trace(consts, *args).lower().compile()
        entry[1](consts, *args)

    thread_map._run_jaxpr = run_jaxpr


_compile_interpreted_threads_once()


def _interpreter_callbacks_on_numpy():
    """Mosaic GPU's interpreter (jax 0.10 / 0.11) does every simulated memory operation, barrier
    and allocation in a host callback (`gpu_callbacks`), which XLA hands NumPy arrays. jax's
    `io_callback_impl` first puts them on the CPU device as jax Arrays, and the callbacks then
    read them back element by element (`int(x)`, iterating a key array, slicing it), each an
    eager jax operation: a py-spy profile of a Hopper backward test put ~40% of its CPU in
    those conversions (two tests of test_attention_hopper_bwd.py: 74 -> 47 s; NOTES s46).
    Here those callbacks alone take the NumPy arrays as they come; their bodies are
    NumPy-compatible (ints, shapes, dtypes, `np.array(val)` into the simulated
    memories) and their results go back through `np.asarray` as before, so what the kernels
    compute is unchanged. Any other io_callback keeps jax's own path; jax 0.11 and any jax
    without these private names keep the interpreter as it is: slower, not different."""
    if not _release_before("jax", 0, 11):
        # jax 0.11's interpreter takes no NumPy array where it counts on a jax one
        # (`shared_memory._to_int`: "Unsupported type: <class 'numpy.ndarray'>", seen on the
        # device machine's 0.11.2), so there it keeps jax's path.
        return
    try:
        from jax._src import callback as jax_callback
        from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    except ImportError:
        return
    impl = getattr(jax_callback, "io_callback_impl", None)
    if impl is None or getattr(impl, "_jaxfuse_numpy", False):
        return
    import numpy as np

    def io_callback_impl(*args, callback, **params):
        func = getattr(callback, "callback_func", None)
        if getattr(getattr(func, "func", func), "__module__", None) != gpu_callbacks.__name__:
            return impl(*args, callback=callback, **params)
        return jax.tree.map(np.asarray, callback(*(np.asarray(a) for a in args)))

    io_callback_impl._jaxfuse_numpy = True
    jax_callback.io_callback_impl = io_callback_impl


_interpreter_callbacks_on_numpy()

def pytest_configure(config):
    config.addinivalue_line(
        "markers", "xla_optimized: compile with XLA's optimizations on a CPU (a test whose time "
                   "goes to running long programs, not to compiling kernels; see conftest)")


@pytest.fixture(autouse=True)
def _fast_cpu_compiles(request):
    """Interpret mode turns each kernel into a large XLA program that then runs once or twice on
    tiny arrays, so most of a test's time went to XLA:CPU compiling it, in its MLIR fusion
    emitters and LLVM's optimization passes. With XLA's older elemental emitters (XLA_FLAGS
    above) and `jax_disable_most_optimizations` (LLVM -O0, no expensive passes) XLA compiles the
    same HLO programs 3-5x faster: the same ops in float32 with no fast-math either way
    (XLA:CPU's default), exp, tanh and the like from the elemental emitters' own float32
    approximations; the tolerances are unchanged, every test passes and kernel mutations are
    still caught. The plainer machine code runs 2-3x slower, which only tests marked
    `xla_optimized` (long training loops) notice: those compile as before. CPU backend only."""
    if jax.default_backend() != "cpu" or request.node.get_closest_marker("xla_optimized"):
        yield
        return
    jax.config.update("jax_disable_most_optimizations", True)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", False)

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


# Longest first. `-n 2` (pytest-xdist's load scheduling) hands the tests out in collection
# order, so a long test collected late ran alone at the end while the other worker sat idle:
# the multidevice suite (tests/test_sharding.py, one test of ~4 minutes) is alphabetically
# near the end. Each entry moves the tests whose id contains it to the front (in this order,
# each group in its own order); nothing is skipped or added.
_SLOW_FIRST = ("tests/test_sharding.py", "test_linear_cross_entropy.py::HopperTest",
               "test_model.py::test_short_likesworld_run", "tests/test_attention_hopper",
               "tests/test_model_scale.py", "tests/test_model.py", "tests/test_properties.py")


def pytest_collection_modifyitems(items):
    def rank(item):
        return next((i for i, part in enumerate(_SLOW_FIRST) if part in item.nodeid),
                    len(_SLOW_FIRST))
    items.sort(key=rank)
