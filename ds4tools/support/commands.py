"""The support-file side of ``ds4tools quantize``:

- ``--mtp-out MTP.gguf`` (with ``--only-support``: nothing else): the MTP support GGUF from the
  source's NextN layer (a Hugging Face Qwen3 / Llama / DeepSeek V4 checkpoint, or a model GGUF
  with an embedded NextN layer); without ``--only-support`` the target model is written to
  ``-o`` as usual;
- ``--dspark-out DRAFT.gguf --target TARGET [--layout llama.cpp|ds4]``: a DSpark draft from a
  DeepSpec Qwen3DSparkModel (llama.cpp's layout) or DeepSeek V4 DSpark (ds4's layout) checkpoint.
"""
from __future__ import annotations

import os
from dataclasses import replace

from .. import formats
from ..errors import InvalidContentError, UsageError, about
from ..mixes import resolve_target
from . import build
from .target import hf_config, open_target
from .write import write_support_gguf

__all__ = ["wants_support", "quantize_support", "LAYOUTS"]

LAYOUTS = ("llama.cpp", "ds4")


def wants_support(options) -> bool:
    return bool(options.mtp_out or options.dspark_out or options.only_support)


def _plan_table(built, path: str) -> str:
    rows = [("tensor", "shape (ne0 first)", "type", "from")]
    for t in built.tensors:
        rows.append((t.name, " x ".join(map(str, t.ggml_shape)), t.type_name, t.src_type))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = [f"{path}: {built.arch}, {len(built.tensors)} tensors"]
    for k, r in enumerate(rows):
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _write(built, path, options, target, report) -> str:
    for note in built.notes:
        report(note)
    if options.dry_run:
        return _plan_table(built, os.fspath(path))
    where = built.inputs[0] if built.inputs else os.fspath(path)
    result = write_support_gguf(path, built.arch, built.keys, built.tensors, where=where,
                                inputs=built.inputs, overwrite=options.overwrite,
                                device=options.device, progress=options.progress,
                                file_type=target.ftype)
    return result.summary


def _check_new_output(path, options, other=None) -> None:
    """Refuse an existing output before anything is written (the target model included)."""
    if options.dry_run:
        return
    if other and os.path.abspath(os.fspath(path)) == os.path.abspath(os.fspath(other)):
        raise UsageError(about(path, "the support file and -o name the same file"))
    if os.path.exists(path) and not options.overwrite:
        raise UsageError(about(os.path.abspath(os.fspath(path)),
                               "already exists (pass --overwrite to replace it)"))


def _dspark_options(options) -> build.DSparkOptions:
    return build.DSparkOptions(block_size=options.dspark_block_size,
                               target_layers=options.dspark_target_layers,
                               markov_rank=options.dspark_markov_rank,
                               noise_token_id=options.dspark_noise_token_id,
                               allow_output_layer=options.dspark_allow_output_layer)


def quantize_support(src, out, options, report, quantize_main) -> list[str]:
    """Run the support part of a quantize request; returns the summary lines. ``quantize_main``
    writes the target model (the ordinary quantize run)."""
    target = resolve_target(options.type, list(formats.FORMATS))
    src = os.fspath(src)
    if options.dspark_out:
        return [_dspark(src, out, options, target, report)]
    if options.only_support and not options.mtp_out:
        raise UsageError("--only-support needs --mtp-out MTP.gguf (the support file to write)")
    if options.only_support and out:
        raise UsageError("--only-support writes only the support file: drop -o")
    _check_new_output(options.mtp_out, options, out)
    built = _mtp_source(src, options, target)
    lines = []
    if not options.only_support:
        plain = replace(options, mtp_out=None, only_support=False)
        lines.append(quantize_main(src, out, plain, report).summary)
    lines.append(_write(built, options.mtp_out, options, target, report))
    return lines


def _mtp_source(src: str, options, target):
    if os.path.isdir(src):
        cfg = hf_config(src)
        from .hf_dsv4 import is_dsv4_config
        if is_dsv4_config(cfg):  # the model itself converts in quantize's pipeline first
            return build.mtp_from_dsv4(src, target)
        return build.mtp_from_hf(src, target)
    if not os.path.exists(src):
        raise UsageError(about(src, "no such file or directory"))
    from ..gguf_io import open_gguf
    return build.mtp_from_gguf(open_gguf(src), src)


def _dspark(src: str, out, options, target, report) -> str:
    if out:
        raise UsageError("--dspark-out writes the draft only: drop -o")
    if options.mtp_out or options.only_support:
        raise UsageError("--dspark-out cannot be combined with --mtp-out / --only-support")
    if not options.target:
        raise UsageError("--dspark-out needs --target TARGET (the target's Hugging Face "
                         "directory or GGUF: its vocabulary, hidden size and layers)")
    if not os.path.isdir(src):
        raise UsageError(about(src, "a DSpark draft is converted from its Hugging Face directory"))
    _check_new_output(options.dspark_out, options)
    from .hf_dspark import is_deepspec_config
    from .hf_dsv4 import is_dsv4_config
    cfg = hf_config(src)
    target_info = open_target(options.target)
    opts = _dspark_options(options)
    if is_deepspec_config(cfg):
        layout = options.layout or "llama.cpp"
        if layout != "llama.cpp":
            raise UsageError("--layout ds4 holds DeepSeek V4 stages; a DeepSpec Qwen3DSparkModel "
                             "draft is written in llama.cpp's layout")
        built = build.dspark_draft_from_deepspec(src, target_info, target, opts, report)
    elif is_dsv4_config(cfg):
        layout = options.layout or "ds4"
        if layout != "ds4":
            raise UsageError("--layout llama.cpp: llama.cpp's DeepSeek V4 DSpark layout is not "
                             "written here; DeepSeek V4 drafts use --layout ds4")
        built = build.dspark_support_from_dsv4(src, target_info, target, opts)
    else:
        raise InvalidContentError(about(src, f"not a DSpark draft checkpoint (architectures "
                                             f"{cfg.get('architectures')}; supported: "
                                             f"Qwen3DSparkModel, DeepSeek V4 DSpark)"))
    return _write(built, options.dspark_out, options, target, report)
