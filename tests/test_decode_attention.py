import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

import jaxfuse
from jaxfuse import DecodeBlocks
from jaxfuse.pallas.decode_attention import choose_splits
from jaxfuse.reference.attention import merge_many, merge_states
from tests._util import assert_close, keys, randn

# (B, S, Hq, Hkv, D): MHA, GQA 4 and 8 per KV head, MQA; S = 1, primes, non-multiples.
CASES = [(4, 37, 4, 4, 16), (3, 53, 8, 2, 8), (2, 41, 8, 1, 16), (3, 1, 4, 1, 8), (2, 100, 16, 2, 8)]
LAYOUTS = {"folded": DecodeBlocks(block_k=16),
           "gpu_layout": DecodeBlocks(block_k=16, folded=False)}
# The reference with its lse (and caches), only the oracle: jitted, one program instead of an
# executable per jnp op and shape.
_reference = jax.jit(lambda *a, **kw: jaxfuse.decode_attention(*a, return_lse=True,
                                                               impl="reference", **kw))


@functools.lru_cache(maxsize=None)
def _inputs_and_reference(case, dtype):
    """test_matches_reference's inputs and the reference's (o, lse), computed once for both
    layouts. The cache beyond each length holds NaN for some cases and 1e30 for the others."""
    poison = float("nan") if CASES.index(case) % 2 == 0 else 1e30
    args = _make(case, dtype, sum(case), poison)
    return args, _reference(*args)


def _make(case, dtype, seed, poison):
    # Drawn by NumPy on the host: jax.random's eager draws (and eager where and set) compiled
    # an XLA program per new shape.
    b, s, hq, hkv, d = case
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, hq, d), np.float32)
    kc, vc = (rng.standard_normal((b, s, hkv, d), np.float32) for _ in range(2))
    lengths = rng.integers(0, s + 1, b, dtype=np.int32)
    lengths[0], lengths[-1] = 0, s
    if b > 2:
        lengths[1] = 1
    beyond = np.arange(s)[None, :, None, None] >= lengths[:, None, None, None]
    kc, vc = (np.where(beyond, np.float32(poison), c) for c in (kc, vc))
    return (*(jnp.asarray(a.astype(dtype)) for a in (q, kc, vc)), jnp.asarray(lengths))


