"""The model's one configuration object, and its presets."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxfuse import _checks
from jaxfuse.pallas.linear_cross_entropy_slabs import check_token_slab
from jaxfuse.sharding._core import residual_name

_FLOAT_NAMES = ("float32", "bfloat16", "float16")
_SIZES = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "max_len")


# The ops inside a block whose arrays carry a checkpoint name (`jaxfuse.residual_name`) that a
# remat policy can keep (names exist on the Pallas path only: impl="reference" has none, and an
# interpreted model computes RoPE with its reference): "attention" its q, k, v (named by the
# model), o and softmax statistics; "add_norm" h and its row statistics (add_norm_linear keeps
# no y: its backward rebuilds it); "rope" its outputs (`rope_qkv`'s
# q, k and v, which it names "rope"); "swiglu" gate and up, the inputs of
# swiglu_linear (named by the model; its product is rebuilt, never kept).
NAMED_OPS = ("attention", "add_norm", "rope", "swiglu")
# The jax.checkpoint_policies that are policies themselves (the others build one from arguments).
POLICIES = ("dots_saveable", "dots_with_no_batch_dims_saveable", "nothing_saveable",
            "everything_saveable", "checkpoint_dots", "checkpoint_dots_with_no_batch_dims")


def remat_policy(remat: str):
    """(whether to rematerialize, the `jax.checkpoint` policy) of a `Config.remat` string.

    "none": no remat. "block": save only each block's input (policy None). One of `POLICIES`
    (e.g. "dots_with_no_batch_dims_saveable"): that `jax.checkpoint_policies` policy. Either may
    be followed by "+op" (repeatable) to keep the named arrays of jaxfuse op `op` as well
    (`NAMED_OPS`), which the policy alone would recompute: a policy sees primitives, not ops, so
    it saves a kernel's arrays only by name. "block+attention" recomputes the block but its attention forward
    (the costliest non-matmul part; q, k, v, o and the softmax statistics are kept).
    """
    if not isinstance(remat, str):
        raise ValueError(f"remat={remat!r} must be a string: 'none', 'block' or a "
                         "jax.checkpoint_policies name, optionally followed by '+op'")
    base, *ops = remat.split("+")
    if base == "none":
        if ops:
            raise ValueError(f"remat={remat!r}: 'none' rematerializes nothing, so '+op' has "
                             f"nothing to keep; use 'block+{ops[0]}'")
        return False, None
    if base != "block" and base not in POLICIES:
        raise ValueError(f"remat={remat!r} must be 'none', 'block' or one of the "
                         f"jax.checkpoint_policies {POLICIES}, optionally followed by '+op' "
                         f"with op one of {NAMED_OPS} (e.g. 'block+attention')")
    bad = [op for op in ops if op not in NAMED_OPS]
    if bad:
        raise ValueError(f"remat={remat!r}: {bad[0]!r} is not one of the ops inside a block "
                         f"whose outputs are named, {NAMED_OPS}")
    policy = None if base == "block" else getattr(jax.checkpoint_policies, base)
    if ops:
        names = jax.checkpoint_policies.save_only_these_names(*map(residual_name, ops))
        policy = names if policy is None else jax.checkpoint_policies.save_from_both_policies(
            policy, names)
    return True, policy


# A static pytree node (no leaves): passed as a plain argument to jax.jit or jax.eval_shape it
# goes through as it is, where its `dtype` field made jax take it for a float32 scalar (an
# AttributeError on a tracer followed). It is frozen and hashable, as a static node must be.
@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class Config:
    """A Llama-style decoder (pre-norm, RoPE, SwiGLU, GQA)."""
    vocab_size: int = 32            # tokens in the vocabulary
    d_model: int = 64               # width of the residual stream
    n_layers: int = 2               # Transformer blocks
    n_heads: int = 4                # query heads per block
    n_kv_heads: int = 4             # key/value heads; fewer than n_heads means GQA
    d_ff: int = 128                 # hidden width of the SwiGLU feed-forward
    max_len: int = 64               # longest sequence: default KV-cache length
    norm: str = "rms"               # "rms" (RMSNorm) or "layer" (LayerNorm)
    rope_base: float = 10000.0      # RoPE frequency base
    label_smoothing: float = 0.0    # cross-entropy label smoothing of the training loss
    dtype: str = "float32"          # activations, matmul inputs and the KV cache
    param_dtype: str = "float32"    # stored parameters (optax's master weights)
    dropout: float = 0.0            # residual, embedding and attention-probability dropout
    scan_layers: bool = True        # run the stacked layers with lax.scan (else a Python loop:
                                    # compiles per layer, but keeps no [n_layers, ...] copies of
                                    # the residuals; 13% faster on the 157M model, BENCHMARKS.md)
    remat: str = "none"             # "none", "block" (save only each block's input) or the name
                                    # of a jax.checkpoint_policies policy, either optionally
                                    # followed by "+op" to also keep a jaxfuse op's residuals:
                                    # "block+attention" (see `remat_policy`)
    tie_embeddings: bool = False    # unembed with embed.T (no separate unembedding matrix)
    deterministic_attention: bool = True  # bitwise-reproducible attention gradients; False:
                                    # at head_dim 64 the Hopper backward adds dQ from every
                                    # key tile in whatever order they finish (faster; cuDNN's
                                    # default); no effect at 128 (no faster way there yet)
    loss_token_slab: int | None = None  # None: the training loss is the fused linear +
                                    # cross-entropy (logits computed twice, never held); n: its
                                    # gradient formed in the forward n tokens at a time (one
                                    # matmul fewer, one [n, V] logits slab held;
                                    # `jaxfuse.LCEBlocks(token_slab=n)`)

    def __post_init__(self):
        # Sizes first (the ratios below divide by them): positive ints, NumPy ints taken as
        # the ints they hold.
        for field in _SIZES:
            value = getattr(self, field)
            if not (_checks.is_int(value) and value >= 1):
                raise ValueError(f"{field}={value!r} must be a positive int")
            object.__setattr__(self, field, int(value))
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must be a multiple of n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} must be a multiple of "
                             f"n_kv_heads={self.n_kv_heads}")
        if (self.d_model // self.n_heads) % 2:
            raise ValueError(f"head_dim={self.d_model // self.n_heads} must be even for RoPE")
        if self.norm not in ("rms", "layer"):
            raise ValueError(f"norm={self.norm!r} must be 'rms' or 'layer'")
        for field in ("scan_layers", "tie_embeddings", "deterministic_attention"):
            object.__setattr__(self, field, _checks.check_bool(field, getattr(self, field)))
        # dtypes are kept as names so that a Config stays hashable (a static jit argument) and
        # prints readably; jnp.bfloat16 and "bfloat16" give the same Config.
        for field in ("dtype", "param_dtype"):
            value = getattr(self, field)
            try:
                name = jnp.dtype(value).name
            except TypeError:
                name = None
            if name not in _FLOAT_NAMES:
                raise ValueError(f"{field}={value!r} must be one of {_FLOAT_NAMES}")
            object.__setattr__(self, field, name)
        _checks.check_finite("dropout", self.dropout)
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout!r} must be in [0, 1)")
        _checks.check_smoothing(self.label_smoothing)
        _checks.check_positive("rope_base", self.rope_base, allow_none=False)
        remat_policy(self.remat)         # validates
        check_token_slab(self.loss_token_slab, "loss_token_slab")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def compute_dtype(self):
        return jnp.dtype(self.dtype)


# The presets: LikesWorld's model (examples/likesworld.py), the 157M model of the H200
# measurements (issue 16) and a Llama-3.2-1B-shaped model (tied embeddings, 1.24B parameters;
# B2 x T8192 fits one H200 when each block is recomputed but for its attention: "block+attention",
# 6.9 GB of temporaries and 7.6% faster than "block" there, BENCHMARKS.md). Both GPU presets
# form the loss's gradient in its forward, 4096 tokens at a time (`loss_token_slab`): one
# [16384 x d x V] product fewer than the fused loss, for one [4096, V] logits slab, its dz
# written over it (run s8-1, H200, slabs of 2048: 1B step 340.9 -> 329.5 ms, 157M 37.13 ->
# 36.75 ms; run s37-3, H100: 4096 against 2048, 1B 329.2 against 332.1 ms, 157M 35.33 against
# 36.01, the same temporaries; 8192 at 1B: 330.9 ms, 0.35 GB more).
PRESETS = {
    "likesworld": Config(vocab_size=32, d_model=64, n_layers=2, n_heads=4, n_kv_heads=4,
                         d_ff=128, max_len=34),
    "157m": Config(vocab_size=32768, d_model=1024, n_layers=8, n_heads=16, n_kv_heads=4,
                   d_ff=2816, max_len=2048, dtype="bfloat16", loss_token_slab=4096),
    "1b": Config(vocab_size=128256, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                 d_ff=8192, max_len=8192, rope_base=500000.0, dtype="bfloat16",
                 tie_embeddings=True, remat="block+attention", loss_token_slab=4096),
}


def preset(name: str, **overrides) -> Config:
    """A preset Config with some fields replaced: `preset("157m", remat="block")`."""
    if name not in PRESETS:
        raise ValueError(f"preset {name!r} is unknown; pick one of {sorted(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **overrides)
