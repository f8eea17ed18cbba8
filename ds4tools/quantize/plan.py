"""The per-tensor plan of a quantization: each tensor's output type, why, and what it costs.

The plan is made before any weight is read, so ``--dry-run`` can print it, and so that every
problem (a type that is not implemented, a missing importance matrix) stops the run before an
output file exists.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from .. import formats
from ..errors import InvalidContentError, UsageError, about
from ..gguf_io import format_bytes
from ..mixes import Target, TypeChooser, is_quantized, llama_cpp_order, resolve_target
from .source import ModelSource

__all__ = ["PlanEntry", "Plan", "build_plan", "parse_tensor_type"]


@dataclass
class PlanEntry:
    name: str
    shape: tuple[int, ...]  # numpy order
    src_type: str
    out_type: str
    action: str  # "copy" (bytes as stored), "convert" (float to float) or "quantize"
    src_bytes: int
    out_bytes: int
    reason: str  # where the type comes from: "mix", "pure", "kept", "--tensor-type ..."...
    note: str | None = None
    imatrix: str | None = None  # "file", "synthetic" or None

    @property
    def ggml_shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.shape))

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.out_bytes / max(1, self.n_elements)


@dataclass
class Plan:
    source: ModelSource
    target: Target
    entries: list[PlanEntry]
    warnings: list[str] = field(default_factory=list)
    #: problems that forbid running (the plan itself can still be printed)
    errors: list[str] = field(default_factory=list)
    n_fallback: int = 0

    @property
    def src_bytes(self) -> int:
        return sum(e.src_bytes for e in self.entries)

    @property
    def out_bytes(self) -> int:
        return sum(e.out_bytes for e in self.entries)

    @property
    def n_elements(self) -> int:
        return sum(e.n_elements for e in self.entries)

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.out_bytes / max(1, self.n_elements)

    def fallback_notes(self) -> list[str]:
        """One line per tensor whose type gave way to its row length (llama.cpp says so too)."""
        return [f"note: {e.name}: written as {e.out_type}: {e.note}" for e in self.entries if e.note]

    def table(self) -> str:
        """The --dry-run report: one row per tensor, then the totals."""
        rows = [("tensor", "shape (ne0 first)", "type", "bytes", "bpw", "from")]
        for e in self.entries:
            kind = e.out_type if e.src_type == e.out_type else f"{e.src_type} -> {e.out_type}"
            why = e.reason + (", imatrix" if e.imatrix == "file" else
                              ", synthetic imatrix" if e.imatrix == "synthetic" else "")
            rows.append((e.name, " x ".join(map(str, e.ggml_shape)), kind, f"{e.out_bytes:,}",
                         f"{e.bits_per_weight:.2f}", why))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = []
        for k, r in enumerate(rows):
            cells = [r[i].rjust(widths[i]) if i in (3, 4) else r[i].ljust(widths[i]) for i in range(len(r))]
            lines.append("  ".join(cells).rstrip())
            if k == 0:
                lines.append("  ".join("-" * w for w in widths))
        for e in self.entries:
            if e.note:
                lines.append(f"note: {e.name}: {e.note}")
        lines.append(
            f"total: {len(self.entries)} tensors, {self.n_elements:,} weights, "
            f"{format_bytes(self.src_bytes)} -> {format_bytes(self.out_bytes)} "
            f"({self.bits_per_weight:.2f} bits per weight), target {self.target.name}")
        if self.n_fallback:
            lines.append(f"{self.n_fallback} of {len(self.entries)} tensors fell back to another "
                         f"type for their row length")
        return "\n".join(lines)


def parse_tensor_type(spec: str, available) -> tuple[re.Pattern, str]:
    """``REGEX=TYPE`` (a --tensor-type value) -> (compiled regex, type name)."""
    pattern, sep, type_name = spec.rpartition("=")
    if not sep or not pattern or not type_name:
        raise UsageError(f"--tensor-type {spec!r}: expected REGEX=TYPE")
    type_name = _known_type(type_name, available, f"--tensor-type {spec}")
    try:
        return re.compile(pattern), type_name
    except re.error as e:
        raise UsageError(f"--tensor-type {spec!r}: bad regular expression: {e}") from None


def _known_type(name: str, available, what: str) -> str:
    key = name.strip().upper()
    if key not in available:
        raise UsageError(f"{what}: unknown tensor type {name!r} (known: {', '.join(available)})")
    return key


def _nbytes(shape, type_name: str) -> int:
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    n = int(np.prod(shape, dtype=np.int64))
    return n // block * size


def build_plan(source: ModelSource, type_name: str, *, pure: bool = False,
               output_type: str | None = None, token_embedding_type: str | None = None,
               tensor_types=(), imatrix=None, imatrix_path: str | None = None) -> Plan:
    available = list(formats.FORMATS)
    target = resolve_target(type_name, available)
    overrides = [parse_tensor_type(s, available) for s in tensor_types]
    if output_type:
        output_type = _known_type(output_type, available, "--output-tensor-type")
    if token_embedding_type:
        token_embedding_type = _known_type(token_embedding_type, available, "--token-embedding-type")
    by_name = {t.name: t for t in source.tensors}
    hp = source.hparams
    chooser = TypeChooser(target, source.arch, hp.n_layer, hp.n_head, hp.n_head_kv, hp.n_expert,
                          has_imatrix=imatrix is not None, pure=pure, output_type=output_type,
                          token_embedding_type=token_embedding_type, overrides=overrides,
                          names=list(by_name))
    plan = Plan(source, target, [])
    if overrides and not is_quantized(target.default_type):
        plan.warnings.append(f"warning: --tensor-type applies only to quantized targets "
                             f"(as in llama.cpp); ignored for {target.name}")
    entries: dict[str, PlanEntry] = {}
    requantized = []
    for name in llama_cpp_order(by_name):
        t = by_name[name]
        choice = chooser.choose(name, tuple(reversed(t.shape)))
        if choice is None:  # llama.cpp keeps it: stored bytes from a GGUF, float32 from HF
            # (an integer table, DeepSeek V4's token -> experts, as I32)
            out = t.type_name if source.kind == "gguf" or t.type_name == "I32" else "F32"
            e = PlanEntry(name, t.shape, t.type_name, out, "", t.n_bytes, _nbytes(t.shape, out), "kept")
        else:
            out = choice.type_name
            if out not in available:
                plan.errors.append(f"tensor '{name}' would need type {out}, which is not "
                                   f"implemented here")
            e = PlanEntry(name, t.shape, t.type_name, out, "", t.n_bytes, _nbytes(t.shape, out),
                          choice.reason, choice.note)
            if (source.kind == "gguf" and t.type_name != out and is_quantized(t.type_name)
                    and is_quantized(out)):
                requantized.append(name)
            _attach_imatrix(e, chooser, imatrix, imatrix_path, plan)
        if (source.kind == "gguf" or t.raw is not None) and e.src_type == e.out_type:
            e.action = "copy"
        elif is_quantized(e.out_type):
            e.action = "quantize"
        else:
            e.action = "convert"
        entries[name] = e
    plan.entries = [entries[t.name] for t in source.tensors]
    plan.n_fallback = chooser.n_fallback
    if requantized:
        plan.warnings.append(
            f"warning: {source.path}: {len(requantized)} tensor(s) are already quantized "
            f"(e.g. {requantized[0]}): they are dequantized and requantized, which loses precision")
    return plan


def _attach_imatrix(e: PlanEntry, chooser: TypeChooser, imatrix, imatrix_path, plan: Plan) -> None:
    if e.out_type not in formats.FORMATS:
        return
    fmt = formats.get_format(e.out_type)
    weights = None
    if imatrix is not None and fmt.uses_imatrix:
        try:
            weights = imatrix.for_tensor(e.name, e.shape)
        except ValueError as err:
            raise InvalidContentError(about(imatrix_path or "imatrix", str(err))) from None
        if weights is not None:
            e.imatrix = "file"
    if weights is None and chooser.requires_imatrix(e.name, e.out_type):
        plan.errors.append(f"tensor '{e.name}' ({e.out_type}) needs an importance matrix: "
                           f"pass --imatrix FILE" + (" (it has no entry for this tensor)" if imatrix else ""))
    elif weights is None and fmt.requires_imatrix:
        e.imatrix = "synthetic"  # llama.cpp exempts this tensor; ggml's quantizer still needs one
