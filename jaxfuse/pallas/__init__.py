"""Pallas kernels, one module per op, each with the public signature plus `interpret=` and
`block_sizes=` knobs."""
from jaxfuse.pallas import attention, cross_entropy, decode_attention, layer_norm, linear_cross_entropy, rms_norm, softmax

__all__ = ["attention", "decode_attention", "linear_cross_entropy", "softmax", "layer_norm", "rms_norm", "cross_entropy"]
