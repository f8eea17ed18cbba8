"""Build the tensors and keys of each support layout from its source (nothing is read until a
tensor is written):

- ``mtp_from_hf``: the NextN layer of a Qwen3 / Llama Hugging Face checkpoint -> dense MTP;
- ``mtp_from_dsv4``: the ``mtp.0.*`` layer of a DeepSeek V4 checkpoint (FP8 / FP4) -> ds4 MTP;
- ``mtp_from_gguf``: an embedded NextN layer of a model GGUF -> dense MTP (bytes kept);
- ``dspark_draft_from_deepspec``: a DeepSpec Qwen3DSparkModel draft -> llama.cpp's dflash draft;
- ``dspark_support_from_dsv4``: a DeepSeek V4 DSpark draft (FP8 / FP4) -> ds4's DSpark support file;
- ``dspark_draft_from_arrays`` / ``mtp_from_arrays``: trained weights held in memory (``ds4tools
  distill``), already in llama.cpp's conventions, -> llama.cpp's dflash draft / the dense MTP file.

Each returns a ``Built`` (architecture, keys, tensors, notes) for ``write.write_support_gguf``.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

import numpy as np
from gguf import GGUFValueType as V

from ..checkpoint import ARCHITECTURES, HFCheckpoint, interleave_rope_rows, tokenizer_metadata
from ..errors import InvalidContentError, UsageError, about
from ..gguf_io import MetaKey
from ..mixes import Target
from . import dspark_ds4, dspark_llamacpp, mtp, nextn
from .hf_dspark import LAYER_NAMES, DeepSpecDraft
from .dsv4_block import HF_BLOCK_NAMES, HF_EXPERT_PROJ
from .hf_dsv4 import DSV4Checkpoint
from .layout import TensorSpec
from .target import Dims, TargetInfo, gguf_dims, hf_config, hf_dims
from .write import OutTensor, pick_type

__all__ = ["Built", "DSparkOptions", "mtp_from_hf", "mtp_from_dsv4", "mtp_from_gguf",
           "dspark_draft_from_deepspec", "dspark_support_from_dsv4", "dspark_draft_from_arrays",
           "mtp_from_arrays", "check_capturable"]


@dataclass
class Built:
    arch: str
    keys: list[MetaKey]
    tensors: list[OutTensor]
    inputs: list[str]
    notes: list[str] = field(default_factory=list)


@dataclass
class DSparkOptions:
    """ds4's converter flags (None: the checkpoint's own value)."""
    block_size: int | None = None
    target_layers: list[int] | None = None
    markov_rank: int | None = None
    noise_token_id: int | None = None
    #: write a llama.cpp-layout draft that reads the target's last layer although llama.cpp
    #: cannot capture it (llama / qwen3 targets): only for ds4tools' engine, which runs it. Not
    #: a command-line option; only tests use it (the bundled demo's draft reads layers 1, 3, 4 of 6).
    allow_output_layer: bool = False


def _check_shape(spec: TensorSpec, shape, where: str, source: str) -> None:
    want = tuple(reversed(spec.shape))
    if len(want) != len(shape) or any(w is not None and w != int(g) for w, g in zip(want, shape)):
        raise InvalidContentError(about(where, f"{source} has shape {list(shape)}, but the layout "
                                               f"expects {['?' if w is None else w for w in want]} "
                                               f"for {spec.name}"))


def _out(spec: TensorSpec, target: Target, source, where: str, name_in_source: str) -> OutTensor:
    load, shape, dtype, nbytes = source
    _check_shape(spec, shape, where, f"tensor '{name_in_source}'")
    t = pick_type(spec, target, tuple(reversed(shape)))
    per_expert = spec.role in HF_EXPERT_PROJ  # loaded (and quantized) one expert at a time
    return OutTensor(spec.name, tuple(int(s) for s in shape), t, load=None if per_expert else load,
                     load_part=load if per_expert else None, src_type=dtype, src_bytes=nbytes)


# --- MTP ------------------------------------------------------------------------------------------


def _hf_source(t, transform=None):
    load = t.load_float32 if transform is None else (lambda: transform(t.load_float32()))
    return load, t.shape, t.dtype, t.n_bytes


def mtp_from_hf(folder, target: Target) -> Built:
    """The first NextN layer of a LlamaForCausalLM / Qwen3ForCausalLM checkpoint."""
    ckpt = HFCheckpoint(folder)
    cfg, where = ckpt.config, ckpt.file("config.json")
    archs = [a for a in cfg.get("architectures") or [] if a in ARCHITECTURES]
    if not archs:
        named = ", ".join(map(str, cfg.get("architectures") or [])) or "(none)"
        raise InvalidContentError(about(ckpt.folder, f"unsupported architecture {named} for an "
                                                     f"MTP support file"))
    arch, _, permute = ARCHITECTURES[archs[0]]
    n_nextn = int(cfg.get("num_nextn_predict_layers") or 0)
    dims = hf_dims(cfg)
    if not n_nextn:
        raise InvalidContentError(about(where, "no num_nextn_predict_layers: the checkpoint has no "
                                               "NextN/MTP layer to write"))
    L = int(dims.n_layer)
    p = f"model.layers.{L}."
    E = int(dims.n_embd)
    notes = []
    if n_nextn > 1:
        notes.append(f"note: {ckpt.folder}: {n_nextn} NextN layers; the MTP support file holds "
                     f"the first (layer {L})")

    def get(name):
        t = ckpt.tensors.get(p + name)
        if t is None:
            raise InvalidContentError(about(ckpt.folder, f"NextN layer {L} lacks '{p + name}'"))
        return t

    eh = get("eh_proj.weight")
    if tuple(eh.shape) != (E, 2 * E):
        raise InvalidContentError(about(eh.path, f"tensor '{p}eh_proj.weight' has shape "
                                                 f"{list(eh.shape)}, expected [{E}, {2 * E}] "
                                                 f"(hidden -> 2 x hidden, embedding half first)"))
    sources = {
        "e_proj": (lambda: eh.load_float32()[:, :E].copy(), (E, E), eh.dtype, eh.n_bytes // 2),
        "h_proj": (lambda: eh.load_float32()[:, E:].copy(), (E, E), eh.dtype, eh.n_bytes // 2),
        "enorm": _hf_source(get("enorm.weight")), "hnorm": _hf_source(get("hnorm.weight")),
        "norm": _hf_source(get("shared_head.norm.weight")),
    }
    n_head, n_head_kv = dims.n_head, dims.n_head_kv
    for role, hf_name in LAYER_NAMES.items():
        if role in ("attn_q_norm", "attn_k_norm") and arch == "llama":
            continue
        transform = None
        if permute and role in ("attn_q", "attn_k"):
            heads = n_head if role == "attn_q" else n_head_kv
            transform = lambda w, h=heads: interleave_rope_rows(w, h)  # noqa: E731
        sources[role] = _hf_source(get(hf_name), transform)
    specs = mtp.dense_specs(dims, qk_norm=arch != "llama")
    tensors = [_out(s, target, sources[s.role], ckpt.folder, p + s.role) for s in specs]
    for part in ("shared_head.head.weight", "embed_tokens.weight"):
        if p + part in ckpt.tensors:
            notes.append(f"note: {ckpt.folder}: {p + part} left out (the target's is used)")
    keys = mtp.metadata_keys(arch, dims, L, [MetaKey("general.name", _name(ckpt.folder, "MTP"), V.STRING)])
    return Built(mtp.arch_for(arch), keys, tensors, ckpt.paths, notes)


def _name(folder: str, what: str) -> str:
    return f"{os.path.basename(os.path.normpath(folder))} {what}"


def _hf_block_name(prefix: str, role: str) -> str:
    """The checkpoint name of a DeepSeek V4 block tensor (for messages)."""
    if role in HF_EXPERT_PROJ:
        return f"{prefix}ffn.experts.*.{HF_EXPERT_PROJ[role]}.weight"
    return prefix + HF_BLOCK_NAMES[role]


def mtp_from_dsv4(folder, target: Target) -> Built:
    """ds4's MTP support file from the ``mtp.0.*`` layer of a DeepSeek V4 checkpoint."""
    ck = DSV4Checkpoint(folder)
    d = ck.dims
    p = mtp.PREFIX
    specs = mtp.dsv4_specs(d)
    tensors = []
    for s in specs:
        if s.role in ("hc_head_base", "hc_head_fn", "hc_head_scale"):
            name = p + s.role
            src = ck.named_source(name)
        elif s.role in ("e_proj", "h_proj", "enorm", "hnorm", "norm"):
            name = p + s.role + ".weight"
            src = ck.named_source(name)
        else:
            name = _hf_block_name(p, s.role)
            src = ck.block_source(p, s.role)
        tensors.append(_out(s, target, src, ck.folder, name))
    target_arch = "deepseek41" if any("V41" in str(a) for a in ck.config.get("architectures") or []) \
        else "deepseek4"
    keys = mtp.metadata_keys(target_arch, d, int(d.n_layer or 0),
                             [MetaKey("general.name", _name(ck.folder, "MTP"), V.STRING)])
    return Built(mtp.arch_for(target_arch), keys, tensors, ck.paths)


