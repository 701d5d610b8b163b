"""The one row kernel behind `dropout`, `bias_dropout_add` and `bias_act_dropout`:

    out = [residual +] dropout(act(x [+ bias]))

in one read of x (and residual) and one write, the dropout mask generated in the kernel from
(key, element index) by Philox (`jaxfuse._philox`) and never stored (LightSeq's bias + dropout +
residual and bias + activation + dropout kernels, lecture 10 sec. 2.3 and 3; unfused that is
three to four kernels and two to three stored intermediates, plus the mask).

Backward (`custom_vjp`, saves x only when there is an activation to differentiate): one kernel
regenerates the mask and writes dx = dy * keep / p * act'(x + bias), summing dbias over
rows in the same pass (per-group float32 partial rows, as the norms' dweight: no atomics);
d residual = dy needs no kernel.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from jaxfuse import _philox
from jaxfuse.pallas import _common as C
from jaxfuse.pallas import _rng, _rows
from jaxfuse.pallas._rows import RowBlocks
from jaxfuse.reference.bias_act_dropout import GELU_TANH_FLAT

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_LOG2_E = math.log2(math.e)
# Abramowitz and Stegun 7.1.26: erf(x) = 1 - t (a1 + t (a2 + t (a3 + t (a4 + t a5)))) e^{-x^2},
# t = 1 / (1 + p |x|), odd in x, |error| <= 1.5e-7 (Handbook of Mathematical Functions, 1964).
_AS_P = 0.3275911
_AS_A = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)


def normal_cdf2(z, recip=C.exact_recip):
    """(1 + erf(z / sqrt 2), e^{-z^2 / 2}): twice the normal CDF of z, and the Gaussian, in
    float32 from + - *, one reciprocal and one exp2 (Pallas's Triton lowering has no erf).
    A and S 7.1.26 gives erfc(|x|) = t poly(t) e^{-x^2} itself, so 1 + erf(x) = erfc(-x) takes no
    cancellation for x < 0: gelu's tail keeps its relative accuracy (0.4% down to z = -6, 1.2%
    at -8, 3.4% at -12: the fit's own; 1 + an erf near -1 lost it: 86% at z = -5 with the
    rational fit of Eigen's float32 erf that these kernels used before), and e^{-z^2 / 2} is
    the Gaussian that gelu's derivative takes as well; x = z / sqrt 2 is folded into the
    constants. bias_act_dropout (gelu) is bound by instruction issue on an H200: SASS a
    32-element thread, forward 1256 -> 1160, backward 1784 -> 1336 against the rational fit
    and libdevice's expf; fwd+bwd 0.340 -> 0.275-0.289 ms at [16384, 4096] bf16 in three runs
    (benchmarks/NOTES.md s27). `recip` (`_common.recip`): the regime's 1 / x; the denominator
    lies in [1, inf)."""
    # exp2: libdevice's exp2f, one MUFU.EX2 with its range fix-ups; expf took ~8 more
    g = jnp.exp2(z * (z * (-0.5 * _LOG2_E)))
    t = recip(1.0 + (_AS_P / math.sqrt(2.0)) * jnp.abs(z))
    poly = jnp.float32(_AS_A[-1])
    for a in _AS_A[-2::-1]:
        poly = poly * t + a
    c = t * poly * g                                         # erfc(|z| / sqrt 2)
    return jnp.where(z < 0.0, c, 2.0 - c), g


def _sigmoid(z, recip=C.exact_recip):
    return recip(1.0 + jnp.exp(-z))


def _tanh_gate(z, recip):
    """gelu_tanh's 0.5 (1 + tanh(y)) = sigmoid(2 y), y = sqrt(2 / pi) (z + 0.044715 z^3), by one
    exp2 and one reciprocal, with no cancellation where tanh(y) nears -1 (the tail keeps its
    relative accuracy). Against libdevice's tanhf: SASS a 32-element thread forward 1392 ->
    896, backward 1744 -> 1208; on an H200 fwd+bwd 0.245 ms at [16384, 4096] bf16, 2.47x XLA's
    jax.nn.gelu(approximate=True) composition (benchmarks/NOTES.md s27). Returns (the gate,
    dy/dz)."""
    z2 = z * z
    s = recip(1.0 + jnp.exp2((z + 0.044715 * z2 * z) * (-2.0 * _SQRT_2_OVER_PI * _LOG2_E)))
    return s, _SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * z2)


def act(name: str | None, z, recip=C.exact_recip):
    """The activation, as `jax.nn` defines it; `recip` as `normal_cdf2`'s."""
    if name is None:
        return z
    if name == "gelu":
        return 0.5 * z * normal_cdf2(z, recip)[0]
    if name == "gelu_tanh":
        return z * _tanh_gate(z, recip)[0]
    if name == "relu":
        return jnp.maximum(z, 0.0)
    return z * _sigmoid(z, recip)                                # silu


def act_grad(name: str, z, recip=C.exact_recip):
    """d act / dz (the backward recomputes it from x; nothing but x is saved)."""
    if name == "gelu":
        e, g = normal_cdf2(z, recip)
        return 0.5 * e + z * _INV_SQRT_2PI * g
    if name == "gelu_tanh":
        # Past |z| = 20 the gate is 0 or 1 in float32 (2y > 600) and the slope its limit; the
        # clamp keeps z^2 in y' finite there (at |z| ~ 1e19 it was inf times s (1 - s) = 0: NaN).
        z = jnp.clip(z, -GELU_TANH_FLAT, GELU_TANH_FLAT)
        s, dy = _tanh_gate(z, recip)                   # d/dz z s(2y) = s + 2 z s (1 - s) y'
        return s + 2.0 * z * s * (1.0 - s) * dy
    if name == "relu":
        return (z > 0.0).astype(jnp.float32)
    s = _sigmoid(z, recip)
    return s * (1.0 + z * (1.0 - s))                             # silu


def swiglu(g, u):
    """silu(gate) * up on float32 tiles: the one formula of both SwiGLU kernels (Triton and
    Mosaic GPU), so that the backward's rebuilt product is the forward's."""
    return act("silu", g) * u


def swiglu_grads(g, u, dy, with_product: bool = False) -> tuple:
    """(dgate, dup), and with `with_product` silu(gate) * up, on float32 tiles: `act` and
    `act_grad`'s silu formulas on one sigmoid (the product bitwise `swiglu`'s)."""
    s = _sigmoid(g)
    silu = g * s
    grads = (dy * u * (s * (1.0 + g * (1.0 - s))), dy * silu)
    return (*grads, *((silu * u,) if with_product else ()))


@dataclasses.dataclass(frozen=True)
class _Static:
    activation: str | None
    rate: float            # 0.0: no dropout, no RNG work
    has_bias: bool
    has_residual: bool
    fwd_blocks: RowBlocks
    bwd_blocks: RowBlocks
    interpret: bool
    name: str


def drop(tile: _rows.Tile, x, rate: float, interpret: bool):
    """Inverted dropout of x [br, bc], the values of the tile's elements: one Philox call per 8
    elements of a tile of whole 32-column blocks (`_rng.keep_tile`)."""
    rows = tile.row0 + jax.lax.broadcasted_iota(jnp.int32, (x.shape[-2], 1), 0)
    return _rng.drop_tile(x, tile.key, rows, tile.col0, rate, interpret)


def _forward(x2, bias, res2, key_w, st: _Static):
    tiled = [x2] + ([res2] if st.has_residual else [])

    def emit(tile):
        z = tile.x[0] + tile.per_col[0] if st.has_bias else tile.x[0]
        z = act(st.activation, z, C.recip(st.interpret))
        if st.rate:
            z = drop(tile, z, st.rate, st.interpret)
        if st.has_residual:
            z = z + tile.x[1]
        return (z,), (), ()

    (out,) = _rows.map_pass(
        emit, tiled=tiled, fills=[0.0] * len(tiled), per_col=[bias] if st.has_bias else [],
        out_dtypes=(x2.dtype,), blocks=st.fwd_blocks, name=f"jaxfuse_{st.name}_fwd",
        interpret=st.interpret, key=key_w if st.rate else None)
    return out


def _backward(x2, bias, key_w, dy2, st: _Static):
    """(dx, dbias or None)."""
    if not (st.rate or st.activation or st.has_bias):
        return dy2, None
    tiled = [dy2] + ([x2] if st.activation else [])

    def emit(tile):
        g = tile.x[0]
        if st.rate:
            g = drop(tile, g, st.rate, st.interpret)
        if st.activation:
            z = tile.x[1] + tile.per_col[0] if st.has_bias else tile.x[1]
            g = g * act_grad(st.activation, z, C.recip(st.interpret))
        return (g,), (), ((g,) if st.has_bias else ())

    needs_x = bool(st.activation)
    dx, *sums = _rows.map_pass(
        emit, tiled=tiled, fills=[0.0] * len(tiled),
        per_col=[bias] if (st.has_bias and needs_x) else [], out_dtypes=(dy2.dtype,),
        n_col_sums=int(st.has_bias), blocks=st.bwd_blocks, name=f"jaxfuse_{st.name}_bwd",
        interpret=st.interpret, key=key_w if st.rate else None)
    return dx, (jnp.sum(sums[0], axis=0) if st.has_bias else None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _fused(x2, bias, res2, key_w, st: _Static):
    return _forward(x2, bias, res2, key_w, st)


def _fused_fwd(x2, bias, res2, key_w, st):
    return _forward(x2, bias, res2, key_w, st), (x2 if st.activation else None, bias, key_w)


def _fused_bwd(st, saved, dy2):
    x2, bias, key_w = saved
    dx, dbias = _backward(x2, bias, key_w, dy2, st)
    dbias = None if bias is None else dbias.astype(bias.dtype)
    dres = dy2 if st.has_residual else None
    key_ct = None if key_w is None else jnp.zeros(key_w.shape, jax.dtypes.float0)
    return dx.astype(dy2.dtype), dbias, dres, key_ct


_fused.defvjp(_fused_fwd, _fused_bwd)


def apply(x, bias, residual, *, activation: str | None, rate: float, key, name: str,
          interpret: bool | None, block_sizes: RowBlocks | None, key_w=None) -> jax.Array:
    """Shared wrapper (inputs already validated): rows view, blocks, key words, run. `key_w`
    instead of `key`: the key's words, with a shard's row map (`_rng.shard_rows`)."""
    interpret = C.resolve_interpret(interpret)
    rate = float(rate) if _philox.active(rate, key if key_w is None else key_w) else 0.0
    x2 = _rows.as_rows(x)
    n_rows, n_cols = x2.shape
    fwd = _rows.resolve_blocks(block_sizes, n_rows, n_cols, interpret)
    bwd_blocks = block_sizes
    if block_sizes is None and activation and not interpret:
        # A backward with an activation holds x's tile, its derivative and the dbias sums:
        # at 1 x 4096 with 4 warps 206-222 registers a thread (relu, gelu, gelu_tanh; silu
        # 168), at 2 x 2048 123-168 (sass_report.py): 3-4 programs a multiprocessor instead
        # of 2. bias_act_dropout (gelu) fwd+bwd 0.490 -> 0.426-0.447 ms on an H200
        # ([16384, 4096] bf16, benchmarks/NOTES.md s24 item 4); the forward keeps its tile.
        if fwd.block_cols >= 4096:        # fwd: the rule's tile (no block_sizes given)
            bwd_blocks = RowBlocks(2 * fwd.block_rows, fwd.block_cols // 2, fwd.num_warps)
    # The backward's dbias sums: 8 programs a multiprocessor (~16 rows each at 16384 rows)
    # instead of the norms' 2 (~63): with the mask's cheaper exchange (NOTES s25 item 3) the
    # pass waits on its loads, and more programs hide them. fwd+bwd on an H200 (s25-8/9):
    # bias_dropout_add 0.310 -> 0.285-0.287 ms at [16384, 4096]; at [16384, 1024] and for
    # bias_act_dropout the settings moved less than the runs' spread.
    bwd = _rows.resolve_blocks(bwd_blocks, n_rows, n_cols, interpret,
                               accumulate_rows=bias is not None, programs_per_sm=8)
    st = _Static(activation, rate, bias is not None, residual is not None, fwd, bwd, interpret,
                 name)
    if key_w is None:
        key_w = _philox.key_words(key) if rate else None
    res2 = None if residual is None else _rows.as_rows(residual)
    return _fused(x2, bias, res2, key_w, st).reshape(x.shape)
