"""The tiny Transformer: kernels vs reference, KV-cache decoding, greedy and beam search,
HARS beam top-k, and a short LikesWorld run."""
import itertools
import os
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

import jaxfuse
from jaxfuse import model as M
from tests._util import apply_jit, assert_close, keys

CFG = M.Config(vocab_size=11, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48,
               max_len=24)


def _params(cfg=CFG, seed=0):
    return M.init(jax.random.key(seed), cfg)


# Jitted like tests/_util.py's apply_jit.
_grad = jax.jit(jax.grad(M.loss), static_argnums=3, static_argnames="impl")


class ModelTest(chex.TestCase):

    @parameterized.parameters("rms", "layer")
    def test_pallas_and_reference_agree_with_grads(self, norm):
        cfg = M.Config(vocab_size=11, d_model=32, n_heads=4, n_kv_heads=2, d_ff=48, max_len=24,
                       norm=norm, label_smoothing=0.1)
        params = _params(cfg)
        k = keys(1, 2)
        tokens = jax.random.randint(k[0], (3, 13), 0, 11)
        targets = jax.random.randint(k[1], (3, 13), 0, 11).at[:, :4].set(-100)
        assert_close(apply_jit(params, tokens, cfg),
                     apply_jit(params, tokens, cfg, impl="reference"), jnp.float32, scale=5.0)
        g = _grad(params, tokens, targets, cfg)
        g_r = _grad(params, tokens, targets, cfg, impl="reference")
        assert_close(g, g_r, jnp.float32, scale=10.0)

    def test_cached_decoding_equals_recomputing(self):
        params = _params()
        prompts = jax.random.randint(keys(2, 1)[0], (3, 7), 0, 11)
        lengths = jnp.array([2, 5, 7], jnp.int32)
        cache = M.init_cache(CFG, 3)
        logits, cache = jax.jit(M.prefill, static_argnums=4)(params, cache, prompts, lengths, CFG)
        seqs = [list(np.asarray(prompts[i, :lengths[i]])) for i in range(3)]
        # Recomputed from scratch on the right-padded sequences (causal: the padding after a
        # sequence never reaches its last position), one compiled shape for every step.
        apply = jax.jit(lambda p, x: M.apply(p, x, CFG, impl="reference"))
        step = jax.jit(lambda p, c, t: M.decode_step(p, c, t, CFG))
        for _ in range(4):
            padded = np.zeros((3, 11), np.int32)
            for i in range(3):
                padded[i, :len(seqs[i])] = seqs[i]
            full = apply(params, jnp.asarray(padded))
            for i in range(3):
                assert_close(logits[i], full[i, len(seqs[i]) - 1], jnp.float32, scale=10.0)
            tok = jnp.argmax(logits, -1).astype(jnp.int32)
            for i in range(3):
                seqs[i].append(int(tok[i]))
            logits, cache = step(params, cache, tok)
        np.testing.assert_array_equal(cache["lengths"], lengths + 4)

    def test_greedy_equals_beam_search_of_one(self):
        params = _params(seed=3)
        prompts = jax.random.randint(keys(3, 1)[0], (2, 6), 0, 11)
        lengths = jnp.array([6, 3], jnp.int32)
        g = M.greedy(params, CFG, prompts, lengths, max_new_tokens=5, eos_id=10)
        b, _ = M.beam_search(params, CFG, prompts, lengths, beam_size=1, max_new_tokens=5,
                             eos_id=10)
        np.testing.assert_array_equal(g, b[:, 0])
        # After eos, greedy keeps emitting eos.
        for row in np.asarray(g):
            hits = np.nonzero(row == 10)[0]
            if len(hits):
                self.assertTrue(np.all(row[hits[0]:] == 10))

    def test_steps_per_sync_does_not_change_the_result(self):
        """Bursts of fixed trip count between early-stop checks (1 = check every step, 16 >
        max_new_tokens = one remainder loop) decode the same tokens, early eos included."""
        params = _params(seed=6)
        prompts = jax.random.randint(keys(6, 1)[0], (3, 5), 0, 11)
        lengths = jnp.array([5, 2, 4], jnp.int32)
        # The loop is under test, not the kernels: the references (faster on a CPU), also for
        # the prefill that picks an eos some row emits early (row 1's first greedy token).
        kw = dict(max_new_tokens=7, impl="reference")
        kw["eos_id"] = int(jnp.argmax(M.prefill(params, M.init_cache(CFG, 3), prompts, lengths,
                                                CFG, impl="reference")[0][1]))
        g = [M.greedy(params, CFG, prompts, lengths, steps_per_sync=n, **kw) for n in (1, 3, 16)]
        self.assertTrue(bool(jnp.any(g[0] == kw["eos_id"])))
        b = [M.beam_search(params, CFG, prompts, lengths, beam_size=3, steps_per_sync=n, **kw)
             for n in (1, 3, 16)]
        for i in (1, 2):
            np.testing.assert_array_equal(g[i], g[0])
            np.testing.assert_array_equal(b[i][0], b[0][0])
            np.testing.assert_array_equal(b[i][1], b[0][1])
        for bad in (0, 2.0):
            with self.assertRaisesRegex(ValueError, "steps_per_sync"):
                M.greedy(params, CFG, prompts, lengths, steps_per_sync=bad, **kw)

    def test_prompt_lengths_outside_the_prompts_are_refused_or_clipped(self):
        """prompt_lengths lie in [1, P]: a known length outside raises, naming it (it read a
        padding position or clamped an index, and decoded plausible tokens); a traced one,
        which cannot be checked, is clipped to that range."""
        params = _params(seed=7)
        prompts = jax.random.randint(keys(7, 1)[0], (2, 4), 0, 11)
        kw = dict(max_new_tokens=3, eos_id=2, impl="reference")
        for bad, first in (([5, 2], "prompt_lengths\\[0\\]=5"),
                           ([3, 0], "prompt_lengths\\[1\\]=0"),
                           ([-1, 2], "prompt_lengths\\[0\\]=-1")):
            for search, extra in ((M.greedy, {}), (M.beam_search, dict(beam_size=2))):
                with self.assertRaisesRegex(ValueError, first + " must lie in \\[1, P=4\\]"):
                    search(params, CFG, prompts, jnp.array(bad), **kw, **extra)
            with self.assertRaisesRegex(ValueError, first):
                M.prefill(params, M.init_cache(CFG, 2), prompts, jnp.array(bad), CFG,
                          impl="reference")
        traced = jax.jit(lambda n: M.greedy(params, CFG, prompts, n, **kw))
        np.testing.assert_array_equal(traced(jnp.array([9, -3])),
                                      M.greedy(params, CFG, prompts, jnp.array([4, 1]), **kw))

    def test_beam_search_matches_brute_force(self):
        cfg = M.Config(vocab_size=5, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=16,
                       max_len=8)
        params = _params(cfg, seed=4)
        params["unembed"] = params["unembed"] * 3.0      # peaked, so ties are impossible
        prompts = jnp.array([[1, 3, 0], [2, 0, 0]], jnp.int32)
        lengths = jnp.array([2, 1], jnp.int32)
        seqs = np.array(list(itertools.product(range(5), repeat=3)), np.int32)   # 125
        # Every prompt + continuation of both rows as one batch [2 x 125, 5] of one jitted apply
        # (row 1's shorter prompt is right-padded, which no scored position sees: causal).
        full = np.zeros((2, 125, 5), np.int32)
        for b in range(2):
            n = int(lengths[b])
            full[b, :, :n] = np.asarray(prompts[b, :n])
            full[b, :, n:n + 3] = seqs
        logp = np.asarray(jax.nn.log_softmax(
            apply_jit(params, jnp.asarray(full.reshape(250, 5)), cfg, impl="reference"))).reshape(
                2, 125, 5, 5)
        # eos_id=5 is outside the vocabulary: no sequence ends early, all 125 are distinct. Each
        # search covers both rows: run once, checked per row below.
        tokens, beam_scores = M.beam_search(params, cfg, prompts, lengths, beam_size=125,
                                            max_new_tokens=3, eos_id=5)
        best = {k: M.beam_search(params, cfg, prompts, lengths, beam_size=k, max_new_tokens=3,
                                 eos_id=5)[1] for k in (1, 3, 7)}
        for b in range(2):
            steps = np.arange(int(lengths[b]) - 1, int(lengths[b]) + 2)
            scores = logp[b][np.arange(125)[:, None], steps, seqs].sum(1)
            order = np.argsort(-scores, kind="stable")
            np.testing.assert_array_equal(np.asarray(tokens[b]), seqs[order])
            np.testing.assert_allclose(beam_scores[b], scores[order], atol=2e-5)
            for k, s in best.items():
                self.assertLessEqual(float(s[b, 0]), scores[order[0]] + 1e-5, k)

    def test_beam_search_length_penalty_and_eos(self):
        params = _params(seed=5)
        prompts = jax.random.randint(keys(5, 1)[0], (2, 4), 0, 11)
        lengths = jnp.array([4, 2], jnp.int32)
        tokens, scores = M.beam_search(params, CFG, prompts, lengths, beam_size=4,
                                       max_new_tokens=6, eos_id=3, length_penalty=0.7)
        self.assertTrue(bool(jnp.all(scores[:, :-1] >= scores[:, 1:])))   # best first
        for row in np.asarray(tokens).reshape(-1, 6):
            hits = np.nonzero(row == 3)[0]
            if len(hits):
                self.assertTrue(np.all(row[hits[0]:] == 3))


class BeamTopKTest(chex.TestCase):

    # Every (shape, k) pair once (each compiles its own kernel), with ties on or off such that
    # every shape and every k also meets both: all pairs of the three parameters, in 12 cases
    # where their product took 24 (the other tie setting of a pair reran the same kernel).
    # Ties meet the widest rows (several blocks of 1001) at k = 3 and 8, and the 6 candidates
    # of (1, 3, 2) at k = 8 (all of them).
    @parameterized.parameters(
        ((2, 4, 37), 1, False), ((2, 4, 37), 3, True), ((2, 4, 37), 8, False),
        ((3, 5, 16), 1, True), ((3, 5, 16), 3, False), ((3, 5, 16), 8, True),
        ((1, 3, 2), 1, False), ((1, 3, 2), 3, True), ((1, 3, 2), 8, True),
        ((2, 8, 1001), 1, False), ((2, 8, 1001), 3, True), ((2, 8, 1001), 8, True))
    def test_equals_reference(self, shape, k, ties):
        kk = keys(sum(shape) + k, 2)
        log_probs = jax.nn.log_softmax(jax.random.normal(kk[0], shape) * 2)
        if ties:   # few distinct values: many exact ties, broken by the lower flat index
            log_probs = jnp.round(log_probs)
        scores = jax.random.normal(kk[1], shape[:2])
        if ties:
            scores = jnp.round(scores)
        k = min(k, shape[1] * shape[2])
        out = jaxfuse.beam_top_k(log_probs, scores, k)
        ref = jaxfuse.beam_top_k(log_probs, scores, k, impl="reference")
        for a, b in zip(out, ref):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    def test_all_tie(self):
        log_probs = jnp.zeros((2, 3, 50))       # every candidate ties: the lowest indices win
        scores = jnp.zeros((2, 3))
        out = jaxfuse.beam_top_k(log_probs, scores, 4)
        ref = jaxfuse.beam_top_k(log_probs, scores, 4, impl="reference")
        for a, b in zip(out, ref):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    def test_bad_input(self):
        with self.assertRaisesRegex(ValueError, "beam_scores.shape=\\(2, 4\\)"):
            jaxfuse.beam_top_k(jnp.zeros((2, 3, 5)), jnp.zeros((2, 4)), 2)
        with self.assertRaisesRegex(ValueError, "k=16"):
            jaxfuse.beam_top_k(jnp.zeros((2, 3, 5)), jnp.zeros((2, 3)), 16)


@pytest.mark.xla_optimized      # 500 training steps: running, not compiling, is its time
def test_short_likesworld_run_beats_the_random_baseline(tmp_path):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples"))
    import likesworld
    acc = likesworld.main(["--steps", "500", "--no-extras", "--out", str(tmp_path)])
    assert acc > 0.6, acc      # the random item from the context scores about 0.25
    assert os.path.exists(tmp_path / "likesworld.npz")


if __name__ == "__main__":
    pytest.main([__file__])
