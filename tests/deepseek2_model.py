"""Synthetic deepseek2 (DeepSeek V2/V3, Kimi K2) GGUFs: random weights, tiny shapes, llama.cpp's
keys and tensor names in the absorbed MLA layout (attn_k_b / attn_v_b), written
deterministically from a seed (the llama.cpp fixtures were captured from these very files:
``weights_digest`` checks that a regenerated file still is one of them).

The default case is DeepSeek V3 in miniature: the low-rank q path, a leading dense layer,
routed experts scored by sigmoid with the selection bias and expert groups, normalised and
scaled weights, a shared expert. The "lite" cases are V2-Lite-like: one q matrix, softmax
routing without bias, and YaRN rope scaling with its attention factor.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tests.llamacpp_families import weights_digest
from tests.reference_model import byte_level_tokenizer_metadata, write_gguf

ARCH = "deepseek2"


@dataclass(frozen=True)
class Deepseek2Config:
    n_vocab: int = 300
    n_embd: int = 64
    n_layer: int = 3             # decoder blocks, not counting the NextN ones
    n_nextn: int = 0
    n_head: int = 4
    n_lora_q: int = 32           # 0: one attn_q matrix (V2-Lite)
    n_lora_kv: int = 32
    n_nope: int = 32
    n_rot: int = 16
    n_v: int = 32
    n_ff: int = 128              # the dense layers
    n_ff_exp: int = 32
    n_expert: int = 8
    n_expert_used: int = 3
    n_expert_shared: int = 1
    n_dense_lead: int = 1
    gating: int = 2              # llama.cpp's expert_gating_func: 1 softmax, 2 sigmoid
    selection_bias: bool = True
    normalize_weights: bool = True
    weights_scale: float = 2.5
    n_group: int = 4
    n_group_used: int = 2
    yarn: bool = False
    yarn_factor: float = 4.0
    yarn_orig_ctx: int = 64
    yarn_log_mul: float = 0.0707  # 0.1 * mscale_all_dim, as the converter writes it
    rms_eps: float = 1e-6
    rope_base: float = 10000.0
    n_ctx: int = 256


LITE = Deepseek2Config(n_lora_q=0, gating=1, selection_bias=False, normalize_weights=False,
                       weights_scale=0.0, n_group=0, n_group_used=0, n_expert_shared=2, yarn=True)

#: the cases the llama.cpp fixtures hold: name -> (config, weight type of the matrices)
CASES = {
    "f32": (Deepseek2Config(), "F32"),
    "q8_0": (Deepseek2Config(), "Q8_0"),
    "f32-lite-softmax-yarn": (LITE, "F32"),
    "q8_0-lite-softmax-yarn": (LITE, "Q8_0"),
}


def metadata(cfg: Deepseek2Config) -> dict:
    a = ARCH
    meta = {
        f"{a}.context_length": cfg.n_ctx, f"{a}.embedding_length": cfg.n_embd,
        f"{a}.block_count": cfg.n_layer + cfg.n_nextn, f"{a}.feed_forward_length": cfg.n_ff,
        f"{a}.attention.head_count": cfg.n_head, f"{a}.attention.head_count_kv": 1,
        # the absorbed layout: the cache row is [latent | rope part]
        f"{a}.attention.key_length": cfg.n_lora_kv + cfg.n_rot,
        f"{a}.attention.value_length": cfg.n_lora_kv,
        f"{a}.attention.key_length_mla": cfg.n_nope + cfg.n_rot,
        f"{a}.attention.value_length_mla": cfg.n_v,
        f"{a}.attention.q_lora_rank": cfg.n_lora_q, f"{a}.attention.kv_lora_rank": cfg.n_lora_kv,
        f"{a}.attention.layer_norm_rms_epsilon": cfg.rms_eps, f"{a}.rope.freq_base": cfg.rope_base,
        f"{a}.rope.dimension_count": cfg.n_rot, f"{a}.vocab_size": cfg.n_vocab,
        f"{a}.expert_count": cfg.n_expert, f"{a}.expert_used_count": cfg.n_expert_used,
        f"{a}.expert_shared_count": cfg.n_expert_shared,
        f"{a}.expert_feed_forward_length": cfg.n_ff_exp,
        f"{a}.leading_dense_block_count": cfg.n_dense_lead,
        f"{a}.expert_gating_func": cfg.gating,
        f"{a}.expert_weights_norm": cfg.normalize_weights,
        f"{a}.expert_weights_scale": float(cfg.weights_scale),
    }
    if cfg.n_nextn:
        meta[f"{a}.nextn_predict_layers"] = cfg.n_nextn
    if cfg.n_group:
        meta[f"{a}.expert_group_count"] = cfg.n_group
        meta[f"{a}.expert_group_used_count"] = cfg.n_group_used
    if cfg.yarn:
        meta |= {f"{a}.rope.scaling.type": "yarn", f"{a}.rope.scaling.factor": cfg.yarn_factor,
                 f"{a}.rope.scaling.original_context_length": cfg.yarn_orig_ctx,
                 f"{a}.rope.scaling.yarn_log_multiplier": cfg.yarn_log_mul}
    return meta


def random_weights(cfg: Deepseek2Config, rng) -> dict:
    """Random float32 weights with llama.cpp's names, sized so activations stay O(1)."""
    H, NH = cfg.n_embd, cfg.n_head
    NK = cfg.n_nope + cfg.n_rot
    E, F = cfg.n_expert, cfg.n_ff_exp
    f = np.float32

    def mat(*shape, scale=0.5):
        return (rng.standard_normal(shape) * scale / np.sqrt(shape[-1])).astype(f)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(f)

    w = {"token_embd.weight": rng.standard_normal((cfg.n_vocab, H)).astype(f),
         "output_norm.weight": norm(H), "output.weight": mat(cfg.n_vocab, H) * f(4.0)}
    for il in range(cfg.n_layer + cfg.n_nextn):
        p = f"blk.{il}."
        w[p + "attn_norm.weight"] = norm(H)
        if cfg.n_lora_q:
            w[p + "attn_q_a.weight"] = mat(cfg.n_lora_q, H, scale=1.0)
            w[p + "attn_q_a_norm.weight"] = norm(cfg.n_lora_q)
            w[p + "attn_q_b.weight"] = mat(NH * NK, cfg.n_lora_q) * f(3.0)  # sharp attention
        else:
            w[p + "attn_q.weight"] = mat(NH * NK, H) * f(3.0)
        w[p + "attn_kv_a_mqa.weight"] = mat(cfg.n_lora_kv + cfg.n_rot, H, scale=1.0)
        w[p + "attn_kv_a_norm.weight"] = norm(cfg.n_lora_kv)
        w[p + "attn_k_b.weight"] = mat(NH, cfg.n_lora_kv, cfg.n_nope, scale=1.5)
        w[p + "attn_v_b.weight"] = mat(NH, cfg.n_v, cfg.n_lora_kv)
        w[p + "attn_output.weight"] = mat(H, NH * cfg.n_v)
        w[p + "ffn_norm.weight"] = norm(H)
        if il < cfg.n_dense_lead:
            w[p + "ffn_gate.weight"] = mat(cfg.n_ff, H)
            w[p + "ffn_up.weight"] = mat(cfg.n_ff, H)
            w[p + "ffn_down.weight"] = mat(H, cfg.n_ff)
        else:
            w[p + "ffn_gate_inp.weight"] = mat(E, H, scale=2.0)  # routing that differs by token
            if cfg.selection_bias:
                w[p + "exp_probs_b.bias"] = (0.05 * rng.standard_normal(E)).astype(f)
            w[p + "ffn_gate_exps.weight"] = mat(E, F, H)
            w[p + "ffn_up_exps.weight"] = mat(E, F, H)
            w[p + "ffn_down_exps.weight"] = mat(E, H, F)
            if cfg.n_expert_shared:
                S = F * cfg.n_expert_shared
                w[p + "ffn_gate_shexp.weight"] = mat(S, H)
                w[p + "ffn_up_shexp.weight"] = mat(S, H)
                w[p + "ffn_down_shexp.weight"] = mat(H, S)
        if il >= cfg.n_layer:  # the NextN layer's own tensors
            w[p + "nextn.eh_proj.weight"] = mat(H, 2 * H)
            w[p + "nextn.enorm.weight"] = norm(H)
            w[p + "nextn.hnorm.weight"] = norm(H)
            w[p + "nextn.shared_head_norm.weight"] = norm(H)
    return w


