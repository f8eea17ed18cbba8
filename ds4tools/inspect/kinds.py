"""What a GGUF file is: a model, a vocabulary only, an importance matrix... (``detect_kind``).

Detection is a list of detectors tried in order; the first that matches names the kind. Other
parts of ds4tools add their own kinds (the MTP / DSpark support GGUFs) with ``register_kind``,
ordered before the generic ``model``:

    @register_kind("mtp-support", order=20, description="NextN/MTP layers for a target model")
    def _is_mtp_support(f):
        return f.metadata.get("general.type") == "mtp-support"
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..gguf_io import GGUFFile

__all__ = ["KindDetector", "register_kind", "detect_kind", "known_kinds", "UNKNOWN",
           "register_summary", "summary_lines"]

UNKNOWN = "unknown"


@dataclass(frozen=True)
class KindDetector:
    name: str
    matches: Callable[[GGUFFile], bool]
    order: int
    description: str


_DETECTORS: list[KindDetector] = []


def register_kind(name: str, *, order: int = 50, description: str = ""):
    """Decorator: add a detector (lower ``order`` is tried first; a name can be replaced)."""
    def add(func: Callable[[GGUFFile], bool]):
        _DETECTORS[:] = [d for d in _DETECTORS if d.name != name]
        _DETECTORS.append(KindDetector(name, func, order, description))
        _DETECTORS.sort(key=lambda d: d.order)
        return func
    return add


def detect_kind(f: GGUFFile) -> str:
    for d in _DETECTORS:
        if d.matches(f):
            return d.name
    return UNKNOWN


def known_kinds() -> list[KindDetector]:
    return list(_DETECTORS)


_SUMMARIES: dict[str, Callable[[GGUFFile], list[str]]] = {}


def register_summary(kind: str):
    """Decorator: lines describing a file of ``kind`` (shown under its kind by inspect)."""
    def add(func: Callable[[GGUFFile], list[str]]):
        _SUMMARIES[kind] = func
        return func
    return add


def summary_lines(f: GGUFFile, kind: str) -> list[str]:
    func = _SUMMARIES.get(kind)
    return list(func(f)) if func is not None else []


@register_kind("imatrix", order=10, description="llama.cpp importance matrix")
def _is_imatrix(f: GGUFFile) -> bool:
    if f.metadata.get("general.type") == "imatrix":
        return True
    names = list(f.tensors)
    return bool(names) and all(n.endswith((".in_sum2", ".counts")) for n in names)


@register_kind("vocab-only", order=80, description="tokenizer without weights")
def _is_vocab_only(f: GGUFFile) -> bool:
    return not f.tensors and "tokenizer.ggml.model" in f.metadata


@register_kind("model", order=90, description="model weights for an architecture")
def _is_model(f: GGUFFile) -> bool:
    return bool(f.tensors) and f.architecture is not None
