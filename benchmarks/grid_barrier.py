"""What a grid-wide barrier costs on the GPU (issue 16, NOTES s23 item 11's first probe).

A persistent decoding kernel would run a layer's phases on every multiprocessor, separated by
grid-wide barriers: each CTA adds one to a global counter and spins on it (an atomic read)
until all have arrived. This times a kernel of `n` CTAs (one a multiprocessor, so all are
resident) that passes `r` such barriers, against the same kernel with none: the difference
over r is one barrier. GPU only (interpreted, the CTAs run one after another and the first
would wait forever).

    PYTHONPATH=. PYTHONUNBUFFERED=1 python benchmarks/grid_barrier.py
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from benchmarks._profile import kernel_times


def _kernel(count_ref, out_ref, count_out_ref, *, rounds: int):
    del count_out_ref   # the same buffer as count_ref (aliased): the count after the barriers
    n = pl.num_programs(0)

    def barrier(k, _):
        plt.atomic_add(count_ref, (0,), 1)
        target = n * (k + 1)
        jax.lax.while_loop(lambda seen: seen < target,
                           lambda _: plt.atomic_add(count_ref, (0,), 0),
                           plt.atomic_add(count_ref, (0,), 0))
        return 0
    jax.lax.fori_loop(0, rounds, barrier, 0)
    out_ref[0] = pl.program_id(0)


@functools.partial(jax.jit, static_argnames=("n", "rounds"))
def run(n: int, rounds: int):
    """(each CTA's id, the counter: n * rounds once every CTA passed every barrier)."""
    return pl.pallas_call(
        functools.partial(_kernel, rounds=rounds),
        out_shape=(jax.ShapeDtypeStruct((n,), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32)),
        grid=(n,),
        in_specs=[pl.BlockSpec((1,), lambda i: (0,))],
        out_specs=(pl.BlockSpec((1,), lambda i: (i,)), pl.BlockSpec((1,), lambda i: (0,))),
        input_output_aliases={0: 1},
        compiler_params=plt.CompilerParams(num_warps=1, num_stages=1),
        name="grid_barrier")(jnp.zeros((1,), jnp.int32))


def main():
    sms = jax.devices()[0].core_count if hasattr(jax.devices()[0], "core_count") else 132
    print(f"device={jax.devices()[0].device_kind} jax={jax.__version__} sms={sms}", flush=True)
    for n in (sms // 2, sms):
        base = None
        for rounds in (0, 1, 8, 32):
            _, count = run(n, rounds)
            assert int(count[0]) == n * rounds, (int(count[0]), n, rounds)
            us = sum(ms for _, _, ms in kernel_times(lambda: run(n, rounds), (), reps=10)) * 1e3
            base = us if base is None else base
            per = (us - base) / rounds if rounds else 0.0
            print(f"grid_barrier n={n:4d} rounds={rounds:3d}: {us:8.2f} us a kernel, "
                  f"{per:6.2f} us a barrier", flush=True)


if __name__ == "__main__":
    main()
