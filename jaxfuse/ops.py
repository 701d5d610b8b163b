"""The public ops. Each routes to `jaxfuse.pallas.<op>` or `jaxfuse.reference.<op>` by `impl`.

`interpret=None` interprets the kernel on a CPU backend and compiles it (Triton) on a GPU;
`JAXFUSE_INTERPRET=1|0` overrides. `block_sizes` overrides the tile rule (for tests and tuning).
Zero-size inputs (an empty batch, zero keys) take the reference and return what jnp would.
"""
from __future__ import annotations

import functools

import jax

from jaxfuse import _checks
from jaxfuse._dispatch import route
from jaxfuse.pallas._attn import AttnBlocks
from jaxfuse.pallas._rows import RowBlocks
from jaxfuse.pallas.decode_attention import DecodeBlocks
from jaxfuse.pallas.linear_cross_entropy import LCEBlocks
from jaxfuse.reference import add_norm as _r_an
from jaxfuse.reference import add_norm_linear as _r_anl
from jaxfuse.reference import attention as _r_attn
from jaxfuse.reference import beam_step as _r_step
from jaxfuse.reference import beam_top_k as _r_topk
from jaxfuse.reference import bias_act_dropout as _r_bad
from jaxfuse.reference import bias_dropout_add as _r_bda
from jaxfuse.reference import dropout as _r_drop
from jaxfuse.reference import embedding as _r_emb
from jaxfuse.reference import reorder_beams as _r_reo
from jaxfuse.reference import cross_entropy as _r_ce
from jaxfuse.reference import decode_attention as _r_dec
from jaxfuse.reference import layer_norm as _r_ln
from jaxfuse.reference import linear_cross_entropy as _r_lce
from jaxfuse.reference import rms_norm as _r_rms
from jaxfuse.reference import rope as _r_rope
from jaxfuse.reference import rope_qkv as _r_rq
from jaxfuse.reference import softmax as _r_softmax
from jaxfuse.reference import swiglu as _r_swiglu
from jaxfuse.reference import swiglu_linear as _r_swl
from jaxfuse.sharding import attention as _s_attn
from jaxfuse.sharding import blocks as _s_blocks
from jaxfuse.sharding import linear_cross_entropy as _s_lce
from jaxfuse.sharding import rows as _s_rows


def softmax(x: jax.Array, *, scale: float = 1.0, mask: jax.Array | None = None,
            causal: bool = False, impl: str = "pallas", interpret: bool | None = None,
            block_sizes=None) -> jax.Array:
    """Softmax over the last axis of `scale * x`.

    `mask`: bool, broadcastable to x, True = keep. `causal`: the last two axes are [queries,
    keys] and key j is kept for query i iff j <= i + (n_keys - n_queries). A fully masked row
    gives zeros (zero gradient). Output dtype = x.dtype; arithmetic in float32.

    >>> y = jaxfuse.softmax(scores, scale=0.125, causal=True)
    """
    return route(impl, _s_rows.softmax, _r_softmax.softmax, x, scale=scale, mask=mask,
                 causal=causal, block_type=RowBlocks, interpret=interpret, block_sizes=block_sizes)


def layer_norm(x: jax.Array, weight: jax.Array | None = None, bias: jax.Array | None = None, *,
               eps: float = 1e-5, impl: str = "pallas", interpret: bool | None = None,
               block_sizes=None) -> jax.Array:
    """LayerNorm over the last axis: (x - mean) / sqrt(var + eps) * weight + bias.

    >>> y = jaxfuse.layer_norm(x, w, b)          # x [..., D], w and b [D]
    """
    return route(impl, _s_rows.layer_norm, _r_ln.layer_norm, x, weight, bias, eps=eps,
                 block_type=RowBlocks, interpret=interpret, block_sizes=block_sizes)


def rms_norm(x: jax.Array, weight: jax.Array | None = None, *, eps: float = 1e-6,
             impl: str = "pallas", interpret: bool | None = None, block_sizes=None) -> jax.Array:
    """RMSNorm over the last axis: x / sqrt(mean(x^2) + eps) * weight.

    >>> y = jaxfuse.rms_norm(x, w)
    """
    return route(impl, _s_rows.rms_norm, _r_rms.rms_norm, x, weight, eps=eps,
                 block_type=RowBlocks, interpret=interpret, block_sizes=block_sizes)


