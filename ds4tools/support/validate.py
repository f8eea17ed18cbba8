"""Validate a support GGUF, alone or against its target: every problem collected (not the first
one only), worded as the program that loads the layout words it.

    >>> problems = validate_support(f, target=open_target("model.gguf"))
    >>> [p.message for p in problems if p.level == "error"]
"""
from __future__ import annotations

from . import dspark_ds4, dspark_llamacpp, mtp
from .detect import DRAFT, DSPARK, ERROR_KINDS, MTP, detect
from .layout import Problems
from .target import TargetInfo

__all__ = ["validate_support", "summary_lines"]

_VALIDATORS = {MTP: mtp.validate, DSPARK: dspark_ds4.validate, DRAFT: dspark_llamacpp.validate}


def validate_support(f, kind: str | None = None, target: TargetInfo | None = None) -> Problems:
    """The problems of support file ``f`` (``kind`` as ``detect`` names it; detected when None).
    A file that is not a support file is itself the problem."""
    det = detect(f)
    kind = kind or det.kind
    if kind in _VALIDATORS:
        return _VALIDATORS[kind](f, target)
    out = Problems()
    if kind in ERROR_KINDS:
        out.error(f"not a usable support GGUF: it holds {det.found}")
    else:
        out.error(f"not a support GGUF: it is {det.found}")
    return out


def summary_lines(f, kind: str) -> list[str]:
    """ds4's ``mtp/dspark:`` summary (and the llama.cpp numbering of a draft's target layers)."""
    if kind == DRAFT:
        return dspark_llamacpp.summary_lines(dspark_llamacpp.DraftHparams(f))
    if kind in (MTP, DSPARK) or kind in ERROR_KINDS:
        lines = dspark_ds4.summary_lines(dspark_ds4.Summary(f))
        if kind == MTP:
            target_arch, dims, nextn, _ = mtp.read_metadata(f)
            if target_arch:
                desc = ", ".join(f"{k}={v}" for k, v in (
                    ("n_embd", dims.n_embd), ("n_vocab", dims.n_vocab), ("n_layer", dims.n_layer),
                    ("n_head", dims.n_head), ("n_head_kv", dims.n_head_kv),
                    ("head_dim", dims.head_dim), ("nextn_layer", nextn)) if v is not None)
                lines.append(f"mtp: head for a {target_arch} target ({desc})")
        return lines
    return []
