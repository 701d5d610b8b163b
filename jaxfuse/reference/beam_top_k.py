"""Reference beam top-k: the best k of beam_size x V candidate continuations.

candidate (beam i, token j) scores beam_scores[b, i] + log_probs[b, i, j]; the flat index is
i * V + j. Returns the k best per batch row, best first, ties broken by the lower flat index
(`lax.top_k`'s order), as (scores, beam_index, token_index).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxfuse import _checks


def validate(log_probs, beam_scores, k) -> None:
    _checks.check_float("log_probs", log_probs)
    _checks.check_ndim("log_probs", log_probs, 3)
    b, n_beams, v = log_probs.shape
    if tuple(beam_scores.shape) != (b, n_beams):
        raise ValueError(f"beam_scores.shape={tuple(beam_scores.shape)} must be ({b}, {n_beams})"
                         " = log_probs.shape[:2]")
    if n_beams * v == 0:
        raise ValueError(f"log_probs.shape={tuple(log_probs.shape)}: the beams and the "
                         "vocabulary (axes 1 and 2) must not be empty")
    if not (_checks.is_int(k) and 1 <= k <= n_beams * v):
        raise ValueError(f"k={k!r} must be an int in [1, beam_size * V = {n_beams * v}]")


def candidates(log_probs, beam_scores):
    """Flat candidate scores [B, beam_size * V] in float32."""
    b, n_beams, v = log_probs.shape
    total = beam_scores.astype(jnp.float32)[:, :, None] + log_probs.astype(jnp.float32)
    return total.reshape(b, n_beams * v)


def beam_top_k(log_probs: jax.Array, beam_scores: jax.Array, k: int):
    """(scores [B, k] float32, beam_index [B, k] int32, token_index [B, k] int32), best first."""
    validate(log_probs, beam_scores, k)
    v = log_probs.shape[-1]
    scores, flat = jax.lax.top_k(candidates(log_probs, beam_scores), k)
    return scores, (flat // v).astype(jnp.int32), (flat % v).astype(jnp.int32)