def cross_entropy(logits: jax.Array, labels: jax.Array, *, label_smoothing: float = 0.0,
                  ignore_index: int = -100, reduction: str = "mean", impl: str = "pallas",
                  interpret: bool | None = None, block_sizes=None) -> jax.Array:
    """Cross-entropy of logits [..., V] against integer labels [...], float32 result.

    Target p = (1 - label_smoothing) onehot + label_smoothing / V. `reduction`: "mean" (over
    tokens whose label is not `ignore_index`), "sum" or "none". A label outside [0, V) that is
    not `ignore_index` gives NaN for that token. Labels of any integer dtype are compared as
    integers (a uint8 label never equals ignore_index=-100); `ignore_index` must be an int
    (Python, NumPy or a concrete jax integer).
    A logit of -inf (a masked entry) is fine without smoothing; with label_smoothing > 0 it
    makes that token's loss +inf, as the formula says (the smoothing term sums every logit).

    >>> loss = jaxfuse.cross_entropy(logits, targets, label_smoothing=0.1)
    """
    return route(impl, _s_rows.cross_entropy, _r_ce.cross_entropy, logits, labels,
                 label_smoothing=label_smoothing, ignore_index=ignore_index,
                 reduction=reduction,
                 block_type=RowBlocks, interpret=interpret, block_sizes=block_sizes)


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = False,
                    scale: float | None = None, q_segment_ids: jax.Array | None = None,
                    kv_segment_ids: jax.Array | None = None, sliding_window: int | None = None,
                    logits_soft_cap: float | None = None, return_lse: bool = False,
                    dropout_rate: float = 0.0, dropout_key=None, deterministic: bool = True,
                    impl: str = "pallas", interpret: bool | None = None, block_sizes=None):
    """Attention of q [B, Tq, Hq, D] over k, v [B, Tk, Hkv, D] (Hq % Hkv == 0: MHA/GQA/MQA).

    `scale` defaults to 1/sqrt(D). `causal` is bottom-right aligned: query i sees key j iff
    j <= i + (Tk - Tq); `sliding_window=w` also drops keys j < i + (Tk - Tq) - w + 1.
    Segment ids (int [B, Tq] and [B, Tk]): a query sees only keys with the same id.
    `logits_soft_cap=c`: logits become c * tanh(s / c). Returns o [B, Tq, Hq, D] (and, with
    `return_lse`, the float32 log-sum-exp [B, Hq, Tq]); a query that sees no key gets zeros
    and lse = -inf. Memory O(T); gradients recompute P (deterministic by default, see below). A NaN in q, k
    or v gives NaN in the rows that see it; `scale` and the soft cap must be finite. Keys and
    values that the masks hide may hold anything (NaN, inf: the padding of packed sequences):
    it reaches no output or gradient of a query that does not see it.
    `dropout_rate` with `dropout_key` (a PRNG key): dropout of the attention probabilities in
    the kernel (FlashAttention-2), the mask that of `jaxfuse.dropout` over P [B, Hq, Tq, Tk],
    regenerated by the backward; lse stays that of the undropped scores. With dropout the
    portable kernels run (no Hopper forward), and on a mesh the op splits over batch and KV
    heads only (each shard draws the one-device mask).

    On a Hopper GPU (sm90) with bf16/f16 inputs and head_dim 64/128/256, the forward runs a
    FlashAttention-3 style Mosaic GPU kernel (TMA ring, wgmma, ping-ponging warpgroups), and
    the backward a Mosaic GPU dK/dV kernel (plus a dQ kernel), segment ids included; lengths
    that are not multiples of their 128-row tiles run padded with zeros (a copy of the inputs
    in XLA; the masks keep the true lengths). Everything else runs the portable Triton kernels.
    `block_sizes=AttnBlocks(hopper=False)` turns both off, `hopper=True` forces them (also in
    Mosaic GPU's interpreter on a CPU; it raises where it does not fit). With a causal mask
    or a window the Hopper forward cleans the tiles the masks cut in shared memory, and so
    does the backward's dQ kernel (the fused dQ of `deterministic=False` at head_dim 64
    passes K and V through one elementwise XLA pass instead): masked keys may hold garbage
    there too.
    `deterministic=True` (default): gradients are bitwise identical across runs. `False` lets
    the Hopper backward fold dQ into its dK/dV kernel and add the partial dQ of each key tile
    into a float32 buffer with reducing (atomic) TMA stores, in whatever order the tiles
    finish: 5 matrix products per tile instead of 7, not bitwise reproducible (as cuDNN's
    attention backward by default). It does so at D = 64, where it is faster; at D = 128 its
    reducing stores cost more than they save, and at D = 256 the dK/dV kernel's consumers
    split the columns rather than the keys, so the deterministic kernels run there
    (BENCHMARKS.md). The portable kernels ignore it (always deterministic).

    Not a bug: dq and dk that are exactly zero in theory (one visible key, one-hot attention,
    v equal for every key) come out as rounding noise, about 1e-6 in float32 and 4e-3
    in bfloat16 relative to the inputs, because delta = rowsum(dO * O) is computed apart from
    P (FlashAttention-2, sec. 3.1), so dP - delta cancels only up to rounding. With one visible
    key P itself is exact (o = v, dv = do), at any logit size. float32 inputs: the kernels'
    matmuls follow JAX's matmul precision as XLA's do (TF32 on a GPU by default, about 1e-3
    relative; `with jax.default_matmul_precision("float32"):` for full float32).

    >>> o = jaxfuse.flash_attention(q, k, v, causal=True)
    """
    pallas = functools.partial(_s_attn.flash_attention,
                               deterministic=_checks.check_bool("deterministic", deterministic))
    return route(impl, pallas, _r_attn.attention, q, k, v, causal=causal,
                 scale=scale, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                 sliding_window=_r_attn.effective_window(_checks.python_scalar(sliding_window), k),
                 logits_soft_cap=logits_soft_cap,
                 return_lse=return_lse, dropout_rate=dropout_rate, dropout_key=dropout_key,
                 block_type=AttnBlocks, interpret=interpret, block_sizes=block_sizes)


def decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                     kv_lengths: jax.Array, *, scale: float | None = None,
                     num_splits: int | None = None, logits_soft_cap: float | None = None,
                     return_lse: bool = False, k_new: jax.Array | None = None,
                     v_new: jax.Array | None = None, packed_qkv: bool | str = False,
                     partial_sums: bool = False, rope_base: float | None = None,
                     rope_interleaved: bool = True, rms_input: jax.Array | None = None,
                     rms_eps: float = 1e-6, impl: str = "pallas",
                     interpret: bool | None = None, block_sizes=None):
    """One new query per sequence, q [B, Hq, D], over KV caches [B, S, Hkv, D] that hold
    `kv_lengths[b]` valid positions (int [B], clipped to [0, S]; whatever lies beyond is never
    read; lengths of any integer dtype are clipped in that dtype, so uint32 2^31 means S).
    Returns o [B, Hq, D] (and float32 lse [B, Hq] with `return_lse`); a sequence of length 0
    (or a cache of S = 0) gives zeros and lse = -inf. `num_splits=None` picks the split-KV count to fill the GPU.

    A decoding step in one launch: with `k_new` and `v_new` ([B, Hkv, D], the new token's key
    and value, in the cache's dtype) the kernel first writes them at position kv_lengths[b]
    and then attends over kv_lengths[b] + 1 positions; it returns (o, k_cache, v_cache), or
    (o, lse, k_cache, v_cache), with the caches updated in place (the Pallas kernel aliases
    them: donate the caches, or update them inside a jitted loop, and no copy is made). A full
    cache (kv_lengths[b] >= S) takes no new row and attends over its S positions.
    `packed_qkv=True`: q is [B, Hq + 2 Hkv, D], the query heads then the new key's then the new
    value's (a fused q/k/v projection's output, e.g. `jnp.concatenate([q, k, v], axis=1)`);
    the kernel reads all three from that one array, where separate q, k_new and v_new would
    each be copied out of it first. `packed_qkv="grouped"`: q is [B, Hkv (G + 2), D], each KV
    head's G query heads, then its new key, then its new value (a projection whose columns are
    grouped by KV head, as `jaxfuse.model`'s, whose heads a tensor-parallel split keeps together).

    The rest of a decoding step's attention input, fused in: `rope_base=` rotates the query
    heads and the new key by RoPE at position kv_lengths[b] (as `jaxfuse.rope`, pairs
    interleaved or, with `rope_interleaved=False`, halves); `partial_sums=True` takes a packed q
    as P float32 partial sums [P, B, heads, D] of the projection split along its contraction
    and adds them in the kernel, so that the projection's reduction takes no launch of its own:
    `jnp.einsum("bpk,pkn->pbn", x.reshape(B, P, -1), w.reshape(P, -1, N),
    preferred_element_type=jnp.float32)`. `rms_input=x` [B, d], the projection's input, applies
    its RMSNorm in the kernel: each row times rsqrt(mean(x^2) + rms_eps), the norm's weight w
    folded into the projection (norm(x) @ W = rsqrt(mean(x^2) + eps) * (x @ (w[:, None] * W))),
    so no launch normalizes x first. The new token's q, k and v are rounded to the cache's dtype
    after the sum, the scale and the rotation; o comes in the cache's dtype.

    >>> o = jaxfuse.decode_attention(q, k_cache, v_cache, lengths)
    >>> o, k_cache, v_cache = jaxfuse.decode_attention(q, k_cache, v_cache, lengths,
    ...                                                k_new=k, v_new=v)   # then lengths + 1
    """
    return route(impl, _s_attn.decode_attention, _r_dec.decode_attention, q, k_cache, v_cache,
                 kv_lengths, scale=scale, num_splits=_checks.python_scalar(num_splits),
                 logits_soft_cap=logits_soft_cap, return_lse=return_lse, k_new=k_new,
                 v_new=v_new, packed_qkv=packed_qkv, partial_sums=partial_sums,
                 rope_base=rope_base, rope_interleaved=rope_interleaved, rms_input=rms_input,
                 rms_eps=rms_eps, block_type=DecodeBlocks, interpret=interpret,
                 block_sizes=block_sizes)


