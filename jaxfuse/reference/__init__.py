"""Plain jax.numpy definitions of every op: the contract the kernels are tested against.

Each op is a module with a function of the same name: `jaxfuse.reference.softmax.softmax`,
`jaxfuse.reference.layer_norm.layer_norm` (and `welford_merge`), ...
"""
from jaxfuse.reference import attention, beam_top_k, cross_entropy, decode_attention, layer_norm, linear_cross_entropy, rms_norm, softmax, bias_act_dropout, bias_dropout_add, dropout, add_norm, rope, swiglu, embedding

__all__ = ["attention", "beam_top_k", "decode_attention", "linear_cross_entropy", "softmax", "layer_norm", "rms_norm", "cross_entropy", "bias_act_dropout", "bias_dropout_add", "dropout", "add_norm", "rope", "swiglu", "embedding"]
