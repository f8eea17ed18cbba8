"""The MTP support GGUF in ds4's layout: one NextN/MTP layer under ``mtp.0.``, without the
embedding and output head (the target's are used).

Two variants, told apart by the target architecture:

- **dense** (qwen3 / llama targets): ``e_proj`` and ``h_proj`` (NextN's fused ``eh_proj``
  [2H -> H] split in two [H -> H] matrices, the embedding half first), ``enorm``, ``hnorm``,
  ``norm`` (NextN's ``shared_head.norm``) and the layer's block tensors under llama.cpp's
  per-layer names (``attn_norm``, ``attn_q``... ``ffn_down``);
- **DeepSeek V4** (ds4's own file): the 32 tensors of ds4.md 1.2 (the e/h projections and
  norms, the hyper-connection head and one DSV4 block).

Metadata: ``general.architecture`` = ``<target arch>-mtp`` and, under that prefix, a
description of the target the head belongs to (``KEYS``), so that a mismatched pair is caught.
ds4 itself reads no metadata from this file; its checks are the tensor checks below, with its
messages (``required tensor is missing: ...``, ``tensor ... has type ..., expected ...``).
"""
from __future__ import annotations

from gguf import GGUFValueType as V

from ..gguf_io import MetaKey
from . import meta
from .dsv4_block import block_specs, infer_block_dims
from .layout import (ANY_WEIGHT, DS4_MTP, F32, PLAIN, Q8_0_ONLY, Problems, TensorSpec,
                     check_tensor)
from .target import DIM_LABELS, Dims, TargetInfo

__all__ = ["PREFIX", "ARCH_SUFFIX", "DSV4_ARCHS", "KEYS", "arch_for", "metadata_keys",
           "read_metadata", "specs", "dense_specs", "dsv4_specs", "infer_dims", "validate",
           "is_dsv4_file"]

PREFIX = "mtp.0."
ARCH_SUFFIX = "-mtp"
DSV4_ARCHS = ("deepseek4", "deepseek41")
#: the routed gate/up type rule ds4 applies to the MTP block
GATE_UP_MESSAGE = "MTP routed gate/up experts use different quant types"

# our keys, under "<general.architecture>.": (Dims field or special, GGUF type)
KEYS = {
    "target_architecture": ("target_arch", V.STRING),
    "block_count": ("block_count", V.UINT32),  # MTP layers in this file: 1
    "target_block_count": ("n_layer", V.UINT32),
    "nextn_layer_index": ("nextn_index", V.UINT32),
    "context_length": ("context_length", V.UINT32),
    "embedding_length": ("n_embd", V.UINT32),
    "vocab_size": ("n_vocab", V.UINT32),
    "feed_forward_length": ("n_ff", V.UINT32),
    "attention.head_count": ("n_head", V.UINT32),
    "attention.head_count_kv": ("n_head_kv", V.UINT32),
    "attention.key_length": ("head_dim", V.UINT32),
    "attention.value_length": ("head_dim", V.UINT32),
    "rope.dimension_count": ("head_dim", V.UINT32),
    "rope.freq_base": ("rope_base", V.FLOAT32),
    "attention.layer_norm_rms_epsilon": ("rms_eps", V.FLOAT32),
    # DeepSeek V4 only
    "attention.q_lora_rank": ("q_lora", V.UINT32),
    "attention.output_lora_rank": ("o_lora", V.UINT32),
    "attention.output_group_count": ("o_groups", V.UINT32),
    "expert_count": ("n_expert", V.UINT32),
    "expert_used_count": ("n_expert_used", V.UINT32),
    "expert_feed_forward_length": ("n_ff_exp", V.UINT32),
    "expert_shared_count": ("n_shared", V.UINT32),
    "hyper_connection.count": ("hc", V.UINT32),
}
_DENSE_ONLY = ("feed_forward_length", "rope.dimension_count")
_DSV4_ONLY = ("attention.q_lora_rank", "attention.output_lora_rank",
              "attention.output_group_count", "expert_count", "expert_used_count",
              "expert_feed_forward_length", "expert_shared_count", "hyper_connection.count")
#: keys the dense variant cannot do without (its shapes come from them)
REQUIRED_DENSE = ("target_architecture", "embedding_length", "vocab_size", "target_block_count",
                  "feed_forward_length", "attention.head_count", "attention.head_count_kv",
                  "attention.key_length", "attention.layer_norm_rms_epsilon", "rope.freq_base")
#: dimensions compared with --target
PAIR_DIMS = ("n_embd", "n_vocab", "n_layer", "n_head", "n_head_kv", "head_dim", "n_ff")
PAIR_DIMS_DSV4 = ("n_embd", "n_vocab", "n_layer", "n_head", "head_dim", "q_lora", "o_lora",
                  "o_groups", "n_expert", "n_ff_exp", "hc")