def write_model(path, cfg: Deepseek2Config = Deepseek2Config(), weight_type: str = "F32",
                seed: int = 0, *, drop=(), override=None, extra_metadata=None,
                drop_metadata=()) -> dict:
    """Write the model; returns the stored (dequantized) weights. Matrices (2-D and the 3-D
    experts and per-head tensors) are ``weight_type`` except the router, which llama.cpp's
    quantizer keeps F32. For bad files: ``drop`` tensor names to leave out, ``override``
    name -> array to write instead, ``extra_metadata`` keys to write over the config's,
    ``drop_metadata`` keys to leave out."""
    w = random_weights(cfg, np.random.default_rng(seed))
    for name in drop:
        del w[name]
    w.update(override or {})
    types = {n: ("F32" if a.ndim == 1 or "ffn_gate_inp" in n else weight_type) for n, a in w.items()}
    meta = metadata(cfg) | byte_level_tokenizer_metadata(cfg.n_vocab) | (extra_metadata or {})
    meta = {k: v for k, v in meta.items() if k not in drop_metadata}
    return write_gguf(path, ARCH, meta, w, types)


def write_case(path, case: str, seed: int = 0) -> dict:
    cfg, weight_type = CASES[case]
    return write_model(path, cfg, weight_type, seed)


__all__ = ["ARCH", "CASES", "Deepseek2Config", "metadata", "random_weights", "weights_digest",
           "write_case", "write_model"]
