"""Ring attention: flash attention with the sequence split across devices (context parallel).

Each device keeps its queries and passes its K/V chunk around the ring of the sequence axes
with `jax.lax.ppermute`; at every step it runs the flash kernel on (its queries, the visiting
chunk) and merges the partial (o, lse) into its running result with
`reference.attention.merge_states` (Liu, Zaharia and Abbeel 2023, "Ring Attention"). Nothing is
gathered: a device holds two K/V chunks at most (its own and the visiting one).

Causal load balancing: with contiguous chunks device N-1 would do N block pairs and device 0
one. So the sequence is cut into 2N halves and device r works on halves r and 2N-1-r (the
"zigzag" layout): every device then does the same work. The halves move to that layout with
four half-chunk ppermutes on entry and back on exit. With equal chunk sizes a (query half, key
half) pair is wholly visible (key before query: the kernel without a mask), the diagonal (the
kernel's causal mask, which is then top-left aligned) or wholly masked (skipped).

Backward: the same ring, with global o and lse: each visiting (K, V) travels with its dK, dV
accumulators (float32), to which every device adds its queries' contribution; after N steps they
are back with their owner. dQ stays put. Deterministic: fixed order of additions.

The steps run in a `fori_loop` (`_ring_loop`): the program's size, and its compile time, do not
grow with the number of devices.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxfuse.pallas import _attn
from jaxfuse.pallas import attention as _p_attn
from jaxfuse.reference.attention import merge_states

_FULL, _DIAG, _SKIP = 0, 1, 2


def _halves_table(n: int):
    """(source device, source half, destination device, destination slot) of every half:
    half h lives on device h // 2 at position h % 2 and goes to device h, slot 0, if h < n,
    else to device 2n - 1 - h, slot 1."""
    return [(h // 2, h % 2, h if h < n else 2 * n - 1 - h, 0 if h < n else 1)
            for h in range(2 * n)]


class RingAxes(NamedTuple):
    """The mesh axes a ring runs over (`names`, in the order the data is split over them) and
    the mesh's own axis order (`mesh_order`, `_core.MESH_ORDER`)."""
    names: tuple
    mesh_order: tuple


def _ppermute(x, axes: RingAxes, perm):
    """`jax.lax.ppermute` with `perm` numbered as `axis_index(axes.names)` numbers the devices,
    and as the data split over them lies: over a tuple of axes that is the tuple's own order,
    while ppermute numbers a group of several axes in the mesh's order (it sorts the group's
    devices). So the pairs are renumbered where the tuple lists the axes otherwise (a sequence
    split `P(None, ("seq", "tensor"))` on a ("tensor", "seq") mesh moved the wrong chunks), and
    the group is named in the mesh's order too, as jax >= 0.11 requires (it raises otherwise)."""
    names = axes.names
    in_mesh = sorted(names, key=axes.mesh_order.index)
    if list(names) != in_mesh:
        sizes = {a: jax.lax.axis_size(a) for a in names}

        def renumber(i):
            coord = {}
            for a in reversed(names):                   # the tuple's order: last axis fastest
                i, coord[a] = divmod(i, sizes[a])
            j = 0
            for a in in_mesh:
                j = j * sizes[a] + coord[a]
            return j
        perm = [(renumber(s), renumber(d)) for s, d in perm]
    return jax.lax.ppermute(x, tuple(in_mesh), perm)


def _move(x, axis: int, axes: RingAxes, table):
    """Moves the two halves of x along `axis` between devices as `table` says."""
    parts = jnp.split(x, 2, axis=axis)
    out = [jnp.zeros_like(parts[0]), jnp.zeros_like(parts[0])]
    for src_pos in (0, 1):
        for dst_pos in (0, 1):
            perm = [(s, d) for s, sp, d, dp in table if sp == src_pos and dp == dst_pos]
            if perm:
                out[dst_pos] = out[dst_pos] + _ppermute(parts[src_pos], axes, perm)
    return jnp.concatenate(out, axis=axis)


