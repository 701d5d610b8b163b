"""Pallas kernels, one module per op, each with the public signature plus `interpret=` and
`block_sizes=` knobs."""
from jaxfuse.pallas import attention, beam_top_k, cross_entropy, decode_attention, layer_norm, linear_cross_entropy, rms_norm, softmax, bias_act_dropout, bias_dropout_add, dropout, add_norm, rope, swiglu, embedding

__all__ = ["attention", "beam_top_k", "decode_attention", "linear_cross_entropy", "softmax", "layer_norm", "rms_norm", "cross_entropy", "bias_act_dropout", "bias_dropout_add", "dropout", "add_norm", "rope", "swiglu", "embedding"]
