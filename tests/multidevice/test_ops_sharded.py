"""Every op under jax.sharding on 8 virtual CPU devices: outputs and gradients equal to the
one-device run (float32, tight tolerances), and the compiled HLO holds no all-gather of an
operand the rule splits (`jit(...).lower(...).compile().as_text()`)."""
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxfuse
from tests._util import kernel_names, keys, randn

AUTO = jax.make_mesh((2, 2, 2), ("data", "tensor", "seq"), axis_types=(AxisType.Auto,) * 3)
TOL = dict(atol=2e-5, rtol=2e-5)


def gathered_shapes(hlo: str) -> list[tuple[int, ...]]:
    """Result shapes of the all-gathers in compiled HLO text."""
    shapes = re.findall(r"= \w+\[([\d,]*)\][^=]*? all-gather\(", hlo)
    return [tuple(int(d) for d in s.split(",") if d) for s in shapes]


def run_both(f, args, specs, diff, seed=99, mesh=AUTO):
    """(outputs, grads of args[diff] for a random cotangent) on one device and on `mesh` with
    args placed by `specs`, and the compiled HLO of the sharded run."""
    cts = jax.tree.map(lambda s: randn(jax.random.key(seed), s.shape, s.dtype),
                       jax.eval_shape(f, *args))

    def fg(*a):
        def of_diff(*d):
            full = list(a)
            for i, x in zip(diff, d):
                full[i] = x
            return f(*full)
        y, vjp = jax.vjp(of_diff, *[a[i] for i in diff])
        # explicit mode types the cotangent with the output's sharding
        ct = jax.tree.map(lambda c, yy: jax.sharding.reshard(c, jax.typeof(yy).sharding.spec)
                          if jax.sharding.get_abstract_mesh().are_all_axes_explicit else c, cts, y)
        return y, vjp(ct)

    jf = jax.jit(fg)
    one = jf(*args)
    with jax.set_mesh(mesh):
        placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]
        # One lowering and compile serves the run and the HLO text (a call, then
        # jf.lower().compile() for the text, lowered the interpreted kernels twice).
        compiled = jf.lower(*placed).compile()
        return one, compiled(*placed), compiled.as_text()


def assert_same(one, many):
    chex.assert_trees_all_close(jax.tree.map(np.asarray, many), jax.tree.map(np.asarray, one),
                                **TOL)


# ---- row ops over leading axes ---------------------------------------------------------------

def _norm(kind, x, w, b):
    """(the norm as a function, its arguments): RMSNorm takes no bias."""
    if kind == "rms_norm":
        return (lambda x, w: jaxfuse.rms_norm(x, w)), (x, w)
    return (lambda x, w, b: jaxfuse.layer_norm(x, w, b)), (x, w, b)


@pytest.mark.parametrize("kind", ["rms_norm", "layer_norm"])
def test_norms_rows_split(kind):
    k = keys(0, 3)
    x = randn(k[0], (2, 12, 13), shift=3.0)
    w, b = randn(k[1], (13,)), randn(k[2], (13,))
    f, args = _norm(kind, x, w, b)
    specs = [P("data", ("tensor", "seq")), P(), P()][:len(args)]
    one, many, hlo = run_both(f, args, specs, diff=tuple(range(len(args))))
    assert_same(one, many)
    assert gathered_shapes(hlo) == []
    assert "all-reduce" in hlo          # dweight (and dbias): one psum of partial column sums


@pytest.mark.parametrize("huge", [False, True])
@pytest.mark.parametrize("kind", ["rms_norm", "layer_norm"])
def test_norms_columns_split(kind, huge):
    """The normalized axis split across devices: per-device statistics merged (Welford/Chan
    for LayerNorm, which stays accurate with |mean| >> std), no gather of x. `huge`: some
    rows' squares overflow float32 on one device's columns only, so states of different
    scales s meet in the merge (a psum of sums of squares in different units was wrong)."""
    k = keys(13, 3)
    x = randn(k[0], (6, 5, 24), shift=30.0)
    if huge:
        x = x.at[::2, :, 6:12].multiply(1e25)
    w, b = randn(k[1], (24,)), randn(k[2], (24,))
    f, args = _norm(kind, x, w, b)
    specs = [P("data", None, ("tensor", "seq")), P(("tensor", "seq")), P(("tensor", "seq"))]
    one, many, hlo = run_both(f, args, specs[:len(args)], diff=tuple(range(len(args))))
    assert_same(one, many)
    # only per-row (count, mean, m2, s) states cross devices: 4 devices x 4 x 15 local rows
    assert all(np.prod(s) <= 4 * 4 * 15 for s in gathered_shapes(hlo))
    if huge:
        y64 = np.asarray(x, np.float64)
        if kind == "layer_norm":
            y64 = y64 - y64.mean(-1, keepdims=True)
        eps = 1e-5 if kind == "layer_norm" else 1e-6
        y64 = y64 / np.sqrt((y64 ** 2).mean(-1, keepdims=True) + eps) * np.asarray(w)
        if kind == "layer_norm":
            y64 = y64 + np.asarray(b)
        np.testing.assert_allclose(np.asarray(many[0]), y64, rtol=1e-4, atol=1e-4)