def mtp_from_gguf(f, path: str) -> Built:
    """The first embedded NextN layer of a model GGUF, in the MTP layout (bytes kept)."""
    e = nextn.find(f)
    if e is None:
        raise InvalidContentError(about(path, f"no NextN layer: the file has no "
                                              f"{f.architecture}.nextn_predict_layers"))
    problems = nextn.validate(f)
    if problems.errors:
        raise InvalidContentError(about(path, problems.errors[0]),
                                  findings=[about(path, m) for m in problems.errors])
    arch, dims, _ = gguf_dims(f)
    if arch in mtp.DSV4_ARCHS:
        raise InvalidContentError(about(path, "extracting an embedded DeepSeek V4 NextN layer is "
                                              "not supported (its MTP file comes from the "
                                              "Hugging Face checkpoint)"))
    block = e.blocks[0]
    tensors, notes = nextn.mtp_tensors(f, block, int(dims.n_embd), path)
    keys = mtp.metadata_keys(arch, dims, block,
                             [MetaKey("general.name", _name(path, "MTP"), V.STRING)])
    return Built(mtp.arch_for(arch), keys, tensors, list(f.paths), notes)


# --- DSpark ---------------------------------------------------------------------------------------


def _draft_values(opts: DSparkOptions, trained_block: int | None, layers, noise, n_targets_fc,
                  n_layer_target, n_vocab, where: str, max_block: int | None) -> tuple[int, list[int], int]:
    """(block size, target layer ids, noise token) after ds4's converter flags, checked."""
    if trained_block is None and opts.block_size is None:
        raise UsageError(about(where, "the checkpoint gives no block size: pass --dspark-block-size"))
    block = opts.block_size if opts.block_size is not None else trained_block
    if block < 1:
        raise UsageError(f"--dspark-block-size {block}: must be at least 1")
    if trained_block is not None and block > trained_block:
        raise UsageError(f"--dspark-block-size {block}: the draft was trained with block size "
                         f"{trained_block}; it may only be lowered")
    if max_block is not None and block > max_block:
        raise UsageError(f"--dspark-block-size {block}: ds4 runs blocks of at most {max_block}")
    if opts.target_layers is not None:
        layers = list(opts.target_layers)
    if not layers:
        raise UsageError(about(where, "the checkpoint gives no target layers: pass --dspark-target-layers"))
    if n_targets_fc is not None and len(layers) != n_targets_fc:
        raise UsageError(f"--dspark-target-layers: the draft's projection takes {n_targets_fc} "
                         f"target layers, {len(layers)} given")
    if any(b <= a for a, b in zip(layers, layers[1:])):
        raise UsageError(f"target layers {layers} are not strictly increasing")
    if n_layer_target is not None and any(not -1 <= x < n_layer_target for x in layers):
        raise UsageError(f"target layers {layers}: the target has {n_layer_target} layers "
                         f"(ids 0..{n_layer_target - 1}; -1 is the embedding)")
    if opts.noise_token_id is not None:
        noise = opts.noise_token_id
    if noise is None:
        raise UsageError(about(where, "the checkpoint gives no mask/noise token: pass "
                                      "--dspark-noise-token-id"))
    if n_vocab is not None and not 0 <= noise < n_vocab:
        raise UsageError(f"noise token {noise} is outside the target's {n_vocab} tokens")
    return int(block), [int(x) for x in layers], int(noise)