def linear_cross_entropy(x: jax.Array, weight: jax.Array, labels: jax.Array, *,
                         label_smoothing: float = 0.0, ignore_index: int = -100,
                         z_loss: float = 0.0, logits_soft_cap: float | None = None,
                         reduction: str = "mean", impl: str = "pallas",
                         interpret: bool | None = None, block_sizes=None) -> jax.Array:
    """`cross_entropy(x @ weight, labels, ...)` plus `z_loss * lse^2` per token, without ever
    materializing the [N, V] logits (x [..., D], weight [D, V], labels [...]).
    `logits_soft_cap=c` caps the logits with c * tanh(z / c). Differentiable in x and weight;
    gradients are deterministic. `impl="reference"` is the plain composition.

    >>> loss = jaxfuse.linear_cross_entropy(hidden, w_unembed, targets, z_loss=1e-4)
    """
    return route(impl, _s_lce.linear_cross_entropy, _r_lce.linear_cross_entropy, x, weight,
                 labels, label_smoothing=label_smoothing, ignore_index=ignore_index,
                 z_loss=z_loss, logits_soft_cap=logits_soft_cap, reduction=reduction,
                 block_type=LCEBlocks, interpret=interpret, block_sizes=block_sizes)


def beam_top_k(log_probs: jax.Array, beam_scores: jax.Array, k: int, *, impl: str = "pallas",
               interpret: bool | None = None, block_sizes=None):
    """Best k of the beam_size x V continuations scored beam_scores[b, i] + log_probs[b, i, j]:
    (scores [B, k] float32, beam_index [B, k], token_index [B, k]), best first, ties broken by
    the lower flat index i * V + j. "pallas" is the hierarchical HARS selection (exact);
    "reference" is `lax.top_k` over the flattened scores. Both give identical results, NaN
    included: +NaN ranks above +inf and -NaN below -inf, as in `lax.top_k`.

    >>> scores, parent, token = jaxfuse.beam_top_k(log_probs, beam_scores, beam_size)
    """
    return route(impl, _s_blocks.beam_top_k, _r_topk.beam_top_k, log_probs, beam_scores,
                 _checks.python_scalar(k),
                 block_type=RowBlocks, interpret=interpret, block_sizes=block_sizes)


