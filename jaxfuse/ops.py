"""The public ops. Each routes to `jaxfuse.pallas.<op>` or `jaxfuse.reference.<op>` by `impl`.

`interpret=None` interprets the kernel on a CPU backend and compiles it (Triton) on a GPU;
`JAXFUSE_INTERPRET=1|0` overrides. `block_sizes` overrides the tile rule (for tests and tuning).
"""
from __future__ import annotations

import jax

from jaxfuse._dispatch import route
from jaxfuse.pallas import beam_top_k as _p_topk
from jaxfuse.reference import attention as _r_attn
from jaxfuse.reference import beam_top_k as _r_topk
from jaxfuse.reference import cross_entropy as _r_ce
from jaxfuse.reference import decode_attention as _r_dec
from jaxfuse.reference import layer_norm as _r_ln
from jaxfuse.reference import linear_cross_entropy as _r_lce
from jaxfuse.reference import rms_norm as _r_rms
from jaxfuse.reference import softmax as _r_softmax
from jaxfuse.sharding import attention as _s_attn
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
                 causal=causal, interpret=interpret, block_sizes=block_sizes)


def layer_norm(x: jax.Array, weight: jax.Array | None = None, bias: jax.Array | None = None, *,
               eps: float = 1e-5, impl: str = "pallas", interpret: bool | None = None,
               block_sizes=None) -> jax.Array:
    """LayerNorm over the last axis: (x - mean) / sqrt(var + eps) * weight + bias.

    >>> y = jaxfuse.layer_norm(x, w, b)          # x [..., D], w and b [D]
    """
    return route(impl, _s_rows.layer_norm, _r_ln.layer_norm, x, weight, bias, eps=eps,
                 interpret=interpret, block_sizes=block_sizes)


def rms_norm(x: jax.Array, weight: jax.Array | None = None, *, eps: float = 1e-6,
             impl: str = "pallas", interpret: bool | None = None, block_sizes=None) -> jax.Array:
    """RMSNorm over the last axis: x / sqrt(mean(x^2) + eps) * weight.

    >>> y = jaxfuse.rms_norm(x, w)
    """
    return route(impl, _s_rows.rms_norm, _r_rms.rms_norm, x, weight, eps=eps,
                 interpret=interpret, block_sizes=block_sizes)


def cross_entropy(logits: jax.Array, labels: jax.Array, *, label_smoothing: float = 0.0,
                  ignore_index: int = -100, reduction: str = "mean", impl: str = "pallas",
                  interpret: bool | None = None, block_sizes=None) -> jax.Array:
    """Cross-entropy of logits [..., V] against integer labels [...], float32 result.

    Target p = (1 - label_smoothing) onehot + label_smoothing / V. `reduction`: "mean" (over
    tokens whose label is not `ignore_index`), "sum" or "none". A label outside [0, V) that is
    not `ignore_index` gives NaN for that token.

    >>> loss = jaxfuse.cross_entropy(logits, targets, label_smoothing=0.1)
    """
    return route(impl, _s_rows.cross_entropy, _r_ce.cross_entropy, logits, labels,
                 label_smoothing=label_smoothing, ignore_index=ignore_index,
                 reduction=reduction, interpret=interpret, block_sizes=block_sizes)


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = False,
                    scale: float | None = None, q_segment_ids: jax.Array | None = None,
                    kv_segment_ids: jax.Array | None = None, sliding_window: int | None = None,
                    logits_soft_cap: float | None = None, return_lse: bool = False,
                    impl: str = "pallas", interpret: bool | None = None, block_sizes=None):
    """Attention of q [B, Tq, Hq, D] over k, v [B, Tk, Hkv, D] (Hq % Hkv == 0: MHA/GQA/MQA).

    `scale` defaults to 1/sqrt(D). `causal` is bottom-right aligned: query i sees key j iff
    j <= i + (Tk - Tq); `sliding_window=w` also drops keys j < i + (Tk - Tq) - w + 1.
    Segment ids (int [B, Tq] and [B, Tk]): a query sees only keys with the same id.
    `logits_soft_cap=c`: logits become c * tanh(s / c). Returns o [B, Tq, Hq, D] (and, with
    `return_lse`, the float32 log-sum-exp [B, Hq, Tq]); a query that sees no key gets zeros
    and lse = -inf. Memory O(T); gradients recompute P and are deterministic.

    >>> o = jaxfuse.flash_attention(q, k, v, causal=True)
    """
    return route(impl, _s_attn.flash_attention, _r_attn.attention, q, k, v, causal=causal,
                 scale=scale, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                 sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                 return_lse=return_lse, interpret=interpret, block_sizes=block_sizes)


def decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                     kv_lengths: jax.Array, *, scale: float | None = None,
                     num_splits: int | None = None, logits_soft_cap: float | None = None,
                     return_lse: bool = False, impl: str = "pallas",
                     interpret: bool | None = None, block_sizes=None):
    """One new query per sequence, q [B, Hq, D], over KV caches [B, S, Hkv, D] that hold
    `kv_lengths[b]` valid positions (int [B], clipped to [0, S]; whatever lies beyond is never
    read). Returns o [B, Hq, D] (and float32 lse [B, Hq] with `return_lse`); a sequence of
    length 0 gives zeros. `num_splits=None` picks the split-KV count to fill the GPU.

    >>> o = jaxfuse.decode_attention(q, k_cache, v_cache, lengths)
    """
    return route(impl, _s_attn.decode_attention, _r_dec.decode_attention, q, k_cache, v_cache,
                 kv_lengths, scale=scale, num_splits=num_splits,
                 logits_soft_cap=logits_soft_cap, return_lse=return_lse, interpret=interpret,
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
                 interpret=interpret, block_sizes=block_sizes)


def beam_top_k(log_probs: jax.Array, beam_scores: jax.Array, k: int, *, impl: str = "pallas",
               interpret: bool | None = None, block_sizes=None):
    """Best k of the beam_size x V continuations scored beam_scores[b, i] + log_probs[b, i, j]:
    (scores [B, k] float32, beam_index [B, k], token_index [B, k]), best first, ties broken by
    the lower flat index i * V + j. "pallas" is the hierarchical HARS selection (exact);
    "reference" is `lax.top_k` over the flattened scores. Both give identical results.

    >>> scores, parent, token = jaxfuse.beam_top_k(log_probs, beam_scores, beam_size)
    """
    return route(impl, _p_topk.beam_top_k, _r_topk.beam_top_k, log_probs, beam_scores, k,
                 interpret=interpret, block_sizes=block_sizes)
