"""The fixed-point sum behind the deterministic fused dQ (`jaxfuse.pallas._fixed_sum`): the
rows' scales bound every partial sum, the integer total is the same in any order and close to
the float32 one, the rows that must be NaN are found, and the masks' key ranges are exact
(`_attn.visible_max`). The kernel that uses it: tests/test_attention_hopper_bwd.py
and test_attention_garbage.py (interpreted), test_gpu_lowering.py, benchmarks/attention_bwd.py
`fixed` (compiled)."""
import numpy as np
import jax
import jax.numpy as jnp
import pytest

from jaxfuse.pallas import _fixed_sum as FS
from jaxfuse.pallas._attn import AttnSpec, visible_max
from jaxfuse.reference._masks import keep_mask


def _spec(tq, tk, d=16, groups=1, **masks):
    return AttnSpec.make(n_q=tq, n_k=tk, head_dim=d, groups=groups, dtype=jnp.bfloat16,
                         scale=None, interpret=False, **masks)


def _keep(tq, tk, causal=False, window=None):
    return np.asarray(keep_mask(np.arange(tq)[:, None], np.arange(tk)[None, :], n_q=tq, n_k=tk,
                                causal=causal, window=window))


@pytest.mark.parametrize("tq,tk", [(1, 1), (13, 5), (5, 300), (200, 333), (300, 129)])
@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, 7),
                                           (True, 1), (True, 200)])
def test_visible_max_is_the_masks(tq, tk, causal, window):
    """Each row's max over the keys the causal and window masks let it see, against the masks
    themselves: exact (prefix, suffix and sparse-table paths, ragged blocks), also of rare
    0/1 flags (whether a row sees a flagged key)."""
    rng = np.random.default_rng(tq * 1000 + tk)
    x = rng.random((2, tk, 3)).astype(np.float32)
    x[1] = rng.random((tk, 3)) < 0.05
    keep = _keep(tq, tk, causal, window)[None, :, :, None]
    spec = _spec(tq, tk, causal=causal, window=window)
    np.testing.assert_array_equal(visible_max(jnp.asarray(x), spec, axis=1),
                                  np.where(keep, x[:, None], 0).max(2))