def test_softmax_mask_rows_split():
    k = keys(1, 2)
    x = randn(k[0], (4, 6, 10, 17))
    mask = jax.random.bernoulli(k[1], 0.7, (10, 17))
    f = lambda x: jaxfuse.softmax(x, scale=0.3, mask=mask)
    one, many, hlo = run_both(f, (x,), [P("data", "tensor", "seq")], diff=(0,))
    assert_same(one, many)
    assert gathered_shapes(hlo) == []


def test_softmax_columns_split():
    """The softmax axis split across devices: per-row (m, l) merged, no gather of x. The mask
    empties some rows on some devices and one row everywhere (zeros, zero gradient)."""
    k = keys(17, 2)
    x = randn(k[0], (4, 6, 24), scale=4.0)
    mask = jax.random.bernoulli(k[1], 0.5, (4, 6, 24)).at[:, :, :12].set(False)
    mask = mask.at[1, 2].set(False)
    f = lambda x: jaxfuse.softmax(x, scale=0.5, mask=mask)
    one, many, hlo = run_both(f, (x,), [P("data", None, ("tensor", "seq"))], diff=(0,))
    assert_same(one, many)
    assert all(np.prod(s) <= 4 * 2 * 6 for s in gathered_shapes(hlo))   # per-row scalars only
    assert np.all(np.asarray(many[0])[1, 2] == 0)


def test_softmax_causal():
    x = randn(keys(2, 1)[0], (4, 2, 8, 11))
    f = lambda x: jaxfuse.softmax(x, causal=True)
    one, many, hlo = run_both(f, (x,), [P("data", "tensor")], diff=(0,))
    assert_same(one, many)
    assert gathered_shapes(hlo) == []
    # The query axis of a causal softmax stays whole (its mask needs global row indices):
    # splitting it is still correct, through a gather.
    one, many, _ = run_both(f, (x,), [P(None, None, ("data", "seq"))], diff=(0,))
    assert_same(one, many)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_cross_entropy_tokens_split(reduction):
    k = keys(3, 2)
    logits = randn(k[0], (4, 8, 19), scale=3.0)
    labels = jax.random.randint(k[1], (4, 8), 0, 19).at[1, 2].set(-100).at[3, 5].set(-100)
    f = lambda lg: jaxfuse.cross_entropy(lg, labels, label_smoothing=0.1, reduction=reduction)
    one, many, hlo = run_both(f, (logits,), [P("data", ("tensor", "seq"))], diff=(0,))
    assert_same(one, many)
    assert gathered_shapes(hlo) == []


@pytest.mark.parametrize("spec", [P(None, None, ("tensor", "seq")), P("data", "seq", "tensor")])
def test_cross_entropy_vocab_split(spec):
    """Megatron's vocab-parallel cross-entropy: only per-row scalars cross devices."""
    k = keys(12, 2)
    logits = randn(k[0], (4, 6, 28), scale=3.0)
    labels = jax.random.randint(k[1], (4, 6), 0, 28).at[0, 1].set(-100)
    f = lambda lg: jaxfuse.cross_entropy(lg, labels, label_smoothing=0.1, reduction="none")
    one, many, hlo = run_both(f, (logits,), [spec], diff=(0,))
    assert_same(one, many)
    assert gathered_shapes(hlo) == []
    reduced = re.findall(r"= \(?\w+\[([\d,]*)\][^=]*? all-reduce\(", hlo)
    assert reduced and all(np.prod([int(d) for d in r.split(",") if d]) <= 4 * 6 for r in reduced)


def test_cross_entropy_vocab_split_with_a_plus_inf_logit():
    """The vocabulary-parallel merge of the per-row (m, l) (`sharding.rows`): a +inf logit on
    one device's slice gives lse = +inf and a loss of +inf, as the reference, where the merge
    took exp(m_i - m) = exp(inf - inf) = NaN. Row 1 also has finite logits of 200 on another
    slice (exp(200) overflows: the rescale is clamped) and -inf on a third; softmax, split the
    same way, gives the reference's NaNs (at the inf, and where exp(0.5 x) overflows) and
    zeros elsewhere."""
    logits = randn(keys(13, 1)[0], (2, 4, 28), scale=3.0)
    logits = (logits.at[0, 0, 3].set(jnp.inf)
              .at[0, 1, 20].set(jnp.inf).at[0, 1, :7].set(200.0).at[0, 1, 7:14].set(-jnp.inf))
    labels = jnp.zeros((2, 4), jnp.int32).at[0, 0].set(5)
    spec = NamedSharding(AUTO, P(None, None, ("tensor", "seq")))
    for f in (lambda lg, impl="pallas": jaxfuse.cross_entropy(lg, labels, reduction="none",
                                                              impl=impl),
              lambda lg, impl="pallas": jaxfuse.softmax(lg, scale=0.5, impl=impl)):
        want = np.asarray(f(logits, "reference"))
        got = np.asarray(jax.jit(f)(jax.device_put(logits, spec)))
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        np.testing.assert_array_equal(np.isposinf(got), np.isposinf(want))
        fin = np.isfinite(want)
        np.testing.assert_allclose(got[fin], want[fin], **TOL)
        if want.ndim == 2:        # the loss: +inf in the rows that hold one
            assert np.isposinf(want[0, :2]).all()


@pytest.mark.parametrize("x_spec,w_spec", [(P(), P(None, ("tensor", "seq"))),
                                            (P("data", "seq"), P(None, "tensor"))])
