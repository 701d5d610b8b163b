"""Beam-search step from the logits (`jaxfuse.beam_step`): the reference against a NumPy
brute force of the rule, and the Pallas kernels bit-identical to the reference (ties, NaN,
finished beams, length penalty, group widths and row blocks that do not divide)."""
from unittest import mock

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import parameterized

import jaxfuse
from jaxfuse.pallas import beam_step as P
from jaxfuse.pallas import beam_top_k as P_topk
from jaxfuse.pallas._rows import RowBlocks
from jaxfuse.reference import beam_step as R
from tests.test_beam_top_k import assert_identical

KINDS = ("normal", "ties", "neginf", "nonfinite")


def _state(seed: int, shape, kind: str, dtype="float32"):
    """Random logits [B, K, V] of a kind and a beam state (raw, lengths, done) with some beams
    dead (raw -inf, as beam search's start) and some finished, whose logits hold garbage."""
    rng = np.random.default_rng(seed)
    b, k, v = shape
    x = rng.standard_normal(shape).astype(np.float32) * 3
    if kind == "ties":        # a handful of values: ties within and across groups and beams
        x = rng.integers(-2, 3, shape).astype(np.float32)
    elif kind == "neginf":    # tokens ruled out (-inf logits), a whole beam's row among them
        x[rng.random(shape) < 0.6] = -np.inf
        x[0, 0] = -np.inf
    elif kind == "nonfinite":
        pick = rng.random(shape) < 0.2
        x[pick] = rng.choice(np.array([np.nan, np.inf, -np.inf], np.float32), pick.sum())
    raw = -rng.random((b, k)).astype(np.float32) * 8
    raw[rng.random((b, k)) < 0.2] = -np.inf
    lengths = rng.integers(0, 9, (b, k)).astype(np.int32)
    done = rng.random((b, k)) < 0.3
    x[done] = np.nan                           # a finished beam's logits are never read
    return jnp.asarray(x, dtype), jnp.asarray(raw), jnp.asarray(lengths), jnp.asarray(done)


def _brute_force(logits, raw, lengths, done, eos_id, length_penalty):
    """The rule of the reference's docstring in NumPy: every candidate scored, sorted stably."""
    x = np.asarray(logits, np.float32).astype(np.float64)
    b, k, v = x.shape
    raw, lengths, done = np.asarray(raw, np.float64), np.asarray(lengths), np.asarray(done)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        m = x.max(-1, keepdims=True)
        logp = x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))
        eos = np.where(np.arange(v) == eos_id, 0.0, -np.inf)
        logp = np.where(done[..., None], eos, logp)
        length = lengths + np.where(done, 0, 1)
        norm = np.maximum(length, 1).astype(np.float64) ** -length_penalty
        cand = ((raw[..., None] + logp) * norm[..., None]).reshape(b, k * v)
    out = []
    for row in range(b):
        order = np.argsort(-np.nan_to_num(cand[row], nan=np.inf), kind="stable")[:k]
        parent, token = order // v, order % v
        out.append((parent, token, raw[row, parent] + logp[row, parent, token],
                    length[row, parent], done[row, parent] | (token == eos_id)))
    return [np.stack(a) for a in zip(*out)]