def _check_rank(opts: DSparkOptions, rank: int) -> None:
    if opts.markov_rank is not None and opts.markov_rank != rank:
        raise UsageError(f"--dspark-markov-rank {opts.markov_rank}: the checkpoint's Markov head "
                         f"has rank {rank}")


def _tokenizer_keys(target: TargetInfo, n_vocab: int, report) -> list[MetaKey]:
    if target.hf_folder is not None:
        return tokenizer_metadata(target.hf_folder, hf_config(target.hf_folder), n_vocab, report)
    f = target.gguf
    keys = []
    for key, value in f.metadata.items():
        if key.startswith("tokenizer."):
            vtype, sub = f.value_type(key)
            if vtype == V.ARRAY and not value:
                continue
            keys.append(MetaKey(key, value, vtype, sub))
    if not keys:
        raise InvalidContentError(about(target.path, "the target GGUF has no tokenizer"))
    return keys


def check_capturable(target_info: TargetInfo, layers, where: str) -> None:
    """Refuse a llama.cpp-layout draft reading a target layer llama.cpp cannot capture (the
    last layer's output of a llama / qwen3 target), naming the layer."""
    bad = dspark_llamacpp.uncapturable(target_info.arch, target_info.dims.n_layer, layers)
    if bad:
        raise InvalidContentError(about(where, dspark_llamacpp.uncapturable_message(
            bad[0], target_info.arch, int(target_info.dims.n_layer), target_info.path)))