def arch_for(target_arch: str) -> str:
    return target_arch + ARCH_SUFFIX


def metadata_keys(target_arch: str, dims: Dims, nextn_index: int, extra=()) -> list[MetaKey]:
    """The keys of an MTP support file for a ``target_arch`` model of ``dims``."""
    arch = arch_for(target_arch)
    dsv4 = target_arch in DSV4_ARCHS
    values = {"target_arch": target_arch, "block_count": 1, "nextn_index": nextn_index,
              **dims.known()}
    keys = []
    for suffix, (field, vtype) in KEYS.items():
        if (dsv4 and suffix in _DENSE_ONLY) or (not dsv4 and suffix in _DSV4_ONLY):
            continue
        v = values.get(field)
        if v is None:
            continue
        keys.append(MetaKey(f"{arch}.{suffix}", float(v) if vtype == V.FLOAT32 else v, vtype))
    keys.extend(extra)
    return keys


def read_metadata(f) -> tuple[str | None, Dims, int | None, list[str]]:
    """(target architecture, dims, NextN layer index, problems with the keys) from the file."""
    arch = f.architecture or ""
    problems = []
    values = {}
    for suffix, (field, vtype) in KEYS.items():
        key = f"{arch}.{suffix}"
        if key not in f.metadata:
            continue
        if vtype == V.UINT32:
            v = meta.u32(f, key)
            if v is None:
                problems.append(f"metadata key has a non-integer type: {key}")
                continue
        elif vtype == V.FLOAT32:
            v = meta.number(f, key)
            if v is None:
                main, _ = f.value_type(key)
                problems.append(f"metadata key has a non-float type {main.name}: {key}")
                continue
        else:
            v = meta.string(f, key)
            if v is None:
                problems.append(f"metadata key is not a string: {key}")
                continue
        values.setdefault(field, v)
    target_arch = values.pop("target_arch", None)
    if target_arch is None and arch.endswith(ARCH_SUFFIX):
        target_arch = arch[:-len(ARCH_SUFFIX)]
    nextn = values.pop("nextn_index", None)
    values.pop("block_count", None)
    return target_arch, Dims(**values), nextn, problems


def is_dsv4_file(f, target_arch: str | None) -> bool:
    if target_arch in DSV4_ARCHS:
        return True
    return any(n in f.tensors for n in (PREFIX + "attn_q_a.weight", PREFIX + "hc_head_fn.weight"))


def dense_specs(d: Dims, qk_norm: bool) -> list[TensorSpec]:
    E, hd = d.n_embd, d.head_dim
    q = None if d.n_head is None or hd is None else d.n_head * hd
    kv = None if d.n_head_kv is None or hd is None else d.n_head_kv * hd
    p, ff = PREFIX, d.n_ff
    out = [
        TensorSpec(p + "e_proj.weight", "e_proj", ANY_WEIGHT, (E, E)),
        TensorSpec(p + "h_proj.weight", "h_proj", ANY_WEIGHT, (E, E)),
        TensorSpec(p + "enorm.weight", "enorm", F32, (E,), default_type="F32"),
        TensorSpec(p + "hnorm.weight", "hnorm", F32, (E,), default_type="F32"),
        TensorSpec(p + "norm.weight", "norm", F32, (E,), default_type="F32"),
        TensorSpec(p + "attn_norm.weight", "attn_norm", F32, (E,), default_type="F32"),
        TensorSpec(p + "attn_q.weight", "attn_q", ANY_WEIGHT, (E, q)),
        TensorSpec(p + "attn_k.weight", "attn_k", ANY_WEIGHT, (E, kv)),
        TensorSpec(p + "attn_v.weight", "attn_v", ANY_WEIGHT, (E, kv)),
        TensorSpec(p + "attn_output.weight", "attn_output", ANY_WEIGHT, (q, E)),
    ]
    if qk_norm:
        out += [TensorSpec(p + "attn_q_norm.weight", "attn_q_norm", F32, (hd,), default_type="F32"),
                TensorSpec(p + "attn_k_norm.weight", "attn_k_norm", F32, (hd,), default_type="F32")]
    out += [
        TensorSpec(p + "ffn_norm.weight", "ffn_norm", F32, (E,), default_type="F32"),
        TensorSpec(p + "ffn_gate.weight", "ffn_gate", ANY_WEIGHT, (E, ff)),
        TensorSpec(p + "ffn_up.weight", "ffn_up", ANY_WEIGHT, (E, ff)),
        TensorSpec(p + "ffn_down.weight", "ffn_down", ANY_WEIGHT, (ff, E)),
    ]
    return out


