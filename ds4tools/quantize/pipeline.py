"""Run a quantization: plan, then stream the tensors one at a time into the output GGUF.

    >>> result = quantize_model("model-f16.gguf", "model-q4_k_m.gguf", QuantizeOptions("Q4_K_M"))
    >>> print(result.summary)
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np
from gguf import GGML_QUANT_VERSION
from gguf import GGUFValueType as V

from .. import formats
from ..errors import InvalidContentError, UsageError, about
from ..gguf_io import GGUFStreamWriter, format_bytes
from .plan import Plan, PlanEntry, build_plan
from .source import ModelSource, open_source

__all__ = ["QuantizeOptions", "QuantizeResult", "quantize_model", "load_imatrix_file"]


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr)


@dataclass
class QuantizeOptions:
    type: str
    pure: bool = False
    output_tensor_type: str | None = None
    token_embedding_type: str | None = None
    tensor_types: list[str] = field(default_factory=list)
    imatrix: str | None = None
    threads: int | None = None
    device: str = "cpu"
    dry_run: bool = False
    overwrite: bool = False
    #: the tqdm bar: True / False, or None to show it only on a terminal
    progress: bool | None = None
    #: HF conversion: embed the NextN layers as llama.cpp does for GLM / DeepSeek
    keep_nextn: bool = False
    #: mixture-of-experts HF conversion, one half of an --mtp-out split: "trunk" (the model
    #: without its NextN tensors) or "mtp" (only them); set by quantize_model itself
    nextn_part: str | None = None
    # support GGUFs (ds4tools.support): the MTP head from the source's NextN layer ...
    mtp_out: str | None = None
    only_support: bool = False
    # ... or a DSpark draft from a DSpark checkpoint (SRC), for the model TARGET
    dspark_out: str | None = None
    target: str | None = None
    layout: str | None = None  # "llama.cpp" or "ds4" (default: by the target's family)
    dspark_block_size: int | None = None
    dspark_target_layers: list[int] | None = None
    dspark_markov_rank: int | None = None
    dspark_noise_token_id: int | None = None
    #: write a llama.cpp-layout draft reading the target's last layer, which llama.cpp cannot
    #: capture on llama / qwen3 targets (refused otherwise): for ds4tools' engine only. Not on
    #: the command line; the bundled demo's draft needs it (ds4tools.demo)
    dspark_allow_output_layer: bool = False


@dataclass
class QuantizeResult:
    plan: Plan | None  # None for a run that wrote support files only
    output: str | None
    seconds: float
    summary: str


def load_imatrix_file(path: str):
    """The importance matrix at ``path`` (llama.cpp's GGUF or .dat format)."""
    from ..gguf_io.imatrix import load_imatrix
    if not os.path.isfile(path):
        raise UsageError(about(path, "no such imatrix file"))
    try:
        return load_imatrix(path)
    except (InvalidContentError, UsageError):
        raise
    except FileNotFoundError:
        raise UsageError(about(path, "no such imatrix file")) from None
    except (ValueError, OSError) as e:
        msg = str(e)
        raise InvalidContentError(msg if msg.startswith(os.fspath(path)) else about(path, msg)) from None


def quantize_model(src, out, options: QuantizeOptions, report=_stderr) -> QuantizeResult:
    """Quantize (or convert) ``src`` to ``out``; ``report`` receives warnings and notes.

    With ``mtp_out`` / ``dspark_out`` the support GGUFs are written too (ds4tools.support);
    the summary then has one line per file written."""
    from ..support.commands import quantize_support, wants_support
    if options.mtp_out and not options.dspark_out and _is_moe_checkpoint(src):
        return _split_moe_nextn(src, out, options, report)
    if options.mtp_out and not options.dspark_out and _is_deepseek4_checkpoint(src):
        return _deepseek4_with_mtp(src, out, options, report)
    if wants_support(options):
        start = time.perf_counter()
        _check_run_options(options)
        lines = quantize_support(src, out, options, report, _quantize_model)
        return QuantizeResult(None, os.fspath(out) if out else None,
                              time.perf_counter() - start, "\n".join(lines))
    return _quantize_model(src, out, options, report)


def _is_moe_checkpoint(src) -> bool:
    """Whether ``src`` is a Hugging Face directory of a mixture-of-experts family."""
    import json
    path = os.path.join(os.fspath(src), "config.json")
    if not os.path.isfile(path):
        return False
    try:
        with open(path, encoding="utf-8") as fh:
            cfg = json.load(fh)
    except (OSError, ValueError):
        return False  # the ordinary path reports it
    from .convert import moe_family
    return isinstance(cfg, dict) and moe_family(cfg) is not None


def _hf_config(src):
    import json
    path = os.path.join(os.fspath(src), "config.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            cfg = json.load(fh)
    except (OSError, ValueError):
        return None  # the ordinary path reports it
    return cfg if isinstance(cfg, dict) else None


def _is_deepseek4_checkpoint(src) -> bool:
    from .convert_deepseek4 import is_deepseek4_config
    cfg = _hf_config(src)
    return cfg is not None and is_deepseek4_config(cfg)


def _deepseek4_with_mtp(src, out, options: QuantizeOptions, report) -> QuantizeResult:
    """``--mtp-out`` on a DeepSeek V4 checkpoint: the model (llama.cpp's deepseek4 layout, no
    MTP block) to -o, and its MTP layer ``mtp.0.*`` as ds4's MTP support file."""
    from dataclasses import replace
    from ..support.commands import quantize_support
    start = time.perf_counter()
    mtp = options.mtp_out
    if options.only_support and out:
        raise UsageError("--only-support writes only the support file: drop -o")
    if options.keep_nextn:
        raise UsageError("--keep-nextn embeds the NextN layers; --mtp-out splits them out: "
                         "use one of them")
    if not options.only_support and out is None and not options.dry_run:
        raise UsageError("an output path (-o OUT.gguf) is required unless --dry-run or "
                         "--only-support")
    if out is not None and os.path.abspath(os.fspath(out)) == os.path.abspath(os.fspath(mtp)):
        raise UsageError(about(mtp, "the support file and -o name the same file"))
    if not options.dry_run:
        for path in ([mtp] if out is None else [out, mtp]):
            if os.path.exists(path) and not options.overwrite:
                raise UsageError(about(os.path.abspath(os.fspath(path)),
                                       "already exists (pass --overwrite to replace it)"))
    lines, plan = [], None
    if not options.only_support:
        r = _quantize_model(src, out, replace(options, mtp_out=None, only_support=False), report)
        lines.append(r.summary)
        plan = r.plan
    _check_run_options(options)
    lines += quantize_support(src, None, replace(options, only_support=True), report,
                              _quantize_model)
    return QuantizeResult(plan if options.dry_run else None, os.fspath(out) if out else None,
                          time.perf_counter() - start, "\n".join(lines))


def _split_moe_nextn(src, out, options: QuantizeOptions, report) -> QuantizeResult:
    """``--mtp-out`` on a DeepSeek / GLM checkpoint: the model without its NextN layers
    (llama.cpp's trunk-only file: ``nextn_predict_layers`` kept, the tensors left out) to -o,
    and the NextN layers alone (llama.cpp's MTP-only file) to MTP.gguf, both with the mix."""
    from dataclasses import replace
    start = time.perf_counter()
    mtp = options.mtp_out
    if options.only_support and out:
        raise UsageError("--only-support writes only the support file: drop -o")
    if options.keep_nextn:
        raise UsageError("--keep-nextn embeds the NextN layers; --mtp-out splits them out: "
                         "use one of them")
    if out is not None and os.path.abspath(os.fspath(out)) == os.path.abspath(os.fspath(mtp)):
        raise UsageError(about(mtp, "the support file and -o name the same file"))
    if not options.dry_run:
        for path in ([mtp] if out is None else [out, mtp]):
            if os.path.exists(path) and not options.overwrite:
                raise UsageError(about(os.path.abspath(os.fspath(path)),
                                       "already exists (pass --overwrite to replace it)"))
    plain = replace(options, mtp_out=None, only_support=False)
    lines = []
    if not options.only_support:
        if out is None and not options.dry_run:
            raise UsageError("an output path (-o OUT.gguf) is required unless --dry-run or "
                             "--only-support")
        lines.append(_quantize_model(src, out, replace(plain, nextn_part="trunk"), report).summary)
    result = _quantize_model(src, mtp, replace(plain, nextn_part="mtp"), report)
    lines.append(result.summary)
    return QuantizeResult(None if not options.dry_run else result.plan,
                          os.fspath(out) if out else None, time.perf_counter() - start,
                          "\n".join(lines))


def _check_run_options(options: QuantizeOptions) -> None:
    if options.device not in formats.DEVICES:
        raise UsageError(f"--device {options.device}: use one of {', '.join(formats.DEVICES)}")
    if options.threads is not None:
        _set_threads(options.threads)
    if options.device == "cuda":
        try:
            formats._check_device("cuda")
        except ValueError as e:
            raise UsageError(f"--device cuda: {e}") from None


def _quantize_model(src, out, options: QuantizeOptions, report=_stderr) -> QuantizeResult:
    start = time.perf_counter()
    if options.device not in formats.DEVICES:
        raise UsageError(f"--device {options.device}: use one of {', '.join(formats.DEVICES)}")
    if out is None and not options.dry_run:
        raise UsageError("an output path (-o OUT.gguf) is required unless --dry-run")
    _check_run_options(options)
    source = open_source(src, report, keep_nextn=options.keep_nextn, nextn_part=options.nextn_part)
    imatrix = load_imatrix_file(options.imatrix) if options.imatrix else None
    plan = build_plan(source, options.type, pure=options.pure,
                      output_type=options.output_tensor_type,
                      token_embedding_type=options.token_embedding_type,
                      tensor_types=options.tensor_types, imatrix=imatrix, imatrix_path=options.imatrix)
    for note in source.notes + plan.warnings:
        report(note)
    if not options.dry_run:  # --dry-run's table already lists them
        for note in plan.fallback_notes():
            report(note)
    if options.dry_run:
        for err in plan.errors:
            report(f"warning: {err} (the real run will stop here)")
        return QuantizeResult(plan, None, time.perf_counter() - start, plan.table())
    if plan.errors:
        more = f" (and {len(plan.errors) - 1} more)" if len(plan.errors) > 1 else ""
        raise UsageError(about(source.path, plan.errors[0] + more))

    writer = GGUFStreamWriter(out, source.arch, inputs=source.paths, overwrite=options.overwrite)
    try:
        _declare(writer, source, plan, imatrix, options.imatrix)
        writer.begin()
        _stream(writer, source, plan, imatrix, options)
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    secs = time.perf_counter() - start
    target = os.fspath(out)
    summary = (f"{target}: {len(plan.entries)} tensors, {format_bytes(plan.src_bytes)} -> "
               f"{format_bytes(plan.out_bytes)}, {plan.bits_per_weight:.2f} bits per weight, "
               f"{secs:.1f} s")
    return QuantizeResult(plan, target, secs, summary)


def _set_threads(n: int) -> None:
    import numba
    if n < 1:
        raise UsageError(f"--threads {n}: must be at least 1")
    numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))