def _problem(seed, tq, tk, hq, hkv, d, causal, window, outlier=None):
    """q, k, v, do (float32, [B, T, H, D]), dlse, and the reference's dS [B, Hq, Tq, Tk],
    delta and natural lse ([B, Hq, Tq])."""
    ks = jax.random.split(jax.random.key(seed), 5)
    q, do = (jax.random.normal(x, (1, tq, hq, d)) for x in (ks[0], ks[3]))
    k, v = (jax.random.normal(x, (1, tk, hkv, d)) for x in (ks[1], ks[2]))
    if outlier is not None:
        k = k.at[:, tk // 3].multiply(outlier)
    dlse = jax.random.normal(ks[4], (1, hq, tq))
    g = hq // hkv
    kk, vv = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, kk) / np.sqrt(d)
    keep = _keep(tq, tk, causal, window)
    s = jnp.where(keep, s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    p = jnp.where(keep, jnp.exp(s - lse[..., None]), 0.0)
    o = jnp.einsum("bhqk,bkhd->bqhd", p, vv)
    dp = jnp.einsum("bqhd,bkhd->bhqk", do, vv)
    delta = jnp.einsum("bqhd,bqhd->bhq", do, o) - dlse
    ds = p * (dp - delta[..., None])
    return q, k, v, do, kk, ds, delta, lse


@pytest.mark.parametrize("causal,window,outlier", [(True, None, None), (False, None, None),
                                                   (True, 50, None), (True, None, 1e3)])
def test_scales_bound_every_partial_sum_and_keep_the_digits(causal, window, outlier):
    """r_i is a power of two, and with it the key tiles' scaled partials of row i (tiles of
    8 keys: many partials), summed in absolute value, stay within 2^30: every partial sum, in
    any order, fits int32. And the bound is within 2^8 of S_i = max_d sum_j |dS_ij K_jd|, the
    sum of the terms' sizes (a unit at most 2^-22 of it; measured: 2^6.2), or c 2^8 beside a
    visible key c = 10^3 times the others (`_fixed_sum`'s precision paragraph). (Not of
    |dQ_i| itself: the terms cancel, sum_j dS_ij = dlse_i.)"""
    tq, tk, hq, hkv, d = 96, 160, 4, 2, 16
    spec = _spec(tq, tk, d, hq // hkv, causal=causal, window=window)
    q, k, v, do, kk, ds, delta, lse = _problem(0, tq, tk, hq, hkv, d, causal, window, outlier)
    r, bad = FS.row_scales(k, v, do, delta, lse / spec.unit, spec)
    assert not bool(bad.any())
    e = np.log2(np.asarray(r))
    np.testing.assert_array_equal(e, np.round(e))
    parts = spec.scale * jnp.einsum("bhqtk,btkhd->bhqtd", ds.reshape(ds.shape[:3] + (-1, 8)),
                                    kk.reshape(1, -1, 8, hq, d))        # [B, Hq, Tq, tiles, D]
    scaled = jnp.abs(parts) * r[..., None, None]
    assert float(scaled.sum(3).max()) <= 2.0 ** FS.BITS
    terms = jnp.einsum("bhqk,bkhd->bhqd", jnp.abs(ds), jnp.abs(kk)).max(-1) * r
    loose = float(FS.BITS - np.log2(np.asarray(terms)).min())
    assert loose < 8 + (0 if outlier is None else np.log2(outlier)), loose


def test_integer_total_is_order_free_and_near_the_float_sum():
    """The quantized partials summed in two orders (int32, wrapping) give the same bits, and
    to_float of the total is within a unit a partial of the float64 sum."""
    tq, tk, hq, d = 64, 96, 2, 16
    spec = _spec(tq, tk, d, causal=True)
    q, k, v, do, kk, ds, delta, lse = _problem(1, tq, tk, hq, hq, d, True, None)
    r, bad = FS.row_scales(k, v, do, delta, lse / spec.unit, spec)
    parts = spec.scale * jnp.einsum("bhqtk,btkhd->tbqhd", ds.reshape(ds.shape[:3] + (-1, 8)),
                                    kk.reshape(1, -1, 8, hq, d))        # [tiles, B, Tq, Hq, D]
    rows = jnp.swapaxes(r, 1, 2)[..., None]
    ints = np.asarray(FS.quantize(parts * rows))
    perm = np.random.default_rng(0).permutation(ints.shape[0])
    with np.errstate(over="ignore"):
        a = ints.sum(0, dtype=np.int32)
        b = ints[perm].sum(0, dtype=np.int32)
    np.testing.assert_array_equal(a, b)
    got = np.asarray(FS.to_float(jnp.asarray(a), r, bad, jnp.float32), np.float64)
    want = np.asarray(parts, np.float64).sum(0)
    unit = 1.0 / np.asarray(rows, np.float64)
    assert (np.abs(got - want) <= ints.shape[0] * unit).all()


def test_bad_rows_are_the_rows_that_see_a_non_finite_value():
    """NaN after the sum exactly where the float32 one would not be finite: rows that see a
    key whose K or V holds a non-finite entry (not the rows the masks hide it from), rows
    whose lse is NaN or whose delta is not finite; a row that sees no key (lse -inf) is
    not."""
    tq, tk, hq, d = 40, 40, 1, 16
    spec = _spec(tq, tk, d, causal=True, window=8)
    q, k, v, do, kk, ds, delta, lse = _problem(2, tq, tk, hq, hq, d, True, 8)
    k = k.at[0, 10, 0, 3].set(-jnp.inf)          # seen by rows 10..17
    v = v.at[0, 30, 0, 0].set(jnp.nan)           # seen by rows 30..37
    lse_u = (lse / spec.unit).at[0, 0, 5].set(jnp.nan).at[0, 0, 39].set(-jnp.inf)
    delta = delta.at[0, 0, 22].set(jnp.inf)
    _, bad = FS.row_scales(k, v, do, delta, lse_u, spec)
    want = np.zeros(tq, bool)
    want[10:18] = want[30:38] = True
    want[[5, 22]] = True
    np.testing.assert_array_equal(np.asarray(bad)[0, 0], want)
    total = jnp.zeros((1, tq, hq, d), jnp.int32)
    out = FS.to_float(total, jnp.ones((1, hq, tq + 24)), jnp.pad(bad, ((0, 0), (0, 0), (0, 24))),
                      jnp.bfloat16)                   # scales padded past the rows, as compiled
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.isnan(np.asarray(out, np.float32)).all(-1)[0, :, 0], want)