def beam_step(logits: jax.Array, raw_scores: jax.Array, lengths: jax.Array, done: jax.Array, *,
              eos_id: int, length_penalty: float = 0.0, impl: str = "pallas",
              interpret: bool | None = None, block_sizes=None):
    """One step of beam search from each beam's next-token logits [B, K, V] (any float dtype)
    and its state: raw_scores [B, K] (sum of log-probs so far), lengths [B, K] (int: tokens so
    far, eos included), done [B, K] (bool: the beam emitted eos). Returns the next K beams of
    every row as (parent, token, raw_scores, lengths, done), each [B, K]: the best K of the
    K x V continuations scored (raw + log_softmax(logits)) * len ** -length_penalty, ties to
    the lower flat index parent * V + token. A finished beam's one continuation is eos_id at
    log-prob 0 (it keeps its score and competes on the same scale; whatever its logits hold,
    NaN included, is not read); an eos_id outside [0, V) ends no beam (and leaves a done beam
    no continuation). lengths come back int32. "pallas": the candidates formed and selected
    in two kernels without a [B, K x V] array in memory (HARS, `jaxfuse.pallas.beam_step`);
    "reference": XLA's log_softmax and `lax.top_k`. Both give the same bits, NaN candidates
    included where `lax.top_k` keeps its total order (+NaN above +inf, -NaN below -inf: a
    CPU; XLA's GPU top_k ranks +NaN below +inf, the kernels keep the total order). A live
    beam whose logits are all -inf or hold a NaN has NaN candidates (its log-softmax is NaN),
    which a GPU makes +NaN: they outrank every real one. For inference: no gradient.

    >>> parent, token, raw, lengths, done = jaxfuse.beam_step(logits, raw, lengths, done,
    ...                                                       eos_id=2, length_penalty=0.6)
    """
    return route(impl, _s_blocks.beam_step, _r_step.beam_step, logits, raw_scores, lengths,
                 done, eos_id=eos_id, length_penalty=length_penalty, block_type=RowBlocks,
                 interpret=interpret, block_sizes=block_sizes)


def reorder_beams(caches, parent: jax.Array, start: jax.Array, stop: jax.Array, *,
                  impl: str = "pallas", interpret: bool | None = None,
                  block_sizes=None) -> tuple:
    """Beam search's cache reorder: in every cache [B, K, S, ...] (K beams, S positions) beam j
    of row b takes beam parent[b, j]'s entries at positions start[b] <= s < stop[b]; the other
    positions keep their own. Returns the caches as a tuple. The Pallas kernel works in place
    (donate the caches, or reorder inside a jitted loop) and touches only those positions and
    only beams whose parent is another beam, every cache in one launch; "reference" gathers.
    Beams grown from one prompt share the prompt's keys and values, so a decoding step reorders
    [prompt length, prompt length + step) only. parent is clipped to [0, K), start and stop to
    [0, S]. For inference: the kernel has no gradient (the reference, a gather, has one).

    >>> k_caches = jaxfuse.reorder_beams(k_caches, parent, prompt_lengths, prompt_lengths + t)
    """
    return route(impl, _s_blocks.reorder_beams, _r_reo.reorder_beams, caches, parent, start,
                 stop, block_type=RowBlocks, interpret=interpret, block_sizes=block_sizes)


def dropout(x: jax.Array, rate: float, key, *, impl: str = "pallas",
            interpret: bool | None = None, block_sizes=None) -> jax.Array:
    """Inverted dropout: where(keep, x / p, 0), p = P(keep) = 1 - rate rounded to a multiple of
    2^-16; the mask a pure function of (key, x.shape, element index) computed in the kernel by
    Philox-4x32-10 (one call per 8 elements) and regenerated by the backward (never stored). `key`: `jax.random.key(...)`; `rate=0` or `key=None`: identity.

    >>> y = jaxfuse.dropout(x, 0.1, jax.random.fold_in(key, step))
    """
    # rate by keyword: `route` reads a concrete jax scalar option as its number
    return route(impl, _s_blocks.dropout, _r_drop.dropout, x, rate=rate, key=key,
                 block_type=RowBlocks, interpret=interpret, block_sizes=block_sizes)


def bias_dropout_add(x: jax.Array, bias: jax.Array | None, residual: jax.Array, *,
                     rate: float = 0.0, key=None, impl: str = "pallas",
                     interpret: bool | None = None, block_sizes=None) -> jax.Array:
    """`residual + dropout(x + bias)` in one pass (bias [D] or None); the mask is `dropout`'s.

    >>> h = jaxfuse.bias_dropout_add(attn_out, b_o, h, rate=0.1, key=k)
    """
    return route(impl, _s_blocks.bias_dropout_add, _r_bda.bias_dropout_add, x, bias, residual,
                 rate=rate, key=key,
                 block_type=RowBlocks, interpret=interpret, block_sizes=block_sizes)


