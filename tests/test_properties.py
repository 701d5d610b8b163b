"""Property-based tests (hypothesis): every op, kernel against reference and against invariants.

Each test draws a shape (0, 1, primes, non-multiples of the tiles), a dtype, the op's options
and a kind of values (normal, 1e4-sized, 1e-4-sized, ties, +-inf entries, all-equal rows, a
NaN), then checks the Pallas kernel against the reference and against what must hold whatever
the values: softmax rows sum to 1 or are all zero, attention with one visible key returns v
exactly and dv = do, losses are finite wherever the maths is, a NaN stays in its row, vmap
equals a loop and jit equals eager.

Profiles (tests/conftest.py): "ci" (default) runs a fixed, derandomized set of examples fast;
`HYPOTHESIS_PROFILE=deep` (with `HYPOTHESIS_MAX_EXAMPLES=N`) searches for as long as one asks
and keeps what it finds in hypothesis' example database. Inputs that once broke an op are
pinned as explicit `@example`s (issue 19's classes).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

import jaxfuse
from tests._util import TOL

DTYPES = st.sampled_from(["float32", "bfloat16", "float16"])
KINDS = ("normal", "large", "small", "ties", "equal", "neginf", "nan")


def _values(seed: int, shape, kind: str, dtype: str, *, scale: float = 1.0) -> jax.Array:
    """Random values of one kind (numpy's generator: drawing them costs no compilation). Finite
    values stay finite in `dtype` (float16's 65504 is reached by 1e4-sized draws: they saturate
    there rather than round to inf); infinities come only from the kinds that ask for them."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32) * scale
    if kind == "large":
        x = x * 1e4
    elif kind == "small":
        x = x * 1e-4
    elif kind == "ties":
        x = rng.integers(-2, 3, shape).astype(np.float32)
    elif kind == "equal" and len(shape):
        x = np.broadcast_to(x[..., :1], shape).copy()
    top = float(jnp.finfo(dtype).max)
    x = np.clip(x, -top, top)
    if kind == "neginf" and x.size:
        x[rng.random(shape) < 0.3] = -np.inf
    elif kind == "posinf" and x.size:
        x[rng.random(shape) < 0.1] = np.inf
    elif kind == "nan" and x.size:
        x.reshape(-1)[rng.integers(x.size)] = np.nan
    return jnp.asarray(x, dtype)


def _close(a, b, dtype: str, scale: float = 1.0):
    """Kernel = reference (trees of arrays) within the dtype's tolerance, NaN and inf at the
    same places."""
    t = TOL[jnp.dtype(dtype)] * scale
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32),
                                   rtol=t, atol=t)

def _close_rows(a, b, dtype: str, scale: float, rounding):
    """`_close`, each row's tolerance widened by `rounding` [rows], the float32 rounding the
    row's maths cannot avoid (derived where it is passed); NaN and inf at the same places."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
    np.testing.assert_array_equal(a[np.isinf(b)], b[np.isinf(b)])
    t = TOL[jnp.dtype(dtype)] * scale
    fin = np.isfinite(b)
    bound = np.broadcast_to((t + np.reshape(rounding, (-1,) + (1,) * (b.ndim - 1))), b.shape)
    err = np.abs(a[fin] - b[fin])
    assert np.all(err <= bound[fin] + t * np.abs(b[fin])), (err.max(), bound[fin].min())


_EPS32 = float(np.finfo(np.float32).eps)


def _close_attention(o, lse, o_r, lse_r, dtype):
    """o within tolerance; lse NaN and -inf exactly where the reference's are, else close."""
    _close(o, o_r, dtype, 2.0)
    np.testing.assert_array_equal(np.isnan(lse), np.isnan(lse_r))
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_r))
    fin = np.isfinite(np.asarray(lse_r))
    np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(lse_r)[fin],
                               rtol=TOL[jnp.dtype(dtype)], atol=TOL[jnp.dtype(dtype)])



