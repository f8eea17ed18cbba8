"""Which decoder runs a GGUF: ``general.architecture`` -> how to read its hyper-parameters and
weights, and the model class that runs them. The Engine looks the file's architecture up here
once; nothing else in the engine branches on the architecture's name."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from . import deepseek2, deepseek4, glm4moe, glm_dsa
from .hparams import hparams_from_metadata
from .transformer import Transformer
from .weights import load_weights


@dataclass(frozen=True)
class Architecture:
    name: str
    #: (metadata, token-embedding rows) -> HParams; raises HParamsError
    read_hparams: Callable
    #: (tensors, hparams, int8=mode) -> ModelWeights; raises WeightsError
    load_weights: Callable
    #: the model class: Transformer or a subclass, built as model(hp, weights, n_ctx=...)
    model: type
    #: whether the model drafters (--mtp FILE, --glm-mtp, --dspark) run on it; prompt
    #: lookup (--lookup) needs no model and runs on every architecture
    model_drafters: bool = True
    #: with model_drafters: whether DSpark drafts (--dspark) do too (MTP drafting runs the
    #: model class's own NextN layer: see speculative/mtp.py)
    dspark_drafts: bool = True
    #: the backends (engine.backends.DEVICES) its decoder runs on
    devices: tuple = ("cpu",)


ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (
    Architecture("llama", hparams_from_metadata, load_weights, Transformer, devices=("cpu", "cuda")),
    Architecture("qwen3", hparams_from_metadata, load_weights, Transformer, devices=("cpu", "cuda")),
    Architecture(glm4moe.ARCH, glm4moe.read_hparams, glm4moe.load_weights,
                 glm4moe.Glm4MoeTransformer, dspark_drafts=False, devices=("cpu", "cuda")),
    Architecture(deepseek2.ARCH, deepseek2.read_hparams, deepseek2.load_weights,
                 deepseek2.Deepseek2Transformer, dspark_drafts=False, devices=("cpu", "cuda")),
    Architecture(glm_dsa.ARCH, glm_dsa.read_hparams, glm_dsa.load_weights,
                 glm_dsa.GlmDsaTransformer, dspark_drafts=False, devices=("cpu", "cuda")),
    Architecture(deepseek4.ARCH, deepseek4.read_hparams, deepseek4.load_weights,
                 deepseek4.Deepseek4Transformer),
)}
