"""Hugging Face checkpoint directories, as the converters read them (nothing is loaded until
a tensor is asked for):

- ``reader``: ``HFCheckpoint`` (config.json, the tokenizer files, the safetensors weights one
  tensor at a time, memory-mapped) and ``HFTensor``;
- ``tokenizer``: tokenizer.json (+ tokenizer_config.json) -> llama.cpp's ``tokenizer.ggml.*`` keys;
- ``architectures``: the architectures that convert (dense and mixture-of-experts), and
  llama's q/k row order.

Read by ``ds4tools.quantize`` (the model) and ``ds4tools.support`` (MTP heads, DSpark drafts).

    >>> from ds4tools.checkpoint import HFCheckpoint
    >>> ckpt = HFCheckpoint("Qwen3-0.6B/")
    >>> ckpt.config["hidden_size"], ckpt.tensors["model.norm.weight"].load_float32()
"""
from .architectures import ARCHITECTURES, MOE_ARCHITECTURES, MoEFamily, interleave_rope_rows
from .reader import HFCheckpoint, HFTensor
from .tokenizer import tokenizer_metadata

__all__ = ["HFCheckpoint", "HFTensor", "tokenizer_metadata", "ARCHITECTURES", "MOE_ARCHITECTURES",
           "MoEFamily", "interleave_rope_rows"]