def to_zigzag(x, axis, axes, n):
    return _move(x, axis, axes, _halves_table(n))


def from_zigzag(x, axis, axes, n):
    return _move(x, axis, axes, [(d, dp, s, sp) for s, sp, d, dp in _halves_table(n)])


def _chunks(x, axis, c):
    """x in c chunks along axis (None, an absent segment-id array: c Nones)."""
    if x is None:
        return [None] * c
    return jnp.split(x, c, axis=axis) if c > 1 else [x]


def _kind(i, j, causal: bool):
    if not causal:
        return _FULL          # static: the pair runs the unmasked kernel alone (no switch)
    return jnp.where(j < i, _FULL, jnp.where(j == i, _DIAG, _SKIP)).astype(jnp.int32)


class _Ring:
    """The static layout of one ring: n devices over `axes`, c chunks per device."""

    def __init__(self, axes, causal: bool, plans):
        self.axes, self.causal, self.plans = axes, causal, plans   # plans: (full, diag) specs
        self.n = jax.lax.axis_size(axes.names)
        self.c = 2 if causal else 1
        self.me = jax.lax.axis_index(axes.names)

    def index(self, device, slot):
        """Global chunk index of `slot` on `device` (zigzag halves when causal)."""
        return device if not self.causal else jnp.where(slot == 0, device,
                                                        2 * self.n - 1 - device)

    def shift(self, tree):
        perm = [(d, (d + 1) % self.n) for d in range(self.n)]
        return jax.tree.map(lambda x: _ppermute(x, self.axes, perm), tree)


def _ring_loop(n: int, step, shift, carry):
    """carry after the ring's n steps: `step(s, carry)` at s = 0 .. n - 1 with `shift` between
    them (none after the last), as a loop of n - 1 iterations and the last step apart. A
    device's program then holds two copies of a step's kernels whatever the ring's size:
    unrolled, a causal ring of 8 devices held 192 kernel calls forward and backward, 4x a
    ring of 2's (tests/multidevice: `test_ring_program_is_flat_in_the_ring_size`), and compile
    time grew with it. `step` gives (what moves, what stays); the move of the visiting K and V
    reads only the iteration's input, so it can run under the step's kernels."""
    def body(s, carry):
        moving, staying = step(s, carry)
        return shift(moving, staying)
    carry = jax.lax.fori_loop(0, n - 1, body, carry)
    return step(n - 1, carry)


def forward(axes, causal, plans, q, k, v, qs, ks):
    """(o, lse) of queries q [B, T, Hq, D] over the whole sequence (local chunks in, out)."""
    ring = _Ring(axes, causal, plans)
    n, c = ring.n, ring.c
    if causal:
        q, k, v = (to_zigzag(x, 1, axes, n) for x in (q, k, v))
        qs, ks = (None if s is None else to_zigzag(s, 1, axes, n) for s in (qs, ks))
    qc, qsc = _chunks(q, 1, c), _chunks(qs, 1, c)
    b, t, hq, d = qc[0].shape
    acc = [(jnp.zeros((b, t, hq, d), jnp.float32), jnp.full((b, hq, t), -jnp.inf, jnp.float32))
           for _ in range(c)]

    def step(s, carry):
        kv, acc = carry
        src = (ring.me - s) % n
        kc, vc, ksc = (_chunks(x, 1, c) for x in kv)
        acc = list(acc)
        for a in range(c):
            for bb in range(c):
                kind = _kind(ring.index(ring.me, a), ring.index(src, bb), causal)
                o_ab, lse_ab = _pair_fwd(kind, plans, qc[a], kc[bb], vc[bb], qsc[a], ksc[bb])
                acc[a] = merge_states(acc[a][0], acc[a][1], o_ab.astype(jnp.float32), lse_ab)
        return kv, acc

    _, acc = _ring_loop(n, step, lambda kv, acc: (ring.shift(kv), acc), ((k, v, ks), acc))
    o = jnp.concatenate([o for o, _ in acc], axis=1).astype(q.dtype)
    lse = jnp.concatenate([lse for _, lse in acc], axis=2)
    if causal:
        o, lse = from_zigzag(o, 1, axes, n), from_zigzag(lse, 2, axes, n)
    return o, lse