def _dspark_draft_keys(dims: Dims, n_layer: int, block: int, stored, noise: int, target_info: TargetInfo,
                       n_vocab: int, name: str, has_confidence: bool, report) -> list[MetaKey]:
    keys = dspark_llamacpp.metadata_keys(
        dims=dims, n_layer=n_layer, block_size=block, target_layers=stored,
        mask_token_id=noise, target_hidden_size=int(target_info.dims.n_embd or dims.n_embd),
        name=name, has_confidence=has_confidence)
    keys += [k for k in _tokenizer_keys(target_info, n_vocab, report)
             if k.key != "tokenizer.ggml.mask_token_id"]
    keys.append(MetaKey("tokenizer.ggml.mask_token_id", noise, V.UINT32))
    return keys


def dspark_draft_from_deepspec(folder, target_info: TargetInfo, target: Target, opts: DSparkOptions,
                    report=lambda msg: None) -> Built:
    """llama.cpp's DSpark draft (dflash + Markov head) from a DeepSpec Qwen3DSparkModel draft."""
    draft = DeepSpecDraft(folder)
    where = draft.folder
    unknown = draft.unknown_tensors()
    if unknown:
        raise InvalidContentError(about(where, f"tensor '{unknown[0]}' has no place in the DSpark "
                                               f"draft layout"))
    if target_info.arch not in ("qwen3", "llama"):
        raise UsageError(f"--target {target_info.path}: a {target_info.arch} model; llama.cpp's "
                         f"DSpark layout is written for qwen3 and llama targets")
    td, dd = target_info.dims, draft.dims
    n_vocab = td.n_vocab
    if n_vocab is None:
        raise InvalidContentError(about(target_info.path, "the target's vocabulary size is unknown"))
    for what, mine, theirs in (("hidden size", dd.n_embd, td.n_embd),
                               ("vocabulary size", dd.n_vocab, td.n_vocab)):
        if mine is not None and theirs is not None and mine != theirs:
            raise InvalidContentError(about(where, f"the draft's {what} is {mine}, but the target "
                                                   f"{target_info.path} has {theirs}"))
    if draft.num_target_layers not in (None, td.n_layer):
        raise InvalidContentError(about(where, f"the draft was trained on a {draft.num_target_layers}-layer "
                                               f"target, but {target_info.path} has {td.n_layer} layers"))
    E = int(dd.n_embd)
    fc = draft.get("fc.weight")
    n_targets_fc = fc.shape[1] // E if fc.shape[1] % E == 0 else None
    _check_rank(opts, draft.markov_rank)
    block, layers, noise = _draft_values(opts, draft.block_size, draft.target_layer_ids,
                                         draft.mask_token_id, n_targets_fc, td.n_layer, n_vocab,
                                         where, None)
    if not opts.allow_output_layer:
        check_capturable(target_info, layers, where)
    stored = dspark_llamacpp.to_llama_layers(layers)
    dims = Dims(**{**dd.known(), "n_vocab": n_vocab})
    keys = _dspark_draft_keys(dims, draft.n_layer, block, stored, noise, target_info, n_vocab,
                              _name(folder, "DSpark draft"), draft.has_confidence, report)
    h = _DraftShape(dims, draft.n_layer, stored, draft.markov_rank)
    specs = dspark_llamacpp.specs(h, E, n_vocab)
    by_name = {
        "fc.weight": "fc.weight", "enc.output_norm.weight": "hidden_norm.weight",
        "output_norm.weight": "norm.weight", "markov_w1.weight": "markov_head.markov_w1.weight",
        "markov_w2.weight": "markov_head.markov_w2.weight",
        "conf_proj.weight": "confidence_head.proj.weight",
        "conf_proj.bias": "confidence_head.proj.bias",
    }
    for i in range(draft.n_layer):
        for role, hf in LAYER_NAMES.items():
            by_name[f"blk.{i}.{role}.weight"] = f"layers.{i}.{hf}"
    tensors = []
    for s in specs:
        src_name = by_name.get(s.name)
        if src_name is None or (not s.required and src_name not in draft.tensors):
            continue
        tensors.append(_out(s, target, _hf_source(draft.get(src_name)), where, src_name))
    notes = [f"note: {where}: {n} left out (the target's is used)" for n in draft.skipped]
    return Built(dspark_llamacpp.ARCH, keys, tensors, draft.paths, notes)


