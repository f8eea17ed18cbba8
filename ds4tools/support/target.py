"""The target model a support file belongs to: its dimensions (``Dims``), read from a GGUF or
from a Hugging Face config.json (``open_target``).

A support GGUF stores no embedding or output head of its own: it borrows the target's. So the
writer needs the target's vocabulary size, hidden size and layer count, and the validator
checks a (support, target) pair against them.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields, replace

from ..errors import InvalidContentError, UnreadableError, about
from ..gguf_io import GGUFFile, open_gguf
from . import meta

__all__ = ["Dims", "TargetInfo", "open_target", "gguf_dims", "hf_dims", "hf_config",
           "HF_ARCHITECTURES", "DIM_LABELS"]

#: Hugging Face architecture -> the GGUF architecture name ds4tools uses for it
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3",
    "DeepseekV4ForCausalLM": "deepseek4", "DeepseekV41ForCausalLM": "deepseek41",
}


@dataclass(frozen=True)
class Dims:
    """Dimensions of a target model (None: not known). DeepSeek V4 ones at the end."""
    n_embd: int | None = None
    n_vocab: int | None = None
    n_layer: int | None = None  # the target's transformer layers (NextN layers not counted)
    n_head: int | None = None
    n_head_kv: int | None = None
    head_dim: int | None = None
    n_ff: int | None = None
    rope_base: float | None = None
    rms_eps: float | None = None
    context_length: int | None = None
    q_lora: int | None = None
    o_lora: int | None = None
    o_groups: int | None = None
    n_expert: int | None = None
    n_expert_used: int | None = None
    n_ff_exp: int | None = None
    n_shared: int | None = None
    hc: int | None = None

    def merged(self, other: "Dims") -> "Dims":
        """These dims, with the unknown ones taken from ``other``."""
        return replace(self, **{f.name: getattr(other, f.name) for f in fields(self)
                                if getattr(self, f.name) is None})

    def known(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


#: how messages name each dimension
DIM_LABELS = {
    "n_embd": "hidden size", "n_vocab": "vocabulary size", "n_layer": "layer count",
    "n_head": "attention head count", "n_head_kv": "KV head count", "head_dim": "head dim",
    "n_ff": "feed-forward size", "rope_base": "rope base", "rms_eps": "RMS norm epsilon",
    "context_length": "context length", "q_lora": "q LoRA rank", "o_lora": "output LoRA rank",
    "o_groups": "output group count", "n_expert": "expert count",
    "n_expert_used": "experts used", "n_ff_exp": "expert feed-forward size",
    "n_shared": "shared expert count", "hc": "hyper-connection count",
}


@dataclass
class TargetInfo:
    path: str
    arch: str
    dims: Dims
    #: the Hugging Face folder (its tokenizer.json serves llama.cpp-layout drafts)
    hf_folder: str | None = None
    #: the GGUF, when the target is one (its tokenizer.* keys serve llama.cpp-layout drafts)
    gguf: GGUFFile | None = None
    nextn_layers: int = 0
    notes: list[str] = field(default_factory=list)


def _first(v):
    if isinstance(v, list):
        return v[0] if v else None
    return v


def gguf_dims(f: GGUFFile) -> tuple[str, Dims, int]:
    arch = f.architecture or ""
    md = f.metadata
    g = lambda k: md.get(f"{arch}.{k}")  # noqa: E731

    def as_int(v):
        v = _first(v)
        return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    n_embd = as_int(g("embedding_length"))
    n_head = as_int(g("attention.head_count"))
    nextn = as_int(g("nextn_predict_layers")) or 0
    blocks = as_int(g("block_count"))
    vocab = as_int(g("vocab_size"))
    if vocab is None and isinstance(md.get("tokenizer.ggml.tokens"), list):
        vocab = len(md["tokenizer.ggml.tokens"])
    emb = f.tensors.get("token_embd.weight")
    if vocab is None and emb is not None and len(emb.ggml_shape) == 2:
        vocab = int(emb.ggml_shape[1])
    head_dim = as_int(g("attention.key_length"))
    if head_dim is None and n_embd and n_head:
        head_dim = n_embd // n_head
    dims = Dims(
        n_embd=n_embd, n_vocab=vocab, n_layer=None if blocks is None else blocks - nextn,
        n_head=n_head, n_head_kv=as_int(g("attention.head_count_kv")) or n_head, head_dim=head_dim,
        n_ff=as_int(g("feed_forward_length")), rope_base=meta.number(f, f"{arch}.rope.freq_base"),
        rms_eps=meta.number(f, f"{arch}.attention.layer_norm_rms_epsilon"),
        context_length=as_int(g("context_length")),
        q_lora=as_int(g("attention.q_lora_rank")), o_lora=as_int(g("attention.output_lora_rank")),
        o_groups=as_int(g("attention.output_group_count")), n_expert=as_int(g("expert_count")),
        n_expert_used=as_int(g("expert_used_count")),
        n_ff_exp=as_int(g("expert_feed_forward_length")),
        n_shared=as_int(g("expert_shared_count")), hc=as_int(g("hyper_connection.count")))
    return arch, dims, nextn


def hf_config(folder: str) -> dict:
    """config.json of a Hugging Face folder, with a nested ``text_config`` merged in."""
    path = os.path.join(folder, "config.json")
    try:
        with open(path, encoding="utf-8") as fh:
            cfg = json.load(fh)
    except FileNotFoundError:
        raise UnreadableError(about(folder, "not a Hugging Face model directory (no config.json)")) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UnreadableError(about(path, f"config.json is not valid JSON: {e}")) from None
    if not isinstance(cfg, dict):
        raise UnreadableError(about(path, "config.json is not a JSON object"))
    if isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg, **cfg["text_config"]}
    return cfg


def _cfg_int(cfg: dict, *keys):
    for k in keys:
        v = cfg.get(k)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return None


def _cfg_float(cfg: dict, *keys):
    for k in keys:
        v = cfg.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return None


def hf_dims(cfg: dict) -> Dims:
    n_embd, n_head = _cfg_int(cfg, "hidden_size"), _cfg_int(cfg, "num_attention_heads")
    head_dim = _cfg_int(cfg, "head_dim")
    if head_dim is None and n_embd and n_head:
        head_dim = n_embd // n_head
    return Dims(
        n_embd=n_embd, n_vocab=_cfg_int(cfg, "vocab_size"),
        n_layer=_cfg_int(cfg, "num_hidden_layers"),
        n_head=n_head, n_head_kv=_cfg_int(cfg, "num_key_value_heads") or n_head, head_dim=head_dim,
        n_ff=_cfg_int(cfg, "intermediate_size"), rope_base=_cfg_float(cfg, "rope_theta"),
        rms_eps=_cfg_float(cfg, "rms_norm_eps"),
        context_length=_cfg_int(cfg, "max_position_embeddings"),
        q_lora=_cfg_int(cfg, "q_lora_rank"), o_lora=_cfg_int(cfg, "o_lora_rank"),
        o_groups=_cfg_int(cfg, "o_groups"), n_expert=_cfg_int(cfg, "n_routed_experts"),
        n_expert_used=_cfg_int(cfg, "num_experts_per_tok"),
        n_ff_exp=_cfg_int(cfg, "moe_intermediate_size"), n_shared=_cfg_int(cfg, "n_shared_experts"),
        hc=_cfg_int(cfg, "hc_mult"))


def open_target(path) -> TargetInfo:
    """A target model: a GGUF (any shard of a split set) or a Hugging Face directory."""
    path = os.fspath(path)
    if os.path.isdir(path):
        cfg = hf_config(path)
        archs = [a for a in (cfg.get("architectures") or []) if a in HF_ARCHITECTURES]
        if not archs:
            named = ", ".join(map(str, cfg.get("architectures") or [])) or "(none)"
            raise InvalidContentError(about(
                path, f"target architecture {named} is not supported (supported: "
                      f"{', '.join(HF_ARCHITECTURES)})"))
        dims = hf_dims(cfg)
        return TargetInfo(path, HF_ARCHITECTURES[archs[0]], dims, hf_folder=path,
                          nextn_layers=_cfg_int(cfg, "num_nextn_predict_layers") or 0)
    if not os.path.exists(path):
        raise UnreadableError(about(path, "no such file or directory"))
    f = open_gguf(path)
    arch, dims, nextn = gguf_dims(f)
    if not arch:
        raise InvalidContentError(about(path, "the target GGUF has no general.architecture"))
    return TargetInfo(path, arch, dims, gguf=f, nextn_layers=nextn)