def _declare(writer: GGUFStreamWriter, source: ModelSource, plan: Plan, imatrix, imatrix_path) -> None:
    for k in source.metadata:
        writer.add_key(k.key, k.value, k.vtype, k.sub_type)
    writer.add_key("general.quantization_version", GGML_QUANT_VERSION, V.UINT32)
    writer.add_key("general.file_type", plan.target.ftype, V.UINT32)
    if imatrix is not None:
        writer.add_key("quantize.imatrix.file", os.fspath(imatrix_path), V.STRING)
        datasets = getattr(imatrix, "datasets", None) or []
        if datasets:
            writer.add_key("quantize.imatrix.dataset", str(datasets[0]), V.STRING)
        # UINT32, as llama-quantize writes its integer overrides since llama.cpp PR 14182
        writer.add_key("quantize.imatrix.entries_count", len(getattr(imatrix, "entries", {})), V.UINT32)
        chunks = getattr(imatrix, "chunk_count", None)
        if chunks is not None:
            writer.add_key("quantize.imatrix.chunks_count", int(chunks), V.UINT32)
    for e in plan.entries:
        writer.add_tensor_info(e.name, e.shape, e.out_type)


def _stream(writer, source: ModelSource, plan: Plan, imatrix, options: QuantizeOptions) -> None:
    from tqdm import tqdm
    tensors = {t.name: t for t in source.tensors}
    with tqdm(total=plan.src_bytes, unit="B", unit_scale=True, desc="quantize",
              disable=None if options.progress is None else not options.progress,
              leave=False, file=sys.stderr) as bar:
        for e in plan.entries:
            bar.set_postfix_str(e.name, refresh=False)
            t = tensors[e.name]
            writer.write_tensor(e.name, _produce(e, t, source, imatrix, options.device))
            t.release()
            bar.update(e.src_bytes)


