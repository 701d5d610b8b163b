"""Pallas kernels, one module per op, each with the public signature plus `interpret=` and
`block_sizes=` knobs."""
from jaxfuse.pallas import attention, cross_entropy, layer_norm, rms_norm, softmax

__all__ = ["attention", "softmax", "layer_norm", "rms_norm", "cross_entropy"]