def bias_act_dropout(x: jax.Array, bias: jax.Array | None, *, activation: str = "gelu",
                     rate: float = 0.0, key=None, impl: str = "pallas",
                     interpret: bool | None = None, block_sizes=None) -> jax.Array:
    """`dropout(act(x + bias))` in one pass; `activation`: "gelu" (erf), "gelu_tanh", "relu" or
    "silu" as in `jax.nn`. The backward recomputes act' from x (nothing else saved). The
    kernels take gelu's 1 + erf as an erfc (Abramowitz and Stegun 7.1.26): gelu within 2 float32
    ulps of max(1, |z|) of the exact value, its derivative within 3 ulps of 1 (interpreted;
    compiled, the reciprocal and exp2 are the hardware's approximations), and relative
    accuracy in the negative tail (0.4% down to z = -6, 1.2% at -8); gelu_tanh's 0.5 (1 + tanh)
    as a sigmoid, likewise without cancellation in the tail.

    >>> a = jaxfuse.bias_act_dropout(x @ w1, b1, activation="gelu", rate=0.1, key=k)
    """
    return route(impl, _s_blocks.bias_act_dropout, _r_bad.bias_act_dropout, x, bias,
                 activation=activation, rate=rate, key=key,
                 block_type=RowBlocks, interpret=interpret, block_sizes=block_sizes)


def add_norm(x: jax.Array, residual: jax.Array, weight: jax.Array | None,
             bias: jax.Array | None = None, *, norm: str = "rms", eps: float | None = None,
             rate: float = 0.0, key=None, impl: str = "pallas", interpret: bool | None = None,
             block_sizes=None):
    """`(h, norm(h))` with `h = residual + dropout(x)`: a pre-norm block's "add, then normalize"
    in one read of x and residual. `norm`: "rms" (eps 1e-6, no bias) or "layer" (eps 1e-5).
    h is returned in x's dtype and y normalizes h as rounded. Differentiable in x, residual,
    weight and bias, with cotangents for both h and y.

    >>> h, y = jaxfuse.add_norm(attn_out, h, w_norm, rate=0.1, key=k)   # then mlp(y)
    """
    return route(impl, _s_blocks.add_norm, _r_an.add_norm, x, residual, weight, bias, norm=norm,
                 eps=eps, rate=rate, key=key,
                 block_type=RowBlocks, interpret=interpret, block_sizes=block_sizes)


def add_norm_linear(x: jax.Array, residual: jax.Array, weight: jax.Array | None,
                    bias: jax.Array | None = None, *, projections, norm: str = "rms",
                    eps: float | None = None, rate: float = 0.0, key=None, impl: str = "pallas",
                    interpret: bool | None = None, block_sizes=None):
    """`(h, tuple(y @ p for p in projections))` with `h, y = add_norm(x, residual, weight,
    bias, ...)`: a pre-norm block's add, norm and the matmuls that read y (q/k/v, gate/up).

    The same numbers as `add_norm` followed by the matmuls, but y is not kept for the
    projections' gradients: the add_norm backward kernel rebuilds it (bitwise equal) while it
    writes dx. Saved: h, its row statistics, the weights and the projections. That is one
    [..., D] array fewer per call to hold and, under `lax.scan` over layers, one fewer to copy
    into and out of the stacked residuals; the rebuild writes it once more. Each projection is
    [D, N] in x's dtype; sharded, N may split (column-parallel), the rows as for `add_norm`.

    >>> h, (q, k, v) = jaxfuse.add_norm_linear(delta, h, w_norm, projections=(wq, wk, wv))
    """
    return route(impl, _s_blocks.add_norm_linear, _r_anl.add_norm_linear, x, residual, weight,
                 bias, projections=tuple(projections) if isinstance(projections, list)
                 else projections, norm=norm, eps=eps, rate=rate, key=key,
                 block_type=RowBlocks, interpret=interpret, block_sizes=block_sizes)


def swiglu(gate: jax.Array, up: jax.Array, *, impl: str = "pallas",
           interpret: bool | None = None, block_sizes=None) -> jax.Array:
    """`silu(gate) * up` (SwiGLU's gate) in one pass; the backward recomputes silu from gate,
    so nothing but the inputs is saved.

    >>> a = jaxfuse.swiglu(x @ w_gate, x @ w_up)
    """
    return route(impl, _s_blocks.swiglu, _r_swiglu.swiglu, gate, up,
                 block_type=RowBlocks, interpret=interpret, block_sizes=block_sizes)