def _pair_fwd(kind, plans, q, k, v, qs, ks):
    b, t, hq, _ = q.shape

    def run(spec_blocks):
        return lambda: _p_attn.forward(q, k, v, qs, ks, *spec_blocks)[:2]   # (o, natural lse)

    def skip():
        return jnp.zeros(q.shape, q.dtype), jnp.full((b, hq, t), -jnp.inf, jnp.float32)

    return _switch(kind, [run(plans[0]), run(plans[1]), skip])


def _switch(kind, branches):
    """`lax.switch`, or the one branch where the kind is static (no other kernel compiled)."""
    return branches[kind]() if isinstance(kind, int) else jax.lax.switch(kind, branches)


def backward(axes, causal, plans, q, k, v, qs, ks, o, lse, do, dlse):
    """(dq, dk, dv) of `forward` (local chunks in, out)."""
    ring = _Ring(axes, causal, plans)
    n, c = ring.n, ring.c
    if causal:
        q, k, v, o, do = (to_zigzag(x, 1, axes, n) for x in (q, k, v, o, do))
        lse, dlse = to_zigzag(lse, 2, axes, n), to_zigzag(dlse, 2, axes, n)
        qs, ks = (None if s is None else to_zigzag(s, 1, axes, n) for s in (qs, ks))
    split = lambda x, axis=1: _chunks(x, axis, c)
    qc, qsc, oc, doc = split(q), split(qs), split(o), split(do)
    lsec, dlsec = split(lse, 2), split(dlse, 2)
    dq = [jnp.zeros(x.shape, jnp.float32) for x in qc]
    kv = (k, v, ks)
    dkv = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))

    def step(s, carry):
        (kv, dkv), dq = carry
        src = (ring.me - s) % n
        kc, vc, ksc = (split(x) for x in kv)
        dkc, dvc, dq = split(dkv[0]), split(dkv[1]), list(dq)
        for a in range(c):
            for bb in range(c):
                kind = _kind(ring.index(ring.me, a), ring.index(src, bb), causal)
                g = _pair_bwd(kind, plans, qc[a], kc[bb], vc[bb], qsc[a], ksc[bb], oc[a],
                              lsec[a], doc[a], dlsec[a])
                dq[a] = dq[a] + g[0]
                dkc[bb], dvc[bb] = dkc[bb] + g[1], dvc[bb] + g[2]
        return (kv, (jnp.concatenate(dkc, 1), jnp.concatenate(dvc, 1))), dq

    # K and V need n - 1 moves; dK and dV one more, which brings them home.
    (_, (dk, dv)), dq = _ring_loop(n, step, lambda moving, dq: (ring.shift(moving), dq),
                                   ((kv, dkv), dq))
    dk, dv = ring.shift((dk, dv))
    dq = jnp.concatenate(dq, 1)
    if causal:
        dq, dk, dv = (from_zigzag(x, 1, axes, n) for x in (dq, dk, dv))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _pair_bwd(kind, plans, q, k, v, qs, ks, o, lse, do, dlse):
    def run(spec_blocks):
        # The kernels recompute P from lse in their own units (`_attn.residual_from_lse`).
        return lambda: tuple(x.astype(jnp.float32) for x in _p_attn.backward(
            q, k, v, qs, ks, o, _attn.residual_from_lse(lse, spec_blocks[0]), do, dlse,
            *spec_blocks))

    def skip():
        return tuple(jnp.zeros(x.shape, jnp.float32) for x in (q, k, v))

    return _switch(kind, [run(plans[0]), run(plans[1]), skip])
