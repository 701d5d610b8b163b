#!/bin/bash
# Session s46: on the device's jax (0.11.2), (1) eager kernel calls through the cached jit
# (`jaxfuse._dispatch`): first and second call times and the second's compiles, results against
# the reference; (2) tests/conftest.py's interpreter patch with the Mosaic GPU interpreter's
# tests on the CPU (JAX_PLATFORMS=cpu, 8 workers).
. "$(dirname "$0")/_lib.sh" "$@"
timeout -s KILL 200 python - <<'PY' 2>&1 | tee "$out/eager.log"
import time, jax, jax.numpy as jnp, numpy as np, jaxfuse
print(jax.__version__, jax.devices()[0].device_kind)
n = [0]
def listen(event, duration, **kw):
    if event == "/jax/core/compile/backend_compile_duration":
        n[0] += 1
jax.monitoring.register_event_duration_secs_listener(listen)
k = jax.random.split(jax.random.key(0), 4)
x = jax.random.normal(k[0], (4096, 4096), jnp.bfloat16)
q, kk, v = (jax.random.normal(kx, (2, 1024, 8, 128), jnp.bfloat16) for kx in k[1:])
for name, f, r in [
        ("softmax", lambda: jaxfuse.softmax(x, causal=True), lambda: jaxfuse.softmax(x, causal=True, impl="reference")),
        ("rms_norm", lambda: jaxfuse.rms_norm(x, x[0]), lambda: jaxfuse.rms_norm(x, x[0], impl="reference")),
        ("flash_attention", lambda: jaxfuse.flash_attention(q, kk, v, causal=True), lambda: jaxfuse.flash_attention(q, kk, v, causal=True, impl="reference"))]:
    ts, cs = [], []
    for i in range(3):
        c = n[0]; t = time.perf_counter(); out = jax.block_until_ready(f()); ts.append(time.perf_counter() - t); cs.append(n[0] - c)
    err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - r().astype(jnp.float32))))
    print(f"eager {name}: " + ", ".join(f"{t*1e3:.2f} ms ({c} compiles)" for t, c in zip(ts, cs)) + f"; max |err| vs reference {err:.3g}")
PY
JAX_PLATFORMS=cpu timeout -s KILL 300 python -m pytest -p no:cacheprovider -q -n 8 \
    tests/test_interpreter_threads.py tests/test_dispatch.py tests/test_attention_hopper_bwd.py \
    tests/test_attention_garbage.py > "$out/cpu_tests.log" 2>&1
echo "cpu tests rc=$?"; tail -3 "$out/cpu_tests.log"
