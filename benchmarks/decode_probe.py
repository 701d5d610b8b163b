"""The small ops of a decoding step on the GPU (diagnostic), timed as kernel time from the
profiler: jaxfuse.rope at decoding shapes (B=32 tokens, one position each) and at the training
shapes, across tiles, against the same rotation written in jax.numpy under jax.jit; and
beam_top_k (HARS) against lax.top_k at beam search's shapes: time, and bitwise agreement on
random, tied and NaN input (with how lax.top_k orders NaN, +-inf and +-0 on this backend); and
decode_attention at decoding shapes across tiles and split counts; and what a chain of
dependent launches costs (`launch_chain`); and decoding's matmuls through the Hopper GEMM
(`hopper_gemv`); the q/k/v projection as float32 partial sums (`qkv_parts`), decode_attention's
fused input checked and timed form by form (`decode_fused`), and greedy's argmax against
`lax.top_k` (`argmax`); beam search's step from the logits (`beam_step`: compiled checks and
kernel time against the XLA reference).

    PYTHONPATH=. python benchmarks/decode_probe.py [top_k_order beam_top_k rope decode_attention]
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxfuse  # noqa: E402
from benchmarks import _timing  # noqa: E402
from jaxfuse.pallas._rows import RowBlocks  # noqa: E402


def beam_top_k():
    for b, k, v in ((8, 4, 32768), (8, 4, 128256), (32, 8, 50257)):
        lp = jax.nn.log_softmax(jax.random.normal(jax.random.key(1), (b, k, v)) * 3, -1)
        sc = jax.random.normal(jax.random.key(2), (b, k))
        ties = jnp.round(lp * 2) / 2
        nan = lp.at[:, :, ::97].set(jnp.nan).at[:, :, 5::101].set(jnp.inf).at[:, 0, 7].set(-0.0)
        ours = jax.jit(lambda x, s: jaxfuse.beam_top_k(x, s, k))
        ref = jax.jit(lambda x, s: jaxfuse.beam_top_k(x, s, k, impl="reference"))
        for name, x in (("random", lp), ("ties", ties), ("nan/inf", nan)):
            a, r = ours(x, sc), ref(x, sc)
            same = all(bool(jnp.array_equal(p, q, equal_nan=True)) for p, q in zip(a, r))
            print(f"beam_top_k B{b} K{k} V{v} {name:8s} bitwise equal to lax.top_k: {same}")
            if not same:
                row = int(jnp.argmax(jnp.any(a[2] != r[2], axis=1) | jnp.any(a[1] != r[1], 1)))
                print("   first row that differs:", row, "ours", a[0][row], a[1][row], a[2][row],
                      "lax.top_k", r[0][row], r[1][row], r[2][row])
        for name, f in (("pallas", ours), ("lax.top_k", ref)):
            print(f"beam_top_k B{b} K{k} V{v} {name:10s} {kernel_us(f, (lp, sc)):8.2f} us "
                  "of kernels")


def _beam_step_total_order(logits, raw, lengths, done, *, eos_id, length_penalty):
    """The reference's rule with its top-k over `order_key` (lax.top_k's total order on a CPU,
    which the kernels keep: XLA's GPU top_k ranks +NaN below +inf for long rows)."""
    from jaxfuse.pallas.beam_top_k import order_key
    from jaxfuse.reference import beam_step as R
    k, v = logits.shape[1:]
    eos_id = R.eos_index(eos_id, v)
    cand, logp, raw, length = R.flat_candidates(logits, raw, lengths, done, eos_id,
                                                length_penalty)
    _, flat = jax.lax.top_k(order_key(cand), k)
    return R.finish(flat, jnp.take_along_axis(logp, flat, axis=1), raw, length, done, v, eos_id)