def test_linear_cross_entropy_vocab_parallel(x_spec, w_spec):
    """Tokens over data, W's vocabulary over tensor: per-token states merge, dW stays sharded,
    dx is reduced; no [N, V] logits and no gathered W anywhere."""
    k = keys(14, 3)
    x, w = randn(k[0], (4, 6, 16)), randn(k[1], (16, 40), scale=0.5)
    labels = jax.random.randint(k[2], (4, 6), 0, 40).at[2, 3].set(-100)
    f = lambda x, w: jaxfuse.linear_cross_entropy(x, w, labels, label_smoothing=0.1,
                                                  z_loss=1e-3, logits_soft_cap=5.0)
    one, many, hlo = run_both(f, (x, w), [x_spec, w_spec], diff=(0, 1))
    assert_same(one, many)
    assert gathered_shapes(hlo) == []
    assert "f32[24,40]" not in hlo and "f32[16,40]" not in hlo.split("ENTRY")[1].split("ROOT")[0]


_SMOOTH = dict(label_smoothing=0.1)


@pytest.mark.parametrize("n_tok,token_slab,x_spec,w_spec,explicit,opts", [
    (64, 8, P(("data", "seq")), P(), False, _SMOOTH),      # 4 devices x 2 slabs each
    (64, 4, P("data"), P(), False, _SMOOTH),               # 2 devices x 8 slabs
    (60, 7, P(("data", "seq")), P(), False, _SMOOTH),      # 15 tokens a device: a padded slab
    (64, 8, P(("data", "seq")), P(), True, _SMOOTH),       # explicit sharding mode
    # W's vocabulary split: it stays split (the slab's statistics merge across the slices)
    (64, 16, P("data"), P(None, "tensor"), False, _SMOOTH),
    (64, 8, P(), P(None, ("tensor", "seq")), False, dict(label_smoothing=1.0)),
    # ... a padded last slab, a summed loss, no smoothing, and an out-of-range label (NaN loss
    # and gradients, as on one device)
    (60, 7, P("data"), P(None, "tensor"), False, dict(reduction="sum", bad_label=True)),
    (64, 8, P("data"), P(None, "tensor"), True, _SMOOTH),  # explicit mode
])
def test_linear_cross_entropy_token_slabs(n_tok, token_slab, x_spec, w_spec, explicit, opts):
    """`LCEBlocks(token_slab=n)` (the gradient formed in the forward) on a mesh: each device
    walks its own tokens and its slice of W's vocabulary, dx stays split like x, dW like W,
    nothing is gathered; the one-device numbers."""
    opts = dict(opts)
    k = keys(15, 3)
    x, w = randn(k[0], (n_tok, 16)), randn(k[1], (16, 40), scale=0.5)
    labels = jax.random.randint(k[2], (n_tok,), 0, 40).at[3].set(-100)
    if opts.pop("bad_label", False):
        labels = labels.at[40].set(40)
    f = lambda x, w, y: jaxfuse.linear_cross_entropy(
        x, w, y, block_sizes=jaxfuse.LCEBlocks(token_slab=token_slab), **opts)
    mesh = (jax.make_mesh((2, 2, 2), ("data", "tensor", "seq"),
                          axis_types=(AxisType.Explicit,) * 3) if explicit else AUTO)
    one, many, hlo = run_both(f, (x, w, labels), [x_spec, w_spec, x_spec], diff=(0, 1),
                              mesh=mesh)
    assert_same(one, many)
    if "reduction" in opts:                    # the out-of-range label's NaN reaches dW
        assert np.isnan(np.asarray(one[1][1])).all() and np.isnan(np.asarray(many[0]))
    assert gathered_shapes(hlo) == []          # no token's x, labels or logits, nor W
    dx, dw = many[1]
    dim = lambda spec, i: (tuple(spec) + (None, None))[i]
    assert dim(dx.sharding.spec, 0) == dim(x_spec, 0), dx.sharding
    assert dim(dw.sharding.spec, 1) == dim(w_spec, 1), dw.sharding


# ---- attention -------------------------------------------------------------------------------

def _qkv(seed, b=2, tq=16, tk=16, hkv=2, g=2, d=8):
    k = keys(seed, 3)
    return (randn(k[0], (b, tq, hkv * g, d)), randn(k[1], (b, tk, hkv, d)),
            randn(k[2], (b, tk, hkv, d)))


@pytest.mark.parametrize("causal", [True, False])
def test_flash_batch_heads_split(causal):
    q, k, v = _qkv(4, hkv=4, g=2)
    f = lambda q, k, v: jaxfuse.flash_attention(q, k, v, causal=causal, return_lse=True)
    specs = [P("data", None, ("tensor", "seq"))] * 3        # query heads follow their KV head
    one, many, hlo = run_both(f, (q, k, v), specs, diff=(0, 1, 2))
    assert_same(one, many)
    assert gathered_shapes(hlo) == []


