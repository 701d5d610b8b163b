"""Training with optax: AdamW under a warmup + cosine schedule, one jitted step (on one device,
or on a mesh: `sharded_train_step`)."""
from __future__ import annotations

import functools

import jax
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxfuse.model import sharding, transformer
from jaxfuse.model.config import Config


def optimizer(lr: float, total_steps: int, warmup_steps: int = 100,
              weight_decay: float = 0.01) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup_steps, max(total_steps, warmup_steps + 1),
                                                  end_value=lr * 0.05)
    return optax.adamw(schedule, weight_decay=weight_decay)


def _step(params, opt_state, tokens, targets, key=None, *, cfg: Config,
          opt: optax.GradientTransformation, impl: str = "pallas"):
    loss, grads = jax.value_and_grad(transformer.loss)(params, tokens, targets, cfg, impl=impl,
                                                       key=key)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


train_step = functools.partial(jax.jit, static_argnames=("cfg", "opt", "impl"),
                               donate_argnums=(0, 1))(_step)
train_step.__doc__ = """One AdamW step on the mean loss over targeted positions; returns
(params, opt_state, loss).

`key` draws this step's dropout masks (cfg.dropout > 0; pass a fresh key every step, e.g.
`jax.random.fold_in(key, step)`); without it the step is deterministic (no dropout).
Under `jax.set_mesh(mesh)` with arrays placed by `jaxfuse.model.sharding` it runs on the mesh
(the shardings follow the arguments); `sharded_train_step` fixes them instead."""


def sharded_train_step(cfg: Config, opt: optax.GradientTransformation, mesh, *,
                       impl: str = "pallas", batch: int | None = None,
                       seq_len: int | None = None):
    """`train_step` jitted for `mesh` with explicit in/out shardings (`jaxfuse.model.sharding`):
    params and opt_state by the rules (donated), tokens, targets by `batch_spec`, the dropout
    key and the loss replicated. `batch` and `seq_len`, if given, are checked against the mesh
    up front. Feed it arrays placed by `shard_train_state` and `shard_batch`:

        step = sharded_train_step(cfg, opt, mesh)
        params, opt_state = sharding.shard_train_state(params, opt_state, cfg, opt, mesh)
        params, opt_state, loss = step(params, opt_state, *sharding.shard_batch(batch, mesh))
    """
    sharding.check(cfg, mesh, batch, seq_len)
    shapes = jax.eval_shape(functools.partial(transformer.init, cfg=cfg), jax.random.key(0))
    ps = sharding.named(mesh, sharding.param_specs(cfg, mesh))
    os_ = sharding.named(mesh, sharding.opt_state_specs(opt, cfg, mesh, shapes))
    data, rep = NamedSharding(mesh, sharding.batch_spec(mesh)), NamedSharding(mesh, P())
    jitted = jax.jit(functools.partial(_step, cfg=cfg, opt=opt, impl=impl),
                     in_shardings=(ps, os_, data, data, rep), out_shardings=(ps, os_, rep),
                     donate_argnums=(0, 1))

    def step(params, opt_state, tokens, targets, key=None):
        with jax.set_mesh(mesh):
            return jitted(params, opt_state, tokens, targets, key)

    def lower(*args):             # for HLO checks; the model reads the mesh while tracing
        with jax.set_mesh(mesh):
            return jitted.lower(*args)

    step.lower = lower
    return step
