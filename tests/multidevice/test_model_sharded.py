"""The model on a mesh (`jaxfuse.model.sharding`): three AdamW steps on every parallelism and
their combinations equal the one-device run (losses, parameters, and AdamW's moments, which
are running sums of the gradients), the tensor-parallel step never holds the [B, T, V] logits,
and greedy decoding and beam search give the one-device tokens."""
import dataclasses
import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from jaxfuse import model as M
from tests._util import kernel_names
from tests.multidevice.test_ops_sharded import gathered_shapes

# Tiny, float32; every mesh below divides it (heads and d_ff by tensor=4, d_model by fsdp=8,
# the batch by data x fsdp = 8, T by 2 x seq = 8). V = 56 differs from every other dimension,
# so the HLO check can spot a logits-shaped array.
CFG = M.Config(vocab_size=56, d_model=32, n_layers=2, n_heads=4, n_kv_heads=4, d_ff=32,
               max_len=16)
B, T, STEPS = 8, 8, 3
OPT = M.optimizer(1e-2, 10, warmup_steps=1)
TOL = dict(atol=2e-5, rtol=2e-5)


def mesh_of(data=1, fsdp=1, tensor=1, seq=1, kind=AxisType.Auto):
    return jax.make_mesh((data, fsdp, tensor, seq), M.sharding.AXES, axis_types=(kind,) * 4)


def batches():
    k1, k2 = jax.random.split(jax.random.key(1))
    tokens = jax.random.randint(k1, (STEPS, B, T), 0, CFG.vocab_size)
    targets = jax.random.randint(k2, (STEPS, B, T), 0, CFG.vocab_size)
    return tokens, targets.at[:, :, :2].set(-100)     # some untargeted positions


def train(step, place):
    params = M.init(jax.random.key(0), CFG)
    params, opt_state = place(params, OPT.init(params))
    losses = []
    for tokens, targets in zip(*batches()):
        params, opt_state, loss = step(params, opt_state, tokens, targets)
        losses.append(loss)
    return losses, params, opt_state


@functools.cache
def _one_device():
    return train(lambda p, s, a, b: M.train_step(p, s, a, b, cfg=CFG, opt=OPT),
                 lambda p, s: (p, s))


@pytest.fixture
def one_device():
    """The one-device run, computed once (memoized) by the first test that asks for it. Not a
    module-scoped fixture: that is set up before conftest's function-scoped
    `_fast_cpu_compiles` of the first test, so it compiled with all of XLA:CPU's optimizations
    (about twice the CPU time of the same compile inside the test)."""
    return _one_device()


def logits_shaped(hlo: str, rows: int) -> list[str]:
    """Arrays in compiled HLO whose last dimension is the vocabulary and which hold at least
    `rows` rows of it: what a materialized (or gathered) logits tensor would look like."""
    found = []
    for dims in re.findall(r"\w+\[([\d,]+)\]", hlo):
        shape = [int(d) for d in dims.split(",")]
        if len(shape) >= 2 and shape[-1] == CFG.vocab_size and np.prod(shape[:-1]) >= rows:
            found.append(dims)
    return found