def test_flash_gqa_segments_queries_split():
    q, k, v = _qkv(5, tq=12, tk=20, hkv=2, g=3)
    seg_q = jnp.repeat(jnp.array([[0, 1, 2], [0, 0, 1]]), 4, axis=1)
    seg_k = jnp.repeat(jnp.array([[0, 1, 2, 2], [0, 0, 1, 1]]), 5, axis=1)
    f = lambda q, k, v, sq, sk: jaxfuse.flash_attention(q, k, v, q_segment_ids=sq,
                                                        kv_segment_ids=sk)
    specs = [P("data", "seq", "tensor"), P("data", None, "tensor"), P("data", None, "tensor"),
             P("data", "seq"), P("data")]
    one, many, hlo = run_both(f, (q, k, v, seg_q, seg_k), specs, diff=(0, 1, 2))
    assert_same(one, many)
    assert gathered_shapes(hlo) == []   # queries split, K/V whole: dK, dV are psum-reduced


@pytest.mark.parametrize("explicit", [False, True])
@pytest.mark.parametrize("impl", ["pallas", "reference"])
def test_flash_int64_segments_split(explicit, impl):
    """int64 segment ids (x64) that an int32 cast would merge (2^32 apart) become per-row
    ranks on the global rows, here split over batch and sequence: on an Explicit mesh that
    sort runs on Auto axes (it was a ShardingTypeError: "Arguments to sort must be unsharded
    over the sorting dimension")."""
    mesh = (jax.make_mesh((2, 2, 2), ("data", "tensor", "seq"),
                          axis_types=(AxisType.Explicit,) * 3) if explicit else AUTO)
    with jax.enable_x64(True):
        q, k, v = _qkv(16, b=2, tq=16, tk=16, hkv=2, g=2)
        seg = jnp.repeat(jnp.array([[0, 1, 2, 3], [5, 5, 6, 6]]), 4, axis=1)
        kv_seg = seg + (seg % 2) * 2 ** 32          # odd documents' keys in another segment
        f = lambda q, k, v, sq, sk: jaxfuse.flash_attention(
            q, k, v, causal=True, q_segment_ids=sq, kv_segment_ids=sk, return_lse=True,
            impl=impl)
        specs = [P("data", "seq", "tensor")] * 3 + [P("data", "seq")] * 2
        one, many, _ = run_both(f, (q, k, v, seg, kv_seg), specs, diff=(0, 1, 2), mesh=mesh)
        want = jaxfuse.flash_attention(q, k, v, causal=True, q_segment_ids=seg,
                                       kv_segment_ids=kv_seg, return_lse=True, impl="reference")
    assert_same(one, many)
    chex.assert_trees_all_close(jax.tree.map(np.asarray, one[0]),
                                jax.tree.map(np.asarray, want), **TOL)
    assert np.isneginf(np.asarray(one[0][1])[0, :, 4:8]).all()   # document 1 sees no key


@pytest.mark.parametrize("causal", [True, False])
def test_ring_attention_gqa_segments(causal):
    """Sequence split (context parallel): ring attention, forward and backward, with K/V
    passed around the ring and never gathered."""
    q, k, v = _qkv(15, b=2, tq=24, tk=24, hkv=2, g=2)
    seg = jnp.repeat(jnp.array([[0, 0, 1], [0, 1, 1]]), 8, axis=1)
    f = lambda q, k, v: jaxfuse.flash_attention(q, k, v, causal=causal, q_segment_ids=seg,
                                                kv_segment_ids=seg, logits_soft_cap=4.0,
                                                return_lse=True)
    one, many, hlo = run_both(f, (q, k, v), [P("data", "seq", "tensor")] * 3, diff=(0, 1, 2))
    assert_same(one, many)
    assert gathered_shapes(hlo) == []


@pytest.mark.parametrize("explicit", [False, True])
def test_ring_attention_over_axes_listed_out_of_mesh_order(explicit):
    """The sequence split over ("seq", "tensor") on a ("data", "tensor", "seq") mesh: the
    chunks lie in the tuple's order, which `axis_index` follows and ppermute does not (it
    numbers a group in the mesh's order): the causal ring's moves and masks took the wrong
    chunks (max error 1.1 before `ring._ppermute` renumbered them)."""
    mesh = (jax.make_mesh((2, 2, 2), ("data", "tensor", "seq"),
                          axis_types=(AxisType.Explicit,) * 3) if explicit else AUTO)
    q, k, v = _qkv(17, b=2, tq=16, tk=16, hkv=2, g=1)
    seg = jnp.repeat(jnp.array([[0, 0, 1, 1], [0, 1, 1, 1]]), 4, axis=1)
    f = lambda q, k, v: jaxfuse.flash_attention(q, k, v, causal=True, q_segment_ids=seg,
                                                kv_segment_ids=seg, return_lse=True)
    one, many, hlo = run_both(f, (q, k, v), [P("data", ("seq", "tensor"))] * 3, diff=(0, 1, 2),
                              mesh=mesh)
    assert_same(one, many)
    assert gathered_shapes(hlo) == []


@pytest.mark.parametrize("explicit", [False, True])
def test_causal_ring_needs_even_chunks_else_the_sequence_stays_whole(explicit):
    """T = 24 over 8 devices gives each 3 positions, which the causal ring cannot cut in two
    halves: the sequence stays whole (gathered), as an uneven split does, and the result is
    the one-device one (on an Auto mesh this was an INTERNAL error from XLA's partitioner)."""
    mesh = jax.make_mesh((8,), ("seq",), axis_types=((AxisType.Explicit if explicit
                                                       else AxisType.Auto),))
    q, k, v = _qkv(18, b=2, tq=24, tk=24, hkv=2, g=1)
    f = lambda q, k, v: jaxfuse.flash_attention(q, k, v, causal=True)
    one, many, _ = run_both(f, (q, k, v), [P(None, "seq")] * 3, diff=(0, 1, 2), mesh=mesh)
    assert_same(one, many)


