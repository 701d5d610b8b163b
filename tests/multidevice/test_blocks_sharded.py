"""The block ops under jax.sharding (`jaxfuse.sharding.blocks`): outputs and gradients equal the
one-device run, dropout masks included (each shard draws the whole array's mask at its global
rows), and nothing the rule splits is gathered."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxfuse
from tests._util import keys, randn
from tests.multidevice.test_ops_sharded import AUTO, assert_same, gathered_shapes, run_both

KEY = jax.random.key(7)


def test_dropout_family_rows_split_same_masks():
    """[B, T, D] split over batch and time (D = 32, whole 32-column blocks: one Philox call per
    eight elements, `_philox.keep_block`), and [rows, 13] over rows (a Philox call per element)."""
    k = keys(40, 4)
    x, res, bias = randn(k[0], (4, 8, 32)), randn(k[1], (4, 8, 32)), randn(k[2], (32,))
    x2 = randn(k[3], (24, 13))

    def f(x, bias, res, x2):
        return (jaxfuse.dropout(x, 0.3, KEY),
                jaxfuse.bias_dropout_add(x, bias, res, rate=0.5, key=KEY),
                jaxfuse.bias_act_dropout(x, bias, activation="gelu", rate=0.2, key=KEY),
                jaxfuse.dropout(x2, 0.4, jax.random.fold_in(KEY, 1)))

    specs = [P("data", ("tensor", "seq")), P(), P("data", ("tensor", "seq")),
             P(("data", "tensor", "seq"))]
    one, many, hlo = run_both(f, (x, bias, res, x2), specs, diff=(0, 1, 2, 3))
    assert_same(one, many)
    assert gathered_shapes(hlo) == []
    # the masks are real: about rate of the elements dropped, on every shard alike
    assert 0.2 < float(jnp.mean(many[0][0] == 0)) < 0.4


@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_add_norm_rows_split_with_dropout(norm):
    k = keys(41, 4)
    x, res = randn(k[0], (4, 8, 32)), randn(k[1], (4, 8, 32), shift=1.0)   # 32: `keep_block`
    w, b = randn(k[2], (32,)), randn(k[3], (32,))
    if norm == "rms":
        f, args = (lambda x, r, w: jaxfuse.add_norm(x, r, w, rate=0.25, key=KEY)), (x, res, w)
    else:
        f = lambda x, r, w, b: jaxfuse.add_norm(x, r, w, b, norm="layer", rate=0.25, key=KEY)
        args = (x, res, w, b)
    specs = [P("data", "seq"), P("data", "seq"), P(), P()][:len(args)]
    one, many, hlo = run_both(f, args, specs, diff=tuple(range(len(args))))
    assert_same(one, many)
    assert gathered_shapes(hlo) == []
    assert "all-reduce" in hlo          # dweight (and dbias): psum of per-device row sums


def test_add_norm_linear_column_parallel_with_dropout():
    """Rows split over batch and time, the projections over their output columns (Megatron's
    column-parallel q/k/v): equal to one device, dropout masks included."""
    k = keys(44, 6)
    x, res = randn(k[0], (4, 8, 32)), randn(k[1], (4, 8, 32), shift=1.0)
    w, b = randn(k[2], (32,)), randn(k[3], (32,))
    ps = (randn(k[4], (32, 16), scale=0.2), randn(k[5], (32, 8), scale=0.2))
    f = lambda x, r, w, b, ps: jaxfuse.add_norm_linear(x, r, w, b, projections=ps, norm="layer",
                                                        rate=0.25, key=KEY)
    specs = [P("data", "seq"), P("data", "seq"), P(), P(), P(None, "tensor")]
    one, many, hlo = run_both(f, (x, res, w, b, ps), specs, diff=(0, 1, 2, 3, 4))
    assert_same(one, many)
    assert gathered_shapes(hlo) == []


def test_swiglu_and_rope_split_everywhere():
    k = keys(42, 4)
    g, u = randn(k[0], (4, 8, 24)), randn(k[1], (4, 8, 24))
    q = randn(k[2], (4, 8, 4, 8))                       # [B, T, H, D]
    pos = jax.random.randint(k[3], (4, 8), 0, 1000)     # global positions travel with the rows

    def f(g, u, q, pos):
        return jaxfuse.swiglu(g, u), jaxfuse.rope(q, pos, interleaved=False)

    specs = [P("data", "seq", "tensor")] * 3 + [P("data", "seq")]
    one, many, hlo = run_both(f, (g, u, q, pos), specs, diff=(0, 1, 2))
    assert_same(one, many)
    assert gathered_shapes(hlo) == []


def test_rope_qkv_split_by_kv_head():
    """The grouped projection [B, T, Hkv, G + 2, D] split over batch, time and KV heads
    (Megatron's tensor parallel): each device's query heads are its KV heads' groups, so q, k, v
    and the packed gradient stay split, equal to one device."""
    k = keys(44, 2)
    qkv = randn(k[0], (4, 8, 2, 5, 8))                  # Hkv 2, G 3
    pos = jax.random.randint(k[1], (4, 8), 0, 1000)

    def f(qkv, pos):
        return jaxfuse.rope_qkv(qkv, pos, interleaved=False)

    specs = [P("data", "seq", "tensor"), P("data", "seq")]
    one, many, hlo = run_both(f, (qkv, pos), specs, diff=(0,))
    assert_same(one, many)
    assert gathered_shapes(hlo) == []


def test_swiglu_linear_row_parallel():
    """gate/up split over rows and F (Megatron's MLP: the down projection's contraction over F
    is split, XLA sums its partial products); w2 split over F, its gradient stays split."""
    k = keys(43, 3)
    g, u = randn(k[0], (4, 8, 24)), randn(k[1], (4, 8, 24))
    w = randn(k[2], (24, 16), scale=0.2)
    specs = [P("data", "seq", "tensor")] * 2 + [P("tensor", None)]
    one, many, hlo = run_both(jaxfuse.swiglu_linear, (g, u, w), specs, diff=(0, 1, 2))
    assert_same(one, many)
    assert gathered_shapes(hlo) == []
    # The forward alone, F split and the rows whole: only the split contraction can reduce.
    with jax.set_mesh(AUTO):
        placed = [jax.device_put(a, NamedSharding(AUTO, P(None, None, "tensor")))
                  for a in (g, u)] + [jax.device_put(w, NamedSharding(AUTO, P("tensor")))]
        fwd = jax.jit(jaxfuse.swiglu_linear).lower(*placed).compile().as_text()
    assert "all-reduce" in fwd or "reduce-scatter" in fwd


EXPLICIT = jax.make_mesh((2, 2, 2), ("data", "tensor", "seq"), axis_types=(AxisType.Explicit,) * 3)


@pytest.mark.parametrize("case", ["norm weight split", "x split over d", "gate and up apart",
                                  "F split", "rows and columns on one axis",
                                  "gate rows and columns on one axis"])
def test_fused_projections_on_an_explicit_mesh(case):
    """Explicit mode types every value with its sharding: operands the kernels split otherwise
    are resharded before the op, the cotangents come back typed like the caller's arguments,
    and a projection over a split F names its summed result (these raised type errors first)."""
    k = keys(45, 7)
    x, res = randn(k[0], (4, 8, 32)), randn(k[1], (4, 8, 32))
    w, ps = randn(k[2], (32,)), (randn(k[3], (32, 16), scale=0.2),)
    g, u, w2 = randn(k[4], (4, 8, 16)), randn(k[5], (4, 8, 16)), randn(k[6], (16, 32), scale=0.2)
    # "... on one axis": the rows and the weight's columns split over "data" (a result cannot
    # name one axis twice: it was a DuplicateSpecError; the rows keep it).
    if case in ("norm weight split", "x split over d", "rows and columns on one axis"):
        f = lambda x, r, w, ps: jaxfuse.add_norm_linear(x, r, w, projections=ps)
        args = (x, res, w, ps)
        specs = {"norm weight split": [P("data", "seq"), P("data", "seq"), P("tensor"), P()],
                 "x split over d": [P("data", None, "tensor"), P("data"), P(),
                                    P(None, "tensor")],
                 "rows and columns on one axis": [P("data"), P("data"), P(),
                                                  P(None, "data")]}[case]
    else:
        f, args = jaxfuse.swiglu_linear, (g, u, w2)
        specs = {"gate and up apart": [P("data"), P(None, "seq"), P()],
                 "F split": [P("data", None, "tensor"), P("data", None, "tensor"),
                             P("tensor", None)],
                 "gate rows and columns on one axis": [P("data"), P("data"),
                                                       P(None, "data")]}[case]
    one, many, _ = run_both(f, args, specs, diff=tuple(range(len(args))), mesh=EXPLICIT)
    assert_same(one, many)
    for grad, spec in zip(jax.tree.leaves(many[1]), specs):
        padded = lambda s: tuple(s) + (None,) * (grad.ndim - len(tuple(s)))
        assert padded(grad.sharding.spec) == padded(spec), (case, grad.sharding, spec)


def test_dropout_on_an_explicit_mesh_and_inside_shard_map():
    """With dropout on, the interpreted kernels under a shard_map (Explicit mode runs each
    op's shards through one; so does a user's own) failed to lower: `lax.mulhi` has no
    lowering under the manual sharding ("failed to legalize 'mhlo.unknown'"), and the kernels
    now take the references' jax.numpy product. The masks are the one-device ones."""
    k = keys(46, 3)
    x, bias, tok = randn(k[0], (8, 32)), randn(k[1], (32,)), jnp.arange(8) % 5
    one = (jaxfuse.dropout(x, 0.3, KEY), jaxfuse.bias_dropout_add(x, bias, x, rate=0.3, key=KEY),
           jaxfuse.embedding(tok, x[:5], rate=0.3, key=KEY))
    rows = NamedSharding(EXPLICIT, P("data"))
    with jax.set_mesh(EXPLICIT):
        placed = [jax.device_put(a, rows) for a in (x, tok)]
        table = jax.device_put(x[:5], NamedSharding(EXPLICIT, P()))
        many = jax.jit(lambda x, t, table: (
            jaxfuse.dropout(x, 0.3, KEY), jaxfuse.bias_dropout_add(x, bias, x, rate=0.3, key=KEY),
            jaxfuse.embedding(t, table, rate=0.3, key=KEY)))(*placed, table)
    for a, b in zip(one, many):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # in a user's shard_map each shard draws its local rows as an array of its own
    local = jax.jit(jax.shard_map(lambda x: jaxfuse.dropout(x, 0.3, KEY), mesh=AUTO,
                                  in_specs=P("data"), out_specs=P("data"), check_vma=False))(x)
    half = x.shape[0] // 2
    np.testing.assert_array_equal(np.asarray(local[:half]),
                                  np.asarray(jaxfuse.dropout(x[:half], 0.3, KEY)))


def test_embedding_vocab_parallel_with_dropout():
    """Table split over the vocabulary (tensor parallel): each device looks up its slice; a
    token out of range still gives a NaN row, and no gradient."""
    k = keys(43, 2)
    table = randn(k[0], (20, 32))                       # 32: `keep_block`
    tokens = jax.random.randint(k[1], (4, 8), 0, 20).at[1, 3].set(20)
    f = lambda tokens, table: jaxfuse.embedding(tokens, table, scale=2.0, rate=0.3, key=KEY)
    one, many, hlo = run_both(f, (tokens, table), [P("data", "seq"), P("tensor")], diff=(1,))
    assert np.isnan(np.asarray(many[0][1, 3])).all()
    assert_same(one, many)
    assert gathered_shapes(hlo) == []                   # the table never travels


def test_embedding_positions_and_d_model_split():
    k = keys(44, 4)
    table, pos_table = randn(k[0], (20, 16)), randn(k[1], (10, 16))
    tokens = jax.random.randint(k[2], (4, 8), 0, 20)
    positions = jax.random.randint(k[3], (4, 8), 0, 10)
    f = lambda tokens, table, pos_table, positions: jaxfuse.embedding(
        tokens, table, pos_table=pos_table, positions=positions)
    specs = [P("data"), P(None, ("tensor", "seq")), P(None, ("tensor", "seq")), P("data")]
    one, many, hlo = run_both(f, (tokens, table, pos_table, positions), specs, diff=(1, 2))
    assert_same(one, many)
    assert gathered_shapes(hlo) == []


def test_flash_attention_dropout_batch_heads_split():
    """Attention-probability dropout with batch and KV heads split (GQA): each shard's kernel
    drops the one-device entries of its (batch, head) slabs, forward and backward."""
    k = keys(45, 3)
    # Tk = 32: whole 32-key blocks, so the kernels draw P's mask with `_philox.keep_block`
    q, kk, v = randn(k[0], (4, 32, 8, 8)), randn(k[1], (4, 32, 4, 8)), randn(k[2], (4, 32, 4, 8))
    f = lambda q, k, v: jaxfuse.flash_attention(q, k, v, causal=True, dropout_rate=0.3,
                                                dropout_key=KEY, return_lse=True)
    one, many, hlo = run_both(f, (q, kk, v), [P("data", None, ("tensor", "seq"))] * 3,
                              diff=(0, 1, 2))
    assert_same(one, many)
    assert gathered_shapes(hlo) == []


def test_beam_step_batch_split():
    k = keys(47, 3)
    logits = randn(k[0], (8, 3, 37))
    raw = randn(k[1], (8, 3))
    lengths = jax.random.randint(k[2], (8, 3), 0, 5)
    done = raw > 1.0
    f = jax.jit(lambda *a: jaxfuse.beam_step(*a, eos_id=4, length_penalty=0.6))
    one = f(logits, raw, lengths, done)
    with jax.set_mesh(AUTO):
        placed = [jax.device_put(a, NamedSharding(AUTO, P(("data", "tensor", "seq"))))
                  for a in (logits, raw, lengths, done)]
        compiled = f.lower(*placed).compile()      # one compile for the run and the text
        many, hlo = compiled(*placed), compiled.as_text()
    for a, b in zip(many, one, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert gathered_shapes(hlo) == []


def test_beam_top_k_batch_split():
    k = keys(46, 2)
    lp = jax.nn.log_softmax(randn(k[0], (8, 3, 37)), axis=-1)
    scores = randn(k[1], (8, 3))
    f = jax.jit(lambda lp, s: jaxfuse.beam_top_k(lp, s, 4))
    one = f(lp, scores)
    with jax.set_mesh(AUTO):
        placed = [jax.device_put(a, NamedSharding(AUTO, P(("data", "tensor", "seq"))))
                  for a in (lp, scores)]
        compiled = f.lower(*placed).compile()      # one compile for the run and the text
        many, hlo = compiled(*placed), compiled.as_text()
    for a, b in zip(many, one):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert gathered_shapes(hlo) == []
