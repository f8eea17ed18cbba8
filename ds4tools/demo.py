"""The bundled default model: ``ds4tools/data/demo/target`` (a Hugging Face checkpoint shipped
with the package), converted and quantized to Q8_0 on first use into the user's cache, and what
the commands run when no model is given (``resolve_model``: the CLI's ``run``, ``bench``).

The cached file is named by a hash of the checkpoint's files and of the package version, so an
updated checkpoint (or converter) gets a fresh conversion and an unchanged one is reused.
Cache directory: ``$DS4TOOLS_CACHE``, else ``$XDG_CACHE_HOME/ds4tools``, else
``~/.cache/ds4tools``. ``$DS4TOOLS_DEMO_SOURCE`` points at another checkpoint (tests).

This sits above the engine and the quantizer (it converts with one and runs the other); the
engine itself always takes a model path.

    >>> from ds4tools.demo import demo_engine
    >>> eng = demo_engine()                     # Engine(<the demo's GGUF>), converted on first use
"""
from __future__ import annotations

import functools
import hashlib
import os
import sys
from dataclasses import replace
from pathlib import Path

from . import __version__
from .errors import UsageError

DEMO_TYPE = "Q8_0"


def demo_source() -> Path:
    env = os.environ.get("DS4TOOLS_DEMO_SOURCE")
    if env:
        return Path(env)
    return Path(__file__).resolve().parent / "data" / "demo" / "target"


def cache_dir() -> Path:
    env = os.environ.get("DS4TOOLS_CACHE")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "ds4tools"


@functools.lru_cache(maxsize=None)
def source_hash(folder: Path) -> str:
    """sha256 over the checkpoint's file names and contents (sorted), and the package version.
    Cached per folder: one run asks for the target's hash for the model and for each support file."""
    h = hashlib.sha256(f"ds4tools {__version__} {DEMO_TYPE}\n".encode())
    for p in sorted(q for q in folder.rglob("*") if q.is_file()):
        h.update(str(p.relative_to(folder)).encode() + b"\0")
        with open(p, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()[:16]


def demo_model_path(progress: bool = True, report=None) -> Path:
    """The demo GGUF, converting it first if the cache does not have it yet."""
    src = demo_source()
    if not (src / "config.json").is_file():
        raise UsageError(f"{src}: the bundled demo model is not installed; pass a model with -m MODEL.gguf")
    target = cache_dir() / f"demo-{source_hash(src)}-{DEMO_TYPE.lower()}.gguf"
    if target.is_file():
        return target
    from .quantize import QuantizeOptions, quantize_model
    say = report or (lambda msg: print(msg, file=sys.stderr))
    target.parent.mkdir(parents=True, exist_ok=True)
    say(f"ds4tools: preparing the demo model (first use): {src} -> {target}")
    # quantize_model writes a temporary file beside the target and renames it into place, so
    # an interrupted run leaves nothing half-written under the final name.
    quantize_model(src, target, QuantizeOptions(DEMO_TYPE, progress=progress, overwrite=True),
                   report=lambda msg: None)
    return target


#: the demo's support files: name -> (what it is, how it is made)
SUPPORT_KINDS = ("nextn", "mtp", "dspark")


def demo_support_path(kind: str, progress: bool = True, report=None) -> Path:
    """A support file of the demo, converted into the cache on first use:
    "nextn" the target with its NextN layer embedded (for --glm-mtp), "mtp" the ds4-layout MTP
    head, "dspark" the DSpark draft in llama.cpp's layout (from the sibling ``dspark/``)."""
    if kind not in SUPPORT_KINDS:
        raise ValueError(f"unknown demo support kind {kind!r}")
    src = demo_source()
    draft_src = src.parent / "dspark"
    if not (src / "config.json").is_file() or (kind == "dspark" and not (draft_src / "config.json").is_file()):
        raise UsageError(f"{src.parent}: the bundled demo model is not installed; pass files with -m / --mtp")
    tag = source_hash(src) + (source_hash(draft_src) if kind == "dspark" else "")
    out = cache_dir() / f"demo-{tag[:24]}-{kind}-{DEMO_TYPE.lower()}.gguf"
    if out.is_file():
        return out
    from .quantize import QuantizeOptions, quantize_model
    say = report or (lambda msg: print(msg, file=sys.stderr))
    out.parent.mkdir(parents=True, exist_ok=True)
    say(f"ds4tools: preparing the demo's {kind} file (first use): -> {out}")
    quiet = lambda msg: None  # noqa: E731
    if kind == "nextn":
        quantize_model(src, out, QuantizeOptions(DEMO_TYPE, keep_nextn=True, progress=progress,
                                                 overwrite=True), report=quiet)
    elif kind == "mtp":
        quantize_model(src, None, QuantizeOptions(DEMO_TYPE, mtp_out=str(out), only_support=True,
                                                  progress=progress, overwrite=True), report=quiet)
    else:
        # the demo's draft reads target layers 1, 3, 4 of 0..5 (ds4tools distill's default):
        # layers whose outputs llama.cpp exposes to a draft, so the writer's check passes
        quantize_model(draft_src, None, QuantizeOptions(DEMO_TYPE, dspark_out=str(out), target=str(src),
                                                        progress=progress, overwrite=True), report=quiet)
    return out


def with_demo_draft(spec, progress: bool = True):
    """``spec`` (a SpecConfig, or None) with the demo's DSpark draft as its file when it asks
    for --dspark without --mtp FILE (converted on first use); otherwise ``spec`` as it is."""
    if spec is None or not spec.active:
        return spec
    wants = spec.resolved(temperature=0.0)
    if wants.dspark and wants.mtp_file is None:
        return replace(spec, mtp_file=str(demo_support_path("dspark", progress=progress)))
    return spec


def resolve_model(model_path, spec=None, progress: bool = True):
    """The ``(model_path, spec)`` a command runs. A given model comes back as it is, with
    ``spec`` unchanged (--dspark then needs --mtp FILE). Without one, the bundled demo: its
    variant with the NextN layer embedded when ``spec`` asks for --glm-mtp, else the demo model;
    and ``spec`` with the demo's DSpark draft filled in (``with_demo_draft``)."""
    if model_path is not None:
        return model_path, spec
    active = spec is not None and spec.active
    if active and spec.resolved(temperature=0.0).glm_mtp:
        model_path = demo_support_path("nextn", progress=progress)  # carries its NextN layer
    else:
        model_path = demo_model_path(progress=progress)
    return model_path, with_demo_draft(spec, progress=progress)


def demo_engine(spec=None, *, progress: bool = True, **options):
    """An ``Engine`` on the bundled demo (what ``ds4tools run`` runs without -m), drafting as
    ``spec`` asks (``resolve_model``). ``options``: the Engine's (n_ctx, threads, exact...)."""
    from .engine import Engine
    model_path, spec = resolve_model(None, spec, progress=progress)
    return Engine(model_path, spec=spec, **options)