def layer_weight_shapes(mesh):
    """Per-device shapes of the stacked weights [L, a, b] once gathered over fsdp (still split
    over tensor)."""
    sizes = dict(mesh.shape)
    shapes = jax.eval_shape(lambda k: M.init(k, CFG), jax.random.key(0))["blocks"]
    specs = M.sharding.param_specs(CFG, mesh)["blocks"]
    out = []
    for name in ("wq", "wk", "wv", "wo", "w1", "w3", "w2"):
        dims = []
        for n, entry in zip(shapes[name].shape, tuple(specs[name]) + (None,) * 3):
            axes = (entry,) if isinstance(entry, str) else entry or ()
            dims.append(n // int(np.prod([sizes[a] for a in axes if a != "fsdp"])))
        out.append(tuple(dims))
    return out


@pytest.mark.parametrize("axes", [dict(data=8), dict(fsdp=8), dict(data=2, tensor=4),
                                  dict(data=2, fsdp=2, tensor=2), dict(data=2, seq=4)],
                         ids=lambda a: ",".join(f"{k}={v}" for k, v in a.items()))
def test_three_steps_equal_one_device(axes, one_device):
    mesh = mesh_of(**axes)
    step = M.sharded_train_step(CFG, OPT, mesh, batch=B, seq_len=T)
    compiled = []

    def run(p, s, a, b):
        a, b = M.sharding.shard_batch((a, b), mesh)
        if not compiled:             # one compile, whose HLO is also inspected
            compiled.append(step.lower(p, s, a, b, None).compile())
        return compiled[0](p, s, a, b, None)

    many = train(run, lambda p, s: M.sharding.shard_train_state(p, s, CFG, OPT, mesh))
    chex.assert_trees_all_close(jax.tree.map(np.asarray, many),
                                jax.tree.map(np.asarray, one_device), **TOL)
    # the parameters stay where the rules put them (FSDP: each device a slice of each weight)
    specs = M.sharding.param_specs(CFG, mesh)
    jax.tree.map(lambda x, s: chex.assert_equal(x.sharding.spec, s), many[1], specs,
                 is_leaf=lambda x: isinstance(x, P))
    hlo = compiled[0].as_text()
    if axes == dict(data=2, tensor=4):
        # vocab-parallel loss: no device holds the logits of its B T / data tokens over the
        # whole vocabulary, nor the whole unembedding [d_model, V]. (With fsdp the kernels'
        # tiles of the smaller local blocks are padded up to such shapes: checked here only.)
        assert logits_shaped(hlo, min(B * T // 2, CFG.d_model)) == []
    if axes.get("fsdp"):
        # FSDP: the scan gathers one layer's weights at a time, never a whole stack [L, ...]
        layer = {s[1:] for s in layer_weight_shapes(mesh)}
        gathered = [s for s in gathered_shapes(hlo) if s[1:] in layer]
        assert gathered and all(s[0] == 1 for s in gathered), gathered


def test_token_slab_loss_keeps_the_vocabulary_split():
    # `Config.loss_token_slab` on a tensor-parallel mesh: each device forms its slabs' logits
    # over its slice of the vocabulary (the unembedding is never gathered, no device holds a
    # whole-vocabulary row) and the step equals the one-device step with the same loss.
    cfg = dataclasses.replace(CFG, loss_token_slab=16)
    mesh = mesh_of(data=2, tensor=4)
    params = M.init(jax.random.key(0), cfg)
    tokens, targets = (a[0] for a in batches())
    step = M.sharded_train_step(cfg, OPT, mesh, batch=B, seq_len=T)
    p, s = M.sharding.shard_train_state(params, OPT.init(params), cfg, OPT, mesh)
    a, b = M.sharding.shard_batch((tokens, targets), mesh)
    compiled = step.lower(p, s, a, b, None).compile()   # run below too: one compile, not two
    hlo = compiled.as_text()
    assert logits_shaped(hlo, min(B * T // 2, CFG.d_model)) == []
    assert not [g for g in gathered_shapes(hlo) if CFG.vocab_size in g], gathered_shapes(hlo)
    with jax.set_mesh(mesh):                    # the loss as the mesh's step traces it
        names = kernel_names(jax.make_jaxpr(jax.grad(
            lambda p: M.loss(p, tokens, targets, cfg)))(params).jaxpr)
    # The jaxpr is the loss's one-device trace (the HLO asserts above check the vocabulary's
    # split): the slabs' one-kernel loss and dz, never the fused op's backward.
    assert "jaxfuse_cross_entropy_loss_grad" in names, names
    assert "jaxfuse_linear_cross_entropy_bwd" not in names
    many = jax.tree.map(np.asarray, compiled(p, s, a, b, None))
    fresh = M.init(jax.random.key(0), cfg)         # the steps donate their parameters
    one = M.train_step(fresh, OPT.init(fresh), tokens, targets, cfg=cfg, opt=OPT)
    chex.assert_trees_all_close(many, jax.tree.map(np.asarray, one), **TOL)


def test_dropout_training_on_a_mesh_equals_one_device():
    """With dropout every shard draws the one-device masks (global element indices), so even
    dropout training on a mesh is the one-device run."""
    cfg = M.Config(**{**CFG.__dict__, "dropout": 0.2})
    key = jax.random.key(5)
    one = train(lambda p, s, a, b: M.train_step(p, s, a, b, jax.random.fold_in(key, 0),
                                                cfg=cfg, opt=OPT), lambda p, s: (p, s))
    mesh = mesh_of(data=2, fsdp=2, seq=2)
    step = M.sharded_train_step(cfg, OPT, mesh)
    many = train(lambda p, s, a, b: step(p, s, *M.sharding.shard_batch((a, b), mesh),
                                         jax.random.fold_in(key, 0)),
                 lambda p, s: M.sharding.shard_train_state(p, s, cfg, OPT, mesh))
    chex.assert_trees_all_close(jax.tree.map(np.asarray, many), jax.tree.map(np.asarray, one),
                                **TOL)


@pytest.mark.parametrize("kind", [AxisType.Auto, AxisType.Explicit], ids=str)
def test_decoding_on_a_mesh_equals_one_device(kind):
    params = M.init(jax.random.key(3), CFG)
    prompts = jax.random.randint(jax.random.key(4), (4, 6), 1, CFG.vocab_size)
    lengths = jnp.array([6, 3, 5, 1], jnp.int32)
    kw = dict(max_new_tokens=4, eos_id=0)

    def decode(params, prompts, lengths):
        g = M.greedy(params, CFG, prompts, lengths, **kw)
        tokens, scores = M.beam_search(params, CFG, prompts, lengths, beam_size=2, **kw)
        return g, tokens, scores

    one = decode(params, prompts, lengths)
    mesh = mesh_of(data=2, tensor=4, kind=kind)
    with jax.set_mesh(mesh):
        placed = M.sharding.shard_params(params, CFG, mesh)
        rows = NamedSharding(mesh, P("data"))
        many = decode(placed, jax.device_put(prompts, rows), jax.device_put(lengths, rows))
    chex.assert_trees_all_equal(np.asarray(many[0]), np.asarray(one[0]))
    chex.assert_trees_all_equal(np.asarray(many[1]), np.asarray(one[1]))
    chex.assert_trees_all_close(np.asarray(many[2]), np.asarray(one[2]), **TOL)
    if kind == AxisType.Explicit:            # typed with their rows over data
        assert [jax.typeof(x).sharding.spec[0] for x in many] == ["data"] * 3


def test_beam_search_on_a_data_axis_that_divides_only_the_beams():
    """data=4 with B=2 rows of K=2 beams: the decoding step's [B x K] rows split over data, and
    that split reached the prefill (through the beams' repeat) and beam_top_k / reorder_beams
    (through the [B, K] reshapes) as a split across two axes that no rule takes (an internal
    partitioning error). The [B, K] arrays now keep their B split (whole here)."""
    cfg = dataclasses.replace(CFG, n_layers=1)
    params = M.init(jax.random.key(3), cfg)
    prompts = jax.random.randint(jax.random.key(4), (2, 6), 1, cfg.vocab_size)
    lengths = jnp.array([4, 6], jnp.int32)
    kw = dict(beam_size=2, max_new_tokens=3, eos_id=0)
    one = M.beam_search(params, cfg, prompts, lengths, **kw)
    mesh = mesh_of(data=4)
    with jax.set_mesh(mesh):
        many = M.beam_search(M.sharding.shard_params(params, cfg, mesh), cfg, prompts, lengths,
                             **kw)
    chex.assert_trees_all_equal(np.asarray(many[0]), np.asarray(one[0]))
    chex.assert_trees_all_close(np.asarray(many[1]), np.asarray(one[1]), **TOL)


@pytest.mark.parametrize("axes", [dict(data=2, fsdp=2, tensor=2), dict(data=2, seq=4)],
                         ids=lambda a: ",".join(f"{k}={v}" for k, v in a.items()))
def test_explicit_mesh_steps_equal_one_device(axes, one_device):
    """On Explicit axes (`jax.make_mesh`'s default in jax 0.10) the model runs its body on
    Auto axes (`sharding.on_auto_axes`): the steps equal the one-device run, and what they
    return is typed with the rules' shardings. (Before, sharding constraints only asserted
    there, and the model refused such meshes.)"""
    mesh = mesh_of(**axes, kind=AxisType.Explicit)
    step = M.sharded_train_step(CFG, OPT, mesh, batch=B, seq_len=T)
    many = train(lambda p, s, a, b: step(p, s, *M.sharding.shard_batch((a, b), mesh)),
                 lambda p, s: M.sharding.shard_train_state(p, s, CFG, OPT, mesh))
    chex.assert_trees_all_close(jax.tree.map(np.asarray, many),
                                jax.tree.map(np.asarray, one_device), **TOL)
    specs = M.sharding.param_specs(CFG, mesh)
    jax.tree.map(lambda x, s: chex.assert_equal(jax.typeof(x).sharding.spec, s), many[1], specs,
                 is_leaf=lambda x: isinstance(x, P))


def test_explicit_mesh_read_off_the_arguments():
    """Without `jax.set_mesh`, model functions on explicitly sharded arguments take the mesh
    from them: the loss (jitted and eager), its gradients (typed like the parameters) and the
    logits (typed batch x vocabulary) equal the one-device ones."""
    mesh = mesh_of(data=2, tensor=4, kind=AxisType.Explicit)
    params = M.init(jax.random.key(0), CFG)
    tokens, targets = (a[0] for a in batches())
    placed = M.sharding.shard_params(params, CFG, mesh)
    rows = M.sharding.shard_batch((tokens, targets), mesh)
    grad = jax.jit(jax.value_and_grad(M.loss), static_argnames="cfg")
    (l1, g1), (l2, g2) = grad(params, tokens, targets, cfg=CFG), grad(placed, *rows, cfg=CFG)
    chex.assert_trees_all_close((np.asarray(l2), jax.tree.map(np.asarray, g2)),
                                (np.asarray(l1), jax.tree.map(np.asarray, g1)), **TOL)
    jax.tree.map(lambda x, s: chex.assert_equal(jax.typeof(x).sharding.spec, s), g2,
                 M.sharding.param_specs(CFG, mesh), is_leaf=lambda x: isinstance(x, P))
    chex.assert_trees_all_close(np.asarray(M.loss(placed, *rows, CFG)), np.asarray(l1), **TOL)
    assert jax.sharding.get_abstract_mesh().empty       # the call set its mesh for itself only
    logits = jax.jit(M.apply, static_argnames="cfg")(placed, rows[0], cfg=CFG)
    assert logits.sharding.spec == P("data", None, "tensor")
    chex.assert_trees_all_close(np.asarray(logits), np.asarray(M.apply(params, tokens, CFG)),
                                **TOL)


def test_init_cache_on_an_explicit_mesh_takes_its_options_positionally():
    """Only arrays pass through `auto_axes`: sizes and a dtype given positionally (a JAX scalar
    type is no array) are closed over."""
    mesh = mesh_of(data=2, fsdp=2, tensor=2, kind=AxisType.Explicit)
    with jax.set_mesh(mesh):
        cache = M.init_cache(CFG, 4, 12, jnp.bfloat16)
    assert cache["k"][0].shape == (4, 12, CFG.n_kv_heads, CFG.head_dim)
    assert cache["k"][0].dtype == jnp.bfloat16
    assert jax.typeof(cache["k"][0]).sharding.spec == P(("data", "fsdp"), None, "tensor", None)


@pytest.mark.parametrize("axes, cfg, message", [
    (dict(tensor=8), CFG, "tensor=8"),                                   # 4 heads
    (dict(fsdp=8), M.Config(d_model=20, n_heads=2, n_kv_heads=2), "fsdp=8"),
    (dict(tensor=2), M.Config(vocab_size=33), "vocab_size = 33"),
])
def test_shapes_the_mesh_does_not_divide(axes, cfg, message):
    with pytest.raises(ValueError, match=message):
        M.sharding.param_specs(cfg, mesh_of(**axes))


def test_batch_and_sequence_the_mesh_does_not_divide():
    mesh = mesh_of(data=2, fsdp=2, seq=2)
    with pytest.raises(ValueError, match="data=2 x fsdp=2"):
        M.sharding.shard_batch((jnp.zeros((6, 8), jnp.int32),), mesh)
    with pytest.raises(ValueError, match="seq=2"):
        M.sharding.shard_batch((jnp.zeros((4, 6), jnp.int32),), mesh)
    with pytest.raises(ValueError, match="seq=2"):
        M.sharded_train_step(CFG, OPT, mesh, batch=4, seq_len=6)
    with pytest.raises(ValueError, match="not model axes"):
        M.sharding.param_specs(CFG, jax.make_mesh((8,), ("batch",)))
