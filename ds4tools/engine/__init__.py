"""The numba CPU engine for llama / qwen3 / glm4moe GGUFs: loading, decoders, tokenizer, sampling.

    >>> from ds4tools.engine import Engine
    >>> eng = Engine("model.gguf")
    >>> "".join(t.text for t in eng.generate("Hello", max_tokens=16, temperature=0))

Layout: architectures (general.architecture -> decoder), hparams (metadata -> HParams),
weights (memory-mapped Linear matrices), kernels (compiled row kernels), kv_cache,
transformer (the llama / qwen3 decoder and ``layer_forward``), glm4moe (the GLM-4.5 family)
with moe (the mixture-of-experts block), tokenizer, sampling, generate (the decoding loop and
its stats), api (``Engine``, which always takes a model path: the bundled demo is
``ds4tools.demo``, above the engine). docs/engine.md describes the design.
"""
from .api import Engine, GeneratedToken, set_threads
from .generate import GenerationStats
from .hparams import HParams, hparams_from_metadata
from .kv_cache import KVCache
from .sampling import Sampler
from .tokenizer import GGUFTokenizer
from .transformer import ForwardResult, Transformer, layer_forward
from .weights import LayerWeights, Linear, ModelWeights, load_weights

__all__ = ["Engine", "GeneratedToken", "GenerationStats", "HParams", "hparams_from_metadata",
           "KVCache", "Sampler", "GGUFTokenizer", "ForwardResult", "Transformer", "layer_forward",
           "LayerWeights", "Linear", "ModelWeights", "load_weights", "set_threads"]