def _produce(e: PlanEntry, t, source: ModelSource, imatrix, device: str) -> np.ndarray:
    if e.action == "copy":
        return t.raw()
    if t.load_part is not None:
        return _produce_by_part(e, t, source, imatrix, device)
    values = t.load_float32()
    weights = None
    if e.imatrix == "file":
        weights = imatrix.for_tensor(e.name, e.shape)
    elif e.imatrix == "synthetic":
        from ..gguf_io.imatrix import synthetic_imatrix
        weights = synthetic_imatrix(values)
    try:
        return formats.quantize(values, e.out_type, imatrix=weights, device=device)
    except ValueError as err:
        raise InvalidContentError(about(source.path, f"tensor '{e.name}': {err}")) from None


def _produce_by_part(e: PlanEntry, t, source: ModelSource, imatrix, device: str) -> np.ndarray:
    """A stacked 3-D tensor (HF experts) one part at a time: ggml quantizes row by row, so the
    bytes are those of the whole tensor, without holding it in float32."""
    weights = imatrix.for_tensor(e.name, e.shape) if e.imatrix == "file" else None
    parts = []
    for i in range(e.shape[0]):
        w = weights
        if w is not None and np.ndim(w) == 2:
            w = w[i] if w.shape[0] == e.shape[0] else w[0]
        part = t.load_part(i)
        if e.imatrix == "synthetic":  # ds4's, per expert: that of the whole tensor, sliced
            from ..gguf_io.imatrix import synthetic_imatrix
            w = synthetic_imatrix(part)
        try:
            parts.append(formats.quantize(part, e.out_type, imatrix=w, device=device))
        except ValueError as err:
            raise InvalidContentError(about(source.path, f"tensor '{e.name}': {err}")) from None
    return np.stack(parts)