def _array_tensors(specs, arrays: dict, target: Target, where: str) -> list[OutTensor]:
    """OutTensors of in-memory float arrays (numpy order) named as the specs name them; a
    required tensor that is missing or misshapen is an error, optional ones may be left out."""
    unknown = sorted(set(arrays) - {s.name for s in specs})
    if unknown:
        raise InvalidContentError(about(where, f"tensor '{unknown[0]}' has no place in the layout"))
    out = []
    for spec in specs:
        a = arrays.get(spec.name)
        if a is None:
            if spec.required:
                raise InvalidContentError(about(where, f"tensor '{spec.name}' is missing"))
            continue
        a = np.ascontiguousarray(a, np.float32)
        _check_shape(spec, a.shape, where, f"tensor '{spec.name}'")
        out.append(OutTensor(spec.name, tuple(int(d) for d in a.shape),
                             pick_type(spec, target, tuple(reversed(a.shape))),
                             load=lambda a=a: a, src_type="F32", src_bytes=a.nbytes))
    return out


def dspark_draft_from_arrays(arrays: dict, target_info: TargetInfo, target: Target, *, draft: Dims,
                             n_layer: int, block_size: int, target_layers, mask_token_id: int,
                             name: str, extra_keys=(), report=lambda msg: None) -> Built:
    """llama.cpp's DSpark draft from trained weights: ``arrays`` maps the dflash tensor names
    (``fc.weight``, ``blk.0.attn_q.weight``... ``conf_proj.bias``) to float32 arrays in numpy
    order (a torch Linear's [out, in]); ``draft`` is the backbone (hidden, heads, head dim,
    feed-forward, rope, eps); ``target_layers`` in DeepSpec numbering (layer outputs)."""
    where = target_info.path
    if target_info.arch not in ("qwen3", "llama"):
        raise UsageError(about(where, f"a {target_info.arch} model; llama.cpp's DSpark layout is "
                                      f"written for qwen3 and llama targets"))
    td = target_info.dims
    n_vocab = td.n_vocab
    block, layers, noise = _draft_values(DSparkOptions(), block_size, list(target_layers),
                                         mask_token_id, None, td.n_layer, n_vocab, where, None)
    check_capturable(target_info, layers, where)
    w1 = arrays.get("markov_w1.weight")
    if w1 is None:
        raise InvalidContentError(about(where, "tensor 'markov_w1.weight' is missing"))
    rank = int(np.shape(w1)[1])
    stored = dspark_llamacpp.to_llama_layers(layers)
    dims = Dims(**{**draft.known(), "n_vocab": n_vocab})
    keys = _dspark_draft_keys(dims, n_layer, block, stored, noise, target_info, n_vocab, name,
                              "conf_proj.weight" in arrays, report) + list(extra_keys)
    specs = dspark_llamacpp.specs(_DraftShape(dims, n_layer, stored, rank), dims.n_embd, n_vocab)
    return Built(dspark_llamacpp.ARCH, keys, _array_tensors(specs, arrays, target, where), [where])