def beam_step():
    """jaxfuse.beam_step compiled against its reference on awkward shapes, bitwise (the same
    beams, scores, lengths and flags): against `impl="reference"`, and where candidates are NaN
    (an all -inf row's log-softmax, NaN logits) against the same rule ranked in lax.top_k's
    CPU order, which the kernels keep. Then kernel time at beam search's shapes against the
    reference (XLA's log_softmax, candidates and lax.top_k)."""
    from tests.test_beam_step import KINDS, _state
    cases = [((8, 4, 32768), "bfloat16", 0.0, None), ((8, 4, 32768), "bfloat16", 0.6, None),
             ((3, 5, 1009), "float32", 1.3, None), ((2, 3, 37), "float16", 0.0, None),
             ((1, 1, 5), "float32", 0.0, None), ((5, 7, 50257), "bfloat16", 0.8, None),
             ((4, 3, 3001), "float32", 0.0, RowBlocks(block_rows=4, block_cols=256)),
             ((2, 8, 130), "bfloat16", 0.5, RowBlocks(block_rows=2, block_cols=8))]
    ok = total = 0
    for i, (shape, dt, lp, blocks) in enumerate(cases):
        for j, kind in enumerate(KINDS):
            args = _state(100 * i + j, shape, kind, dt)
            for eos in (2, shape[2]):                  # in the vocabulary, and outside it
                kw = dict(eos_id=eos, length_penalty=lp)
                got = jax.jit(lambda *a: jaxfuse.beam_step(*a, **kw, block_sizes=blocks))(*args)
                want = jax.jit(lambda *a: jaxfuse.beam_step(*a, **kw, impl="reference"))(*args)
                total_order = jax.jit(lambda *a: _beam_step_total_order(*a, **kw))(*args)
                same = [bool(jnp.array_equal(g, w, equal_nan=True)) for g, w in zip(got, want)]
                same_t = [bool(jnp.array_equal(g, w, equal_nan=True))
                          for g, w in zip(got, total_order)]
                good = all(same) or (kind in ("neginf", "nonfinite") and all(same_t))
                ok, total = ok + good, total + 1
                print(f"beam_step check {shape} {dt} lp={lp} {kind} eos={eos} blocks="
                      f"{None if blocks is None else (blocks.block_rows, blocks.block_cols)}: "
                      f"{'ok' if good else 'FAIL'} (reference {same}, total order {same_t})")
    print(f"beam_step checks: {ok} of {total} ok")
    for shape in ((8, 4, 32768), (8, 4, 128256), (32, 8, 50257)):
        args = _state(7, shape, "normal", "bfloat16")
        for impl in ("pallas", "reference"):
            f = jax.jit(lambda *a, impl=impl: jaxfuse.beam_step(*a, eos_id=2, impl=impl))
            us = kernel_us(f, args)
            print(f"beam_step B{shape[0]} K{shape[1]} V{shape[2]} {impl:9s} "
                  f"{us:8.2f} us of kernels")
            # kernel time as the row's time (`PROBE_JSON=path` saves the rows for charts.py)
            _timing.record("beam_step", f"B{shape[0]} K{shape[1]} V{shape[2]} bf16",
                           "jaxfuse" if impl == "pallas" else "reference", us * 1e-6)
    if not os.environ.get("BEAM_TILES"):
        return
    # Tiles (BEAM_TILES=1): the retrieval's rows and warps a program (group width 2048), the
    # re-rank's warps.
    from benchmarks._profile import kernel_times
    from jaxfuse.pallas import beam_step as P
    args = _state(7, (8, 4, 32768), "normal", "bfloat16")
    default = P._RERANK_WARPS
    try:
        for br, warps in ((2, 4), (1, 4), (1, 2), (2, 8), (4, 8), (1, 8)):
            for rw in (2, 1, 4):
                P._RERANK_WARPS = rw
                blocks = RowBlocks(block_rows=br, block_cols=2048, num_warps=warps)
                f = jax.jit(lambda *a: jaxfuse.beam_step(*a, eos_id=2, block_sizes=blocks))
                kt = kernel_times(f, args, reps=20)
                print(f"beam_step tiles rows={br} warps={warps} rerank_warps={rw}: "
                      + ", ".join(f"{n[:32]} {ms * 1e3:.2f}" for n, _, ms in kt))
    finally:
        P._RERANK_WARPS = default


def kernel_us(f, args) -> float:
    """GPU kernel time of one call (profiler trace), in microseconds: small kernels hide under
    the ~35 us a jitted call costs on the host, so wall-clock timing cannot rank them."""
    from benchmarks._profile import kernel_times
    return sum(ms for _, _, ms in kernel_times(f, args, reps=20)) * 1e3


def top_k_order():
    """How lax.top_k orders the special values on this backend."""
    vals = jnp.array([1.0, jnp.nan, -jnp.nan, jnp.inf, -jnp.inf, -0.0, 0.0, -1.0], jnp.float32)
    s, i = jax.jit(lambda x: jax.lax.top_k(x, 8))(vals)
    bits = jax.lax.bitcast_convert_type(s, jnp.uint32)
    print("lax.top_k order of [1, nan, -nan, inf, -inf, -0, 0, -1]:", [int(j) for j in i],
          [hex(int(b)) for b in bits])


def rope_kernels():
    for shape in ((32, 1, 16, 64), (32, 1, 4, 64), (8, 2048, 16, 64), (8, 2048, 4, 64)):
        x = jax.random.normal(jax.random.key(0), shape, jnp.bfloat16)
        pos = 600 + jnp.broadcast_to(jnp.arange(shape[1]), shape[:2]).astype(jnp.int32)
        rows = [("xla", jax.jit(lambda x, p: jaxfuse.rope(x, p, impl="reference"))),
                ("pallas default", jax.jit(lambda x, p: jaxfuse.rope(x, p)))]
        for br, nw in ((1, 1), (1, 4), (4, 4), (8, 4), (32, 4)):
            if br <= shape[0] * shape[1]:
                blk = RowBlocks(block_rows=br, block_cols=shape[-1], num_warps=nw)
                rows.append((f"pallas rows={br} warps={nw}", jax.jit(
                    lambda x, p, blk=blk: jaxfuse.rope(x, p, block_sizes=blk))))
        for name, f in rows:
            print(f"rope {str(shape):18s} {name:26s} {kernel_us(f, (x, pos)):8.2f} us of kernels")


def decode_attention_kernels():
    """decode_attention at the 157M model's decoding shapes (32 rows, 4 KV heads of 64, a cache
    of 768 holding 640 on average) across tiles and split counts: a step's attention is one
    program per (row, KV head) reading ~140 KB, latency- rather than bandwidth-bound."""
    from jaxfuse.pallas.decode_attention import DecodeBlocks
    for b, s, n, hq, hkv in ((32, 768, 640, 16, 4), (8, 4096, 3000, 16, 4)):
        ks = jax.random.split(jax.random.key(3), 3)
        q = jax.random.normal(ks[0], (b, hq, 64), jnp.bfloat16)
        kc = jax.random.normal(ks[1], (b, s, hkv, 64), jnp.bfloat16)
        vc = jax.random.normal(ks[2], (b, s, hkv, 64), jnp.bfloat16)
        lengths = jnp.full((b,), n, jnp.int32)
        want = jaxfuse.decode_attention(q, kc, vc, lengths, impl="reference")
        print(f"decode_attention B{b} S{s} len{n} Hq{hq} Hkv{hkv} D64: bytes "
              f"{2 * b * n * hkv * 64 * 2 / 1e6:.1f} MB")
        rows = [("xla", None, None)]
        rows += [(f"splits={sp} bk={bk} warps={nw} stages={st}", sp,
                  DecodeBlocks(block_k=bk, num_warps=nw, num_stages=st))
                 for sp in (None, 1, 2, 4) for bk in (64, 128) for nw in (2, 4, 8)
                 for st in (2, 3, 4) if not (sp is None and (bk, nw, st) != (64, 4, 3))]
        for name, sp, blk in rows:
            if blk is None:
                f = jax.jit(lambda *a: jaxfuse.decode_attention(*a, impl="reference"))
            else:
                f = jax.jit(lambda *a, sp=sp, blk=blk: jaxfuse.decode_attention(
                    *a, num_splits=sp, block_sizes=blk))
            try:
                err = float(jnp.max(jnp.abs(f(q, kc, vc, lengths).astype(jnp.float32)
                                            - want.astype(jnp.float32))))
                from benchmarks._profile import kernel_times
                kt = kernel_times(f, (q, kc, vc, lengths), reps=20)
                us = sum(ms for _, _, ms in kt) * 1e3
                launches = sum(c for _, c, _ in kt)
                print(f"  {name:36s} {us:8.2f} us of kernels in {launches} launches, "
                      f"max err {err:.2e}")
            except Exception as e:   # a tile that does not compile is a result, not a stop
                print(f"  {name:36s} failed: {type(e).__name__}: {str(e)[:120]}")


