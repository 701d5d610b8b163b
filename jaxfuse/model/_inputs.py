"""The model functions' input checks (a ValueError naming the value and the fix), in one place.

Shapes, dtypes and static options are checked always. Token and target ids are judged where
their values are known (an eager call; `greedy` and `beam_search` read their prompts before
their jit): under the caller's `jax.jit` (as in `train_step`) they cannot be read, and an
out-of-range id gives what the ops give it, a NaN row or loss.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxfuse import _checks
from jaxfuse.model.config import Config
from jaxfuse.pallas.attention import check_head_dim


def tokens(x, cfg: Config, name: str = "tokens", ndim: int = 2) -> None:
    """Integer token ids, `ndim` axes ([B, T]; [B] for a decoding step), in [0, vocab)."""
    _checks.check_int(name, x)
    if x.ndim != ndim:
        shape = "[B, T]" if ndim == 2 else "[B]"
        raise ValueError(f"{name}.shape={tuple(x.shape)} must be {shape}")
    _checks.check_ids(name, x, cfg.vocab_size, f"token ids index the vocabulary of "
                      f"cfg.vocab_size={cfg.vocab_size}")


def targets(y, cfg: Config) -> None:
    """Target ids in [0, vocab) or -100 (no target)."""
    _checks.check_int("targets", y)
    _checks.check_ids("targets", y, cfg.vocab_size, f"targets index the vocabulary of "
                      f"cfg.vocab_size={cfg.vocab_size} (-100: no target)", ignore=-100)


def kernels(cfg: Config, impl: str) -> None:
    """The Pallas attention kernels' head dims (Config takes any even one: the references do)."""
    if impl == "pallas":
        try:
            check_head_dim(cfg.head_dim)
        except ValueError as e:      # the kernels' rule, traced back to the Config
            raise ValueError(f"Config(d_model={cfg.d_model}, n_heads={cfg.n_heads}): {e}; pick "
                             f"d_model and n_heads for a head dim it takes, or run "
                             f"impl='reference'") from None


def head_mask(mask, cfg: Config) -> None:
    if mask is not None and tuple(mask.shape) != (cfg.n_layers, cfg.n_heads):
        raise ValueError(f"head_mask.shape={tuple(mask.shape)} must be [n_layers, n_heads] = "
                         f"({cfg.n_layers}, {cfg.n_heads}) (1 keeps a head, 0 ablates it)")


def lengths(name: str, x, batch: int, per: str) -> None:
    """An integer array [batch] of lengths, one per `per` (a sequence, a prompt)."""
    _checks.check_int(name, x)
    if tuple(x.shape) != (batch,):
        raise ValueError(f"{name}.shape={tuple(x.shape)} must be ({batch},), one length per "
                         f"{per}")


def cache(c: dict, cfg: Config, batch: int, width: int, *, after_lengths: bool) -> None:
    """A cache of `cfg`'s layers and KV heads (`init_cache`) for `batch` sequences with room
    for `width` positions: from 0 (prefill), or past each sequence's `lengths` where they are
    known (a decoding step past the end would drop its token's K/V and attend without it)."""
    layers = (len(c["k"]), len(c["v"]))
    if layers != (cfg.n_layers,) * 2:
        raise ValueError(f"the cache holds {layers} layers of keys and values and cfg has "
                         f"n_layers={cfg.n_layers}: make it with init_cache(cfg, ...)")
    b, s = c["k"][0].shape[:2]
    want = (b, s, cfg.n_kv_heads, cfg.head_dim)
    bad = [tuple(x.shape) for x in c["k"] + c["v"] if tuple(x.shape) != want]
    if bad:
        raise ValueError(f"a cache layer has shape {bad[0]} where cfg's is [batch, positions, "
                         f"n_kv_heads, head_dim] = {want}: make it with init_cache(cfg, ...)")
    lengths("cache['lengths']", c["lengths"], b, "sequence")
    if b != batch:
        raise ValueError(f"the cache holds {b} sequences (init_cache(cfg, batch={b}, ...)) and "
                         f"the call has {batch}: make the cache for this batch")
    used = 0
    if after_lengths and not isinstance(c["lengths"], jax.core.Tracer):
        used = int(jnp.max(c["lengths"]))
    if used + width > s:
        full = f"lengths up to {used} of " if after_lengths else ""
        raise ValueError(f"the cache is too short: {full}{s} positions, and the call writes "
                         f"{width}; make it longer (init_cache(cfg, batch, max_len=...))")


def new_cache(batch, max_len, dtype) -> None:
    for name, v in (("batch", batch), ("max_len", max_len)):
        if not (_checks.is_int(v) and v >= 1) and not (name == "max_len" and v is None):
            raise ValueError(f"{name}={v!r} must be a positive int")
    if dtype is None:
        return
    try:
        floating = jnp.issubdtype(jnp.dtype(dtype), jnp.floating)
    except TypeError:                      # not a dtype at all ("foo")
        floating = False
    if not floating:
        raise ValueError(f"dtype={dtype!r} must be a float dtype (the keys' and values'; "
                         "default cfg.dtype)")


def search(prompt_lengths, cfg: Config, max_new_tokens, eos_id, beam_size=1,
           length_penalty=0.0) -> None:
    """greedy's and beam_search's options."""
    _checks.check_int("prompt_lengths", prompt_lengths)
    for name, v in (("max_new_tokens", max_new_tokens), ("beam_size", beam_size)):
        if not (_checks.is_int(v) and v >= 1):
            raise ValueError(f"{name}={v!r} must be a positive int")
    if not _checks.is_int(eos_id):      # outside [0, vocab): no sequence ends before the last
        raise ValueError(f"eos_id={eos_id!r} must be an int (a token id; one outside the "
                         "vocabulary ends no sequence early)")
    _checks.check_finite("length_penalty", length_penalty)
