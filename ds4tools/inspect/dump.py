"""The ``inspect`` report: one JSON-ready document (``describe``) and its text rendering.

The document's keys are stable and documented in docs/cli.md (schema ``ds4tools.inspect/1``).
"""
from __future__ import annotations

import math
import re

import numpy as np

from gguf import GGUFValueType as V

from ..errors import UsageError
from ..gguf_io import GGUFFile
from .validate import Finding

__all__ = ["SCHEMA", "describe", "describe_unopenable", "render_text", "ARRAY_HEAD"]

SCHEMA = "ds4tools.inspect/1"
ARRAY_HEAD = 8  # array items kept in the report; the length is always given
_TEXT_WIDTH = 72


def _plain(v, float32: bool = False):
    """A JSON-safe value: non-finite floats become strings, and a FLOAT32 value is shown by its
    shortest float32 spelling (1e-06, not 9.999999974752427e-07)."""
    if isinstance(v, float):
        if not math.isfinite(v):
            return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
        if float32:
            return float(str(np.float32(v)))
    return v


def _metadata(f: GGUFFile, pattern) -> dict:
    out = {}
    for key, value in f.metadata.items():
        if pattern is not None and not pattern.search(key):
            continue
        main, sub = f.value_type(key)
        entry = {"type": main.name, "element_type": sub.name if sub is not None else None,
                 "length": None, "truncated": False, "value": None}
        if main == V.ARRAY:
            entry["length"] = len(value)
            entry["truncated"] = len(value) > ARRAY_HEAD
            entry["value"] = [_plain(x, sub == V.FLOAT32) for x in value[:ARRAY_HEAD]]
        else:
            entry["value"] = _plain(value, main == V.FLOAT32)
        out[key] = entry
    return out


def _totals(f: GGUFFile) -> dict:
    by_type: dict[str, dict] = {}
    for t in f.tensors.values():
        d = by_type.setdefault(t.type_name, {"type": t.type_name, "tensors": 0, "n_elements": 0, "bytes": 0})
        d["tensors"] += 1
        d["n_elements"] += t.n_elements
        d["bytes"] += t.n_bytes
    for d in by_type.values():
        d["bits_per_weight"] = round(8.0 * d["bytes"] / max(1, d["n_elements"]), 4)
    n = sum(d["n_elements"] for d in by_type.values())
    b = sum(d["bytes"] for d in by_type.values())
    return {"tensors": len(f.tensors), "n_elements": n, "bytes": b,
            "bits_per_weight": round(8.0 * b / max(1, n), 4),
            "by_type": sorted(by_type.values(), key=lambda d: -d["bytes"])}


def describe(f: GGUFFile, kind: str, findings: list[Finding], *, tensors: bool = False,
             keys: str | None = None, summary: list[str] | None = None) -> dict:
    """The whole report as plain data (what ``--json`` prints)."""
    pattern = None
    if keys is not None:
        try:
            pattern = re.compile(keys)
        except re.error as e:
            raise UsageError(f"--keys {keys!r}: bad regular expression: {e}") from None
    doc = {
        "schema": SCHEMA,
        "file": f.path,
        "files": list(f.paths),
        "file_size": f.file_size,
        "gguf_version": f.version,
        "alignment": f.alignment,
        "data_offset": f.shards[0].data_offset,
        "architecture": f.architecture,
        "kind": kind,
        "summary": list(summary or []),
        "tensor_count": len(f.tensors),
        "key_count": len(f.metadata),
        "metadata": _metadata(f, pattern),
        "tensors": None,
        "totals": _totals(f),
        "findings": [{"level": x.level, "message": x.message} for x in findings],
        "valid": not any(x.level == "error" for x in findings),
    }
    if tensors:
        doc["tensors"] = [
            {"name": t.name, "type": t.type_name, "shape": list(t.ggml_shape),
             "n_elements": t.n_elements, "bytes": t.n_bytes, "offset": t.data_offset,
             "file": t.path}
            for t in f.tensors.values()]
    return doc