# Attention examples compile three kernels each: they run half as many examples as the rest
# (of whichever profile is loaded, see tests/conftest.py).
_HALF = settings(max_examples=max(2, settings().max_examples // 2))


def _cotangent(seed: int, shape, dtype="float32"):
    return _values(seed + 1, shape, "normal", dtype)


# ---------------------------------------------------------------------------------- softmax

@given(rows=st.sampled_from([0, 1, 3]), n=st.sampled_from([1, 7, 33]), dtype=DTYPES,
       kind=st.sampled_from(KINDS + ("posinf",)), causal=st.booleans(),
       seed=st.integers(0, 2 ** 16))
@example(rows=3, n=7, dtype="float32", kind="nan", causal=False, seed=0)       # class 8
@example(rows=0, n=7, dtype="float32", kind="normal", causal=True, seed=0)     # class 2
@example(rows=1, n=33, dtype="float16", kind="large", causal=True, seed=3)     # s54: inf draws
@example(rows=3, n=33, dtype="float32", kind="posinf", causal=True, seed=5)
def test_softmax(rows, n, dtype, kind, causal, seed):
    x = _values(seed, (rows, n), kind, dtype, scale=3.0)
    f = lambda x, impl: jaxfuse.softmax(x, scale=0.7, causal=causal, impl=impl)
    y = f(x, "pallas")
    y_r = f(x, "reference")
    assert y.shape == x.shape and y.dtype == x.dtype
    _close(y, y_r, dtype)
    y32, x32 = np.asarray(y, np.float32), np.asarray(x, np.float32)
    # What each row sees: all of it, or causal (bottom-right) its first i + n - rows entries.
    seen = (np.arange(n)[None] <= np.arange(rows)[:, None] + (n - rows) if causal
            else np.ones((rows, n), bool))
    nan_rows = (np.isnan(x32) & seen).any(-1)
    assert np.all(np.isnan(y32[nan_rows]))           # a NaN it sees stays in its row
    # A +inf it sees (and no NaN) takes the row: NaN where the inf is (inf / inf), 0 elsewhere,
    # as the reference (`_common.finite_shift`).
    inf_at = np.isposinf(x32) & seen & ~nan_rows[:, None]
    inf_rows = inf_at.any(-1)
    assert np.all(np.isnan(y32[inf_at])) and np.all(y32[inf_rows[:, None] & ~inf_at] == 0)
    sums = y32[~nan_rows & ~inf_rows].sum(-1)
    # Every other row sums to 1, or is all zero (every entry masked or -inf).
    ok = np.isclose(sums, 1.0, atol=TOL[jnp.dtype(dtype)] * n) | (sums == 0)
    assert np.all(ok), sums
    if kind in ("normal", "ties", "equal") and rows:
        ct = _cotangent(seed, x.shape, dtype)
        g = jax.vjp(lambda x: f(x, "pallas"), x)[1](ct)
        g_r = jax.vjp(lambda x: f(x, "reference"), x)[1](ct)
        _close(g, g_r, dtype, 2.0)


# ------------------------------------------------------------------------------------ norms

@given(rows=st.sampled_from([0, 1, 5]), n=st.sampled_from([1, 8, 37]), dtype=DTYPES,
       kind=st.sampled_from(("normal", "large", "small", "ties", "equal", "nan")),
       center=st.booleans(), seed=st.integers(0, 2 ** 16))
@example(rows=5, n=37, dtype="float32", kind="large", center=True, seed=3)    # |mean| >> std
def test_norms(rows, n, dtype, kind, center, seed):
    x = _values(seed, (rows, n), kind, dtype)
    if kind == "large":     # LayerNorm's hard case: |mean| >> std (1e4 against 1)
        x = (_values(seed, (rows, n), "normal", "float32") + 1e4).astype(dtype)
    w = _values(seed + 2, (n,), "normal", dtype)
    b = _values(seed + 3, (n,), "normal", dtype)
    if center:
        f = lambda x, w, b, impl: jaxfuse.layer_norm(x, w, b, impl=impl)
    else:
        f = lambda x, w, b, impl: jaxfuse.rms_norm(x, w, impl=impl) + 0 * b
    y, y_r = f(x, w, b, "pallas"), f(x, w, b, "reference")
    assert y.shape == x.shape and y.dtype == x.dtype
    # LayerNorm's y = (x - mean) w / sigma: the mean is rounded at ~eps |x|, whatever the
    # summation (kernel and reference round it differently), and that is divided by sigma =
    # sqrt(var + eps), up to 1/sqrt(1e-5) = 316 for a row of equal values (kind "equal": the
    # exact y is b, and either side misses it by an ulp of the mean times 316 |w|; deep profile,
    # s54). RMSNorm subtracts nothing.
    x32 = np.asarray(x, np.float32)
    rounding = 0.0
    if center and rows and n:
        sigma = np.sqrt(np.nanvar(x32, axis=-1) + 1e-5)
        rounding = (4 * _EPS32 * np.nanmax(np.abs(x32), axis=-1) / sigma
                    * float(np.abs(np.asarray(w, np.float32)).max()))
    _close_rows(y, y_r, dtype, 4.0, rounding)
    nan_rows = np.isnan(np.asarray(x, np.float32)).any(-1)
    assert np.all(np.isnan(np.asarray(y, np.float32)[nan_rows]))
    assert np.all(np.isfinite(np.asarray(y, np.float32)[~nan_rows]))
    if kind in ("normal", "ties") and rows:
        ct = _cotangent(seed, x.shape, dtype)
        g = jax.vjp(lambda *a: f(*a, "pallas"), x, w, b)[1](ct)
        g_r = jax.vjp(lambda *a: f(*a, "reference"), x, w, b)[1](ct)
        _close(g, g_r, dtype, 4.0 * np.sqrt(rows))


# ----------------------------------------------------------------------------- cross-entropy

@given(rows=st.sampled_from([0, 1, 6]), n_cls=st.sampled_from([1, 5, 37]), dtype=DTYPES,
       kind=st.sampled_from(("normal", "large", "small", "ties", "equal", "neginf", "posinf",
                             "nan")),
       smoothing=st.sampled_from([0.0, 0.1]),
       label_dtype=st.sampled_from(["int32", "uint8", "int16"]), seed=st.integers(0, 2 ** 16))
@example(rows=6, n_cls=5, dtype="float32", kind="neginf", smoothing=0.0, label_dtype="int32",
         seed=1)                                                                 # class 1
@example(rows=6, n_cls=37, dtype="float32", kind="normal", smoothing=0.0, label_dtype="uint8",
         seed=2)                                                                 # class 6
@example(rows=6, n_cls=37, dtype="float16", kind="posinf", smoothing=0.0, label_dtype="int32",
         seed=0)                                   # s54: +inf gave NaN where lse is +inf
def test_cross_entropy(rows, n_cls, dtype, kind, smoothing, label_dtype, seed):
    rng = np.random.default_rng(seed)
    x = _values(seed, (rows, n_cls), kind, dtype, scale=3.0)
    labels = rng.integers(0, n_cls, rows)
    labels[rng.random(rows) < 0.25] = -100
    if label_dtype == "uint8":
        labels = np.where(labels < 0, 156, labels)   # -100 wrapped: out of range, not ignored
    labels = jnp.asarray(labels, label_dtype)
    f = lambda x, impl: jaxfuse.cross_entropy(x, labels, label_smoothing=smoothing,
                                              reduction="none", impl=impl)
    loss, loss_r = f(x, "pallas"), f(x, "reference")
    assert loss.dtype == jnp.float32 and loss.shape == (rows,)
    # loss = lse - (1 - a) x_y - a mean(x): terms of the logits' size that cancel (one class:
    # exactly 0), each rounded in float32 at ~eps |x|; with 3e4-sized logits that is ~4e-3,
    # kernel and reference alike (deep profile, s54: n_cls = 1, both within 6e-4 of 0).
    x32 = np.asarray(x, np.float32)
    size = np.nanmax(np.where(np.isfinite(x32), np.abs(x32), 0.0), axis=-1) if n_cls else 0.0
    _close_rows(loss, loss_r, dtype, 4.0, 4 * _EPS32 * size)
    # Finite wherever the maths is: a valid label, no NaN in the row, no -inf at the label
    # (nor anywhere, with smoothing). Never negative.
    lab = np.asarray(labels).astype(np.int64)
    valid = (lab >= 0) & (lab < n_cls)
    ignored = lab == -100
    at_label = x32[np.arange(rows), np.clip(lab, 0, n_cls - 1)] if rows else np.zeros(0)
    # (+inf: lse = +inf, the loss +inf or NaN, as the reference's, checked above)
    finite_maths = valid & ~np.isnan(x32).any(-1) & ~np.isposinf(x32).any(-1) & (
        at_label > -np.inf)
    if smoothing:
        finite_maths &= ~np.isneginf(x32).any(-1)
    loss = np.asarray(loss)
    assert np.all(np.isfinite(loss[finite_maths | ignored]))
    assert np.all(loss[ignored] == 0.0)
    assert np.all(np.isnan(loss[~valid & ~ignored]))
    assert np.all(loss[finite_maths] >= -1e-3 * (1 + np.abs(at_label[finite_maths])))
    if kind in ("normal", "ties", "equal", "neginf") and rows:
        ct = _cotangent(seed, (rows,))
        g = jax.vjp(lambda x: f(x, "pallas"), x)[1](ct)
        g_r = jax.vjp(lambda x: f(x, "reference"), x)[1](ct)
        _close(g, g_r, dtype, 2.0)


@given(rows=st.sampled_from([0, 1, 7]), d=st.sampled_from([8, 16]),
       v=st.sampled_from([1, 7, 33]), dtype=DTYPES, smoothing=st.sampled_from([0.0, 0.1]),
       z_loss=st.sampled_from([0.0, 1e-3]), softcap=st.sampled_from([None, 5.0]),
       seed=st.integers(0, 2 ** 16))
def test_linear_cross_entropy(rows, d, v, dtype, smoothing, z_loss, softcap, seed):
    rng = np.random.default_rng(seed)
    x = _values(seed, (rows, d), "normal", dtype)
    w = _values(seed + 5, (d, v), "normal", dtype, scale=0.5)
    labels = np.asarray(rng.integers(0, v, rows))
    labels[rng.random(rows) < 0.25] = -100
    labels = jnp.asarray(labels)
    kw = dict(label_smoothing=smoothing, z_loss=z_loss, logits_soft_cap=softcap)
    f = lambda x, w, impl: jaxfuse.linear_cross_entropy(x, w, labels, impl=impl, **kw)
    (loss, g), (loss_r, g_r) = (jax.value_and_grad(functools.partial(f, impl=i),
                                                   argnums=(0, 1))(x, w)
                                for i in ("pallas", "reference"))
    assert np.isfinite(float(loss))
    _close(loss, loss_r, dtype, 4.0)
    _close(g, g_r, dtype, 4.0)


# -------------------------------------------------------------------------------- attention

ATTN_SHAPES = st.sampled_from([(1, 1, 1, 1, 1), (1, 5, 7, 2, 1), (2, 17, 17, 2, 2),
                               (1, 7, 5, 4, 2), (1, 0, 5, 2, 1), (1, 3, 0, 2, 2)])


@_HALF
@given(shape=ATTN_SHAPES, dtype=DTYPES, kind=st.sampled_from(("normal", "large", "small",
                                                               "ties", "nan")),
       causal=st.booleans(), window=st.sampled_from([None, 3]),
       softcap=st.sampled_from([None, 4.0]), seed=st.integers(0, 2 ** 16))
@example(shape=(1, 5, 7, 2, 1), dtype="float32", kind="large", causal=False, window=None,
         softcap=None, seed=0)                                                   # classes 3, 4
@example(shape=(1, 3, 0, 2, 2), dtype="float32", kind="normal", causal=True, window=None,
         softcap=None, seed=0)                                                   # class 2
def test_flash_attention(shape, dtype, kind, causal, window, softcap, seed):
    b, tq, tk, hq, hkv = shape[:5]
    d = 16
    # "large": q.k of about 1e4 * 1e4 * sqrt(d) / sqrt(d); the logits reach ~1e8.
    q = _values(seed, (b, tq, hq, d), kind, dtype)
    k = _values(seed + 1, (b, tk, hkv, d), "large" if kind == "large" else "normal", dtype)
    v = _values(seed + 2, (b, tk, hkv, d), "normal", dtype)
    kw = dict(causal=causal, sliding_window=window, logits_soft_cap=softcap, return_lse=True)
    f = lambda q, k, v, impl: jaxfuse.flash_attention(q, k, v, impl=impl, **kw)
    (o, lse), vjp = jax.vjp(functools.partial(f, impl="pallas"), q, k, v)
    (o_r, lse_r), vjp_r = jax.vjp(functools.partial(f, impl="reference"), q, k, v)
    assert o.shape == q.shape and o.dtype == q.dtype and lse.shape == (b, hq, tq)
    _close_attention(o, lse, o_r, lse_r, dtype)
    if kind == "nan":
        return
    do = _cotangent(seed, o.shape, dtype)
    dlse = jnp.where(jnp.isfinite(lse_r), _cotangent(seed + 3, lse.shape), 0.0)
    g, g_r = vjp((do, dlse)), vjp_r((do, dlse))
    for a, a_r in zip(g, g_r):
        assert np.all(np.isfinite(np.asarray(a, np.float32)))
    if kind == "large":
        # P is exact up to rounding of 1e8-sized logits: compare dv, bound the rest by |P| <= 1.
        _close(g[2], g_r[2], dtype, 4.0)
        for a, a_r, ref_in in zip(g[:2], g_r[:2], (k, q)):
            bound = 4 * float(jnp.sum(jnp.abs(do.astype(jnp.float32)))) * (
                float(jnp.max(jnp.abs(ref_in.astype(jnp.float32)), initial=0.0)) + 1)
            assert float(jnp.max(jnp.abs(a.astype(jnp.float32)), initial=0.0)) <= bound
    else:
        _close(g, g_r, dtype, 4.0)


@given(tq=st.sampled_from([1, 4]), hq=st.sampled_from([1, 2]), dtype=DTYPES,
       logit=st.sampled_from([1.0, 1e3, 1e5, 1e7, 3e8]), seed=st.integers(0, 2 ** 16))
@example(tq=4, hq=2, dtype="float32", logit=3e8, seed=0)                       # class 4
def test_attention_one_visible_key(tq, hq, dtype, logit, seed):
    # Tk = 1: every query sees one key, whatever its logit: o = v and dv = sum of do, exactly
    # (P = exp2(0) = 1 in the forward and in the backward).
    d = 16
    q = _values(seed, (1, tq, hq, d), "normal", dtype, scale=float(np.sqrt(logit)))
    k = _values(seed + 1, (1, 1, 1, d), "normal", dtype, scale=float(np.sqrt(logit)))
    v = _values(seed + 2, (1, 1, 1, d), "normal", dtype)
    do = _values(seed + 3, (1, tq, hq, d), "ties", dtype)   # small integers: exact sums
    o, vjp = jax.vjp(jaxfuse.flash_attention, q, k, v)
    np.testing.assert_array_equal(o, jnp.broadcast_to(v, o.shape))
    dv = vjp(do)[2]
    np.testing.assert_array_equal(dv, jnp.sum(do.astype(jnp.float32), axis=(1, 2),
                                              keepdims=True).astype(dtype)[:, :1])


@_HALF
@given(b=st.sampled_from([1, 3]), s=st.sampled_from([0, 1, 13, 40]),
       heads=st.sampled_from([(1, 1), (4, 2), (3, 1)]), dtype=DTYPES,
       kind=st.sampled_from(("normal", "large", "small", "nan")),
       lengths_dtype=st.sampled_from(["int32", "uint32", "uint8"]), seed=st.integers(0, 2 ** 16))
@example(b=3, s=13, heads=(4, 2), dtype="float32", kind="normal", lengths_dtype="uint32",
         seed=0)                                                                 # class 7
def test_decode_attention(b, s, heads, dtype, kind, lengths_dtype, seed):
    hq, hkv = heads
    d = 8
    rng = np.random.default_rng(seed)
    q = _values(seed, (b, hq, d), kind, dtype)
    kc = _values(seed + 1, (b, s, hkv, d), "large" if kind == "large" else "normal", dtype)
    vc = _values(seed + 2, (b, s, hkv, d), "normal", dtype)
    lengths = rng.integers(0, s + 1, b).astype(np.int64)
    lengths[0] = {"int32": s, "uint32": 2 ** 31 + 7, "uint8": 255}[lengths_dtype]  # clips to S
    lengths = jnp.asarray(lengths.astype(lengths_dtype))
    f = lambda impl: jaxfuse.decode_attention(q, kc, vc, lengths, return_lse=True, impl=impl)
    (o, lse), (o_r, lse_r) = f("pallas"), f("reference")
    _close_attention(o, lse, o_r, lse_r, dtype)


# ------------------------------------------------------------------------------- beam top-k

@given(b=st.sampled_from([0, 1, 3]), beams=st.sampled_from([1, 3]), v=st.sampled_from([1, 5, 17]),
       kind=st.sampled_from(("normal", "ties", "equal", "neginf", "nan")),
       k=st.integers(1, 6), seed=st.integers(0, 2 ** 16))
@example(b=3, beams=3, v=17, kind="nan", k=4, seed=0)                           # class 5
def test_beam_top_k(b, beams, v, kind, k, seed):
    k = min(k, beams * v)
    lp = _values(seed, (b, beams, v), kind, "float32")
    scores = _values(seed + 1, (b, beams), "ties", "float32")
    got = jaxfuse.beam_top_k(lp, scores, k)
    want = jaxfuse.beam_top_k(lp, scores, k, impl="reference")
    for a, a_r in zip(got, want):     # identical, NaN and ties included
        np.testing.assert_array_equal(a, a_r)


# ----------------------------------------------------------------------- vmap, jit, eager

@given(kind=st.sampled_from(("normal", "neginf", "ties", "nan")), seed=st.integers(0, 2 ** 16))
def test_vmap_equals_loop_and_jit_equals_eager(kind, seed):
    # One shape (each new shape compiles four variants of each kernel); the values vary.
    x = _values(seed, (3, 2, 7), kind, "float32", scale=2.0)
    labels = jnp.asarray(np.random.default_rng(seed).integers(0, 7, (3, 2)))
    ops = [lambda x, y: jaxfuse.softmax(x, scale=0.5),
           lambda x, y: jaxfuse.cross_entropy(x, y, reduction="none")]
    for op in ops:
        batched = jax.vmap(op)(x, labels)
        looped = jnp.stack([op(x[i], labels[i]) for i in range(3)])
        np.testing.assert_allclose(batched, looped, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(jax.jit(op)(x, labels), op(x, labels), rtol=1e-6, atol=1e-6)