def mtp_from_arrays(arrays: dict, target_info: TargetInfo, target: Target, *, name: str,
                    extra_keys=()) -> Built:
    """The dense MTP support file (ds4's layout) from a trained NextN layer: ``arrays`` maps
    the ``mtp.0.*`` names to float32 arrays in numpy order, in llama.cpp's conventions (the
    target's rope pairing: no row reordering is done here)."""
    where = target_info.path
    arch = target_info.arch
    if arch not in ("qwen3", "llama"):
        raise UsageError(about(where, f"a {arch} model; the dense MTP layout is written for qwen3 "
                                      f"and llama targets"))
    dims = target_info.dims
    qk_norm = (mtp.PREFIX + "attn_q_norm.weight") in arrays
    specs = mtp.dense_specs(dims, qk_norm=qk_norm)
    keys = mtp.metadata_keys(arch, dims, int(dims.n_layer),
                             [MetaKey("general.name", name, V.STRING), *extra_keys])
    return Built(mtp.arch_for(arch), keys, _array_tensors(specs, arrays, target, where), [where])


class _DraftShape:
    """The hyper-parameters ``dspark_llamacpp.specs`` reads, for a draft not yet written."""

    def __init__(self, d: Dims, n_layer: int, stored_layers, rank: int):
        self.n_embd, self.head_dim, self.n_head, self.n_head_kv = d.n_embd, d.head_dim, d.n_head, d.n_head_kv
        self.n_ff, self.n_layer, self.target_layers, self.markov_rank = d.n_ff, n_layer, stored_layers, rank


def _find_stage_tensor(ck: DSV4Checkpoint, stages, *suffixes) -> str | None:
    for s in stages:
        for suffix in suffixes:
            if ck.has(f"mtp.{s}.{suffix}"):
                return f"mtp.{s}.{suffix}"
    return None