class DecodeAttentionTest(chex.TestCase):

    @chex.variants(with_jit=True)
    @parameterized.product(case=CASES, dtype=[jnp.float32, jnp.bfloat16], layout=list(LAYOUTS))
    def test_matches_reference(self, case, dtype, layout):
        (q, kc, vc, lengths), (o_r, lse_r) = _inputs_and_reference(case, dtype)
        self.assertFalse(bool(jnp.isnan(o_r.astype(jnp.float32)).any()))
        # Split counts by the slices of the cache they cut (whole 16-key tiles; each slice is
        # a program of its own): 1, one slice written straight to o; 2, slices of several tiles,
        # the last one short; S, one-tile slices up to S, then empty ones (lse -inf) to merge.
        # 3 and 7, swept here before, cut no other kind of slice: 7 those of S less some empty
        # ones, 3 those of S (S = 37, 41), of 2 and an empty one (S = 53), or several-tile
        # slices and one short tile (S = 100).
        splits = sorted({1, 2, case[1]} & set(range(1, case[1] + 1)))
        # Every split count in one jitted program: one compile, not one per count.
        f = self.variant(lambda q, kc, vc, lengths: [jaxfuse.decode_attention(
            q, kc, vc, lengths, num_splits=n, return_lse=True, block_sizes=LAYOUTS[layout])
            for n in splits])
        for o, lse in f(q, kc, vc, lengths):
            self.assertEqual(o.dtype, dtype)
            assert_close(o, o_r, dtype)
            np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_r))
            fin = np.isfinite(np.asarray(lse_r))
            assert_close(np.asarray(lse)[fin], np.asarray(lse_r)[fin], dtype)
            # Length 0 gives zeros.
            np.testing.assert_array_equal(np.asarray(o[0], np.float32), 0.0)

    def test_default_split_rule_and_soft_cap(self):
        q, kc, vc, lengths = _make((2, 300, 8, 2, 16), jnp.float32, 7, 0.0)
        o = jaxfuse.decode_attention(q, kc, vc, lengths, logits_soft_cap=2.0)
        o_r = jaxfuse.decode_attention(q, kc, vc, lengths, logits_soft_cap=2.0, impl="reference")
        assert_close(o, o_r, jnp.float32)

    def test_equals_last_row_of_causal_prefill(self):
        b, t, hq, hkv, d = 2, 29, 8, 2, 16
        k = keys(8, 3)
        q = randn(k[0], (b, t, hq, d))
        kk, vv = randn(k[1], (b, t, hkv, d)), randn(k[2], (b, t, hkv, d))
        full = jaxfuse.flash_attention(q, kk, vv, causal=True)
        s = 40   # a cache longer than the prompt, garbage past it
        pad = lambda x: jnp.concatenate([x, jnp.full((b, s - t, hkv, d), jnp.nan)], axis=1)
        dec = jaxfuse.decode_attention(q[:, -1], pad(kk), pad(vv), jnp.full((b,), t, jnp.int32))
        assert_close(dec, full[:, -1], jnp.float32)

    def test_choose_splits_fills_waves(self):
        self.assertEqual(choose_splits(256, 32768, 132) * 256 % 132, 0)   # whole waves
        n = choose_splits(8, 131072, 132)
        self.assertGreaterEqual(8 * n, 132)
        self.assertEqual(choose_splits(8, 100, 132), 1)   # too short to split

    def test_merge_many_equals_folded_merge_states(self):
        k = keys(9, 2)
        o = randn(k[0], (2, 5, 3, 4))
        lse = randn(k[1], (2, 5, 3)).at[:, 2].set(-jnp.inf)
        o_m, lse_m = merge_many(o, lse, axis=1)
        o_f, lse_f = o[:, 0], lse[:, 0]
        for i in range(1, 5):
            o_f, lse_f = merge_states(o_f, lse_f, o[:, i], lse[:, i])
        assert_close((o_m, lse_m), (o_f, lse_f), jnp.float32)

    def test_bad_input(self):
        q = jnp.zeros((2, 4, 16))
        kc = jnp.zeros((2, 10, 2, 16))
        with self.assertRaisesRegex(ValueError, "kv_lengths.shape=\\(3,\\)"):
            jaxfuse.decode_attention(q, kc, kc, jnp.zeros((3,), jnp.int32))
        with self.assertRaisesRegex(ValueError, "kv_lengths.dtype=float32"):
            jaxfuse.decode_attention(q, kc, kc, jnp.zeros((2,)))
        with self.assertRaisesRegex(ValueError, "query heads 4 .* KV heads 3"):
            jaxfuse.decode_attention(q, jnp.zeros((2, 10, 3, 16)), jnp.zeros((2, 10, 3, 16)),
                                     jnp.zeros((2,), jnp.int32))
        with self.assertRaisesRegex(ValueError, "num_splits=11"):
            jaxfuse.decode_attention(q, kc, kc, jnp.zeros((2,), jnp.int32), num_splits=11)


