"""Distill drafts for a target model: ``ds4tools distill TARGET.gguf --kind dspark|mtp -o OUT.gguf``
(docs/distill.md).

The target's features come from the engine's own forward, training runs in PyTorch (the
``train`` extra: ``pip install 'ds4tools[train]'``; nothing else in ds4tools imports torch), the
draft is written through the support writers and measured with the engine's drafters.

    >>> from ds4tools.distill import DistillOptions, distill
    >>> r = distill("model.gguf", "draft.gguf", DistillOptions("dspark", data=["corpus/"], time_s=1800))
    >>> r.report["evaluation"]["heldout"]["dspark"]["tau"]

Modules: ``options`` (the request), ``target`` (the frozen target through the engine), ``data``
(corpus, self-generation), ``features`` (the engine's layer outputs and final hidden, cached on
disk), ``model`` / ``dspark`` / ``mtp`` (torch modules and losses), ``train`` (the loop,
checkpoints, resume), ``export`` (the support GGUF), ``evaluate`` (tau / agreement against
prompt lookup), ``run`` (one run end to end).
"""
from __future__ import annotations

from ..errors import UsageError
from .options import DEFAULTS, KINDS, DistillOptions, parse_duration

__all__ = ["DistillOptions", "KINDS", "DEFAULTS", "distill", "parse_duration", "require_torch",
           "TORCH_HINT"]

TORCH_HINT = "pip install 'ds4tools[train]'"


def require_torch():
    """torch, or a UsageError (exit 2) naming the extra that installs it."""
    try:
        import torch
    except ImportError:
        raise UsageError(f"ds4tools distill trains with PyTorch, which is not installed: "
                         f"{TORCH_HINT}") from None
    return torch


def distill(target, out, options: DistillOptions, report=None, on_step=None):
    """Run one distill (``run.run_distill``); returns a ``DistillResult`` (``.summary``,
    ``.report``: what the JSON report holds)."""
    from .run import _stderr, run_distill
    return run_distill(target, out, options, report or _stderr, on_step=on_step)
