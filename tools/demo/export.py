"""Stage 7: write ds4tools/data/demo (f16 safetensors, Hugging Face / DeepSpec configs, card)."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from .common import SHIP_DTYPE, Plan
from .corpus import MASK, SPECIALS
from .model import DraftShape, TargetShape


def target_config(s: TargetShape) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": s.vocab_size,
        "hidden_size": s.hidden_size,
        "intermediate_size": s.intermediate_size,
        "num_hidden_layers": s.num_hidden_layers,
        "num_attention_heads": s.num_attention_heads,
        "num_key_value_heads": s.num_key_value_heads,
        "head_dim": s.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": s.max_position_embeddings,
        "rms_norm_eps": s.rms_norm_eps,
        "rope_theta": s.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": s.num_hidden_layers,
        "layer_types": ["full_attention"] * s.num_hidden_layers,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": SPECIALS.index("<|endoftext|>"),
        "eos_token_id": SPECIALS.index("<|endoftext|>"),
        "torch_dtype": "float16",
        "num_nextn_predict_layers": 1,
    }


def dspark_config(s: TargetShape, d: DraftShape, num_anchors: int) -> dict:
    """DeepSpec's build_draft_config: a copy of the target config plus the DSpark fields."""
    cfg = target_config(s)
    del cfg["num_nextn_predict_layers"]  # the draft has no NextN layer of its own
    cfg.update({
        "architectures": ["Qwen3DSparkModel"],
        "num_target_layers": s.num_hidden_layers,
        "num_hidden_layers": d.num_draft_layers,
        "max_window_layers": d.num_draft_layers,
        "layer_types": ["full_attention"] * d.num_draft_layers,
        "block_size": d.block_size,
        "tie_word_embeddings": False,
        "mask_token_id": SPECIALS.index(MASK),
        "target_layer_ids": list(d.target_layer_ids),
        "num_anchors": num_anchors,
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
        "markov_rank": d.markov_rank,
        "markov_head_type": "vanilla",
    })
    return cfg


def _shipped(state: dict) -> dict:
    return {k: v.detach().to(SHIP_DTYPE).contiguous() for k, v in state.items()}


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _write_safetensors(path: Path, tensors: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, path)


def write_target_folder(work: Path, folder: Path) -> None:
    """The shipped target as a Hugging Face folder (what ``target/`` holds): f16 safetensors,
    config, generation config, tokenizer."""
    folder.mkdir(parents=True, exist_ok=True)
    _write_safetensors(folder / "model.safetensors", _shipped(torch.load(work / "target_shipped.pt")))
    _write_text(folder / "config.json", json.dumps(target_config(TargetShape()), indent=2) + "\n")
    _write_text(folder / "generation_config.json", json.dumps(
        {"bos_token_id": 0, "eos_token_id": 0, "do_sample": False}, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(work / name, folder / (name + ".tmp"))
        os.replace(folder / (name + ".tmp"), folder / name)


def export(plan: Plan, work: Path, out: Path, card_text: str, metrics: dict) -> None:
    s, d = TargetShape(), DraftShape()
    (out / "dspark").mkdir(parents=True, exist_ok=True)
    write_target_folder(work, out / "target")
    draft_state = torch.load(work / "dspark_shipped.pt")
    _write_safetensors(out / "dspark" / "model.safetensors", _shipped(draft_state))
    # DeepSpec's num_anchors: the blocks a training window holds (distill's --anchors)
    num_anchors = metrics["dspark"]["options"]["anchors"]
    _write_text(out / "dspark" / "config.json", json.dumps(dspark_config(s, d, num_anchors), indent=2) + "\n")
    for name in ("heldout_files.txt", "prompts.json"):
        shutil.copyfile(work / name, out / (name + ".tmp"))
        os.replace(out / (name + ".tmp"), out / name)
    _write_text(out / "metrics.json", json.dumps(metrics, indent=2) + "\n")
    _write_text(out / "README.md", card_text)