def dspark_support_from_dsv4(folder, target_info: TargetInfo, target: Target, opts: DSparkOptions) -> Built:
    """ds4's DSpark support file from a DeepSeek V4 DSpark draft checkpoint (stages mtp.0..2)."""
    ck = DSV4Checkpoint(folder)
    where = ck.folder
    stages = ck.stage_prefixes()
    if stages != list(range(dspark_ds4.N_STAGES)):
        raise InvalidContentError(about(where, f"a DeepSeek V4 DSpark draft has stages mtp.0..2, "
                                               f"found {['mtp.%d' % s for s in stages] or 'none'}"))
    if target_info.arch not in ("deepseek4", "deepseek41"):
        raise UsageError(f"--target {target_info.path}: a {target_info.arch} model; ds4's DSpark "
                         f"layout belongs to a DeepSeek V4 target")
    td = target_info.dims
    cfg = ck.config
    w1_name = _find_stage_tensor(ck, stages, "markov_head.markov_w1.weight", "markov_head.embed.weight")
    w2_name = _find_stage_tensor(ck, stages, "markov_head.markov_w2.weight", "markov_head.head.weight")
    conf_name = _find_stage_tensor(ck, stages, "confidence_head.proj.weight")
    main_name = _find_stage_tensor(ck, stages, "main_proj.weight")
    for what, n in (("markov_head.markov_w1", w1_name), ("markov_head.markov_w2", w2_name),
                    ("confidence_head.proj", conf_name), ("main_proj", main_name)):
        if n is None:
            raise InvalidContentError(about(where, f"the draft has no {what} tensor"))
    rank = int(ck.shape(w1_name)[1])
    _check_rank(opts, rank)
    E = int(ck.dims.n_embd)
    main_in = ck.shape(main_name)[1]
    n_targets_fc = main_in // E if main_in % E == 0 else None
    block, layers, noise = _draft_values(
        opts, cfg.get("dspark_block_size"), cfg.get("dspark_target_layer_ids"),
        cfg.get("dspark_noise_token_id"), n_targets_fc, td.n_layer, td.n_vocab, where,
        dspark_ds4.MAX_BLOCK_SIZE)
    if any(x < 0 for x in layers):
        raise UsageError(f"target layers {layers}: ds4 reads layer outputs 0..n_layer-1")
    v4 = _find_stage_tensor(ck, [stages[-1]], "hc_head_fn") is not None
    arch = dspark_ds4.ARCH_V4 if v4 else dspark_ds4.ARCH_V41
    d = Dims(**{**ck.dims.known(), "n_vocab": td.n_vocab, "n_layer": td.n_layer})
    specs = dspark_ds4.specs(d, dspark_ds4.N_STAGES, len(layers), rank, with_hc_head=v4)
    last = f"mtp.{stages[-1]}."
    tensors = []
    for s in specs:
        m = re.match(r"^mtp\.(\d+)\.", s.name)
        prefix = m.group(0)
        if s.role == "main_proj":
            name, src = main_name, ck.named_source(main_name)
        elif s.role == "main_norm":
            name = _find_stage_tensor(ck, stages, "main_norm.weight") or prefix + "main_norm.weight"
            src = ck.named_source(name)
        elif s.role == "norm":
            name = last + "norm.weight"
            src = ck.named_source(name)
        elif s.role in ("hc_head_base", "hc_head_fn", "hc_head_scale"):
            if not v4:
                continue
            name = last + s.role
            src = ck.named_source(name)
        elif s.role == "markov_w1":
            name, src = w1_name, ck.named_source(w1_name)
        elif s.role == "markov_w2":
            name, src = w2_name, ck.named_source(w2_name)
        elif s.role == "confidence_proj":
            name, src = conf_name, ck.named_source(conf_name)
        else:
            name, src = _hf_block_name(prefix, s.role), ck.block_source(prefix, s.role)
        tensors.append(_out(s, target, src, where, name))
    keys = dspark_ds4.metadata_keys(arch, block, rank, noise, layers, d, _name(folder, "DSpark"))
    return Built(arch, keys, tensors, ck.paths)
