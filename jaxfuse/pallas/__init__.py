"""Pallas kernels, one module per op, each with the public signature plus `interpret=` and
`block_sizes=` knobs."""
from jaxfuse.pallas import (add_norm, attention, beam_step, beam_top_k, bias_act_dropout, bias_dropout_add,
                            cross_entropy, decode_attention, dropout, embedding, layer_norm,
                            linear_cross_entropy, rms_norm, rope, rope_qkv, softmax,
                            swiglu)

__all__ = ["add_norm", "attention", "beam_step", "beam_top_k", "bias_act_dropout", "bias_dropout_add",
           "cross_entropy", "decode_attention", "dropout", "embedding", "layer_norm",
           "linear_cross_entropy", "rms_norm", "rope", "rope_qkv", "softmax", "swiglu"]
