import jax
import pytest

from jaxfuse.pallas import _common


def test_interpret_resolution(monkeypatch):
    monkeypatch.delenv("JAXFUSE_INTERPRET", raising=False)
    assert _common.resolve_interpret(None) == (jax.default_backend() == "cpu")
    assert _common.resolve_interpret(True) is True
    assert _common.resolve_interpret(False) is False
    monkeypatch.setenv("JAXFUSE_INTERPRET", "0")
    assert _common.resolve_interpret(None) is False
    monkeypatch.setenv("JAXFUSE_INTERPRET", "1")
    assert _common.resolve_interpret(None) is True
    assert _common.resolve_interpret(False) is False  # an explicit flag wins
    monkeypatch.setenv("JAXFUSE_INTERPRET", "yes")
    with pytest.raises(ValueError, match="JAXFUSE_INTERPRET='yes'"):
        _common.resolve_interpret(None)


def test_keep_mask_bottom_right():
    import jax.numpy as jnp
    q = jnp.arange(3)[:, None]
    k = jnp.arange(5)[None, :]
    keep = _common.keep_mask(q, k, n_q=3, n_k=5, causal=True, window=2)
    # query i sees keys i+1 and i+2 (shift 2, window 2).
    assert keep.astype(int).tolist() == [[0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]]


def _compiles(f):
    """The number of XLA compiles (jax's backend-compile events) while f() runs, and f()."""
    import jax.monitoring
    seen = []

    def listen(event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            seen.append(event)
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        out = jax.block_until_ready(f())
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    return len(seen), out


def test_an_eager_kernel_call_compiles_once_per_shape_and_options():
    """Eager calls run through a jit cached by op and static options (`_dispatch`): the second
    call of the same op, shapes and options compiles nothing (each call compiled its kernel
    again before), an op that binds an option with functools.partial (flash_attention) hits
    too, and options that compare equal but differ (1 and 1.0, 0.0 and -0.0) or that differ
    (causal) never share a program: each result equals the reference's."""
    import numpy as np
    import jaxfuse
    from tests._util import keys, randn
    k = keys(3, 4)
    x = randn(k[0], (6, 37))
    q, kk, v = (randn(kx, (1, 9, 2, 8)) for kx in k[1:])
    # jax 0.11 registers a config value of its own while it traces the first kernel of the
    # process (the trace context grows from 50 to 51 values), so a process's very first
    # kernel is compiled a second time at its next call, whatever the cache; one kernel of
    # another shape is traced first to leave that out of the count.
    jax.block_until_ready(jaxfuse.softmax(randn(k[0], (3, 5))))
    calls = [lambda: jaxfuse.softmax(x, scale=0.5),
             lambda: jaxfuse.flash_attention(q, kk, v, causal=True),
             lambda: jaxfuse.rms_norm(x, x[0])]
    for f in calls:
        first, want = _compiles(f)
        again, got = _compiles(f)
        assert first >= 1 and again == 0, (first, again)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    y = randn(k[0], (4, 6, 6))
    for opts in (dict(causal=False), dict(causal=True), dict(scale=2), dict(scale=2.0),
                 dict(scale=0.0), dict(scale=-0.0)):
        got = jaxfuse.softmax(y, **opts)
        np.testing.assert_allclose(got, jaxfuse.softmax(y, impl="reference", **opts),
                                   rtol=1e-6, atol=1e-7, err_msg=str(opts))
        assert got.dtype == y.dtype
    # under a transformation the call is made as it is (tracers, nothing cached by value)
    g = jax.grad(lambda y: jaxfuse.softmax(y, causal=True)[..., 0].sum())(y)
    r = jax.grad(lambda y: jaxfuse.softmax(y, causal=True, impl="reference")[..., 0].sum())(y)
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)


def test_the_eager_cache_keys_options_by_type_and_sign():
    """Options that compare equal but are not the same (1 and 1.0, True and 1, 0.0 and -0.0)
    never share a cached program: a kernel stand-in that bakes the option's type and sign in
    gives each its own answer; array arguments stay arguments (new values, same program)."""
    import math
    import jax.numpy as jnp
    from jaxfuse import _dispatch

    def fn(x, *, opt, interpret=None, block_sizes=None):
        return x + (10.0 * isinstance(opt, float) + 100.0 * isinstance(opt, bool)
                    + math.copysign(1.0, opt))
    x = jnp.zeros(3)
    got = {repr(o): float(_dispatch._call_kernel(fn, (x,), dict(opt=o))[0])
           for o in (1, 1.0, True, 0.0, -0.0)}
    assert got == {"1": 1.0, "1.0": 11.0, "True": 101.0, "0.0": 11.0, "-0.0": 9.0}, got
    assert float(_dispatch._call_kernel(fn, (x + 5,), dict(opt=1))[0]) == 6.0
