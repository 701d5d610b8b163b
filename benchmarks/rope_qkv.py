"""`jaxfuse.rope_qkv` on the GPU (issue 16's q/k/v split): compiled checks against the float32
reference, then fwd+bwd and forward times against today's split (XLA slices + `jaxfuse.rope`)
and the reference under jit, interleaved, at the 1B and 157M models' attention inputs.

    PYTHONPATH=. python benchmarks/rope_qkv.py {check|perf|sweep|all} [OUT.json]
    PYTHONPATH=. python benchmarks/gpu_check.py rope_qkv       (checks, perf and the sweep)
"""
from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp

import jaxfuse
from benchmarks import _timing
from jaxfuse.reference import rope_qkv as ref

S = "rope_qkv"
ROUNDS = int(os.environ.get("ROUNDS", "5"))
# [B, T, Hkv, G + 2, D]: the 1B model's and the 157M's grouped projections; checks add awkward
# shapes (G = 3, one KV head, D = 6, a token tail, G = 5: q's tile of 8 slots overhangs the 7).
WORKLOADS = {"1B B2 T8192 Hkv8 G4 D64": (2, 8192, 8, 6, 64),
             "157M B8 T2048 Hkv4 G4 D64": (8, 2048, 4, 6, 64)}
CHECKS = [(1, 37, 3, 5, 64), (2, 9, 1, 3, 6), (1, 100, 2, 6, 128), (1, 37, 2, 7, 64)]


def _split_then_rope(qkv, pos, interleaved=True):
    """The model's path before s36: XLA slices q, k and v out of the projection, the RoPE kernel
    turns q and k."""
    q, k, v = ref.split(qkv)
    turn = functools.partial(jaxfuse.rope, positions=pos, interleaved=interleaved)
    return turn(q), turn(k), v


IMPLS = {"jaxfuse.rope_qkv": lambda qkv, pos: jaxfuse.rope_qkv(qkv, pos),
         "split + jaxfuse.rope": _split_then_rope,
         "xla (reference)": lambda qkv, pos: jaxfuse.rope_qkv(qkv, pos, impl="reference")}


def _fwd_bwd(f):
    def step(qkv, pos, cts):
        out, vjp = jax.vjp(lambda x: f(x, pos), qkv)
        return out, vjp(cts)[0]
    return jax.jit(step)


def _inputs(shape, dtype, seed):
    k = jax.random.split(jax.random.key(seed), 5)
    qkv = jax.random.normal(k[0], shape, dtype)
    pos = jax.random.randint(k[1], shape[:2], 0, 8192)
    b, t, hkv, s, d = shape
    cts = tuple(jax.random.normal(kk, sh, dtype) for kk, sh in zip(
        k[2:], ((b, t, hkv * (s - 2), d), (b, t, hkv, d), (b, t, hkv, d))))
    return qkv, pos, cts


def check():
    """Forward and gradient against the float32 reference (relative: bf16 1e-2, f16 2e-3,
    float32 1e-5), and bitwise against `split + jaxfuse.rope` (the same arithmetic)."""
    for shape in CHECKS + list(WORKLOADS.values())[1:]:
        for dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
            for interleaved in (True, False):
                qkv, pos, cts = _inputs(shape, dtype, 0)
                f = lambda x, p: jaxfuse.rope_qkv(x, p, interleaved=interleaved)
                out, grad = _fwd_bwd(f)(qkv, pos, cts)
                r32 = lambda x, p: ref.rope_qkv(x.astype(jnp.float32), p,
                                                interleaved=interleaved)
                rout, rgrad = _fwd_bwd(r32)(qkv, pos, tuple(c.astype(jnp.float32) for c in cts))
                err = max([_timing.rel_err(a, b) for a, b in zip(out, rout)]
                          + [_timing.rel_err(grad, rgrad)])
                tout, tgrad = _fwd_bwd(functools.partial(_split_then_rope,
                                                         interleaved=interleaved))(qkv, pos, cts)
                same = all(bool(jnp.array_equal(a, b)) for a, b in zip(
                    (*out, grad), (*tout, tgrad)))
                tol = {jnp.bfloat16: 1e-2, jnp.float16: 2e-3}.get(dtype, 1e-5)
                _timing.record(S, f"check {shape} {jnp.dtype(dtype).name} "
                               f"{'pairs' if interleaved else 'halves'}", "jaxfuse.rope_qkv",
                               rel_err=err, bitwise_as_rope=same,
                               ok=bool(err < tol and same))


def perf(copy_bw: float | None = None, sweep: bool = False):
    """fwd and fwd+bwd of each of IMPLS, interleaved (`gpu_check.py rope_qkv` passes its copy
    ceiling and, unless --no-sweep, asks for the tile sweep too)."""
    if copy_bw is None:
        copy_bw = _timing.copy_ceiling()
        _timing.record(S, "copy ceiling", "xla", TBps=copy_bw / 1e12)
    for name, shape in WORKLOADS.items():
        sets = [_inputs(shape, jnp.bfloat16, s) for s in range(3)]
        moved = 2 * sets[0][0].nbytes               # read qkv, write q, k, v (and back)
        fwd = {n: jax.jit(f) for n, f in IMPLS.items()}
        times = _timing.interleaved(fwd, [s[:2] for s in sets], ROUNDS)
        for n, ts in times.items():
            t = sorted(ts)[len(ts) // 2]
            _timing.record(S, f"{name} fwd", n, t, frac_copy=moved / t / copy_bw)
        times = _timing.interleaved({n: _fwd_bwd(f) for n, f in IMPLS.items()}, sets, ROUNDS)
        for n, ts in times.items():
            t = sorted(ts)[len(ts) // 2]
            _timing.record(S, f"{name} fwd+bwd", n, t, frac_copy=2 * moved / t / copy_bw)
    if sweep:
        tiles()


def tiles():
    """Tokens a program and warps (`RowBlocks`) of the fwd+bwd at each workload, interleaved
    against the tile rule's default."""
    from jaxfuse import RowBlocks
    for name, shape in WORKLOADS.items():
        sets = [_inputs(shape, jnp.bfloat16, s) for s in range(3)]
        fns = {"default": _fwd_bwd(lambda x, p: jaxfuse.rope_qkv(x, p))}
        for bt in (1, 2, 4):
            for warps in (2, 4, 8):
                blocks = RowBlocks(bt, shape[-1], warps)
                fns[f"{bt} tokens, {warps} warps"] = _fwd_bwd(
                    lambda x, p, b=blocks: jaxfuse.rope_qkv(x, p, block_sizes=b))
        for n, ts in _timing.interleaved(fns, sets, 3).items():
            _timing.record(S, f"{name} fwd+bwd", n, sorted(ts)[1])


if __name__ == "__main__":
    _timing.commands({"check": check, "perf": perf, "sweep": tiles,
                      "all": lambda: (check(), perf())})
