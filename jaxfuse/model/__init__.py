"""A tiny Flax-free Transformer on jaxfuse kernels: training, KV-cache decoding, beam search."""
from jaxfuse.model.config import PRESETS, Config, preset
from jaxfuse.model.decoding import decode_params, decode_step, init_cache, prefill
from jaxfuse.model.search import beam_search, greedy
from jaxfuse.model import sharding
from jaxfuse.model.train import optimizer, sharded_train_step, train_step
from jaxfuse.model.transformer import apply, attention_maps, hidden, init, loss

__all__ = ["Config", "PRESETS", "preset", "init", "apply", "hidden", "loss", "attention_maps",
           "init_cache", "prefill", "decode_params", "decode_step", "greedy", "beam_search",
           "optimizer", "train_step", "sharded_train_step", "sharding"]