class AppendTest(chex.TestCase):
    """decode_attention(..., k_new=, v_new=): the new token's key and value are written at
    kv_lengths[b] inside the kernel, then attended over kv_lengths[b] + 1 positions."""

    @chex.variants(with_jit=True)
    @parameterized.product(case=CASES, layout=list(LAYOUTS))
    def test_matches_reference(self, case, layout):
        # Both dtypes in both layouts, alternating over the cases (the append is dtype-blind
        # code; the attention itself is swept over the full product above).
        dtype = (jnp.float32, jnp.bfloat16)[(CASES.index(case) + len(layout)) % 2]
        b, s, hq, hkv, d = case
        q, kc, vc, lengths = _make(case, dtype, sum(case) + 1, float("nan"))
        # The slot the new row goes to holds NaN before the call, and so does everything past
        # it: only the appended row may reach o. One sequence's cache is full (length S):
        # nothing is written for it and it attends over its S positions.
        k = keys(sum(case) + 2, 2)
        k_new, v_new = randn(k[0], (b, hkv, d), dtype), randn(k[1], (b, hkv, d), dtype)
        want = _reference(q, kc, vc, lengths, k_new=k_new, v_new=v_new)
        self.assertFalse(bool(jnp.isnan(want[0].astype(jnp.float32)).any()))
        # The reference is the two-step composition: write, then attend one position more.
        rows = jnp.arange(b)
        k_set = kc.at[rows, lengths].set(k_new, mode="drop")
        v_set = vc.at[rows, lengths].set(v_new, mode="drop")
        f32 = lambda x: np.asarray(x, np.float32)
        np.testing.assert_array_equal(f32(want[2]), f32(k_set))
        np.testing.assert_array_equal(f32(want[3]), f32(v_set))
        two_step = _reference(q, k_set, v_set, jnp.minimum(lengths + 1, s))
        assert_close(want[:2], two_step, jnp.float32)
        # One split (o written directly) and three (the appended row may sit in any split),
        # both in one jitted program.
        splits = sorted({1, 3} & set(range(1, s + 1)))
        f = self.variant(lambda *a: [jaxfuse.decode_attention(
            *a[:4], k_new=a[4], v_new=a[5], num_splits=n, return_lse=True,
            block_sizes=LAYOUTS[layout]) for n in splits])
        for o, lse, k_out, v_out in f(q, kc, vc, lengths, k_new, v_new):
            assert_close(o, want[0], dtype)
            np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want[1]))
            # The caches come back bitwise: the new rows written, every other entry untouched
            # (NaN past each length included).
            np.testing.assert_array_equal(f32(k_out), f32(want[2]))
            np.testing.assert_array_equal(f32(v_out), f32(want[3]))

    # The reference takes no layout (`route` drops block_sizes): it runs once.
    @parameterized.parameters(("folded", "pallas"), ("gpu_layout", "pallas"),
                              ("folded", "reference"))
    def test_packed_qkv(self, layout, impl):
        # q, k_new and v_new as one [B, Hq + 2 Hkv, D] array: the same result and caches.
        case = (3, 53, 8, 2, 8)
        b, s, hq, hkv, d = case
        q, kc, vc, lengths = _make(case, jnp.bfloat16, 21, float("nan"))
        k = keys(22, 2)
        k_new = randn(k[0], (b, hkv, d), jnp.bfloat16)
        v_new = randn(k[1], (b, hkv, d), jnp.bfloat16)
        want = _reference(q, kc, vc, lengths, k_new=k_new, v_new=v_new)
        qkv = jnp.concatenate([q, k_new, v_new], axis=1)
        both = jax.jit(lambda *a: [jaxfuse.decode_attention(      # one split and three
            *a, packed_qkv=True, num_splits=n, return_lse=True, impl=impl,
            block_sizes=LAYOUTS[layout]) for n in (1, 3)])(qkv, kc, vc, lengths)
        for got in both:
            assert_close(got[0], want[0], jnp.bfloat16)
            np.testing.assert_array_equal(np.isneginf(got[1]), np.isneginf(want[1]))
            for a, w in zip(got[2:], want[2:]):
                np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(w, np.float32))
        with self.assertRaisesRegex(ValueError, "packed_qkv=True takes k_new and v_new"):
            jaxfuse.decode_attention(qkv, kc, vc, lengths, packed_qkv=True, k_new=k_new,
                                     impl=impl)
        with self.assertRaisesRegex(ValueError,
                                    r"q.shape=\(3, 3, 8\) must be \[B, Hq \+ 2 Hkv, D\]"):
            jaxfuse.decode_attention(qkv[:, :3], kc, vc, lengths, packed_qkv=True, impl=impl)

    def test_decoding_loop_equals_attention_over_the_whole_sequence(self):
        # Appending token by token from an empty cache, each step's o equals causal attention's
        # row at that position.
        b, t, hq, hkv, d, s = 2, 9, 4, 2, 8, 12
        k = keys(11, 3)
        q = randn(k[0], (b, t, hq, d))
        kk, vv = randn(k[1], (b, t, hkv, d)), randn(k[2], (b, t, hkv, d))
        full = jax.jit(lambda q, k, v: jaxfuse.flash_attention(    # the oracle, jitted
            q, k, v, causal=True, impl="reference"))(q, kk, vv)
        step = jax.jit(lambda q, kc, vc, n, kn, vn: jaxfuse.decode_attention(
            q, kc, vc, n, k_new=kn, v_new=vn), donate_argnums=(1, 2))
        kc, vc = jnp.full((b, s, hkv, d), jnp.nan), jnp.full((b, s, hkv, d), jnp.nan)
        for i in range(t):
            o, kc, vc = step(q[:, i], kc, vc, jnp.full((b,), i, jnp.int32), kk[:, i], vv[:, i])
            assert_close(o, full[:, i], jnp.float32)
        assert_close(kc[:, :t], kk, jnp.float32)

    def test_vmap(self):
        k = keys(12, 4)
        q, kc = randn(k[0], (2, 3, 4, 8)), randn(k[1], (2, 3, 10, 2, 8))
        new = randn(k[2], (2, 3, 2, 8))
        lengths = jnp.array([[0, 4, 10], [1, 9, 3]], jnp.int32)
        f = lambda impl: jax.vmap(lambda q, kc, n, kn: jaxfuse.decode_attention(
            q, kc, kc, n, k_new=kn, v_new=-kn, num_splits=2, impl=impl))
        got = jax.jit(f("pallas"))(q, kc, lengths, new)
        want = jax.jit(f("reference"))(q, kc, lengths, new)          # the oracle, jitted too
        assert_close(got[0], want[0], jnp.float32)
        for a, w in zip(got[1:], want[1:]):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(w))

    def test_bad_input(self):
        q, kc = jnp.zeros((2, 4, 16)), jnp.zeros((2, 10, 2, 16))
        n, new = jnp.zeros((2,), jnp.int32), jnp.zeros((2, 2, 16))
        with self.assertRaisesRegex(ValueError, "k_new and v_new go together"):
            jaxfuse.decode_attention(q, kc, kc, n, k_new=new)
        with self.assertRaisesRegex(ValueError, r"k_new \(2, 16\) float32 must be \[B, Hkv, D\]"):
            jaxfuse.decode_attention(q, kc, kc, n, k_new=new[:, 0], v_new=new)
        with self.assertRaisesRegex(ValueError, "v_new .* bfloat16 must be .* float32"):
            jaxfuse.decode_attention(q, kc, kc, n, k_new=new, v_new=new.astype(jnp.bfloat16))


class FusedInputTest(chex.TestCase):
    """A fused q/k/v projection's output handed over as it comes: packed "heads" or "grouped",
    as float32 partial sums the kernel adds (`partial_sums`), with the new token's q and k
    turned by RoPE in the kernel (`rope_base`)."""

    B, S, HQ, HKV = 3, 29, 8, 2          # GQA 4 per KV head; a prime cache length
    LENGTHS = (0, 11, 29)                # empty, mid-tile, full (nothing appended)

    @staticmethod
    def _oracle(*args, **kw):
        """The reference, jitted with its options static (strings and flags)."""
        return jax.jit(functools.partial(jaxfuse.decode_attention, impl="reference",
                                         **kw))(*args)

    def _inputs(self, d, parts, seed):
        rng = np.random.default_rng(seed)
        b, s, hq, hkv = self.B, self.S, self.HQ, self.HKV
        kc, vc = (jnp.asarray(rng.standard_normal((b, s, hkv, d)), jnp.bfloat16)
                  for _ in range(2))
        # The float32 partial sums of a [B, heads, D] q/k/v; one partial (as stored) otherwise.
        qkv = jnp.asarray(rng.standard_normal((parts or 1, b, hq + 2 * hkv, d)), jnp.float32)
        return (qkv if parts else qkv[0].astype(jnp.bfloat16)), kc, vc, jnp.array(
            self.LENGTHS, jnp.int32)

    @parameterized.product(layout=list(LAYOUTS), packed=["heads", "grouped"], parts=[None, 3],
                           rope=[None, True, False])
    def test_matches_reference(self, layout, packed, parts, rope):
        d = 16                                     # the GPU layout's own width: halves in-kernel
        qkv, kc, vc, lengths = self._inputs(d, parts, seed=(parts or 1) + 10 * (rope is None))
        kw = dict(packed_qkv=packed, partial_sums=parts is not None, return_lse=True,
                  rope_base=None if rope is None else 500.0, rope_interleaved=bool(rope))
        want = self._oracle(qkv, kc, vc, lengths, **kw)
        got = jax.jit(lambda *a: [jaxfuse.decode_attention(
            *a, num_splits=n, block_sizes=LAYOUTS[layout], **kw) for n in (1, 3)])(
            qkv, kc, vc, lengths)
        for o, lse, k_out, v_out in got:
            self.assertEqual(o.dtype, jnp.bfloat16)
            assert_close(o, want[0], jnp.bfloat16)
            np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want[1]))
            # The new rows as the reference forms them (sum, rotation, one rounding): within
            # one bfloat16 rounding (the kernel's cos, sin and sums may differ in the last
            # float32 bits), every other entry bitwise.
            for a, w in ((k_out, want[2]), (v_out, want[3])):
                a, w = np.asarray(a, np.float32), np.asarray(w, np.float32)
                np.testing.assert_allclose(a, w, rtol=2 ** -7, atol=0)
                rows = np.arange(self.S)[None, :] != np.asarray(lengths)[:, None]
                np.testing.assert_array_equal(a[rows], w[rows])

    def test_reference_is_the_composition(self):
        # Sum, unpack, RoPE (`jaxfuse.rope`'s reference), round to the cache's dtype, append.
        d, hkv, g = 16, self.HKV, self.HQ // self.HKV
        qkv, kc, vc, lengths = self._inputs(d, 3, seed=5)
        got = self._oracle(qkv, kc, vc, lengths, packed_qkv="grouped", partial_sums=True,
                           rope_base=10000.0)
        grouped = jnp.sum(qkv, axis=0).reshape(self.B, hkv, g + 2, d)
        pos = lengths[:, None]
        turn = lambda x: jaxfuse.rope(x[:, None], pos, impl="reference")[:, 0]
        q = turn(grouped[:, :, :g].reshape(self.B, hkv * g, d)).astype(jnp.bfloat16)
        k_new = turn(grouped[:, :, g]).astype(jnp.bfloat16)
        v_new = grouped[:, :, g + 1].astype(jnp.bfloat16)
        want = self._oracle(q, kc, vc, lengths, k_new=k_new, v_new=v_new)
        for a, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(w, np.float32))

    @parameterized.parameters(*LAYOUTS)
    def test_rms_input(self, layout):
        # The projection's input RMSNorm applied in the kernel (its weight folded into the
        # projection by the caller): the sums scaled per row by rsqrt(mean(x^2) + eps), x of a
        # prime width (a padded block on the GPU layout) and large enough that the scale matters.
        qkv, kc, vc, lengths = self._inputs(16, 3, seed=11)
        x = jnp.asarray(np.random.default_rng(12).standard_normal((self.B, 37)) * 5, jnp.bfloat16)
        kw = dict(packed_qkv="grouped", partial_sums=True, rope_base=500.0, rms_input=x,
                  rms_eps=1e-5, return_lse=True)
        want = self._oracle(qkv, kc, vc, lengths, **kw)
        # The reference is the scale on the summed q/k/v, then the rest as without it.
        r = jax.lax.rsqrt(jnp.mean(jnp.square(x.astype(jnp.float32)), -1) + 1e-5)
        scaled = self._oracle(jnp.sum(qkv, 0, keepdims=True) * r[None, :, None, None], kc, vc,
                              lengths, **dict(kw, rms_input=None))
        for a, w in zip(want, scaled):
            np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(w, np.float32),
                                       rtol=2 ** -7, atol=1e-6)
        got = jax.jit(lambda *a: [jaxfuse.decode_attention(
            *a, num_splits=n, block_sizes=LAYOUTS[layout], **kw) for n in (1, 3)])(
            qkv, kc, vc, lengths)
        for o, lse, k_out, v_out in got:
            assert_close(o, want[0], jnp.bfloat16)
            np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want[1]))
            for a, w in ((k_out, want[2]), (v_out, want[3])):
                np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(w, np.float32),
                                           rtol=2 ** -7, atol=0)
        call = lambda **k: jaxfuse.decode_attention(qkv, kc, vc, lengths, **dict(kw, **k))
        with self.assertRaisesRegex(ValueError, "rms_input needs packed_qkv"):
            jaxfuse.decode_attention(qkv[0, :, :self.HQ].astype(jnp.bfloat16), kc, vc, lengths,
                                     rms_input=x)
        with self.assertRaisesRegex(ValueError, r"rms_input.shape=\(2, 37\) must be \[B=3"):
            call(rms_input=x[:2])
        with self.assertRaisesRegex(ValueError, "rms_eps=0"):
            call(rms_eps=0.0)

    def test_halves_of_a_padded_head_dim(self):
        # D = 8 is padded to 16 columns on the GPU layout, where halves [i, i + 4] do not meet
        # in the kernel's reshape: XLA forms the new token, the kernel appends and attends.
        qkv, kc, vc, lengths = self._inputs(8, 2, seed=7)
        kw = dict(packed_qkv="grouped", partial_sums=True, rope_base=100.0,
                  rope_interleaved=False, return_lse=True)
        want = self._oracle(qkv, kc, vc, lengths, **kw)
        got = jaxfuse.decode_attention(qkv, kc, vc, lengths, block_sizes=LAYOUTS["gpu_layout"],
                                       **kw)
        assert_close(got[0], want[0], jnp.bfloat16)
        np.testing.assert_allclose(np.asarray(got[2], np.float32),
                                   np.asarray(want[2], np.float32), rtol=2 ** -7, atol=0)

    def test_vmap_over_partial_sums(self):
        # The mapped axis folds into the batch, which is axis 1 of partial sums.
        qkv, kc, vc, lengths = self._inputs(16, 2, seed=8)
        qkv2 = jnp.stack([qkv, -qkv], axis=1)                  # [P, 2, B, heads, D]
        kc2, vc2 = jnp.stack([kc, vc]), jnp.stack([vc, kc])
        lengths2 = jnp.stack([lengths, lengths[::-1]])
        f = lambda impl: jax.jit(jax.vmap(lambda q, k, v, n: jaxfuse.decode_attention(
            q, k, v, n, packed_qkv=True, partial_sums=True, rope_base=10000.0, impl=impl),
            in_axes=(1, 0, 0, 0)))
        got, want = f("pallas")(qkv2, kc2, vc2, lengths2), f("reference")(qkv2, kc2, vc2,
                                                                          lengths2)
        assert_close(got[0], want[0], jnp.bfloat16)
        np.testing.assert_allclose(np.asarray(got[1], np.float32),
                                   np.asarray(want[1], np.float32), rtol=2 ** -7, atol=0)

    @parameterized.parameters("pallas", "reference")
    def test_bad_input(self, impl):
        qkv, kc, vc, lengths = self._inputs(16, 2, seed=9)
        call = lambda q, **kw: jaxfuse.decode_attention(q, kc, vc, lengths, impl=impl, **kw)
        with self.assertRaisesRegex(ValueError, "partial_sums=True needs packed_qkv"):
            call(qkv, partial_sums=True)
        with self.assertRaisesRegex(ValueError, r"q.shape=\(3, 12, 16\) must be \[P, B"):
            call(qkv[0], packed_qkv=True, partial_sums=True)
        with self.assertRaisesRegex(ValueError, "packed_qkv='rows' must be one of"):
            call(qkv[0], packed_qkv="rows")
        with self.assertRaisesRegex(ValueError, r"grouped.*q.shape=\(3, 11, 16\) must be"):
            call(qkv[0, :, :11], packed_qkv="grouped")
        with self.assertRaisesRegex(ValueError, "rope_base rotates the new token"):
            call(qkv[0, :, :self.HQ].astype(jnp.bfloat16), rope_base=10000.0)
        with self.assertRaisesRegex(ValueError, "rope_base=-1.0"):
            call(qkv, packed_qkv=True, partial_sums=True, rope_base=-1.0)
        with self.assertRaisesRegex(ValueError, "even head dim, got D=15"):
            call(qkv[..., :15], packed_qkv=True, partial_sums=True, rope_base=10000.0)


if __name__ == "__main__":
    pytest.main([__file__])