def dsv4_specs(d: Dims) -> list[TensorSpec]:
    """ds4's 32 required MTP tensors (mtp_weights_bind / mtp_weights_validate_layout)."""
    E, HC = d.n_embd, d.hc
    p = PREFIX
    head = [
        TensorSpec(p + "hc_head_base.weight", "hc_head_base", F32, (HC,), default_type="F32"),
        TensorSpec(p + "hc_head_fn.weight", "hc_head_fn", PLAIN,
                   (None if E is None or HC is None else E * HC, HC), default_type="F16"),
        TensorSpec(p + "hc_head_scale.weight", "hc_head_scale", F32, (1,), default_type="F32"),
        TensorSpec(p + "e_proj.weight", "e_proj", Q8_0_ONLY, (E, E)),
        TensorSpec(p + "h_proj.weight", "h_proj", Q8_0_ONLY, (E, E)),
        TensorSpec(p + "enorm.weight", "enorm", F32, (E,), default_type="F32"),
        TensorSpec(p + "hnorm.weight", "hnorm", F32, (E,), default_type="F32"),
        TensorSpec(p + "norm.weight", "norm", F32, (E,), default_type="F32"),
    ]
    return head + block_specs(p, d, "mtp")


def specs(d: Dims, target_arch: str | None, dsv4: bool, qk_norm: bool | None = None) -> list[TensorSpec]:
    if dsv4:
        return dsv4_specs(d)
    if qk_norm is None:
        qk_norm = target_arch != "llama"
    return dense_specs(d, qk_norm)


def _ne(f, name, i=0):
    t = f.tensors.get(name)
    return int(t.ggml_shape[i]) if t is not None and len(t.ggml_shape) > i else None


def infer_dims(f, dsv4: bool) -> Dims:
    """What the file's own tensors say about the target (a file without our keys)."""
    p = PREFIX
    if dsv4:
        d = infer_block_dims(f, p)
        return d.merged(Dims(n_embd=_ne(f, p + "enorm.weight")))
    hd = _ne(f, p + "attn_q_norm.weight") or _ne(f, p + "attn_k_norm.weight")
    q, kv = _ne(f, p + "attn_q.weight", 1), _ne(f, p + "attn_k.weight", 1)
    return Dims(n_embd=_ne(f, p + "enorm.weight"), head_dim=hd,
                n_head=q // hd if q and hd and q % hd == 0 else None,
                n_head_kv=kv // hd if kv and hd and kv % hd == 0 else None,
                n_ff=_ne(f, p + "ffn_gate.weight", 1))


def validate(f, target: TargetInfo | None = None) -> Problems:
    """Every problem of an MTP support file (and of the pair, with ``target``)."""
    out = Problems()
    target_arch, own, nextn, key_problems = read_metadata(f)
    for msg in key_problems:
        out.error(msg)
    dsv4 = is_dsv4_file(f, target_arch)
    arch = f.architecture or "(none)"
    if not arch.endswith(ARCH_SUFFIX):
        out.warning(f"general.architecture is '{arch}'; an MTP support file has "
                    f"'<target architecture>{ARCH_SUFFIX}'")
    if not dsv4:  # our layout: the shapes come from these keys
        for suffix in REQUIRED_DENSE:
            key = f"{f.architecture}.{suffix}"
            if key not in f.metadata:
                out.error(f"required metadata key is missing: {key}")
    expected = own.merged(infer_dims(f, dsv4))
    if target is not None:
        _pair(out, target, target_arch, own, dsv4)
        expected = target.dims.merged(expected)
    arch_of_target = target.arch if target is not None else target_arch
    qk = (arch_of_target != "llama") if arch_of_target else (PREFIX + "attn_q_norm.weight") in f.tensors
    all_specs = specs(expected, target_arch, dsv4, qk)
    for spec in all_specs:
        for msg in check_tensor(spec, f.tensors.get(spec.name), DS4_MTP):
            out.error(msg)
    if dsv4:
        g, u = (f.tensors.get(PREFIX + f"ffn_{x}_exps.weight") for x in ("gate", "up"))
        if g is not None and u is not None and g.ggml_type != u.ggml_type:
            out.error(GATE_UP_MESSAGE)
    known = {s.name for s in all_specs}
    for name in f.tensors:
        if name not in known:
            out.warning(f"tensor {name} is not part of the MTP layout (ds4 ignores it)")
    return out


def _pair(out: Problems, target: TargetInfo, target_arch, own: Dims, dsv4: bool) -> None:
    if target_arch and target.arch != target_arch:
        out.error(f"the MTP head was made for a {target_arch} model, but {target.path} is {target.arch}")
    for name in (PAIR_DIMS_DSV4 if dsv4 else PAIR_DIMS):
        mine, theirs = getattr(own, name), getattr(target.dims, name)
        if mine is not None and theirs is not None and mine != theirs:
            out.error(f"the MTP head was made for a target with {DIM_LABELS[name]} {mine}, "
                      f"but {target.path} has {theirs}")
