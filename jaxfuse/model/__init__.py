"""A tiny Flax-free Transformer on jaxfuse kernels: training, KV-cache decoding, beam search."""
from jaxfuse.model.config import Config
from jaxfuse.model.decoding import decode_step, init_cache, prefill
from jaxfuse.model.search import beam_search, greedy
from jaxfuse.model.train import optimizer, train_step
from jaxfuse.model.transformer import apply, attention_maps, init, loss

__all__ = ["Config", "init", "apply", "loss", "attention_maps", "init_cache", "prefill",
           "decode_step", "greedy", "beam_search", "optimizer", "train_step"]