def test_ring_attention_causal_balanced_over_4():
    """Causal ring over 4 devices (zigzag halves: equal work per device), MQA."""
    mesh = jax.make_mesh((2, 4), ("data", "seq"), axis_types=(AxisType.Auto,) * 2)
    q, k, v = _qkv(16, b=2, tq=40, tk=40, hkv=1, g=3)
    f = lambda q, k, v: jaxfuse.flash_attention(q, k, v, causal=True, return_lse=True)
    one, many, hlo = run_both(f, (q, k, v), [P("data", "seq")] * 3, diff=(0, 1, 2), mesh=mesh)
    assert_same(one, many)
    assert gathered_shapes(hlo) == []


@pytest.mark.parametrize("causal", [True, False])
def test_ring_program_is_flat_in_the_ring_size(causal):
    """The ring's steps run in a loop (`ring._ring_loop`): a device's program holds the same
    kernels for a ring of 2 devices as for 8, forward and backward. Unrolled, a causal ring of
    8 held 4x the 2-ring's (8 steps of 4 chunk pairs, each a switch of 2 kernel variants)."""
    from jaxfuse.pallas import attention as p_attn
    from jaxfuse.sharding import ring

    def kernels(n):
        mesh = jax.make_mesh((n,), ("seq",), axis_types=(AxisType.Auto,))
        c = 2 if causal else 1
        q = jnp.zeros((1, 4 * n, 2, 8), jnp.float32)
        chunk = (1, 4 // c, 2, 8)
        plans = tuple(p_attn.plan(chunk, chunk, q.dtype, causal=cz, scale=None, segments=False,
                                  sliding_window=None, logits_soft_cap=None, interpret=True,
                                  block_sizes=None) for cz in (False, True))
        axes = ring.RingAxes(("seq",), ("seq",))
        seq = P(None, "seq")

        def fwd_bwd(q, k, v):
            o, lse = ring.forward(axes, causal, plans, q, k, v, None, None)
            return ring.backward(axes, causal, plans, q, k, v, None, None, o, lse, o, lse)
        f = jax.shard_map(fwd_bwd, mesh=mesh, in_specs=(seq,) * 3, out_specs=(seq,) * 3,
                          check_vma=False)     # as the partitioning rules run it
        return len(kernel_names(jax.make_jaxpr(f)(q, q, q).jaxpr))

    two, eight = kernels(2), kernels(8)
    assert two > 0 and two == eight, (two, eight)


def test_decode_batch_heads_length_split():
    b, s, hkv, g, d = 4, 40, 2, 3, 8
    k = keys(6, 3)
    q, kc, vc = randn(k[0], (b, hkv * g, d)), randn(k[1], (b, s, hkv, d)), randn(k[2], (b, s, hkv, d))
    lengths = jnp.array([0, 7, 40, 23])
    f = jax.jit(lambda *a: jaxfuse.decode_attention(*a, return_lse=True))
    one = f(q, kc, vc, lengths)
    specs = [P("data", "tensor"), P("data", "seq", "tensor"), P("data", "seq", "tensor"),
             P("data")]
    placed = [jax.device_put(a, NamedSharding(AUTO, sp)) for a, sp in zip((q, kc, vc, lengths), specs)]
    compiled = f.lower(*placed).compile()          # one compile for the run and the text
    many = compiled(*placed)
    np.testing.assert_allclose(np.asarray(many[0]), np.asarray(one[0]), **TOL)
    np.testing.assert_allclose(np.asarray(many[1]), np.asarray(one[1]), **TOL)  # -inf at length 0
    # Only the per-device partial (o, lse) rows cross devices, never the cache.
    hlo = compiled.as_text()
    assert gathered_shapes(hlo) and all(np.prod(sh) <= b * hkv * g * d for sh in gathered_shapes(hlo))


def test_decode_append_on_a_length_split_cache():
    """k_new/v_new land on the device whose slice of the cache holds position kv_lengths[b]
    (two slices of 20: positions 0 and 9 in the first, 39 in the second; 40 is a full cache,
    nothing written)."""
    b, s, hkv, g, d = 4, 40, 2, 3, 8
    k = keys(7, 5)
    q, kc, vc = randn(k[0], (b, hkv * g, d)), randn(k[1], (b, s, hkv, d)), randn(k[2], (b, s, hkv, d))
    kn, vn = randn(k[3], (b, hkv, d)), randn(k[4], (b, hkv, d))
    lengths = jnp.array([0, 9, 40, 39])
    f = jax.jit(lambda *a: jaxfuse.decode_attention(*a[:4], k_new=a[4], v_new=a[5],
                                                    return_lse=True))
    want = jaxfuse.decode_attention(q, kc, vc, lengths, k_new=kn, v_new=vn, return_lse=True,
                                    impl="reference")
    specs = [P("data", "tensor"), P("data", "seq", "tensor"), P("data", "seq", "tensor"),
             P("data"), P("data", "tensor"), P("data", "tensor")]
    placed = [jax.device_put(a, NamedSharding(AUTO, sp))
              for a, sp in zip((q, kc, vc, lengths, kn, vn), specs)]
    many = f(*placed)
    for got, w in zip(many[:2], want[:2]):
        np.testing.assert_allclose(np.asarray(got), np.asarray(w), **TOL)
    for got, w in zip(many[2:], want[2:]):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(w))
        assert tuple(got.sharding.spec)[:3] == ("data", "seq", "tensor")   # the cache stays split
    # q, k_new and v_new packed in one array: its heads stay whole, batch and length split.
    packed = jax.jit(lambda qkv, *a: jaxfuse.decode_attention(qkv, *a, packed_qkv=True,
                                                              return_lse=True))
    qkv = jax.device_put(jnp.concatenate([q, kn, vn], axis=1), NamedSharding(AUTO, P("data")))
    many = packed(qkv, *placed[1:4])
    for got, w in zip(many[:2], want[:2]):
        np.testing.assert_allclose(np.asarray(got), np.asarray(w), **TOL)
    for got, w in zip(many[2:], want[2:]):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(w))
    # Grouped partial sums with RoPE (decoding's fused input): on a length-split cache each
    # device's lengths are shifted to its slice, so the new token is turned by its global
    # position (positions 39 and 9 land on different devices).
    parts = randn(keys(8, 1)[0], (2, b, hkv * (g + 2), d))
    x = jax.device_put(randn(keys(9, 1)[0], (b, 24)) * 3, NamedSharding(AUTO, P("data")))
    kw = dict(packed_qkv="grouped", partial_sums=True, rope_base=100.0, rms_input=x,
              return_lse=True)
    fused = jax.jit(lambda qkv, *a: jaxfuse.decode_attention(qkv, *a, **kw))
    want = jaxfuse.decode_attention(parts, kc, vc, lengths, impl="reference", **kw)
    many = fused(jax.device_put(parts, NamedSharding(AUTO, P(None, "data"))), *placed[1:4])
    for got, w in zip(many[:2], want[:2]):
        np.testing.assert_allclose(np.asarray(got), np.asarray(w), **TOL)
    for got, w in zip(many[2:], want[2:]):
        np.testing.assert_allclose(np.asarray(got), np.asarray(w), rtol=1e-6, atol=1e-6)


# ---- other modes -----------------------------------------------------------------------------

def test_explicit_mesh():
    mesh = jax.make_mesh((4, 2), ("data", "tensor"), axis_types=(AxisType.Explicit,) * 2)
    q, k, v = _qkv(7, b=4)
    x, w = randn(keys(8, 1)[0], (8, 6, 24)), randn(keys(9, 1)[0], (24,))
    f = lambda q, k, v, x, w: (jaxfuse.flash_attention(q, k, v, causal=True),
                               jaxfuse.rms_norm(x, w))
    specs = [P("data", None, "tensor")] * 3 + [P("data", "tensor"), P()]
    one, many, _ = run_both(f, (q, k, v, x, w), specs, diff=(0, 1, 2, 3, 4), mesh=mesh)
    assert_same(one, many)


def _reference_cases():
    """name -> (op(impl) -> function, args, specs, diff): ops whose jax.numpy reference gathers
    from a split table, contracts a split axis or scatters into a split cache, which Explicit
    axes type-check."""
    k = keys(50, 8)
    x, w, tab = randn(k[0], (8, 32)), randn(k[1], (32, 16), scale=0.3), randn(k[2], (16, 32))
    labels = jax.random.randint(k[3], (8,), 0, 16)
    q, cache = randn(k[4], (4, 4, 16)), randn(k[5], (4, 16, 4, 16))
    beams = randn(k[6], (4, 2, 8, 4, 16))
    return {
        "embedding": (
            lambda impl: lambda t, e, p: jaxfuse.embedding(t, e, pos_table=p, impl=impl),
            (jnp.arange(16).reshape(2, 8) % 16, tab, randn(k[7], (8, 32))),
            [P("data", "seq"), P("tensor"), P(None, "tensor")], (1, 2)),
        "linear_cross_entropy": (
            lambda impl: lambda x, w, y: jaxfuse.linear_cross_entropy(
                x, w, y, label_smoothing=0.1, impl=impl),
            (x, w, labels), [P("data"), P(None, "tensor"), P("data")], (0, 1)),
        "cross_entropy": (
            lambda impl: lambda z, y: jaxfuse.cross_entropy(z, y, impl=impl),
            (x[:, :16], labels), [P("data", "tensor"), P("data")], (0,)),
        "swiglu_linear": (
            lambda impl: lambda g, u, w: jaxfuse.swiglu_linear(g, u, w, impl=impl),
            (x, x[::-1], randn(keys(51, 1)[0], (32, 8), scale=0.3)), [P("data", "tensor"),
             P("data", "tensor"), P("tensor")], (0, 1, 2)),
        "decode_attention": (
            lambda impl: lambda q, kc, vc, n: jaxfuse.decode_attention(
                q, kc, vc, n, k_new=q, v_new=-q, impl=impl),
            (q, cache, cache[::-1], jnp.array([3, 15, 1, 9])),
            [P("data", "tensor"), P("data", "seq", "tensor"), P("data", "seq", "tensor"),
             P("data")], ()),
        "reorder_beams": (
            lambda impl: lambda c, p: jaxfuse.reorder_beams(
                (c,), p, jnp.full(4, 2), jnp.full(4, 5), impl=impl),
            (beams, jnp.array([[1, 0]] * 4, jnp.int32)),
            [P("data", None, None, "tensor"), P("data")], ()),
    }