def decode_attention_cold():
    """decode_attention as the model's step meets it: the cache cold in L2 (each call reads
    one of 8 caches of ~17 MB in turn, 136 MB > the H200's 50 MB of L2; the warm sweep above
    reads one cache 20 times) at the 157M model's first decoded positions (B32, 528 of 768,
    4 KV heads of 64, bf16): in the model's profile (s13-4) a call took 9.4 us against the
    4.2 us its bytes take at the copy rate."""
    from jaxfuse.pallas.decode_attention import DecodeBlocks
    from benchmarks._profile import kernel_times
    b, s, n, hq, hkv, copies = 32, 768, 528, 16, 4, 8
    ks = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(ks[0], (b, hq, 64), jnp.bfloat16)
    kcs = [jax.random.normal(jax.random.fold_in(ks[1], i), (b, s, hkv, 64), jnp.bfloat16)
           for i in range(copies)]
    vcs = [jax.random.normal(jax.random.fold_in(ks[2], i), (b, s, hkv, 64), jnp.bfloat16)
           for i in range(copies)]
    lengths = jnp.full((b,), n, jnp.int32)
    want = jaxfuse.decode_attention(q, kcs[-1], vcs[-1], lengths, impl="reference")
    print(f"decode_attention cold B{b} S{s} len{n} Hq{hq} Hkv{hkv} D64: "
          f"{2 * b * n * hkv * 64 * 2 / 1e6:.1f} MB a call")
    # s13-5 swept splits (None, 2, 4) x bk (128, 256) x warps (4, 8) x stages (2, 3, 4): the
    # default best. DECODE_COLD=warps (s23) sweeps fewer warps a program (1, 2, 4: the
    # softmax's row reductions within fewer warps, the one program an SM keeping the same
    # loads in flight) x bk (64, 128, 256) x stages (2, 3, 4), one split.
    if os.environ.get("DECODE_COLD") == "warps":
        grid = ((None,), (64, 128, 256), (1, 2, 4), (2, 3, 4))
    elif os.environ.get("DECODE_COLD") == "splits":   # each launch's own time printed too
        grid = ((None, 2, 4), (128,), (4,), (3, 4))
    elif os.environ.get("DECODE_COLD") == "stages":
        # s25 (ncu): 22% of the kernel's stall samples sit at the loop's first barrier, waiting
        # for a K/V tile; with 4-5 tiles a program, a ring deep enough for all of them puts
        # every load in flight at the start (6 x 32 KB of 128-key tiles fit one CTA's smem).
        grid = ((None,), (64, 128), (4,), (3, 4, 5, 6, 8))
    else:
        grid = ((None, 2, 4), (128, 256), (4, 8), (2, 3, 4))
    rows = [(f"splits={sp} bk={bk} warps={nw} stages={st}", sp,
             DecodeBlocks(block_k=bk, num_warps=nw, num_stages=st))
            for sp in grid[0] for bk in grid[1] for nw in grid[2] for st in grid[3]]
    for name, sp, blk in rows:
        f = jax.jit(lambda q, kcs, vcs, n, sp=sp, blk=blk: [jaxfuse.decode_attention(
            q, kc, vc, n, num_splits=sp, block_sizes=blk) for kc, vc in zip(kcs, vcs)])
        try:
            err = float(jnp.max(jnp.abs(f(q, kcs, vcs, lengths)[-1].astype(jnp.float32)
                                        - want.astype(jnp.float32))))
            kt = kernel_times(f, (q, kcs, vcs, lengths), reps=5)
            us = sum(ms for _, _, ms in kt) * 1e3 / copies
            launches = sum(c for _, c, _ in kt) / copies
            print(f"  {name:36s} {us:8.2f} us a call in {launches:.0f} launches, "
                  f"max err {err:.2e}")
            if launches > 1:
                for kname, count, ms in kt:
                    print(f"      {kname[:48]:48s} {ms * 1e3 / copies:8.2f} us a call")
        except Exception as e:   # a tile that does not compile is a result, not a stop
            print(f"  {name:36s} failed: {type(e).__name__}: {str(e)[:120]}")


