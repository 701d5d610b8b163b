"""Reference beam-search step: from each beam's next-token logits to the next beams.

One step of beam search (lecture 10, sec. 6) over B rows of K beams, with logits [B, K, V]:

    logp[b, i, j] = log_softmax(logits[b, i])[j], except for a finished beam (done[b, i]),
                    whose one continuation is eos_id at log-prob 0: it keeps its score and
                    competes with the live beams on the same scale;
    len[b, i]     = lengths[b, i] + (0 if done[b, i] else 1)   (tokens up to and with eos);
    cand[b, i, j] = (raw[b, i] + logp[b, i, j]) * len[b, i] ** -length_penalty;

the K best candidates of a row (ties to the lower flat index i * V + j, `lax.top_k`'s order)
are the new beams: parent i, token j, raw = raw[b, i] + logp[b, i, j] (the unnormalized sum
of log-probs), lengths = len[b, i] (int32), done = done[b, i] | (j == eos_id). An eos_id
outside [0, V) ends no beam, and a beam already done then has no continuation at all (every
candidate -inf): beam search never marks one done without an eos to emit.

Written once for both paths: `row_stats` (the log-softmax's max and log of the shifted sum,
computed by XLA on both), `candidate` (the Pallas kernel evaluates it in its tiles) and
`finish`. The same float operations in the same order give the same bits on both, so the
kernel's selection equals this one's, ties included. That is also why the length penalty is a
multiply by a reciprocal computed once per beam, not a divide of every candidate: XLA divides
correctly rounded, Triton's float32 divide is approximate (div.full), and a last-bit
difference could swap two candidates that tie.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxfuse import _checks


def validate(logits, raw_scores, lengths, done, eos_id, length_penalty) -> None:
    # Both paths branch on the two options in Python (the eos row, the penalty's multiply).
    _checks.check_static("eos_id", eos_id)
    _checks.check_static("length_penalty", length_penalty)
    _checks.check_float("logits", logits)
    _checks.check_ndim("logits", logits, 3)
    b, k, v = logits.shape
    if k * v == 0:
        raise ValueError(f"logits.shape={tuple(logits.shape)}: the beams and the vocabulary "
                         "(axes 1 and 2) must not be empty")
    if k * v >= 2 ** 31 - 1:
        raise ValueError(f"logits.shape={tuple(logits.shape)}: K x V = {k * v} candidates a "
                         "row overflow the int32 flat index; split the beams over calls")
    for name, x in (("raw_scores", raw_scores), ("lengths", lengths), ("done", done)):
        _checks.check_array(name, x)
        if tuple(x.shape) != (b, k):
            raise ValueError(f"{name}.shape={tuple(x.shape)} must be ({b}, {k}) = "
                             "logits.shape[:2], one per beam")
    _checks.check_float("raw_scores", raw_scores)
    _checks.check_int("lengths", lengths)
    if done.dtype != jnp.bool_:
        raise ValueError(f"done.dtype={done.dtype} must be bool (True: the beam has ended)")
    if not _checks.is_int(eos_id):
        raise ValueError(f"eos_id={eos_id!r} must be an int (a token id; one outside the "
                         "vocabulary ends no beam)")
    _checks.check_finite("length_penalty", length_penalty)


def row_stats(logits: jax.Array):
    """The log-softmax's per-row max m and log of the shifted sum ls, float32 [...]:
    logp = (x - m) - ls, as `jax.nn.log_softmax` computes it."""
    x = logits.astype(jnp.float32)
    m = jnp.max(x, axis=-1)
    return m, jnp.log(jnp.sum(jnp.exp(x - m[..., None]), axis=-1))


def beam_values(logits, raw_scores, lengths, done, length_penalty: float):
    """What both paths compute per beam before the candidates, in XLA: (m, ls, raw, length with
    this step's token, norm or None). Behind an optimization barrier: without it XLA fuses
    them into their consumers, which differ (the reference's log-softmax diamond became one
    fusion on an H100 and summed in another order than the kernel path's reduction: raw
    scores a last bit apart, s45-1); behind it both paths compute them alike."""
    m, ls = row_stats(logits)
    length = new_lengths(lengths, done)
    return jax.lax.optimization_barrier(
        (m, ls, raw_scores.astype(jnp.float32), length, scale(length, length_penalty)))


def new_lengths(lengths, done):
    """A beam's length with this step's token: finished beams do not grow."""
    return lengths.astype(jnp.int32) + jnp.where(done, 0, 1)


def scale(length, length_penalty: float):
    """length ** -length_penalty in float32 (None for no penalty: no multiply at all)."""
    if length_penalty == 0.0:
        return None
    return 1.0 / jnp.maximum(length, 1).astype(jnp.float32) ** length_penalty


def eos_index(eos_id: int, v: int) -> int:
    """eos_id as an index the kernels can compare with: -1 (no token) outside [0, V)."""
    return eos_id if 0 <= eos_id < v else -1


def normalized(raw, length, length_penalty: float):
    """A beam's score: its raw score times length ** -length_penalty."""
    norm = scale(length, length_penalty)
    return raw if norm is None else raw * norm


def candidate(x, m, ls, raw, norm, done, col, eos_id: int):
    """(cand, logp) of float32 logits x at token indices col, with the beam's m, ls, raw
    score, norm (or None) and done broadcast against them."""
    logp = jnp.where(done, jnp.where(col == eos_id, 0.0, -jnp.inf), (x - m) - ls)
    cand = raw + logp
    return (cand if norm is None else cand * norm), logp


def finish(flat, logp, raw, length, done, v: int, eos_id: int):
    """The new beams from the winners' flat indices [B, K] and log-probs: (parent, token, raw,
    lengths, done), each [B, K]."""
    parent, token = (flat // v).astype(jnp.int32), (flat % v).astype(jnp.int32)
    take = lambda a: jnp.take_along_axis(a, parent, axis=1)
    return (parent, token, take(raw) + logp, take(length),
            take(done) | (token == eos_id))


def flat_candidates(logits, raw_scores, lengths, done, eos_id: int, length_penalty: float):
    """Every candidate of a row, flat: (cand, logp) [B, K * V], and the beams' raw scores and
    lengths with this step's token [B, K]; `eos_id` as `eos_index` gives it."""
    b, k, v = logits.shape
    m, ls, raw, length, norm = beam_values(logits, raw_scores, lengths, done, length_penalty)
    cand, logp = candidate(logits.astype(jnp.float32), m[..., None], ls[..., None],
                           raw[..., None], None if norm is None else norm[..., None],
                           done[..., None], jnp.arange(v), eos_id)
    return cand.reshape(b, k * v), logp.reshape(b, k * v), raw, length


def beam_step(logits: jax.Array, raw_scores: jax.Array, lengths: jax.Array, done: jax.Array,
              *, eos_id: int, length_penalty: float = 0.0):
    """(parent, token, raw_scores, lengths, done) of the next beams, each [B, K]."""
    validate(logits, raw_scores, lengths, done, eos_id, length_penalty)
    b, k, v = logits.shape
    eos_id = eos_index(eos_id, v)
    cand, logp, raw, length = flat_candidates(logits, raw_scores, lengths, done, eos_id,
                                              length_penalty)
    _, flat = jax.lax.top_k(cand, k)
    return finish(flat, jnp.take_along_axis(logp, flat, axis=1), raw, length, done, v, eos_id)