@pytest.mark.parametrize("name", list(_reference_cases()))
def test_references_on_an_explicit_mesh(name):
    """`impl="reference"` on a mesh with Explicit axes: the jax.numpy reference runs on Auto
    axes (`_dispatch._reference_on_auto_axes`) and equals its one-device run, gradients too,
    its results typed as the kernel's. (Each raised a ShardingTypeError before: a gather from
    a split table or logits row, a contraction over a split axis, a scatter into a split
    cache.)"""
    op, args, specs, diff = _reference_cases()[name]
    mesh = jax.make_mesh((2, 2, 2), ("data", "tensor", "seq"),
                         axis_types=(AxisType.Explicit,) * 3)
    one, many, _ = run_both(op("reference"), args, specs, diff=diff, mesh=mesh)
    assert_same(one, many)
    with jax.set_mesh(mesh):
        placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]
        want = jax.eval_shape(op("pallas"), *placed)
    spec = lambda a: jax.typeof(a).sharding.spec
    assert jax.tree.map(spec, many[0]) == jax.tree.map(lambda s: s.sharding.spec, want)


def test_reference_on_an_explicit_mesh_takes_what_only_it_takes():
    """A head dim of 4 has no kernel tiles; the reference takes it (it did before its results
    were typed by the kernel's rule, whose trace then refused it). Custom tiles do not reach
    that trace either."""
    mesh = jax.make_mesh((2, 2, 2), ("data", "tensor", "seq"),
                         axis_types=(AxisType.Explicit,) * 3)
    q = randn(keys(71, 1)[0], (2, 8, 2, 4))
    want = jaxfuse.flash_attention(q, q, q, causal=True, impl="reference")
    with jax.set_mesh(mesh):
        placed = jax.device_put(q, NamedSharding(mesh, P("data", None, "tensor")))
        got = jaxfuse.flash_attention(placed, placed, placed, causal=True, impl="reference",
                                      block_sizes=jaxfuse.AttnBlocks(block_q=1024))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **TOL)


@pytest.mark.parametrize("impl", ["pallas", "reference"])
def test_explicit_arrays_without_set_mesh(impl):
    """Arrays placed on an Explicit mesh, no `jax.set_mesh`: the ops take the mesh from their
    arguments (the rules' reshards and shard_map name PartitionSpecs, which need it in
    context: "Using PartitionSpec when you are not under a mesh context" before), eager and
    under jit, gradients under jit (an eager gradient of explicitly sharded arrays needs
    `jax.set_mesh` in JAX itself)."""
    mesh = jax.make_mesh((2, 2, 2), ("data", "tensor", "seq"),
                         axis_types=(AxisType.Explicit,) * 3)
    k = keys(70, 4)
    x, w = randn(k[0], (8, 32)), randn(k[1], (32, 16), scale=0.2)
    labels = jnp.arange(8) % 16
    q = randn(k[2], (2, 8, 4, 16))
    f = lambda x, w, q: (jaxfuse.linear_cross_entropy(jaxfuse.layer_norm(x, impl=impl), w,
                                                      labels, impl=impl)
                         + jaxfuse.swiglu_linear(x, x, w, impl=impl).sum() * 1e-2
                         + jaxfuse.flash_attention(q, q, q, causal=True, impl=impl).sum())
    put = lambda a, *s: jax.device_put(a, NamedSharding(mesh, P(*s)))
    placed = (put(x, "data", "tensor"), put(w, "tensor"), put(q, "data", None, "tensor"))
    want = f(x, w, q), jax.grad(f, argnums=(0, 1, 2))(x, w, q)
    assert jax.sharding.get_abstract_mesh().empty
    got = f(*placed), jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(*placed)
    chex.assert_trees_all_close(jax.tree.map(np.asarray, (got[0], got[1][1])),
                                jax.tree.map(np.asarray, want), **TOL)
    np.testing.assert_allclose(got[1][0], want[0], **TOL)
    for g, p in zip(got[1][1], placed):              # gradients typed like their arguments
        assert jax.typeof(g).sharding.spec == jax.typeof(p).sharding.spec


@pytest.mark.parametrize("token_slab", [None, 5])
def test_explicit_mesh_with_shardings_the_op_cannot_split(token_slab):
    """Explicit mode types every value with its sharding, and a custom_vjp's backward must type
    its cotangents like its arguments: operands the rule cannot split as they lie (W split over
    d_model, W's vocabulary on the tokens' axis, x split over d_model, a norm's weight split)
    are resharded before the op, and their gradients come back in the caller's sharding (these
    raised a custom_vjp type error before)."""
    mesh = jax.make_mesh((2, 2, 2), ("data", "tensor", "seq"),
                         axis_types=(AxisType.Explicit,) * 3)
    k = keys(40, 4)
    x, w = randn(k[0], (48, 16)), randn(k[1], (16, 40), scale=0.5)
    labels = jax.random.randint(k[2], (48,), 0, 40).at[2].set(-100)
    nw = randn(k[3], (16,))
    f = lambda x, w, y, nw: jaxfuse.linear_cross_entropy(
        jaxfuse.rms_norm(x, nw), w, y, label_smoothing=0.1,
        block_sizes=None if token_slab is None else jaxfuse.LCEBlocks(token_slab=token_slab))
    for specs in ([P("data"), P("seq", "tensor"), P("data"), P("tensor")],
                  [P("data"), P(None, "data"), P("data"), P()],
                  [P(None, "tensor"), P(None, "seq"), P(), P()]):
        one, many, _ = run_both(f, (x, w, labels, nw), specs, diff=(0, 1, 3), mesh=mesh)
        assert_same(one, many)
        for g, spec in zip(many[1], (specs[0], specs[1], specs[3])):
            padded = lambda s: tuple(s) + (None,) * (g.ndim - len(tuple(s)))
            assert padded(g.sharding.spec) == padded(spec), (g.sharding, spec)


