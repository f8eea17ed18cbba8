"""What the quantizer reads from: a model as metadata keys plus tensors that load one at a time.

Two kinds: a GGUF (``GGUFSource``, any architecture, keys copied as stored) and a Hugging Face
directory (``ds4tools.quantize.convert.HFSource`` for dense models,
``ds4tools.quantize.convert_moe.MoEHFSource`` for mixture-of-experts ones; converted to
llama.cpp's layout).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from gguf import GGUFValueType as V

from ..gguf_io import GGUFFile, MetaKey, open_gguf

__all__ = ["SourceTensor", "ModelSource", "GGUFSource", "open_source", "Hparams"]

# Keys a quantized output gets fresh (or must not inherit) rather than copied from a GGUF input.
_NOT_COPIED = ("general.architecture", "general.file_type", "general.quantization_version",
               "general.alignment", "split.no", "split.count", "split.tensors.count")
_NOT_COPIED_PREFIXES = ("quantize.imatrix.",)


@dataclass
class SourceTensor:
    name: str  # the GGUF name it is written under
    shape: tuple[int, ...]  # numpy order
    type_name: str  # how the source stores it ("F32", "BF16", "Q4_K"...)
    n_bytes: int  # its size in the source
    load_float32: Callable[[], np.ndarray]
    #: the stored GGUF bytes (GGUF sources only): copied as they are when the type stays
    raw: Callable[[], np.ndarray] | None = None
    #: drop the tensor's source pages from memory once it is written (GGUF sources)
    release: Callable[[], None] = lambda: None
    #: a 3-D tensor stacked from parts (HF experts): part i's float32 values, so that the
    #: quantizer never holds more than one expert in float
    load_part: Callable[[int], np.ndarray] | None = None

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


@dataclass
class Hparams:
    """The few hyperparameters llama.cpp's mix rules look at."""
    n_layer: int = 0
    n_head: int = 0
    n_head_kv: int = 0
    n_expert: int = 0

    @property
    def n_gqa(self) -> int:
        return self.n_head // self.n_head_kv if self.n_head and self.n_head_kv else 1


@dataclass
class ModelSource:
    path: str
    kind: str  # "gguf" or "hf"
    arch: str
    metadata: list[MetaKey]
    tensors: list[SourceTensor]
    hparams: Hparams
    #: every input file (the output must not replace any of them)
    paths: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _first_int(v) -> int:
    if isinstance(v, list):
        v = v[0] if v else 0
    try:
        return int(v)
    except (TypeError, ValueError):
        return 0


class GGUFSource(ModelSource):
    def __init__(self, f: GGUFFile):
        arch = f.architecture or "llama"
        md = f.metadata
        hp = Hparams(
            n_layer=_first_int(md.get(f"{arch}.block_count")),
            n_head=_first_int(md.get(f"{arch}.attention.head_count")),
            n_head_kv=_first_int(md.get(f"{arch}.attention.head_count_kv",
                                        md.get(f"{arch}.attention.head_count"))),
            n_expert=_first_int(md.get(f"{arch}.expert_count")))
        keys = []
        for key, value in md.items():
            if key in _NOT_COPIED or key.startswith(_NOT_COPIED_PREFIXES):
                continue
            vtype, sub = f.value_type(key)
            if vtype == V.ARRAY and not value:
                continue  # gguf cannot write an empty array; the key carried nothing
            keys.append(MetaKey(key, value, vtype, sub))
        tensors = [SourceTensor(t.name, t.shape, t.type_name, t.n_bytes, t.to_float32, t.raw,
                                t.release_pages) for t in f.tensors.values()]
        super().__init__(path=f.path, kind="gguf", arch=arch, metadata=keys, tensors=tensors,
                         hparams=hp, paths=list(f.paths))
        self.gguf = f
        if f.architecture is None:
            self.notes.append(f"warning: {f.path}: no general.architecture; writing 'llama'")


def open_source(path, report=lambda msg: None, keep_nextn: bool = False,
                nextn_part: str | None = None) -> ModelSource:
    """A GGUF file (or split set) or a Hugging Face model directory (``keep_nextn``: with its
    NextN layers embedded, as llama.cpp does for GLM / DeepSeek; ``nextn_part`` "trunk" or
    "mtp": one half of a mixture-of-experts checkpoint split by ``--mtp-out``)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        from .convert import open_hf
        return open_hf(path, report=report, keep_nextn=keep_nextn, nextn_part=nextn_part)
    return GGUFSource(open_gguf(path))
