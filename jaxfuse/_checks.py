"""Input validation shared by the reference and the Pallas versions of every op.

Every check raises `ValueError` naming the offending value and saying how to fix it, before any
kernel is traced, so that bad input never turns into a silent wrong answer or a NaN.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def check_float(name: str, x) -> None:
    check_array(name, x)
    if jnp.dtype(x.dtype) not in [jnp.dtype(d) for d in FLOAT_DTYPES]:
        raise ValueError(f"{name}.dtype={x.dtype} is not supported: pass float32, bfloat16 or "
                         f"float16 (e.g. {name}.astype(jnp.float32))")


def check_ndim(name: str, x, ndim: int | None = None, min_ndim: int = 1) -> None:
    check_array(name, x)
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"{name}.shape={tuple(x.shape)} must have {ndim} axes")
    if x.ndim < min_ndim:
        raise ValueError(f"{name}.shape={tuple(x.shape)} must have at least {min_ndim} axes")


def check_array(name: str, x) -> None:
    """An array (jax or NumPy), not a list: as jax.numpy's own functions, the ops take no
    Python sequences for array arguments."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise ValueError(f"{name} must be an array, got {type(x).__name__} (pass "
                         f"jnp.asarray({name}))")


def check_int(name: str, x) -> None:
    check_array(name, x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"{name}.dtype={x.dtype} must be an integer type (e.g. "
                         f"{name}.astype(jnp.int32))")


def check_vector(name: str, w, n: int, what: str = "the last axis of x") -> None:
    if w is None:
        return
    check_array(name, w)
    if tuple(w.shape) != (n,):
        raise ValueError(f"{name}.shape={tuple(w.shape)} must be ({n},), the length of {what}")
    check_float(name, w)


def check_mask(mask, shape) -> None:
    if mask is None:
        return
    check_array("mask", mask)
    if mask.dtype != jnp.bool_:
        raise ValueError(f"mask.dtype={mask.dtype} must be bool (True = keep); pass mask.astype(bool)")
    try:
        np.broadcast_shapes(tuple(mask.shape), tuple(shape))
    except ValueError:
        raise ValueError(f"mask.shape={tuple(mask.shape)} does not broadcast to x.shape="
                         f"{tuple(shape)}") from None
    if np.broadcast_shapes(tuple(mask.shape), tuple(shape)) != tuple(shape):
        raise ValueError(f"mask.shape={tuple(mask.shape)} would broadcast x.shape={tuple(shape)} "
                         f"to a larger shape; the mask must broadcast to x")


def is_int(value) -> bool:
    """A Python or NumPy integer, not a bool (True is an int to Python, never a count or a
    size here)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def clip_int32(x, lo: int, hi: int):
    """Integer x of any dtype clipped to [lo, hi] in its own dtype, then int32. A cast first
    would wrap (uint32 values >= 2^31 to negative ones), and a bound past the dtype's range
    would wrap too (300 as a uint8 is 44): the bounds are taken within the dtype's range."""
    info = jnp.iinfo(x.dtype)
    return jnp.clip(x, max(lo, info.min), min(hi, info.max)).astype(jnp.int32)


def fits_int32(dtype) -> bool:
    """Whether every value of integer `dtype` is an int32 (an int32 cast keeps it)."""
    dtype = np.dtype(dtype)
    return dtype.itemsize < 4 or dtype == np.int32


def _number(name: str, value) -> float | None:
    """A scalar option as a float: a Python, NumPy or concrete jax number (not a bool or a
    string, which float() would also take); None for a traced value, which is left to the
    caller (only the reference accepts one, and what it computes with it is its own)."""
    try:
        if isinstance(value, (str, bytes, bool, np.bool_)) or value is None:
            raise TypeError
        return float(value)
    except jax.errors.ConcretizationTypeError:
        return None
    except (TypeError, ValueError):
        raise ValueError(f"{name}={value!r} must be a real number") from None


def check_positive(name: str, value, *, allow_none: bool = True) -> None:
    """A positive finite number (`_number`), or None where allowed."""
    if value is None and allow_none:
        return
    v = _number(name, value)
    if v is not None and not (v > 0 and math.isfinite(v)):
        raise ValueError(f"{name}={value!r} must be a positive finite number")