def describe_unopenable(path: str, findings: list[str]) -> dict:
    """The report for a file whose header reads but whose content stops the gguf reader."""
    findings = [m.split(": ", 1)[1] if m.startswith(f"{path}: ") else m for m in findings]
    return {
        "schema": SCHEMA, "file": path, "files": [path], "file_size": None, "gguf_version": None,
        "alignment": None, "data_offset": None, "architecture": None, "kind": None,
        "summary": [], "tensor_count": None, "key_count": None, "metadata": {}, "tensors": None, "totals": None,
        "findings": [{"level": "error", "message": m} for m in findings], "valid": False,
    }


# --- text --------------------------------------------------------------------------------------


def _short(v, width: int = 60) -> str:
    s = repr(v)
    return s if len(s) <= width else s[:width - 3] + "..."


def _value_text(entry: dict) -> str:
    if entry["type"] == "ARRAY":
        head = ", ".join(_short(x, 24) for x in entry["value"])
        more = ", ..." if entry["truncated"] else ""
        return f"[{head}{more}]"
    v = entry["value"]
    if isinstance(v, str):
        return _short(v) + (f" ({len(v)} chars)" if len(repr(v)) > 60 else "")
    return str(v)


def _table(rows, right=()) -> list[str]:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for k, r in enumerate(rows):
        cells = [str(c).rjust(widths[i]) if i in right else str(c).ljust(widths[i]) for i, c in enumerate(r)]
        lines.append("  " + "  ".join(cells).rstrip())
        if k == 0:
            lines.append("  " + "  ".join("-" * w for w in widths))
    return lines


def render_text(doc: dict) -> str:
    lines = [f"file: {doc['file']}"]
    if doc["gguf_version"] is not None:
        if len(doc["files"]) > 1:
            lines.append(f"shards: {len(doc['files'])}")
        lines += [
            f"size: {doc['file_size']:,} bytes",
            f"GGUF version: {doc['gguf_version']}, alignment: {doc['alignment']}, "
            f"data offset: {doc['data_offset']}",
            f"architecture: {doc['architecture'] or '(none)'}",
            f"kind: {doc['kind']}",
            *doc["summary"],
            f"tensors: {doc['tensor_count']}, keys: {doc['key_count']}",
        ]
        if doc["metadata"]:
            lines += ["", "metadata:"]
            rows = [("key", "type", "value")]
            for key, e in doc["metadata"].items():
                typ = f"[{e['element_type']}] x{e['length']}" if e["type"] == "ARRAY" else e["type"]
                rows.append((key, typ, _value_text(e)))
            lines += _table(rows)
        if doc["tensors"] is not None:
            lines += ["", "tensors:"]
            rows = [("name", "type", "shape (ne0 first)", "bytes", "offset")]
            for t in doc["tensors"]:
                rows.append((t["name"], t["type"], " x ".join(map(str, t["shape"])),
                             f"{t['bytes']:,}", f"{t['offset']:,}"))
            lines += _table(rows, right=(3, 4))
            lines += ["", "by type:"]
            rows = [("type", "tensors", "weights", "bytes", "bits/weight")]
            for d in doc["totals"]["by_type"]:
                rows.append((d["type"], d["tensors"], f"{d['n_elements']:,}", f"{d['bytes']:,}",
                             f"{d['bits_per_weight']:.2f}"))
            lines += _table(rows, right=(1, 2, 3, 4))
        tot = doc["totals"]
        lines += ["", f"total: {tot['tensors']} tensors, {tot['n_elements']:,} weights, "
                      f"{tot['bytes']:,} bytes, {tot['bits_per_weight']:.2f} bits per weight"]
    lines.append("")
    if doc["findings"]:
        lines += [f"{x['level']}: {x['message']}" for x in doc["findings"]]
    else:
        lines.append("ok: no problems found")
    return "\n".join(lines)