def decode_append():
    """A decoding step's attention with the new K/V appended: in the kernel (k_new/v_new,
    in place) against XLA's scatter into each cache then the kernel. Checks the GPU result
    against the reference (caches bitwise) and times both as kernel time."""
    b, s, n, hq, hkv = 32, 768, 640, 16, 4
    ks = jax.random.split(jax.random.key(4), 5)
    q = jax.random.normal(ks[0], (b, hq, 64), jnp.bfloat16)
    kc = jax.random.normal(ks[1], (b, s, hkv, 64), jnp.bfloat16)
    vc = jax.random.normal(ks[2], (b, s, hkv, 64), jnp.bfloat16)
    kn = jax.random.normal(ks[3], (b, hkv, 64), jnp.bfloat16)
    vn = jax.random.normal(ks[4], (b, hkv, 64), jnp.bfloat16)
    lengths = jnp.arange(b, dtype=jnp.int32) * (s // b) + 7          # every split, and row 0
    lengths = lengths.at[-1].set(s)                                   # a full cache
    want = jaxfuse.decode_attention(q, kc, vc, lengths, k_new=kn, v_new=vn, impl="reference")
    for splits in (None, 3):
        got = jax.jit(lambda *a, sp=splits: jaxfuse.decode_attention(
            *a[:4], k_new=a[4], v_new=a[5], num_splits=sp))(q, kc, vc, lengths, kn, vn)
        err = float(jnp.max(jnp.abs(got[0].astype(jnp.float32) - want[0].astype(jnp.float32))))
        same = all(bool(jnp.array_equal(a, w)) for a, w in zip(got[1:], want[1:]))
        print(f"decode append splits={splits}: o max err {err:.2e}, caches bitwise equal to "
              f"the reference: {same}")

    def scatter_then_attend(q, kc, vc, n, kn, vn):
        rows = jnp.arange(b)
        kc = kc.at[rows, n].set(kn, mode="drop", unique_indices=True)
        vc = vc.at[rows, n].set(vn, mode="drop", unique_indices=True)
        return jaxfuse.decode_attention(q, kc, vc, jnp.minimum(n + 1, s)), kc, vc

    def steps(one, q, kc, vc, n, kn, vn, count=16):
        # As in a decoding loop: the caches are loop state, updated in place (the copy of the
        # undonated inputs on entry is the same for both and shows as its own kernel).
        def body(i, c):
            o, kc, vc = one(q, c[1], c[2], n + i, kn, vn)
            return c[0] + o.astype(jnp.float32), kc, vc
        return jax.lax.fori_loop(0, count, body, (jnp.zeros(q.shape, jnp.float32), kc, vc))
    args = (q, kc, vc, jnp.full((b,), n, jnp.int32), kn, vn)
    from benchmarks._profile import kernel_times
    for name, one in (("fused append", lambda *a: jaxfuse.decode_attention(
            *a[:4], k_new=a[4], v_new=a[5])), ("scatter + attend", scatter_then_attend)):
        kt = kernel_times(jax.jit(lambda *a, one=one: steps(one, *a)), args, reps=5)
        print(f"decode step attention B{b} S{s} len{n}, 16 steps: {name:18s} "
              f"{sum(ms for _, _, ms in kt) * 1e3:7.2f} us of kernels in "
              f"{sum(c for _, c, _ in kt)} launches: "
              + ", ".join(f"{k[:40]} x{c} {ms * 1e3:.1f}" for k, c, ms in kt[:5]))


def reorder():
    """reorder_beams at beam search's shapes (B=8, K=4, 16 caches [768, 4, 64] bf16, 128
    positions decoded after a 512 prompt): bitwise against the reference, kernel time of the
    in-place kernel against XLA's gather, both inside a 16-step loop (caches as loop state)."""
    b, k, s = 8, 4, 768
    caches = tuple(jax.random.normal(jax.random.key(i), (b, k, s, 4, 64), jnp.bfloat16)
                   for i in range(16))
    parent = jax.random.randint(jax.random.key(99), (16, b, k), 0, k)
    start = jnp.full((b,), 512, jnp.int32)
    got = jaxfuse.reorder_beams(caches, parent[0], start, start + 128)
    want = jaxfuse.reorder_beams(caches, parent[0], start, start + 128, impl="reference")
    print("reorder_beams bitwise equal to the reference:",
          all(bool(jnp.array_equal(g, w)) for g, w in zip(got, want)))
    # Awkward shapes compiled: prime lengths and widths, one beam, ranges empty, whole, past
    # S and not whole tiles, small tiles (many loop steps), every dtype a cache may take.
    from jaxfuse import RowBlocks
    cases = [((3, 4, 37, 5), jnp.bfloat16, None), ((1, 1, 5, 3), jnp.float32, None),
             ((2, 3, 1, 64), jnp.float16, None), ((5, 2, 300, 257), jnp.bfloat16, None),
             ((2, 5, 130, 7), jnp.int32, RowBlocks(block_rows=4, block_cols=4, num_warps=4)),
             ((4, 4, 768, 256), jnp.bfloat16, RowBlocks(block_rows=16, block_cols=64,
                                                         num_warps=4))]
    ok = 0
    for i, ((b_, k_, s_, f_), dt, blocks) in enumerate(cases):
        kk = jax.random.split(jax.random.key(100 + i), 4)
        cs = (jax.random.normal(kk[0], (b_, k_, s_, f_)) * 100).astype(dt),
        par = jax.random.randint(kk[1], (b_, k_), -1, k_ + 1)       # out of range: clipped
        st = jax.random.randint(kk[2], (b_,), 0, s_ + 1)
        sp = st + jax.random.randint(kk[3], (b_,), 0, s_ + 2)          # past S: clipped
        st, sp = st.at[0].set(0), sp.at[0].set(s_)                      # one row whole
        if b_ > 1:
            st, sp = st.at[1].set(min(3, s_)), sp.at[1].set(min(2, s_))  # empty
        g = jax.jit(lambda c, *a: jaxfuse.reorder_beams(c, *a, block_sizes=blocks))(
            cs, par, st, sp)
        w = jaxfuse.reorder_beams(cs, par, st, sp, impl="reference")
        same = all(bool(jnp.array_equal(x, y)) for x, y in zip(g, w))
        ok += same
        print(f"reorder_beams check {(b_, k_, s_, f_)} {jnp.dtype(dt).name} blocks={blocks}: "
              f"{'ok' if same else 'FAIL'}")
    print(f"reorder_beams checks: {ok} of {len(cases)} ok")

    def loop(cs, impl):
        body = lambda t, cs: jaxfuse.reorder_beams(cs, parent[t], start, start + 120 + t,
                                                   impl=impl)
        return jax.lax.fori_loop(0, 16, body, cs)
    from benchmarks._profile import kernel_times
    for impl in ("pallas", "reference"):
        kt = kernel_times(jax.jit(lambda cs, impl=impl: loop(cs, impl)), (caches,), reps=3)
        print(f"reorder_beams 16 steps {impl:9s} {sum(ms for _, _, ms in kt) * 1e3:8.1f} us of "
              f"kernels in {sum(c for _, c, _ in kt)} launches: "
              + ", ".join(f"{n[:30]} x{c} {ms * 1e3:.1f}" for n, c, ms in kt[:4]))


def launch_chain():
    """What a chain of dependent launches costs, the way a decoding step is made (s23): n
    kernels, each reading what the previous one wrote, in one jitted call (XLA puts them in a
    CUDA graph, as it does the step's). (a) n tiny elementwise kernels on [32, 1024] float32
    (`optimization_barrier` keeps XLA from fusing them): the per-kernel floor of a step of
    small launches. (b) n [32, 1024] x [1024, 1024] bf16 matmuls, each with its own 2 MiB
    weight (n x 2 MiB > L2: the weights arrive cold, as a step's do), XLA's choice of kernel:
    the o projection of the 157M model, with everything a dependent matmul costs."""
    import time
    from benchmarks._timing import bench

    def per_call(f, args):
        return bench(jax.jit(f), [args], reps=20, repeats=5, warmup=2)

    x = jax.random.normal(jax.random.key(0), (32, 1024), jnp.float32)
    for n in (16, 64):
        def chain(x, n=n):
            for _ in range(n):
                x = jax.lax.optimization_barrier(x * 1.0001 + 1e-4)
            return x
        t = per_call(chain, (x,))
        print(f"launch_chain elementwise n={n:3d}: {t * 1e6:8.1f} us a call, "
              f"{t * 1e6 / n:6.2f} us a kernel", flush=True)
    xb = x.astype(jnp.bfloat16)
    for n in (16, 64):
        ws = jax.random.normal(jax.random.key(1), (n, 1024, 1024), jnp.bfloat16) * 0.03

        def gemms(x, ws, n=n):
            for i in range(n):
                x = jax.lax.optimization_barrier((x @ ws[i]).astype(jnp.bfloat16))
            return x
        t0 = time.perf_counter()
        t = per_call(gemms, (xb, ws))
        print(f"launch_chain matmul 32x1024x1024 n={n:3d}: {t * 1e6:8.1f} us a call, "
              f"{t * 1e6 / n:6.2f} us a matmul ({2 * 2 ** 20 / (t / n) / 1e12:.2f} TB/s of "
              f"weights; set up {time.perf_counter() - t0:.0f} s)", flush=True)


def hopper_gemv():
    """A decoding step's matmuls through the Hopper GEMM of the linear + cross-entropy
    (`_hopper_gemm.matmul_epilogue`: TMA ring up to 8 stages deep, wgmma, a persistent grid):
    out^T [N, 64] = W [N, K] @ x^T, W stored [N, K] (the wgmma A operand: features are the
    tile's rows) and x's 32 rows padded to 64 (B: 2 x 32 columns). NOTES s24 items 1-2: Triton
    kernels streamed these weights at 0.3-0.7 TB/s, slower than XLA's split-K GEMMs; the
    question is whether TMA's deep queues (not threads' loads) reach the copy rate with the
    few tiles decoding has (16-88 output tiles: no split of K here). 8 launches a shape, each
    its own weight (cold), kernel times from the profiler, against XLA's x @ W^T."""
    from jaxfuse.pallas import _hopper_gemm as HG
    small = jax.default_backend() == "cpu"          # a smoke test in Mosaic GPU's interpreter
    copies = 2 if small else 8
    shapes = ((128, 64),) if small else ((1024, 1024), (1536, 1024), (5632, 1024), (1024, 2816))
    configs = ((64, "pingpong", 8), (64, "cooperative", 8), (128, "cooperative", 6))
    if os.environ.get("GEMV_QUICK"):        # the o and gate/up shapes, two schedules
        shapes, configs = shapes[::2], configs[::2]

    def store(z, rows, ctx):
        HG.store_tile(z.astype(jnp.bfloat16), ctx.scratch.at[ctx.wg], ctx.outs[0], ctx.row,
                      ctx.col)

    def timed(f, args, mb):         # a matmul's kernel time (interpreted: not timed)
        if small:
            return "not timed"
        us = kernel_us(f, args) / copies
        return f"{us:7.2f} us a matmul ({mb / us:.2f} TB/s)"

    for n, k in shapes:
        ws = tuple(jax.random.normal(jax.random.key(50 + i), (n, k), jnp.bfloat16) * k ** -0.5
                   for i in range(copies))
        x = jax.random.normal(jax.random.key(49), (64, k), jnp.bfloat16)
        want = x[:32] @ ws[-1].T
        mb = n * k * 2 / 1e6
        xla = jax.jit(lambda x, ws: [x[:32] @ w.T for w in ws])
        print(f"hopper_gemv [{n}, {k}] ({mb:.1f} MB): XLA {timed(xla, (x, ws), mb)}",
              flush=True)
        for m_tile, sched, stages in configs:
            tiles = HG.Tiles(m=m_tile, n=32, k=64, stages=stages, epi=32, piece=32,
                             schedule=sched)
            f = jax.jit(lambda x, ws, tiles=tiles: [HG.matmul_epilogue(
                w, x, b_t=True, epilogue=store,
                out_types=jax.ShapeDtypeStruct((n, 64), jnp.bfloat16),
                scratch_types=HG.tile_smem(jnp.bfloat16, tiles), tiles=tiles,
                interpret=small, name="probe_hopper_gemv") for w in ws])
            try:
                got = f(x, ws)[-1][:, :32].T
                err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
                print(f"  m={m_tile} {sched:11s} stages={stages}: {timed(f, (x, ws), mb)}, "
                      f"max err {err:.2e}", flush=True)
            except Exception as e:   # a tile that does not compile is a result, not a stop
                print(f"  m={m_tile} {sched} failed: {type(e).__name__}: {str(e)[:160]}")


def qkv_parts():
    """Can a decoding step's q/k/v projection hand its split-K partial sums to the next kernel
    instead of reducing them in a launch of its own (s26)? XLA's [32, 1024] x [1024, 1536] GEMM
    runs split-K and reduces the partials in a fusion (with RoPE and the concat: ~2.2 us a
    layer). Written as a batched matmul over P slices of K with float32 partials [P, 32, N],
    XLA has nothing to reduce; the question is whether that batched GEMM is one kernel and as
    fast as its split-K GEMM. 8 cold weights a formulation, kernel times from the profiler."""
    from benchmarks._profile import kernel_times
    copies, k, n = 8, 1024, 1536
    ws = jax.random.normal(jax.random.key(3), (copies, k, n), jnp.bfloat16) * k ** -0.5
    x = jax.random.normal(jax.random.key(4), (32, k), jnp.bfloat16)
    bar = jax.lax.optimization_barrier

    def chain(project):         # each layer's input depends on the last (no merged GEMMs)
        def f(x, ws):
            for i in range(copies):
                out = bar(project(x, ws[i]))
                out = out.sum(0) if out.ndim == 3 else out
                x = out[:, :k].astype(jnp.bfloat16)
            return out
        return f
    forms = {"x @ W, bf16 out (split-K + reduce)":
             chain(lambda x, w: (x @ w).astype(jnp.bfloat16))}
    for p in (1, 2, 4, 8):
        forms[f"batched P={p}, f32 partials"] = chain(lambda x, w, p=p: jnp.einsum(
            "bpk,pkn->pbn", x.reshape(32, p, k // p), w.reshape(p, k // p, n),
            preferred_element_type=jnp.float32))
    for name, f in forms.items():
        f = jax.jit(f)
        f(x, ws)
        kt = kernel_times(f, (x, ws), reps=5)
        total = sum(ms for _, _, ms in kt) * 1e3 / copies
        print(f"qkv_parts {name:36s} {total:6.2f} us a layer (with the chain's sums)",
              flush=True)
        for kname, count, ms in kt:
            print(f"      {kname[:60]:60s} x{count} {ms * 1e3 / copies:6.2f} us a layer")


def decode_fused():
    """The decoding step's fused attention input (s26): checks on the GPU against the float32
    reference (grouped and heads-packed q/k/v, as stored or as 4 float32 partial sums, RoPE
    interleaved or halves, awkward lengths and head dims), then the kernel at the 157M model's
    step as the model calls it, cold (8 caches in turn): the packed bf16 q/k/v that XLA's
    reduction + RoPE fusion used to write, against the partial sums added and rotated in the
    kernel."""
    from benchmarks._profile import kernel_times
    from benchmarks._timing import rel_err
    ok = True
    shapes = ((3, 53, 8, 2, 64), (5, 1000, 16, 4, 64), (2, 333, 4, 1, 128), (3, 97, 6, 2, 80))
    for b, s, hq, hkv, d in ([] if os.environ.get("DECODE_FUSED_NO_CHECK") else shapes):
        g, ks = hq // hkv, jax.random.split(jax.random.key(b * s + d), 3)
        kc = jax.random.normal(ks[0], (b, s, hkv, d), jnp.bfloat16)
        vc = jax.random.normal(ks[1], (b, s, hkv, d), jnp.bfloat16)
        lengths = jnp.array([0, s // 2, s, s - 1, 1][:b], jnp.int32)
        parts = jax.random.normal(ks[2], (4, b, hkv * (g + 2), d), jnp.float32)
        x = jax.random.normal(ks[2], (b, 1000), jnp.bfloat16) * 3      # an RMS input row
        forms = [(packed, ps, rope, False) for packed in ("grouped", "heads")
                 for ps in (False, True) for rope in (None, True, False)]
        for packed, ps, rope, rms in forms + [("grouped", True, True, True)]:
            qkv = parts if ps else parts[0].astype(jnp.bfloat16)
            kw = dict(packed_qkv=packed, partial_sums=ps, return_lse=True,
                      rope_base=None if rope is None else 10000.0,
                      rope_interleaved=bool(rope), rms_input=x if rms else None)
            want = jaxfuse.decode_attention(qkv.astype(jnp.float32) if ps else qkv,
                                            kc, vc, lengths, impl="reference", **kw)
            got = jax.jit(lambda *a, kw=kw: jaxfuse.decode_attention(*a, **kw))(
                qkv, kc, vc, lengths)
            f32 = lambda x: x.astype(jnp.float32)
            # o: the norm-relative error and bar of every bf16 check (decode.py); the
            # caches: the new key within one bf16 rounding.
            eo = rel_err(got[0], want[0])
            ek = float(jnp.max(jnp.abs(f32(got[2]) - f32(want[2])) /
                               (jnp.abs(f32(want[2])) + 1e-30)))
            ev = float(jnp.max(jnp.abs(f32(got[3]) - f32(want[3])) /
                               (jnp.abs(f32(want[3])) + 1e-30)))
            # values: bitwise, but for the RMS scale (a product rounded once more)
            good = eo < 2e-2 and ek <= 2 ** -7 and (ev <= 2 ** -7 if rms else ev == 0)
            ok &= good
            print(f"decode_fused check B{b} S{s} Hq{hq}/{hkv} D{d} {packed:7s} "
                  f"parts={4 if ps else 1} rope={rope} rms={rms}: o rel err {eo:.1e}, k rel "
                  f"{ek:.1e}, v rel {ev:.1e} -> {'ok' if good else 'FAIL'}", flush=True)
    print(f"decode_fused checks: {'all ok' if ok else 'FAILURES'}")
    b, s, n, hq, hkv, d, copies = 32, 768, 528, 16, 4, 64, 8
    g = hq // hkv
    ks = jax.random.split(jax.random.key(5), 3)
    kcs = [jax.random.normal(jax.random.fold_in(ks[0], i), (b, s, hkv, d), jnp.bfloat16)
           for i in range(copies)]
    vcs = [jax.random.normal(jax.random.fold_in(ks[1], i), (b, s, hkv, d), jnp.bfloat16)
           for i in range(copies)]
    lengths = jnp.full((b,), n, jnp.int32)
    parts = jax.random.normal(ks[2], (4, b, hkv * (g + 2), d), jnp.float32)
    heads = jnp.concatenate([parts[0, :, :hkv * g], parts[0, :, hkv * g:]], 1).astype(
        jnp.bfloat16)
    grouped = parts[0].astype(jnp.bfloat16)
    rope = dict(rope_base=10000.0)
    forms = {"packed heads, bf16 (XLA summed and rotated)": (heads, dict(packed_qkv=True)),
             "grouped, bf16": (grouped, dict(packed_qkv="grouped")),
             "grouped, bf16 + RoPE in the kernel": (grouped, dict(packed_qkv="grouped", **rope)),
             "grouped, 4 float32 partials": (parts, dict(packed_qkv="grouped",
                                                         partial_sums=True)),
             "grouped, 4 float32 partials + RoPE in the kernel": (parts, dict(
                 packed_qkv="grouped", partial_sums=True, **rope))}
    for name, (qkv, kw) in forms.items():
        f = jax.jit(lambda q, kcs, vcs, n, kw=kw: [jaxfuse.decode_attention(
            q, kc, vc, n, **kw)[0] for kc, vc in zip(kcs, vcs)])
        # The attention kernel alone: unjitted from a loop, the aliased caches are copied
        # first (not donated here), which the model's loop does not do.
        kt = [r for r in kernel_times(f, (qkv, kcs, vcs, lengths), reps=5)
              if "decode_attention" in r[0]]
        us = sum(ms for _, _, ms in kt) * 1e3 / copies
        print(f"decode_fused cold B{b} S{s} len{n}: {name:52s} {us:6.2f} us a call",
              flush=True)


def argmax_forms():
    """Greedy's pick of each row's best token, [32, 32768] logits (s26): `jnp.argmax` (XLA: two
    reductions) against `lax.top_k(., 1)` (XLA's top-k kernel), equal on random rows, ties and
    NaN/inf, and their kernels."""
    from benchmarks._profile import kernel_times
    x = jax.random.normal(jax.random.key(0), (32, 32768), jnp.float32)
    odd = x.at[3, 100].set(jnp.nan).at[3, 50].set(jnp.nan).at[5, 7].set(jnp.inf)
    argmax = jax.jit(lambda z: jnp.argmax(z, -1))
    top1 = jax.jit(lambda z: jax.lax.top_k(z, 1)[1][:, 0])
    for name, y in (("random", x), ("ties", jnp.round(x * 2)), ("nan/inf", odd)):
        for dt in (jnp.bfloat16, jnp.float32):
            z = y.astype(dt)
            print(f"argmax_forms {name:8s} {jnp.dtype(dt).name:9s} top_k equals argmax: "
                  f"{bool((argmax(z) == top1(z)).all())}")
    z = x.astype(jnp.bfloat16)
    for name, f in (("argmax", argmax), ("top_k", top1)):
        kt = kernel_times(f, (z,), reps=20)
        print(f"argmax_forms {name}: " + ", ".join(f"{k[:40]} x{c} {ms * 1e3:.2f} us"
                                                   for k, c, ms in kt))


def _touch(arrays, programs: int, interpret: bool = False, block: int = 2048, unroll: int = 8):
    """A Pallas kernel of `programs` programs that reads `arrays` into L2 and keeps nothing:
    each program loads every `programs`-th group of `unroll` blocks of `block` elements
    ("evict_last", all of a group's loads issued before any is used) and stores their sum (an
    unused load is deleted by the compiler). The prefetch s27 tried inside the decoding
    kernel, alone."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt
    from jaxfuse.pallas import _common as C

    def kernel(*refs):
        program, total = pl.program_id(0), jnp.float32(0)
        for ref in refs[:-1]:
            n = ref.shape[0]
            size = min(block, 1 << (n.bit_length() - 1))
            blocks = C.cdiv(n, size)

            def body(i, acc, ref=ref, n=n, size=size, blocks=blocks):
                g, tiles = program + i * programs, []
                for u in range(unroll):
                    j = g * unroll + u
                    idx = j * size + jnp.arange(size, dtype=jnp.int32)
                    tiles.append(plt.load(ref.at[pl.ds(jnp.minimum(j, blocks - 1) * size, size)],
                                          mask=idx < n, other=0, eviction_policy="evict_last"))
                for t in tiles:
                    acc = acc + t.astype(jnp.float32)
                return acc
            acc = jax.lax.fori_loop(0, C.cdiv(C.cdiv(blocks, unroll), programs), body,
                                    jnp.zeros((size,), jnp.float32))
            total = total + jnp.sum(acc)
        refs[-1][...] = jnp.full((1,), total)

    return C.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((programs,), jnp.float32),
                         grid=(programs,), name="probe_touch", interpret=interpret,
                         num_warps=4, in_specs=[pl.BlockSpec(memory_space=pl.ANY)] * len(arrays),
                         out_specs=pl.BlockSpec((1,), lambda i: (i,)))(
                             *[a.reshape(-1) for a in arrays])


def l2_prefetch():
    """Would a decoding step's small matmuls run faster from L2? (s27) After each layer's
    attention the 157M step runs o (2 MiB), gate/up (11.5 MB), down (5.8 MB) and the next
    layer's q/k/v (3.1 MB) matmuls at 0.65-1.8 TB/s of weights (latency-bound launches, cold
    weights); the attention kernel before them moves ~21 MB in ~10 us, half the copy rate.
    Chain of 8 layers with their own weights (cold), profiler kernel times a layer:
    A) the matmuls alone; B) after a kernel that reads the layer's weights; C) after a kernel
    whose programs read a 21 MB stand-in KV cache and the weights; D) the KV stand-in alone
    (C - D: what the weights add to such a kernel). Every load "evict_last" (`_touch`)."""
    from benchmarks._profile import kernel_times
    bar = jax.lax.optimization_barrier
    n_layers, d, f, nqkv = 8, 1024, 2816, 1536
    keys = jax.random.split(jax.random.key(7), 5)
    ws = {"o": (n_layers, d, d), "w13": (n_layers, d, 2 * f), "w2": (n_layers, f, d),
          "qkv": (n_layers, d, nqkv)}
    # One array a layer (not stacked): a slice of a stacked array would reach the touch
    # kernel as a copy, and the copy, not the touch, would warm L2 (s27-2's first version).
    ws = {k: [jax.random.normal(jax.random.fold_in(kk, i), s[1:], jnp.bfloat16) * s[1] ** -0.5
              for i in range(n_layers)] for kk, (k, s) in zip(keys, ws.items())}
    kv = [jax.random.normal(jax.random.fold_in(keys[4], i), (21 * 2 ** 20 // 2,), jnp.bfloat16)
          for i in range(n_layers)]
    x = jax.random.normal(jax.random.key(8), (32, d), jnp.bfloat16)
    programs = int(os.environ.get("TOUCH_PROGRAMS", "264"))

    def chain(form):
        def fn(x, ws, kv):
            touched = []          # returned, or XLA drops the touch kernels as dead
            for i in range(n_layers):
                w = {k: v[i] for k, v in ws.items()}
                nxt = ws["qkv"][(i + 1) % n_layers]
                mats = [w["o"], w["w13"], w["w2"], nxt]
                # tied to this layer's input: the touch runs after the layers before it
                x, *mats = bar((x, *mats))
                if form == "B":
                    x, t = bar((x, _touch(mats, programs)))
                elif form == "C":
                    x, t = bar((x, _touch([kv[i]] + mats, programs)))
                elif form == "D":
                    x, t = bar((x, _touch([kv[i]], programs)))
                if form != "A":
                    touched.append(t)
                h = (x @ w["o"]).astype(jnp.bfloat16) + x
                hf = h.astype(jnp.float32)
                n = (hf * jax.lax.rsqrt(jnp.mean(hf * hf, -1, keepdims=True) + 1e-6)
                     ).astype(jnp.bfloat16)
                gu = n @ w["w13"]
                a = (jax.nn.silu(gu[:, :f].astype(jnp.float32)) * gu[:, f:]).astype(jnp.bfloat16)
                h = h + (a @ w["w2"]).astype(jnp.bfloat16)
                parts = jnp.einsum("bpk,pkn->pbn", h.reshape(32, 8, d // 8),
                                   nxt.reshape(8, d // 8, nqkv),
                                   preferred_element_type=jnp.float32)
                x = bar(parts.sum(0)[:, :d].astype(jnp.bfloat16))
            return x, touched
        return jax.jit(fn)

    for form in ("A", "B", "C", "D"):
        fn = chain(form)
        fn(x, ws, kv)
        kt = kernel_times(fn, (x, ws, kv), reps=5)
        total = sum(ms for _, _, ms in kt) * 1e3 / n_layers
        touch = sum(ms for k, _, ms in kt if "probe_touch" in k) * 1e3 / n_layers
        gemm = sum(ms for k, _, ms in kt if "gemm" in k or "nvjet" in k) * 1e3 / n_layers
        print(f"l2_prefetch {form} programs={programs}: {total:6.2f} us of kernels a layer, "
              f"touch {touch:5.2f}, matmuls {gemm:6.2f}, the rest {total - touch - gemm:6.2f}",
              flush=True)
        for kname, count, ms in kt[:8]:
            print(f"      {kname[:60]:60s} x{count} {ms * 1e3 / n_layers:6.2f} us a layer")


SECTIONS = {"top_k_order": top_k_order, "beam_top_k": beam_top_k, "beam_step": beam_step,
            "rope": rope_kernels,
            "decode_attention": decode_attention_kernels, "decode_append": decode_append,
            "decode_attention_cold": decode_attention_cold,
            "reorder": reorder, "launch_chain": launch_chain, "hopper_gemv": hopper_gemv,
            "qkv_parts": qkv_parts, "decode_fused": decode_fused,
            "argmax": argmax_forms, "l2_prefetch": l2_prefetch}


def main():
    print(f"device={jax.devices()[0].device_kind} jax={jax.__version__}")
    for name in sys.argv[1:] or list(SECTIONS):
        SECTIONS[name]()
    _timing.save(os.environ.get("PROBE_JSON"))


if __name__ == "__main__":
    main()
