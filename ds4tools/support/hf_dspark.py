"""Read a DeepSpec ``Qwen3DSparkModel`` checkpoint (a DSpark draft for a Qwen3 / Llama target).

config.json is a copy of the target's with the draft's fields: ``architectures`` =
["Qwen3DSparkModel"], ``num_hidden_layers`` (draft layers), ``block_size``,
``target_layer_ids`` (which target layers' *outputs* feed ``fc``; -1 is the embedding),
``num_target_layers``, ``mask_token_id``, ``markov_rank``, ``markov_head_type`` (only
"vanilla": first-order Markov bias), ``enable_confidence_head``.

Tensors (optionally under ``model.``): ``fc.weight`` [H, n_targets * H], ``hidden_norm.weight``,
``layers.i.{input_layernorm, self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm,
post_attention_layernorm, mlp.{gate,up,down}_proj}.weight``, ``norm.weight``,
``markov_head.markov_w1.weight`` [V, r] (an embedding), ``markov_head.markov_w2.weight`` [V, r],
``confidence_head.proj.weight`` [1, H + r] and ``.bias`` [1]. The embedding and LM head are
the target's (DeepSpec copies and freezes them); copies in the checkpoint are left out.
"""
from __future__ import annotations

from ..checkpoint import HFCheckpoint, HFTensor
from ..errors import InvalidContentError, about
from .target import Dims, hf_dims

__all__ = ["DeepSpecDraft", "is_deepspec_config", "LAYER_NAMES"]

#: llama.cpp per-layer name -> DeepSpec name under layers.i.
LAYER_NAMES = {
    "attn_norm": "input_layernorm.weight", "attn_q": "self_attn.q_proj.weight",
    "attn_k": "self_attn.k_proj.weight", "attn_v": "self_attn.v_proj.weight",
    "attn_output": "self_attn.o_proj.weight", "attn_q_norm": "self_attn.q_norm.weight",
    "attn_k_norm": "self_attn.k_norm.weight", "ffn_norm": "post_attention_layernorm.weight",
    "ffn_gate": "mlp.gate_proj.weight", "ffn_up": "mlp.up_proj.weight",
    "ffn_down": "mlp.down_proj.weight",
}
#: DeepSpec names that are copies of the target's (not stored in the draft GGUF)
TARGET_COPIES = ("embed_tokens.weight", "lm_head.weight")


def is_deepspec_config(cfg: dict) -> bool:
    return "Qwen3DSparkModel" in (cfg.get("architectures") or [])


class DeepSpecDraft:
    def __init__(self, folder):
        self.ckpt = HFCheckpoint(folder)
        self.folder = self.ckpt.folder
        cfg = self.ckpt.config
        self.config = cfg
        where = self.ckpt.file("config.json")
        if not is_deepspec_config(cfg):
            raise InvalidContentError(about(where, f"not a DeepSpec Qwen3DSparkModel draft "
                                                   f"(architectures {cfg.get('architectures')})"))
        kind = cfg.get("markov_head_type", "vanilla")
        if kind != "vanilla":
            raise InvalidContentError(about(where, f"markov_head_type {kind!r} is not supported: "
                                                   f"llama.cpp's DSpark head is the vanilla one"))
        self.tensors: dict[str, HFTensor] = {}
        for name, t in self.ckpt.tensors.items():
            short = name[len("model."):] if name.startswith("model.") else name
            self.tensors[short] = t
        self.dims: Dims = hf_dims(cfg)
        self.n_layer = int(cfg.get("num_hidden_layers") or 0)
        self.block_size = _int(cfg, "block_size", where)
        ids = cfg.get("target_layer_ids")
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
            raise InvalidContentError(about(where, "config.json lacks a target_layer_ids list"))
        self.target_layer_ids = [int(i) for i in ids]
        self.num_target_layers = cfg.get("num_target_layers")
        self.mask_token_id = cfg.get("mask_token_id")
        w1 = self.tensors.get("markov_head.markov_w1.weight")
        if w1 is None:
            raise InvalidContentError(about(self.folder, "the checkpoint has no "
                                                         "markov_head.markov_w1.weight: not a DSpark draft"))
        self.markov_rank = int(w1.shape[1])
        if cfg.get("markov_rank") not in (None, self.markov_rank):
            raise InvalidContentError(about(where, f"markov_rank is {cfg.get('markov_rank')} but "
                                                   f"markov_w1 has rank {self.markov_rank}"))
        self.has_confidence = "confidence_head.proj.weight" in self.tensors
        self.skipped = [n for n in self.tensors if n in TARGET_COPIES]

    @property
    def paths(self) -> list[str]:
        return self.ckpt.paths

    def get(self, name: str) -> HFTensor:
        t = self.tensors.get(name)
        if t is None:
            raise InvalidContentError(about(self.folder, f"tensor '{name}' is missing from the draft"))
        return t

    def unknown_tensors(self) -> list[str]:
        known = {"fc.weight", "hidden_norm.weight", "norm.weight", "markov_head.markov_w1.weight",
                 "markov_head.markov_w2.weight", "confidence_head.proj.weight",
                 "confidence_head.proj.bias", *TARGET_COPIES}
        for i in range(self.n_layer):
            known.update(f"layers.{i}.{v}" for v in LAYER_NAMES.values())
        return [n for n in self.tensors if n not in known and not n.endswith("rotary_emb.inv_freq")]


def _int(cfg: dict, key: str, where: str) -> int:
    v = cfg.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise InvalidContentError(about(where, f"config.json lacks a positive '{key}'"))
    return v
