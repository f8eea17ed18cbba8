"""Synthetic glm4moe (GLM-4.5 family) GGUFs: random weights, tiny shapes, llama.cpp's keys and
tensor names, written deterministically from a seed (the llama.cpp fixtures were captured from
these very files: ``weights_digest`` checks that a regenerated file still is one of them).

The default case has what the family has: a leading dense layer, routed experts (more than
the top-k) scored by sigmoid with the selection bias, normalised and scaled weights, a shared
expert, q/k/v biases, rope over half the head, and one NextN layer after the decoder blocks.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tests.llamacpp_families import weights_digest  # noqa: F401 (part of this module's interface)
from tests.reference_model import byte_level_tokenizer_metadata, write_gguf

ARCH = "glm4moe"


@dataclass(frozen=True)
class Glm4MoeConfig:
    n_vocab: int = 300
    n_embd: int = 64
    n_layer: int = 3             # decoder blocks, not counting the NextN ones
    n_nextn: int = 1
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 32
    n_rot: int = 16              # GLM-4.5: half the head rotates
    n_ff: int = 128              # the dense layers
    n_ff_exp: int = 32
    n_expert: int = 8
    n_expert_used: int = 3
    n_expert_shared: int = 1
    n_dense_lead: int = 1
    gating: int = 2              # llama.cpp's expert_gating_func: 1 softmax, 2 sigmoid
    normalize_weights: bool = True
    weights_scale: float = 2.5
    n_group: int = 0
    n_group_used: int = 0
    qk_norm: bool = False
    biases: bool = True
    rms_eps: float = 1e-5
    rope_base: float = 10000.0
    n_ctx: int = 256


#: the cases the llama.cpp fixtures hold: name -> (config, weight type of the matrices)
CASES = {
    "f32": (Glm4MoeConfig(), "F32"),
    "q8_0": (Glm4MoeConfig(), "Q8_0"),
    # the other routing options llama.cpp's MoE block has, on the same architecture
    "f32-softmax-groups": (Glm4MoeConfig(gating=1, normalize_weights=False, weights_scale=0.0,
                                         n_group=4, n_group_used=2, n_expert_shared=2,
                                         qk_norm=True, n_nextn=0), "F32"),
}


def metadata(cfg: Glm4MoeConfig) -> dict:
    a = ARCH
    meta = {
        f"{a}.context_length": cfg.n_ctx, f"{a}.embedding_length": cfg.n_embd,
        f"{a}.block_count": cfg.n_layer + cfg.n_nextn, f"{a}.feed_forward_length": cfg.n_ff,
        f"{a}.attention.head_count": cfg.n_head, f"{a}.attention.head_count_kv": cfg.n_head_kv,
        f"{a}.attention.key_length": cfg.head_dim, f"{a}.attention.value_length": cfg.head_dim,
        f"{a}.attention.layer_norm_rms_epsilon": cfg.rms_eps, f"{a}.rope.freq_base": cfg.rope_base,
        f"{a}.rope.dimension_count": cfg.n_rot, f"{a}.vocab_size": cfg.n_vocab,
        f"{a}.expert_count": cfg.n_expert, f"{a}.expert_used_count": cfg.n_expert_used,
        f"{a}.expert_shared_count": cfg.n_expert_shared,
        f"{a}.expert_feed_forward_length": cfg.n_ff_exp,
        f"{a}.leading_dense_block_count": cfg.n_dense_lead,
        f"{a}.expert_gating_func": cfg.gating,
        f"{a}.expert_weights_norm": cfg.normalize_weights,
        f"{a}.expert_weights_scale": float(cfg.weights_scale),
        f"{a}.nextn_predict_layers": cfg.n_nextn,
    }
    if cfg.n_group:
        meta[f"{a}.expert_group_count"] = cfg.n_group
        meta[f"{a}.expert_group_used_count"] = cfg.n_group_used
    return meta


def random_weights(cfg: Glm4MoeConfig, rng) -> dict:
    """Random float32 weights with llama.cpp's names, sized so activations stay O(1)."""
    H, Q, KV = cfg.n_embd, cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
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
        w[p + "attn_q.weight"] = mat(Q, H) * f(3.0)  # sharper attention than uniform
        w[p + "attn_k.weight"] = mat(KV, H) * f(3.0)
        w[p + "attn_v.weight"] = mat(KV, H)
        w[p + "attn_output.weight"] = mat(H, Q)
        if cfg.biases:
            w[p + "attn_q.bias"] = (0.1 * rng.standard_normal(Q)).astype(f)
            w[p + "attn_k.bias"] = (0.1 * rng.standard_normal(KV)).astype(f)
            w[p + "attn_v.bias"] = (0.1 * rng.standard_normal(KV)).astype(f)
        if cfg.qk_norm:
            w[p + "attn_q_norm.weight"] = norm(cfg.head_dim)
            w[p + "attn_k_norm.weight"] = norm(cfg.head_dim)
        w[p + "post_attention_norm.weight"] = norm(H)
        if il < cfg.n_dense_lead:
            w[p + "ffn_gate.weight"] = mat(cfg.n_ff, H)
            w[p + "ffn_up.weight"] = mat(cfg.n_ff, H)
            w[p + "ffn_down.weight"] = mat(H, cfg.n_ff)
        else:
            w[p + "ffn_gate_inp.weight"] = mat(E, H, scale=2.0)  # routing that differs by token
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


def write_model(path, cfg: Glm4MoeConfig = Glm4MoeConfig(), weight_type: str = "F32", seed: int = 0,
                *, drop=(), override=None, extra_metadata=None) -> dict:
    """Write the model; returns the stored (dequantized) weights. Matrices (2-D and the 3-D
    experts) are ``weight_type`` except the router, which llama.cpp's quantizer keeps F32.
    For bad files: ``drop`` tensor names to leave out, ``override`` name -> array to write
    instead, ``extra_metadata`` keys to write over the config's."""
    w = random_weights(cfg, np.random.default_rng(seed))
    for name in drop:
        del w[name]
    w.update(override or {})
    types = {n: ("F32" if a.ndim == 1 or "ffn_gate_inp" in n else weight_type) for n, a in w.items()}
    meta = metadata(cfg) | byte_level_tokenizer_metadata(cfg.n_vocab) | (extra_metadata or {})
    return write_gguf(path, ARCH, meta, w, types)


def write_case(path, case: str, seed: int = 0) -> dict:
    cfg, weight_type = CASES[case]
    return write_model(path, cfg, weight_type, seed)


__all__ = ["ARCH", "CASES", "Glm4MoeConfig", "metadata", "random_weights",
           "weights_digest", "write_case", "write_model"]
