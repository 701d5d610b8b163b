"""The model's one configuration object."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Config:
    """A Llama-style decoder (pre-norm, RoPE, SwiGLU, GQA). No dropout anywhere."""
    vocab_size: int = 32            # tokens in the vocabulary
    d_model: int = 64               # width of the residual stream
    n_layers: int = 2               # Transformer blocks
    n_heads: int = 4                # query heads per block
    n_kv_heads: int = 4             # key/value heads; fewer than n_heads means GQA
    d_ff: int = 128                 # hidden width of the SwiGLU feed-forward
    max_len: int = 64               # longest sequence: RoPE table and default KV-cache length
    norm: str = "rms"               # "rms" (RMSNorm) or "layer" (LayerNorm)
    rope_base: float = 10000.0      # RoPE frequency base
    label_smoothing: float = 0.0    # cross-entropy label smoothing of the training loss

    def __post_init__(self):
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must be a multiple of n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} must be a multiple of "
                             f"n_kv_heads={self.n_kv_heads}")
        if (self.d_model // self.n_heads) % 2:
            raise ValueError(f"head_dim={self.d_model // self.n_heads} must be even for RoPE")
        if self.norm not in ("rms", "layer"):
            raise ValueError(f"norm={self.norm!r} must be 'rms' or 'layer'")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads
