"""Checks on an opened GGUF: the file's structure for every kind, and for models the keys and
tensors llama.cpp needs for their architecture. Each problem is a ``Finding`` (error or warning).

Checks for a kind are functions registered with ``register_check(kind)``; ``"*"`` runs on all.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from gguf import GGUFValueType as V

from ..errors import UsageError, about
from ..gguf_io import GGUFFile

__all__ = ["Finding", "validate", "register_check", "register_target_check", "ARCH_RULES"]


@dataclass(frozen=True)
class Finding:
    level: str  # "error" or "warning"
    message: str

    def __str__(self) -> str:
        return f"{self.level}: {self.message}"


def error(msg: str) -> Finding:
    return Finding("error", msg)


def warning(msg: str) -> Finding:
    return Finding("warning", msg)


_CHECKS: dict[str, list[Callable[[GGUFFile], list[Finding]]]] = {}


def register_check(kind: str):
    def add(func):
        _CHECKS.setdefault(kind, []).append(func)
        return func
    return add


_TARGET_CHECKS: dict[str, list[Callable[[GGUFFile, str], list[Finding]]]] = {}


def register_target_check(kind: str):
    """Decorator: a check of a file of ``kind`` against the model given with ``--target``
    (``"*"``: for kinds without one of their own)."""
    def add(func):
        _TARGET_CHECKS.setdefault(kind, []).append(func)
        return func
    return add


def validate(f: GGUFFile, kind: str, target: str | None = None) -> list[Finding]:
    out: list[Finding] = []
    for check in _CHECKS.get("*", []) + _CHECKS.get(kind, []):
        out.extend(check(f))
    if target is not None:
        checks = _TARGET_CHECKS.get(kind) or _TARGET_CHECKS.get("*", [])
        if not checks:  # a wrong command, not a wrong file: exit 2
            raise UsageError(about(f.path, f"--target applies to support GGUFs; this file is "
                                           f"kind '{kind}'"))
        for check in checks:
            out.extend(check(f, target))
    return out


# --- structure (every kind) ----------------------------------------------------------------


@register_check("*")
def check_layout(f: GGUFFile) -> list[Finding]:
    """Tensor data inside its file, aligned, and not overlapping the next tensor."""
    out = []
    by_shard: dict[str, list] = {}
    for t in f.tensors.values():
        by_shard.setdefault(t.path, []).append(t)
    for shard in f.shards:
        tensors = sorted(by_shard.get(shard.path, []), key=lambda t: t.data_offset)
        for t in tensors:
            rel = t.data_offset - shard.data_offset
            if rel % shard.alignment:
                out.append(error(f"tensor '{t.name}': offset {rel} is not a multiple of the "
                                 f"alignment {shard.alignment}"))
            if t.data_offset + t.n_bytes > shard.size:
                out.append(error(f"tensor '{t.name}': data ends past the end of {shard.path}"))
        for a, b in zip(tensors, tensors[1:]):
            if a.data_offset + a.n_bytes > b.data_offset:
                out.append(error(
                    f"tensor '{a.name}' ({a.type_name}, shape {list(a.ggml_shape)}) needs "
                    f"{a.n_bytes} bytes, but tensor '{b.name}' starts "
                    f"{b.data_offset - a.data_offset} bytes after it"))
    return out


@register_check("*")
def check_split(f: GGUFFile) -> list[Finding]:
    out = []
    n = len(f.shards)
    if n == 1:
        count = f.metadata.get("split.count")
        if isinstance(count, int) and count > 1:
            out.append(warning(f"this file is shard {f.metadata.get('split.no', 0) + 1} of "
                               f"{count}; name it *-0000k-of-0000N.gguf to read the whole set"))
        return out
    for i, shard in enumerate(f.shards):
        md = shard.metadata
        if md.get("split.count") != n:
            out.append(error(f"{shard.path}: split.count is {md.get('split.count')}, the set has {n} files"))
        if md.get("split.no") != i:
            out.append(error(f"{shard.path}: split.no is {md.get('split.no')}, expected {i}"))
        total = md.get("split.tensors.count")
        if total is not None and total != len(f.tensors):
            out.append(error(f"{shard.path}: split.tensors.count is {total}, the set has "
                             f"{len(f.tensors)} tensors"))
    return out


# --- models -----------------------------------------------------------------------------------

U32, F32, STR, BOOL = (V.UINT32,), (V.FLOAT32,), (V.STRING,), (V.BOOL,)
U32_OR_ARRAY = (V.UINT32, (V.ARRAY, V.UINT32), (V.ARRAY, V.INT32))


@dataclass(frozen=True)
class ArchRule:
    required: dict  # key suffix -> accepted types
    optional: dict
    qk_norm: bool = False
    moe: bool = False


_TRANSFORMER_REQUIRED = {
    "context_length": U32, "embedding_length": U32, "block_count": U32,
    "feed_forward_length": U32_OR_ARRAY, "attention.head_count": U32_OR_ARRAY,
    "attention.layer_norm_rms_epsilon": F32,
}
_TRANSFORMER_OPTIONAL = {
    "attention.head_count_kv": U32_OR_ARRAY, "rope.freq_base": F32, "rope.dimension_count": U32,
    "attention.key_length": U32, "attention.value_length": U32, "vocab_size": U32,
    "rope.scaling.type": STR, "rope.scaling.factor": F32,
    "rope.scaling.original_context_length": U32, "expert_count": U32, "expert_used_count": U32,
}
#: the architectures whose keys and tensors are checked in full
ARCH_RULES = {
    "llama": ArchRule(_TRANSFORMER_REQUIRED, _TRANSFORMER_OPTIONAL, qk_norm=False, moe=True),
    "qwen3": ArchRule(_TRANSFORMER_REQUIRED, _TRANSFORMER_OPTIONAL, qk_norm=True),
}


def _type_str(t) -> str:
    return f"ARRAY[{t[1].name}]" if isinstance(t, tuple) else t.name


def _check_type(f: GGUFFile, key: str, accepted) -> Finding | None:
    main, sub = f.value_type(key)
    got = (main, sub) if main == V.ARRAY else main
    if got not in accepted:
        return error(f"key '{key}' is {_type_str(got)}, expected "
                     f"{' or '.join(_type_str(a) for a in accepted)}")
    return None


@register_check("model")
def check_architecture(f: GGUFFile) -> list[Finding]:
    arch = f.architecture
    if f.value_type("general.architecture")[0] != V.STRING:
        return [error("general.architecture is not a string")]
    rule = ARCH_RULES.get(arch)
    if rule is None:
        return [warning(f"no rules for architecture '{arch}': only the file structure and the "
                        f"tokenizer were checked")]
    out = []
    for suffix, accepted in rule.required.items():
        key = f"{arch}.{suffix}"
        if key not in f.metadata:
            out.append(error(f"required key '{key}' is missing"))
        elif (bad := _check_type(f, key, accepted)) is not None:
            out.append(bad)
    for suffix, accepted in rule.optional.items():
        key = f"{arch}.{suffix}"
        if key in f.metadata and (bad := _check_type(f, key, accepted)) is not None:
            out.append(bad)
    if any(x.level == "error" for x in out):
        return out  # shapes cannot be derived from broken hyperparameters
    return out + _check_tensors(f, arch, rule)


def _per_layer(value, i: int) -> int:
    return int(value[i] if isinstance(value, list) else value)


def _check_tensors(f: GGUFFile, arch: str, rule: ArchRule) -> list[Finding]:
    md = f.metadata
    g = lambda k, d=None: md.get(f"{arch}.{k}", d)  # noqa: E731
    n_embd, n_layer = int(g("embedding_length")), int(g("block_count"))
    heads, heads_kv, ff = g("attention.head_count"), g("attention.head_count_kv"), g("feed_forward_length")
    heads_kv = heads if heads_kv is None else heads_kv
    n_expert = int(g("expert_count", 0) or 0)
    tokens = md.get("tokenizer.ggml.tokens")
    n_vocab = g("vocab_size") or (len(tokens) if isinstance(tokens, list) else None)
    expected: dict[str, tuple] = {"output_norm.weight": (n_embd,)}
    optional: dict[str, tuple] = {}
    emb = f.tensors.get("token_embd.weight")
    vocab = n_vocab
    if not vocab and emb is not None and len(emb.ggml_shape) == 2:
        vocab = emb.ggml_shape[1]
    expected["token_embd.weight"] = (n_embd, vocab)
    optional["output.weight"] = (n_embd, vocab)
    for i in range(n_layer):
        try:
            nh, nkv, nff = _per_layer(heads, i), _per_layer(heads_kv, i), _per_layer(ff, i)
        except (IndexError, TypeError, ValueError):
            return [error(f"per-layer hyperparameter arrays are shorter than block_count {n_layer}")]
        if nh == 0:
            continue  # a layer without attention (hybrid models): not checked
        hk = int(g("attention.key_length") or n_embd // nh)
        hv = int(g("attention.value_length") or hk)
        p = f"blk.{i}."
        expected.update({
            p + "attn_norm.weight": (n_embd,), p + "attn_q.weight": (n_embd, nh * hk),
            p + "attn_k.weight": (n_embd, nkv * hk), p + "attn_v.weight": (n_embd, nkv * hv),
            p + "attn_output.weight": (nh * hv, n_embd), p + "ffn_norm.weight": (n_embd,),
        })
        if rule.qk_norm:
            expected[p + "attn_q_norm.weight"] = (hk,)
            expected[p + "attn_k_norm.weight"] = (hk,)
        if rule.moe and n_expert > 0:
            expected.update({
                p + "ffn_gate_inp.weight": (n_embd, n_expert),
                p + "ffn_gate_exps.weight": (n_embd, nff, n_expert),
                p + "ffn_up_exps.weight": (n_embd, nff, n_expert),
                p + "ffn_down_exps.weight": (nff, n_embd, n_expert),
            })
        else:
            expected.update({p + "ffn_gate.weight": (n_embd, nff), p + "ffn_up.weight": (n_embd, nff),
                             p + "ffn_down.weight": (nff, n_embd)})
        for b in ("attn_q", "attn_k", "attn_v", "attn_output"):
            w = expected[p + b + ".weight"]
            optional[p + b + ".bias"] = (w[1],)
        optional[p + "rope_freqs.weight"] = None
    optional["rope_freqs.weight"] = None
    out = []
    for name, shape in expected.items():
        t = f.tensors.get(name)
        if t is None:
            out.append(error(f"tensor '{name}' is missing (architecture {arch})"))
        elif not _shape_ok(t.ggml_shape, shape):
            out.append(error(f"tensor '{name}' has shape {list(t.ggml_shape)}, expected "
                             f"{_shape_str(shape)} from the hyperparameters"))
    for name, t in f.tensors.items():
        if name in expected:
            continue
        if name in optional:
            shape = optional[name]
            if shape is not None and not _shape_ok(t.ggml_shape, shape):
                out.append(error(f"tensor '{name}' has shape {list(t.ggml_shape)}, expected "
                                 f"{_shape_str(shape)} from the hyperparameters"))
        else:
            out.append(warning(f"tensor '{name}' is not part of architecture {arch} (llama.cpp "
                               f"will refuse or ignore it)"))
    return out


def _shape_ok(got, want) -> bool:
    return len(got) == len(want) and all(w is None or int(g) == int(w) for g, w in zip(got, want))


def _shape_str(shape) -> str:
    return "[" + ", ".join("?" if s is None else str(s) for s in shape) + "]"


@register_check("model")
def check_tokenizer(f: GGUFFile) -> list[Finding]:
    md = f.metadata
    model = md.get("tokenizer.ggml.model")
    if model is None:
        # llama.cpp needs a vocabulary to load any of its language models; for architectures
        # without rules here the file may be meant for another program
        say = error if f.architecture in ARCH_RULES else warning
        return [say("key 'tokenizer.ggml.model' is missing (llama.cpp cannot load a vocabulary)")]
    return _tokenizer_findings(f)


@register_check("vocab-only")
def check_vocab(f: GGUFFile) -> list[Finding]:
    return _tokenizer_findings(f)


_TOKENIZER_TYPES = {
    "tokenizer.ggml.model": STR, "tokenizer.ggml.pre": STR,
    "tokenizer.ggml.tokens": ((V.ARRAY, V.STRING),), "tokenizer.ggml.token_type": ((V.ARRAY, V.INT32),),
    "tokenizer.ggml.scores": ((V.ARRAY, V.FLOAT32),), "tokenizer.ggml.merges": ((V.ARRAY, V.STRING),),
    "tokenizer.ggml.add_bos_token": BOOL, "tokenizer.ggml.add_eos_token": BOOL,
    "tokenizer.ggml.add_space_prefix": BOOL, "tokenizer.chat_template": STR,
}
_TOKEN_IDS = ("bos", "eos", "unknown", "seperator", "padding", "mask", "eot", "eom")
#: a special token id of -1 stored as UINT32: "unset" (llama.cpp's LLAMA_TOKEN_NULL)
TOKEN_NULL = 0xFFFFFFFF


def _tokenizer_findings(f: GGUFFile) -> list[Finding]:
    md, out = f.metadata, []
    keys = dict(_TOKENIZER_TYPES)
    keys.update({f"tokenizer.ggml.{k}_token_id": U32 for k in _TOKEN_IDS})
    for key, accepted in keys.items():
        if key in md and (bad := _check_type(f, key, accepted)) is not None:
            out.append(bad)
    if out:
        return out
    model = md.get("tokenizer.ggml.model")
    tokens = md.get("tokenizer.ggml.tokens")
    if model == "none":
        return out
    if tokens is None:
        return [error("key 'tokenizer.ggml.tokens' is missing")]
    n = len(tokens)
    for key in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
        if key in md and len(md[key]) != n:
            out.append(error(f"key '{key}' has {len(md[key])} entries for {n} tokens"))
    if model == "gpt2":
        if "tokenizer.ggml.merges" not in md:
            out.append(error("a gpt2 (byte-level BPE) tokenizer needs 'tokenizer.ggml.merges'"))
        if "tokenizer.ggml.pre" not in md:
            out.append(warning("no 'tokenizer.ggml.pre': llama.cpp falls back to its default "
                               "pre-tokenizer, which may split text differently"))
    for k in _TOKEN_IDS:
        key = f"tokenizer.ggml.{k}_token_id"
        if key in md and md[key] == TOKEN_NULL:
            # llama.cpp's own converters write -1 as UINT32 for "no such token" (its test model
            # stories260K has them); llama.cpp warns and keeps its default
            out.append(warning(f"key '{key}' is {TOKEN_NULL} (-1, unset): llama.cpp ignores it"))
        elif key in md and not 0 <= md[key] < n:
            out.append(error(f"key '{key}' is {md[key]}, outside the {n} tokens"))
    emb = f.tensors.get("token_embd.weight")
    if emb is not None and len(emb.ggml_shape) == 2 and emb.ggml_shape[1] != n:
        out.append(warning(f"the vocabulary has {n} tokens but token_embd.weight has "
                           f"{emb.ggml_shape[1]} rows"))
    return out
