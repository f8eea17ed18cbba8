"""Inspect and validate GGUF files: what a file holds, what kind it is, and what is wrong with it.

    >>> doc = inspect_file("model.gguf", tensors=True)   # the --json document
    >>> doc["kind"], doc["valid"], doc["findings"]
"""
from __future__ import annotations

from ..errors import InvalidContentError
from ..gguf_io import open_gguf
from .dump import SCHEMA, describe, describe_unopenable, render_text
from .kinds import detect_kind, known_kinds, register_kind, register_summary, summary_lines
from .validate import Finding, register_check, register_target_check, validate

__all__ = ["inspect_file", "describe", "render_text", "detect_kind", "register_kind",
           "known_kinds", "validate", "register_check", "register_target_check",
           "register_summary", "Finding", "SCHEMA"]


def inspect_file(path, *, tensors: bool = False, keys: str | None = None,
                 target: str | None = None) -> dict:
    """The inspection report of a GGUF file (or split set) as a JSON-ready dict; with
    ``target`` (a model GGUF or Hugging Face directory) a support file is checked against it.

    Raises ``UnreadableError`` when the file cannot be read as GGUF at all; a file that reads
    but breaks the rules gives a report with ``valid`` false and its findings."""
    try:
        f = open_gguf(path)
    except InvalidContentError as e:
        return describe_unopenable(str(path), e.findings)
    with f:
        kind = detect_kind(f)
        return describe(f, kind, validate(f, kind, target), tensors=tensors, keys=keys,
                        summary=summary_lines(f, kind))


# The support GGUF kinds (MTP heads, DSpark drafts) register themselves here.
from ..support import inspect_plugin as _support_kinds  # noqa: E402,F401
