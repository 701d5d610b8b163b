"""jaxfuse: fused Transformer kernels in JAX/Pallas, each paired with a jax.numpy reference.

Every op takes `impl="pallas" | "reference"`; Pallas kernels interpret on a CPU and compile
(Triton) on an NVIDIA GPU.
"""
from jaxfuse import pallas, reference
from jaxfuse.ops import (add_norm, add_norm_linear, beam_step, beam_top_k, bias_act_dropout, bias_dropout_add, cross_entropy,
                         decode_attention, dropout, embedding, flash_attention, layer_norm,
                         linear_cross_entropy, reorder_beams, rms_norm, rope, rope_qkv, softmax,
                         swiglu, swiglu_linear)
from jaxfuse.pallas._attn import AttnBlocks
from jaxfuse.pallas._rows import RowBlocks
from jaxfuse.pallas.decode_attention import DecodeBlocks
from jaxfuse.pallas.linear_cross_entropy import LCEBlocks
from jaxfuse.sharding._core import residual_name

__all__ = ["softmax", "layer_norm", "rms_norm", "cross_entropy", "flash_attention",
           "decode_attention", "linear_cross_entropy", "beam_step", "beam_top_k", "dropout", "bias_dropout_add",
           "bias_act_dropout", "add_norm", "add_norm_linear", "swiglu", "swiglu_linear", "rope", "rope_qkv", "embedding", "reorder_beams",
           "RowBlocks", "residual_name",
           "DecodeBlocks", "LCEBlocks", "AttnBlocks", "pallas", "reference", "model"]
__version__ = "0.1.0"

from jaxfuse import model  # noqa: E402  (the model calls the ops above)
