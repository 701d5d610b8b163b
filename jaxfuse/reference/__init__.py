"""Plain jax.numpy definitions of every op: the contract the kernels are tested against.

Each op is a module with a function of the same name: `jaxfuse.reference.softmax.softmax`,
`jaxfuse.reference.layer_norm.layer_norm` (and `welford_merge`), ...
"""
from jaxfuse.reference import (add_norm, add_norm_linear, attention, beam_step, beam_top_k, bias_act_dropout,
                               bias_dropout_add, cross_entropy, decode_attention, dropout,
                               embedding, layer_norm, linear_cross_entropy, rms_norm, rope,
                               rope_qkv, softmax, swiglu, swiglu_linear)

__all__ = ["add_norm", "add_norm_linear", "attention", "beam_step", "beam_top_k", "bias_act_dropout", "bias_dropout_add",
           "cross_entropy", "decode_attention", "dropout", "embedding", "layer_norm",
           "linear_cross_entropy", "rms_norm", "rope", "rope_qkv", "softmax", "swiglu",
           "swiglu_linear"]
