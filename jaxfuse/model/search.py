"""Greedy decoding and beam search over the KV cache, each one `jax.jit` around a
`lax.while_loop` that stops early once every sequence (every beam) has ended.

The loop runs `steps_per_sync` decoding steps per iteration as a `lax.fori_loop` of fixed trip
count: on a GPU a while loop's condition is read back by the host every iteration (a device ->
host sync, measured at 0.25 ms of idle GPU per 157M step, about half the step), a loop of known
trip count is not. The early stop is checked every `steps_per_sync` steps, and the last
max_new_tokens % steps_per_sync steps run as one more fixed loop (at most max_new_tokens <=
steps_per_sync is one fixed loop alone); steps taken after every sequence has ended are no-ops
(an ended sequence emits eos at log-prob 0).

Beam search (lecture 10, sec. 6): every step scores beam_size x V continuations and keeps the best
beam_size with `jaxfuse.beam_step` (log-softmax, length penalty and HARS top-k in two kernels
with impl="pallas"); each beam's cache then takes its
parent's keys and values at the positions decoded so far (`jaxfuse.reorder_beams`, in place; the
prompt's positions are the same in every beam of a row). A finished beam's only continuation is
`eos_id` at log-prob 0, so it keeps its score and competes with the live beams on the same scale:
score = sum of log-probs / len ** length_penalty, len counting the tokens up to and including eos.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import jaxfuse
from jaxfuse import _checks
from jaxfuse.model import _block_ops as ops
from jaxfuse.model import _inputs, decoding
from jaxfuse.model.config import Config
from jaxfuse.model.sharding import Out, constrain, on_auto_axes
from jaxfuse.reference import beam_step as beam_step_ref


def _check_lengths(prompts, prompt_lengths, max_new_tokens, cfg, steps_per_sync):
    if prompts.ndim != 2 or tuple(prompt_lengths.shape) != (prompts.shape[0],):
        raise ValueError(f"prompts.shape={prompts.shape} must be [B, P] and prompt_lengths.shape="
                         f"{prompt_lengths.shape} must be [B]")
    if prompts.shape[1] + max_new_tokens > cfg.max_len:
        raise ValueError(f"prompt width {prompts.shape[1]} + max_new_tokens={max_new_tokens} "
                         f"exceeds cfg.max_len={cfg.max_len}")
    if not (_checks.is_int(steps_per_sync) and steps_per_sync >= 1):
        raise ValueError(f"steps_per_sync={steps_per_sync!r} must be an int >= 1")


def _lengths_checked(search):
    """`search` (greedy or beam search, jitted) with its options checked and its prompts and
    prompt lengths judged first, where they are known (`_inputs`,
    `decoding.check_prompt_lengths`): inside the jit they are traced, and the lengths only
    clipped to [1, P]."""
    @functools.wraps(search)
    def call(params, cfg, prompts, prompt_lengths, **options):
        # Static options as the Python numbers they hold (a jax scalar cannot be hashed).
        options = {k: _checks.python_scalar(v) for k, v in options.items()}
        _inputs.search(prompt_lengths, cfg, options.get("max_new_tokens"),
                       options.get("eos_id"), options.get("beam_size", 1),
                       options.get("length_penalty", 0.0))
        _inputs.tokens(prompts, cfg, "prompts")
        decoding.check_prompt_lengths(prompt_lengths, prompts.shape[1])
        return search(params, cfg, prompts, prompt_lengths, **options)
    call._clear_cache = search._clear_cache
    return call


def _loop(step, state, max_new_tokens: int, steps_per_sync: int):
    """Runs `step` on `state` (t first, done last) max_new_tokens times or until every sequence
    is done, in bursts of `steps_per_sync` steps of fixed trip count (see above)."""
    repeat = lambda n, s: jax.lax.fori_loop(0, n, lambda _, s: step(s), s) if n else s
    if max_new_tokens <= steps_per_sync:   # one burst: no early stop to check, one loop body
        return repeat(max_new_tokens, state)
    bursts = max_new_tokens - max_new_tokens % steps_per_sync
    state = jax.lax.while_loop(_running(bursts), lambda s: repeat(steps_per_sync, s), state)
    return repeat(max_new_tokens % steps_per_sync, state)


@_lengths_checked
@functools.partial(jax.jit, static_argnames=("cfg", "max_new_tokens", "eos_id", "impl",
                                             "steps_per_sync"))
@on_auto_axes(lambda prompts, max_new_tokens, **_: Out(
    (prompts.shape[0], max_new_tokens), ("batch", None)))
def greedy(params: dict, cfg: Config, prompts: jax.Array, prompt_lengths: jax.Array, *,
           max_new_tokens: int, eos_id: int, impl: str = "pallas",
           steps_per_sync: int = 8) -> jax.Array:
    """Generated tokens [B, max_new_tokens]; `eos_id` fills the rest once a sequence ended (an
    eos_id outside the vocabulary ends none: every sequence runs max_new_tokens).
    prompts [B, P] right-padded, prompt_lengths [B] in [1, P] (`decoding.prefill`).
    `steps_per_sync`: decoding steps between two checks of the early stop (see module doc)."""
    _check_lengths(prompts, prompt_lengths, max_new_tokens, cfg, steps_per_sync)
    b = prompts.shape[0]
    # The cache holds what this call needs, not cfg.max_len: beam search copies it every step.
    cache = decoding.init_cache(cfg, b, prompts.shape[1] + max_new_tokens)
    logits, cache = decoding.prefill(params, cache, prompts, prompt_lengths, cfg, impl=impl)
    params = decoding.decode_params(params, cfg)         # cast and split once, not per step

    def step(state):
        t, logits, cache, out, done = state
        tok = jnp.where(done, eos_id, jnp.argmax(logits, axis=-1).astype(jnp.int32))
        # t lies in [0, max_new_tokens): lax's update, without `.at[]`'s normalization of a
        # negative index and its bounds check (a kernel of their own in every step).
        # (An int32 0 beside t: with jax_enable_x64 a Python 0 is int64, which lax refuses.)
        out = jax.lax.dynamic_update_slice(out, tok[:, None], (jnp.int32(0), t))
        done = done | (tok == eos_id)
        logits, cache = decoding.decode_step(params, cache, tok, cfg, impl=impl)
        return t + 1, logits, cache, out, done

    out = jnp.full((b, max_new_tokens), eos_id, jnp.int32)
    state = (jnp.int32(0), logits, cache, out, jnp.zeros((b,), bool))
    return _loop(step, state, max_new_tokens, steps_per_sync)[3]


def _running(max_new_tokens: int):
    """Loop while tokens remain to generate and some sequence has not ended."""
    return lambda state: (state[0] < max_new_tokens) & ~jnp.all(state[-1])


@_lengths_checked
@functools.partial(jax.jit, static_argnames=("cfg", "beam_size", "max_new_tokens", "eos_id",
                                             "length_penalty", "impl", "steps_per_sync"))
@on_auto_axes(lambda prompts, beam_size, max_new_tokens, **_: (
    Out((prompts.shape[0], beam_size, max_new_tokens), ("batch", None, None)),
    Out((prompts.shape[0], beam_size), ("batch", None))))
def beam_search(params: dict, cfg: Config, prompts: jax.Array, prompt_lengths: jax.Array, *,
                beam_size: int, max_new_tokens: int, eos_id: int, length_penalty: float = 0.0,
                impl: str = "pallas", steps_per_sync: int = 8):
    """(tokens [B, beam_size, max_new_tokens], scores [B, beam_size]), best first.
    prompts [B, P] right-padded, prompt_lengths [B] in [1, P] (`decoding.prefill`).
    `steps_per_sync`: decoding steps between two checks of the early stop (see module doc)."""
    _check_lengths(prompts, prompt_lengths, max_new_tokens, cfg, steps_per_sync)
    b, k, v = prompts.shape[0], beam_size, cfg.vocab_size
    # The cache holds what this call needs, not cfg.max_len: beam search copies it every step.
    cache = decoding.init_cache(cfg, b, prompts.shape[1] + max_new_tokens)
    logits, cache = decoding.prefill(params, cache, prompts, prompt_lengths, cfg, impl=impl)
    params = decoding.decode_params(params, cfg)         # cast and split once, not per step
    # Every beam starts as the prompt; only beam 0 is live at first, so the k first picks differ.
    # The prompts' arrays keep their own layout first: a data axis that divides B x K but not
    # B would otherwise reach back through the repeat and split the prefill's batch in parts
    # no partitioning rule takes (its attention failed to partition).
    cache = decoding.constrain_cache(cache)
    logits = constrain(logits, "batch", None)
    cache = jax.tree.map(lambda x: jnp.repeat(x, k, axis=0), cache)
    logits = jnp.repeat(logits, k, axis=0)                                   # [B*K, V]
    raw = (jnp.where(jnp.arange(k)[None] == 0, 0.0, -jnp.inf).astype(jnp.float32)
           * jnp.ones((b, 1), jnp.float32))          # float32 with jax_enable_x64 on too
    state = (jnp.int32(0), logits, cache, jnp.full((b, k, max_new_tokens), eos_id, jnp.int32),
             raw, jnp.zeros((b, k), jnp.int32), jnp.zeros((b, k), bool))
    # [B, K, ...] arrays pinned to a split of their B alone, as the ops' rules take them: a
    # data axis that divides B x K but not B (B 2, K 2 on data 4) would otherwise reach them
    # from the [B x K] rows of the decoding step as a split across both axes, which no
    # partitioning rule takes (beam_top_k and reorder_beams failed to partition).
    rows = lambda x: constrain(x, "batch", *(None,) * (x.ndim - 1))

    def step(state):
        t, logits, cache, tokens, raw, length, done = state
        tokens, raw, length, done = map(rows, (tokens, raw, length, done))
        # Scores, finished beams, length penalty and the top-k from the logits in one op
        # (`jaxfuse.beam_step`: two small kernels with impl="pallas", no [B, K x V] array).
        parent, tok, raw, length, done = map(rows, jaxfuse.beam_step(
            rows(logits.reshape(b, k, v)), raw, length, done, eos_id=eos_id,
            length_penalty=length_penalty, impl=impl))
        tokens = jax.lax.dynamic_update_slice(
            jnp.take_along_axis(tokens, parent[..., None], 1), tok[..., None],
            (jnp.int32(0), jnp.int32(0), t))
        # Each beam takes its parent's K/V at the positions decoded so far; the prompt's are the
        # same in every beam of a row (`reorder_beams`: in place, one launch for all layers).
        n = rows(cache["lengths"].reshape(b, k)[:, 0])                       # prompt + t
        split = lambda cs: tuple(rows(c.reshape(b, k, *c.shape[1:])) for c in cs)
        moved = ops.reorder_beams(split(cache["k"]) + split(cache["v"]), parent, n - t, n,
                                  impl=impl)
        join = lambda cs: tuple(c.reshape(b * k, *c.shape[2:]) for c in cs)
        layers = len(cache["k"])
        cache = dict(cache, k=join(moved[:layers]), v=join(moved[layers:]))
        logits, cache = decoding.decode_step(params, cache, tok.reshape(-1), cfg, impl=impl)
        return t + 1, logits, cache, tokens, raw, length, done

    _, _, _, tokens, raw, length, _ = _loop(step, state, max_new_tokens, steps_per_sync)
    scores = beam_step_ref.normalized(raw, length, length_penalty)
    order = jnp.argsort(-scores, axis=1, stable=True)
    return (jnp.take_along_axis(tokens, order[..., None], 1),
            jnp.take_along_axis(scores, order, 1))