class BeamStepTest(parameterized.TestCase):

    @parameterized.product(shape=[(2, 4, 37), (1, 1, 13), (3, 5, 2), (2, 3, 1)],
                           length_penalty=[0.0, 0.7], eos_id=[1, 99])
    def test_reference_is_the_rule(self, shape, length_penalty, eos_id):
        # Distinct candidates (no ties for the sort's rounding to break differently).
        logits, raw, lengths, done = _state(sum(shape), shape, "normal")
        got = R.beam_step(logits, raw, lengths, done, eos_id=eos_id,
                          length_penalty=length_penalty)
        want = _brute_force(logits, raw, lengths, done, eos_id, length_penalty)
        live = np.isfinite(np.asarray(got[2]))      # -inf beams tie, their order is the sort's
        for name, a, b in zip(("parent", "token", "raw", "lengths", "done"), got, want):
            a = np.asarray(a)
            if name == "raw":
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=name)
            else:
                np.testing.assert_array_equal(a[live], b[live], err_msg=name)

    # Every shape meets every tile and both penalties (8 of the 24 combinations, each its own
    # kernel): one group per row (interpret mode's default) or many, with ragged last groups
    # and row blocks that do not divide B x K.
    @parameterized.parameters(
        ((2, 4, 37), None, 0.0), ((2, 4, 37), (3, 5), 1.3), ((1, 1, 13), (2, 8), 0.0),
        ((1, 1, 13), None, 1.3), ((3, 5, 2), (3, 5), 0.0), ((3, 5, 2), (2, 8), 1.3),
        ((2, 3, 16), (2, 8), 0.0), ((2, 3, 16), (3, 5), 1.3))
    def test_kernel_equals_reference(self, shape, blocks, length_penalty):
        k = shape[1]
        bs = None if blocks is None else RowBlocks(blocks[0], max(blocks[1], k))
        f = jax.jit(lambda *a: P.beam_step(*a, eos_id=2, length_penalty=length_penalty,
                                           block_sizes=bs))
        for i, kind in enumerate(KINDS):
            args = _state(sum(shape) + i, shape, kind)
            with self.subTest(kind=kind):
                assert_identical(f(*args), R.beam_step(*args, eos_id=2,
                                                       length_penalty=length_penalty))

    @parameterized.parameters("float32", "bfloat16", "float16")
    def test_logit_dtypes(self, dtype):
        args = _state(5, (2, 3, 50), "normal", dtype)
        for eos_id in (0, 49, 50, -1):
            assert_identical(jaxfuse.beam_step(*args, eos_id=eos_id, length_penalty=0.5,
                                               block_sizes=RowBlocks(4, 16)),
                             jaxfuse.beam_step(*args, eos_id=eos_id, length_penalty=0.5,
                                               impl="reference"))

    def test_finished_beams_garbage_is_not_read(self):
        logits, raw, lengths, done = _state(6, (2, 3, 20), "normal")
        assert bool(done.any())
        clean = jnp.where(done[..., None], 1.0, logits)
        for impl in ("pallas", "reference"):
            a = jaxfuse.beam_step(logits, raw, lengths, done, eos_id=3, impl=impl)
            b = jaxfuse.beam_step(clean, raw, lengths, done, eos_id=3, impl=impl)
            assert_identical(a, b)
            assert np.all(~np.isnan(np.asarray(a[2])))

    def test_a_finished_beam_continues_with_eos_and_keeps_its_score(self):
        logits = jnp.asarray(np.random.default_rng(7).standard_normal((1, 2, 6)), jnp.float32)
        raw = jnp.array([[-0.1, -5.0]])
        for impl in ("pallas", "reference"):
            parent, token, new_raw, length, done = jaxfuse.beam_step(
                logits, raw, jnp.array([[3, 2]]), jnp.array([[True, False]]), eos_id=4,
                length_penalty=1.0, impl=impl)
            # Beam 0 (finished, -0.1 / 3) beats every continuation of beam 1 (< -5 / 3).
            assert (int(parent[0, 0]), int(token[0, 0]), float(new_raw[0, 0]),
                    int(length[0, 0]), bool(done[0, 0])) == (0, 4, np.float32(-0.1), 3, True)
            assert int(parent[0, 1]) == 1 and int(length[0, 1]) == 3

    def test_survivors_beyond_a_program_take_xla_top_k(self):
        # The GPU's fallback when a row's survivors outgrow a re-rank program, run on the CPU:
        # XLA's top_k of the survivors' keys must pick what the kernel's passes pick.
        for kind in KINDS:
            args = _state(13, (3, 4, 40), kind)
            want = P.beam_step(*args, eos_id=2, length_penalty=0.4,
                               block_sizes=RowBlocks(2, 8))
            with mock.patch.object(P, "_rerank_max_cols", lambda interpret: 8):
                got = P.beam_step(*args, eos_id=2, length_penalty=0.4,
                                  block_sizes=RowBlocks(2, 8))
            with self.subTest(kind=kind):
                assert_identical(got, want)

    def test_large_k_takes_the_reference(self):
        args = _state(8, (2, P_topk._MAX_PASSES + 1, 3), "ties")
        assert_identical(P.beam_step(*args, eos_id=1), R.beam_step(*args, eos_id=1))

    def test_two_kernels_and_no_branch(self):
        jaxpr = jax.make_jaxpr(lambda *a: P.beam_step(*a, eos_id=1, interpret=True))(
            *_state(9, (2, 4, 37), "normal"))
        names = [e.params["name"] for e in jaxpr.jaxpr.eqns if e.primitive.name == "pallas_call"]
        prims = {e.primitive.name for e in jaxpr.jaxpr.eqns}
        assert names == ["jaxfuse_beam_step_retrieve", "jaxfuse_beam_step_rerank"], names
        assert not prims & {"cond", "while", "top_k", "sort"}, prims

    def test_gradient_only_through_the_reference(self):
        logits, raw, lengths, done = _state(12, (2, 3, 7), "normal")
        raw = jnp.where(jnp.isfinite(raw), raw, -1.0)
        logits = jnp.where(done[..., None], 0.5, logits)   # no NaN rows to differentiate
        loss = lambda impl: lambda x: jaxfuse.beam_step(x, raw, lengths, done, eos_id=1,
                                                        impl=impl)[2].sum()
        with self.assertRaisesRegex(ValueError, "beam_step .* no gradient.*impl=.reference."):
            jax.grad(loss("pallas"))(logits)
        g = jax.grad(loss("reference"))(logits)
        assert bool(jnp.all(jnp.isfinite(g))) and bool(jnp.any(g != 0))

    def test_bad_input_raises(self):
        logits, raw, lengths, done = _state(10, (2, 3, 7), "normal")
        cases = [
            ((logits[0], raw, lengths, done), {}, "logits.*3"),
            ((logits.astype(jnp.int32), raw, lengths, done), {}, "logits"),
            ((logits, raw[:, :2], lengths, done), {},
             r"raw_scores.shape=\(2, 2\) must be \(2, 3\)"),
            ((logits, raw, lengths.astype(jnp.float32), done), {}, "lengths"),
            ((logits, raw, lengths, done.astype(jnp.int32)), {},
             "done.dtype=int32 must be bool"),
            ((logits, raw, lengths, done), dict(eos_id=1.5), "eos_id=1.5 must be an int"),
            ((logits, raw, lengths, done), dict(length_penalty=float("nan")), "length_penalty"),
            ((jnp.zeros((2, 0, 7)), raw[:, :0], lengths[:, :0], done[:, :0]), {},
             "must not be empty"),
        ]
        for impl in ("pallas", "reference"):
            for args, kw, msg in cases:
                kw = {"eos_id": 1, **kw}
                with self.subTest(impl=impl, msg=msg), self.assertRaisesRegex(ValueError, msg):
                    jaxfuse.beam_step(*args, impl=impl, **kw)
        for impl in ("pallas", "reference"):
            with self.assertRaisesRegex(ValueError, "eos_id is a traced value"):
                jax.jit(lambda e: jaxfuse.beam_step(logits, raw, lengths, done, eos_id=e,
                                                    impl=impl))(1)
            with self.assertRaisesRegex(ValueError, "length_penalty is a traced value"):
                jax.jit(lambda p: jaxfuse.beam_step(logits, raw, lengths, done, eos_id=1,
                                                    length_penalty=p, impl=impl))(0.5)
        with self.assertRaisesRegex(ValueError, "overflow the int32 flat index"):
            big = jax.ShapeDtypeStruct((1, 2, 2 ** 30), jnp.bfloat16)
            jax.eval_shape(lambda x: jaxfuse.beam_step(x, raw[:1, :2], lengths[:1, :2],
                                                       done[:1, :2], eos_id=1), big)
        with self.assertRaisesRegex(ValueError, "block_cols=2 is the group width"):
            jaxfuse.beam_step(logits, raw, lengths, done, eos_id=1, block_sizes=RowBlocks(1, 2))


class BeamStepTransformsTest(chex.TestCase):

    @chex.variants(with_jit=True, without_jit=True)
    def test_vmap(self):
        states = [_state(11 + i, (2, 3, 9), kind) for i, kind in enumerate(KINDS)]
        args = [jnp.stack(a) for a in zip(*states)]
        f = lambda impl: self.variant(jax.vmap(
            lambda *a: jaxfuse.beam_step(*a, eos_id=2, length_penalty=0.6, impl=impl)))
        assert_identical(f("pallas")(*args), f("reference")(*args))
