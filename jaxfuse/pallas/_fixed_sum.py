"""Sums whose bits do not depend on the order of their terms: integer addition of fixed point.

The Hopper backward's fused dQ (`attention_hopper_dkv`) adds dQ_i = scale sum_j dS_ij K_j from
every key tile's CTA into one buffer by reducing stores. In float32 the total depends on the
order the adds land in (each add rounds), so the bits change from run to run. Integer addition
is exact and associative: each CTA scales its partial's row i by a power of two r_i, rounds it
to int32 and adds it with an integer reducing store (two's complement; the TMA adds int32 as
well as float32, at the same bytes), and the total is the same in any order; dq_i = total / r_i
afterwards. One kernel forms dQ with dK and dV (5 products a tile pair) and its gradients are
bitwise repeatable, where the float32 one is not and the kernel pair takes 7 products
(`HopperBwdTiles(fixed_dq=True)`; its measurements: `attention_hopper_bwd`'s docstring).

r_i comes from a bound of |dQ_i| computed before the kernel, from its inputs only:
    |dP_ij| = |dO_i . V_j| <= |dO_i| |V_j|                               (2-norms),
    sum_j |dS_ij| = sum_j P_ij |dP_ij - delta_i| <= max_j |dP_ij| + |delta_i|   (sum_j P_ij = 1),
    |dQ_id| <= scale max_j |K_jd| sum_j |dS_ij| <= B_i,
with the maxima over the keys row i sees (`_attn.visible_max`, exact: masked keys' garbage
never enters, so a row's bits do not depend on it), a factor 2 for a + b <= 2 max(a, b) and 2
more for rounding (the bf16 dS, the float32 products, P's sum). r_i = 2^(30 - ceil(log2 B_i)):
every partial, and every partial sum in any order, stays within 2^30 after scaling, so int32
(2^31) never overflows.

Precision: each partial is truncated toward zero, a unit (2^-30 B_i) at most, so with n key
tiles the total is within n units of the float32 sum. What a unit is worth is B_i against
S_i = max_d sum_j |dS_ij K_jd|, the sum of the terms' sizes (the float32 sum's own rounding
is ~2^-24 of it a step; |dQ_i| itself may be far smaller, by cancellation). On random inputs
B_i is ~2^6 times S_i (tests/test_fixed_sum.py), a unit ~2^-24 of S_i; a visible key c times
larger than those row i attends to (one it gives probability ~0) makes B_i c times larger: at
c = 10^3 and n = 64 (8192 keys) the error reaches ~2^-8 of S_i, bfloat16's rounding. The
float32 fused dQ (`deterministic=False`) and the kernel pair (`HopperBwdTiles(fixed_dq=False)`)
have no such loss.

An integer holds no NaN: a row whose float32 sum would not be finite is found from the inputs
instead (`row_scales`' `bad`: a non-finite value in a key or value the row sees, in its dO,
delta or lse, or a bound past 2^156, where a partial's units would exceed float32's range) and
made NaN after the sum, as the kernel pair's dq would be.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from jaxfuse.pallas import _attn as A
from jaxfuse.pallas._attn import AttnSpec

_F32 = jnp.float32
BITS = 30          # |scaled partial sums| <= 2^BITS < 2^31
_EXP = 126         # r_i = 2^e, |e| <= 126: normal float32 both ways


def _pow2(e):
    """2^e, exactly, for integer-valued float32 e in [-126, 127] (the exponent bits)."""
    return lax.bitcast_convert_type(((e.astype(jnp.int32) + 127) << 23), _F32)


def _row_stats(x):
    """(max |x|, an upper bound of the 2-norm) over the last axis of x's finite entries, and
    whether it held a non-finite one: one pass (three reductions of one read). The norm is
    sqrt(sum x^2) where that sum is a normal float32 well inside its range, else sqrt(n)
    max |x| (a sum of squares that overflowed, or underflowed, where a flushed square would
    make it an underestimate). The barrier keeps XLA from moving a later transpose of these
    small results into the reduction, where it transposed all of dO (0.137 ms of the 1B
    model's attention, s38)."""
    x = x.astype(_F32)
    ok = jnp.isfinite(x)
    a = jnp.where(ok, jnp.abs(x), 0.0)
    m, ss = jnp.max(a, axis=-1), jnp.sum(a * a, axis=-1)
    safe = (ss >= 2.0 ** -100) & (ss <= 2.0 ** 120)
    norm = jnp.where(safe, jnp.sqrt(ss), math.sqrt(x.shape[-1]) * m)
    return lax.optimization_barrier((m, norm, jnp.any(~ok, axis=-1)))


def row_scales(k, v, do, delta, lse_u, spec: AttnSpec):
    """(r, bad), both [B, Hq, Tq]: r the float32 power of two each query row's dQ is scaled by
    before it is rounded to int32, bad whether the row's dQ is not finite (module docstring).
    k, v [B, Tk, Hkv, D], do [B, Tq, Hq, D]; delta and lse_u [B, Hq, Tq] as the backward
    kernels read them. Not for segment ids (a row's visible keys are then not a range)."""
    assert not spec.segments
    (ka, _, kbad), (_, vn, vbad) = _row_stats(k), _row_stats(v)
    per_key = jnp.stack([ka, vn, (kbad | vbad).astype(_F32)])           # [3, B, Tk, Hkv]
    # Each row's max over the keys it sees; of the 0/1 flags: whether it sees a bad key.
    mk, mv, seen_bad = A.visible_max(per_key, spec, axis=2)             # [3, B, Tq, Hkv]
    heads = lambda x: jnp.swapaxes(jnp.repeat(x, spec.groups, axis=2), 1, 2)   # [B, Hq, Tq]
    mk, mv, seen_bad = heads(mk), heads(mv), heads(seen_bad) > 0
    _, don, dobad = (jnp.swapaxes(x, 1, 2) for x in _row_stats(do))     # [B, Hq, Tq]
    dp = jnp.log2(don) + jnp.log2(mv)                                   # log2 max |dP_ij|
    # + 1: a + b <= 2 max(a, b); + 1: rounding (bf16 dS, P's sum, the float32 products).
    log_bound = (math.log2(spec.scale) + jnp.log2(mk) + 2
                 + jnp.maximum(dp, jnp.log2(jnp.abs(delta))))
    log_bound = jnp.where(jnp.isnan(log_bound), 0.0, log_bound)      # such a row is bad
    e = jnp.clip(BITS - jnp.ceil(log_bound), -_EXP, _EXP)            # -inf (dQ = 0): 126
    bad = (seen_bad | dobad | ~jnp.isfinite(delta) | jnp.isnan(lse_u) | (lse_u == jnp.inf)
           | (log_bound > BITS + _EXP))
    return _pow2(e), bad


def quantize(x):
    """x (float32, already scaled by its rows' r) as int32, truncated toward zero: at most one
    unit, 2^-BITS of the row's bound, off per partial. Rounding to nearest cost more than it
    is worth (H100, s38, the 1B model's dK/dV kernel: 3.29 ms truncating, 3.45 adding half
    away from zero first, 3.91 by Mosaic GPU's round-to-even; the float32 kernel 3.22)."""
    return x.astype(jnp.int32)


def to_float(total, r, bad, dtype):
    """dq [B, Tq, Hq, D] in `dtype` from the int32 total and `row_scales`' r and bad (which
    may hold more rows, padding, than the total)."""
    # 1 / r, exactly (r is a power of two; 0 in padded rows, which are sliced off).
    inv = 1.0 / jnp.where(r > 0, r, 1.0)
    rows = lambda x: jnp.swapaxes(x[:, :, :total.shape[1]], 1, 2)[..., None]
    dq = total.astype(_F32) * rows(inv)
    return jnp.where(rows(bad), jnp.nan, dq).astype(dtype)