def test_inside_shard_map_runs_per_shard():
    x, w = randn(keys(10, 1)[0], (8, 5, 24)), randn(keys(11, 1)[0], (24,))
    per_shard = jax.shard_map(lambda x, w: jaxfuse.rms_norm(x, w), mesh=AUTO,
                              in_specs=(P(("data", "tensor", "seq")), P()),
                              out_specs=P(("data", "tensor", "seq")), check_vma=False)
    np.testing.assert_allclose(np.asarray(jax.jit(per_shard)(x, w)),
                               np.asarray(jaxfuse.rms_norm(x, w)), **TOL)


@pytest.mark.parametrize("named", [False, True])
def test_inside_scan_and_remat(named):
    """Layers stacked with lax.scan and jax.checkpoint (the model's form) keep the rules, also
    under a policy that keeps the op's named residuals (`jaxfuse.residual_name`)."""
    x, ws = randn(keys(30, 1)[0], (4, 8, 16)), randn(keys(31, 1)[0], (3, 16))
    policy = (jax.checkpoint_policies.save_only_these_names(jaxfuse.residual_name("rms_norm"))
              if named else None)

    def f(x, ws):
        def layer(h, w):
            return h + jax.checkpoint(lambda h: jaxfuse.rms_norm(h, w), policy=policy)(h), None
        return jax.lax.scan(layer, x, ws)[0]

    one, many, hlo = run_both(f, (x, ws), [P("data", "seq"), P()], diff=(0, 1))
    assert_same(one, many)
    assert gathered_shapes(hlo) == []


def test_reorder_beams_batch_and_heads_split():
    """Each device reorders its rows' beams at its KV heads; no cache crosses devices."""
    b, k, s, h, d = 4, 3, 10, 2, 4
    ks = keys(8, 3)
    caches = (randn(ks[0], (b, k, s, h, d)), randn(ks[1], (b, k, s, h, d)))
    parent = jax.random.randint(ks[2], (b, k), 0, k)
    start, stop = jnp.array([0, 2, 5, 9]), jnp.array([10, 6, 5, 10])
    f = jax.jit(lambda c, p, a, z: jaxfuse.reorder_beams(c, p, a, z))
    want = jaxfuse.reorder_beams(caches, parent, start, stop, impl="reference")
    spec = NamedSharding(AUTO, P("data", None, None, "tensor"))
    placed = tuple(jax.device_put(c, spec) for c in caches)
    rows = NamedSharding(AUTO, P("data"))
    args = (jax.device_put(parent, rows), jax.device_put(start, rows), jax.device_put(stop, rows))
    compiled = f.lower(placed, *args).compile()    # one compile for the run and the text
    got = compiled(placed, *args)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
        assert tuple(g.sharding.spec)[:4] == ("data", None, None, "tensor")
    assert gathered_shapes(compiled.as_text()) == []


@pytest.mark.parametrize("op", ["rms_norm", "flash_attention"])
def test_ops_on_auto_axes_inside_an_explicit_mesh(op):
    """Whole-array code run on Auto axes inside a mesh with Explicit ones
    (`jax.sharding.auto_axes`, as `jaxfuse.model` runs its blocks): there an op partitions
    through custom_partitioning, whose per-shard body XLA traces while it compiles, with the
    caller's Explicit mesh in context. jax 0.11 typed the interpreted kernels' new values
    with that mesh, and every op failed to compile (ShardingTypeError in a
    dynamic_update_slice); the body is now traced under no mesh (`_core._per_shard`)."""
    mesh = jax.make_mesh((2, 2, 2), ("data", "tensor", "seq"),
                         axis_types=(AxisType.Explicit,) * 3)
    if op == "rms_norm":
        k = keys(21, 2)
        args = (randn(k[0], (4, 12, 13), shift=3.0), randn(k[1], (13,)))
        specs, op_fn = [P("data"), P()], lambda x, w: jaxfuse.rms_norm(x, w)
    else:
        args = _qkv(22, b=2, tq=16, tk=16, hkv=2, g=2)
        specs = [P("data")] * 3
        op_fn = lambda q, k, v: jaxfuse.flash_attention(q, k, v, causal=True)  # noqa: E731

    def f(*a):
        if jax.sharding.get_abstract_mesh().empty:   # the one-device run
            return op_fn(*a)
        return jax.sharding.auto_axes(op_fn, out_sharding=P("data"))(*a)

    one, many, _ = run_both(f, args, specs, diff=tuple(range(len(args))), mesh=mesh)
    assert_same(one, many)