def check_finite(name: str, value, *, minimum: float | None = None) -> None:
    """A finite number (`_number`; >= minimum if given)."""
    v = _number(name, value)
    if v is None:
        return
    if not math.isfinite(v) or (minimum is not None and v < minimum):
        bound = "" if minimum is None else f" >= {minimum}"
        raise ValueError(f"{name}={value!r} must be a finite number{bound}")


def check_static(name: str, value) -> None:
    """An option the computation branches on (both impls: which loss terms exist) cannot be
    traced: a ValueError naming it and the fix."""
    if isinstance(value, jax.core.Tracer):
        raise ValueError(f"{name} is a traced value ({value}): the op takes it as a constant; "
                         "pass a Python number (under jax.jit, a static argument or a "
                         "closed-over constant)")


def check_bool(name: str, value) -> bool:
    """A flag the op branches on (causal, return_lse, ...) as a Python bool: a Python, NumPy or
    concrete jax bool, or the ints 0 and 1; anything else (a string, which is truthy; another
    number; a traced bool, which cannot choose a branch) is a ValueError naming it."""
    if isinstance(value, jax.core.Tracer):
        raise ValueError(f"{name}={value!r} must be True or False (traced: pass a Python bool, "
                         "under jax.jit a static argument)")
    if isinstance(value, (jax.Array, np.ndarray)) and value.ndim == 0:
        value = value.item()
    if isinstance(value, (bool, np.bool_)) or (is_int(value) and value in (0, 1)):
        return bool(value)
    raise ValueError(f"{name}={value!r} must be True or False")


def python_scalar(value):
    """A concrete jax or NumPy scalar option as the Python number it holds (an option computed
    with NumPy, such as `np.int64(k)`; the kernels bake their options into cached, hashed
    closures, and the checks judge Python ints), anything else unchanged."""
    if isinstance(value, (jax.Array, np.generic)) and not isinstance(value, jax.core.Tracer) \
            and getattr(value, "ndim", 0) == 0 and not isinstance(value, np.bool_):
        return value.item()
    return value


def check_ids(name: str, ids, n: int, what: str, *, ignore: int | None = None) -> None:
    """Integer ids in [0, n) (or `ignore`), judged where they are known: a ValueError naming
    the first bad one. Traced ids (under jax.jit) cannot be read and pass; what the ops then do
    with an out-of-range id is theirs (a NaN row or loss)."""
    if isinstance(ids, jax.core.Tracer):
        return
    a = np.asarray(ids)
    bad = (a < 0) | (a >= n)
    if ignore is not None:
        bad &= a != ignore
    if bad.any():
        i = np.unravel_index(int(np.flatnonzero(bad)[0]), a.shape)
        extra = f" or {ignore}" if ignore is not None else ""
        raise ValueError(f"{name}[{', '.join(map(str, i))}]={a[i]} is outside [0, {n}){extra}: "
                         f"{what}")


def check_impl(impl: str) -> None:
    if impl not in ("pallas", "reference"):
        raise ValueError(f"impl={impl!r} must be 'pallas' or 'reference'")


def check_reduction(reduction: str) -> None:
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction={reduction!r} must be 'mean', 'sum' or 'none'")


def check_smoothing(label_smoothing: float) -> None:
    check_finite("label_smoothing", label_smoothing)
    check_static("label_smoothing", label_smoothing)
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"label_smoothing={label_smoothing!r} must lie in [0, 1]")


def check_ignore_index(ignore_index) -> None:
    """A Python or NumPy integer in int32's range: labels are compared with it as integers
    (a float such as 1.5 would be truncated silently)."""
    if (isinstance(ignore_index, (bool, np.bool_))
            or not isinstance(ignore_index, (int, np.integer))
            or not -2 ** 31 <= int(ignore_index) < 2 ** 31):
        raise ValueError(f"ignore_index={ignore_index!r} must be an int in int32's range "
                         "(e.g. -100)")


def check_labels(labels, lead_shape, of: str, label_smoothing: float, reduction: str,
                 ignore_index: int = -100) -> None:
    """Integer labels shaped like `of` without its last axis, plus the loss options."""
    check_int("labels", labels)
    check_ignore_index(ignore_index)
    if tuple(labels.shape) != tuple(lead_shape):
        raise ValueError(f"labels.shape={tuple(labels.shape)} must equal {of}.shape[:-1]="
                         f"{tuple(lead_shape)}")
    check_smoothing(label_smoothing)
    check_reduction(reduction)