def swiglu_linear(gate: jax.Array, up: jax.Array, weight: jax.Array, *, impl: str = "pallas",
                  interpret: bool | None = None, block_sizes=None) -> jax.Array:
    """`swiglu(gate, up) @ weight`: SwiGLU, then the MLP's down projection (weight [F, D]).

    The same numbers as the two ops in a row, but the backward does not keep the [..., F]
    product for the weight's gradient: the SwiGLU backward kernel rebuilds it (bitwise equal)
    while it writes dgate and dup. Saved for the backward: gate, up and weight only. That is
    one array fewer per layer to hold and, under `lax.scan` over layers, one fewer to copy into
    and out of the stacked residuals; the rebuild writes it once more. Sharded, F may split
    (the product's partial sums are summed by XLA, as for any row-parallel matmul).

    >>> out = jaxfuse.swiglu_linear(x @ w_gate, x @ w_up, w_down)   # the MLP of a block
    """
    return route(impl, _s_blocks.swiglu_linear, _r_swl.swiglu_linear, gate, up, weight,
                 block_type=RowBlocks, interpret=interpret, block_sizes=block_sizes)


def rope(x: jax.Array, positions: jax.Array, *, base: float = 10000.0, interleaved: bool = True,
         impl: str = "pallas", interpret: bool | None = None, block_sizes=None) -> jax.Array:
    """Rotary embedding of x [..., T, H, D] at integer positions [..., T]: pair i turns by
    positions * base^(-2i/D). `interleaved=True` pairs (x[2i], x[2i+1]) (RoFormer,
    `jaxfuse.model`); `False` pairs (x[i], x[i + D/2]) (GPT-NeoX / Llama halves). Angles are
    computed in the kernel; the backward is the inverse rotation.

    >>> q = jaxfuse.rope(q, positions)
    """
    return route(impl, _s_blocks.rope, _r_rope.rope, x, positions, base=base,
                 interleaved=interleaved,
                 block_type=RowBlocks, interpret=interpret, block_sizes=block_sizes)


def rope_qkv(qkv: jax.Array, positions: jax.Array, *, base: float = 10000.0,
             interleaved: bool = True, impl: str = "pallas", interpret: bool | None = None,
             block_sizes=None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The grouped q/k/v projection [..., T, Hkv, G + 2, D] split into heads, q and k turned
    by RoPE (as `rope`): returns q [..., T, Hkv G, D], k and v [..., T, Hkv, D]. For each KV
    head the layout holds its G query heads, then its key, then its value (one matmul's
    output, `decode_attention(packed_qkv="grouped")`'s layout); query head n G + i is slot i
    of KV head n. One kernel reads qkv once and writes q, k, v once; the backward packs dq,
    dk (turned back) and dv into one gradient in one kernel. Its outputs carry RoPE's residual
    name, `residual_name("rope")`.

    >>> q, k, v = jaxfuse.rope_qkv((x @ w_qkv).reshape(b, t, hkv, g + 2, hd), positions)
    """
    return route(impl, _s_blocks.rope_qkv, _r_rq.rope_qkv, qkv, positions, base=base,
                 interleaved=interleaved, block_type=RowBlocks, interpret=interpret,
                 block_sizes=block_sizes)


def embedding(tokens: jax.Array, table: jax.Array, *, scale: float = 1.0,
              pos_table: jax.Array | None = None, positions: jax.Array | None = None,
              rate: float = 0.0, key=None, impl: str = "pallas", interpret: bool | None = None,
              block_sizes=None) -> jax.Array:
    """`dropout(scale * table[tokens] + pos_table[positions])` in one kernel (tokens int [...],
    table [V, D] -> [..., D]; positions default to 0..T-1 along tokens' last axis). A token or
    position out of range gives a NaN row and no gradient. The backward sums each table row's
    occurrences in a fixed (sorted) order: deterministic, no atomics.

    >>> x = jaxfuse.embedding(tokens, w_emb, scale=d_model ** 0.5, rate=0.1, key=k)
    """
    return route(impl, _s_blocks.embedding, _r_emb.embedding, tokens, table, scale=scale,
                 pos_table=pos_table, positions=positions, rate=rate, key=key,
                 block_type=RowBlocks, interpret=interpret, block_sizes=block_sizes)
