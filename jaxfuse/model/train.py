"""Training with optax: AdamW under a warmup + cosine schedule, one jitted step."""
from __future__ import annotations

import functools

import jax
import optax

from jaxfuse.model import transformer
from jaxfuse.model.config import Config


def optimizer(lr: float, total_steps: int, warmup_steps: int = 100,
              weight_decay: float = 0.01) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup_steps, max(total_steps, warmup_steps + 1),
                                                  end_value=lr * 0.05)
    return optax.adamw(schedule, weight_decay=weight_decay)


@functools.partial(jax.jit, static_argnames=("cfg", "opt", "impl"), donate_argnums=(0, 1))
def train_step(params, opt_state, tokens, targets, key=None, *, cfg: Config,
               opt: optax.GradientTransformation, impl: str = "pallas"):
    """One AdamW step on the mean loss over targeted positions; returns (params, opt_state, loss).

    `key` draws this step's dropout masks (cfg.dropout > 0; pass a fresh key every step, e.g.
    `jax.random.fold_in(key, step)`); without it the step is deterministic (no dropout)."""
    loss, grads = jax.value_and_grad(transformer.loss)(params, tokens, targets, cfg, impl=impl,
                                                       key=key)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss
