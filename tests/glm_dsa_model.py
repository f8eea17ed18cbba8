"""Synthetic glm-dsa (GLM-5 family) GGUFs: random weights, tiny shapes, llama.cpp's keys and
tensor names (MLA in the absorbed layout, the DSA lightning indexer, experts), written
deterministically from a seed (the llama.cpp fixtures were captured from these very files:
``weights_digest`` checks that a regenerated file still is one of them).

The indexer keeps ``top_k`` = 6 positions, so within a 12-token prompt and 16 generated
tokens most rows attend sparsely. Its key length is twice the rope dimensions, as llama.cpp
b10309 requires (it asserts on other ratios), and a power of two of at least 64 (the size of
its Hadamard rotation). The "shared" cases mark layer 1 as a shared indexer layer (GLM-5.2's
``attention.indexer.types``: it reuses layer 0's positions) and add YaRN rope scaling with a
log multiplier key that this llama.cpp's glm-dsa does not read.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tests.llamacpp_families import weights_digest
from tests.reference_model import byte_level_tokenizer_metadata, write_gguf

ARCH = "glm-dsa"


@dataclass(frozen=True)
class GlmDsaConfig:
    n_vocab: int = 300
    n_embd: int = 64
    n_layer: int = 3             # decoder blocks, not counting the NextN ones
    n_nextn: int = 0
    n_head: int = 4
    n_lora_q: int = 32
    n_lora_kv: int = 64
    n_nope: int = 32
    n_rot: int = 32
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
    idx_head: int = 8
    idx_dim: int = 64            # 2 * n_rot (llama.cpp b10309 needs it)
    idx_top_k: int = 6
    idx_types: tuple | None = None  # per layer: True full, False shared (None: key absent)
    k_norm: bool = True          # the indexer's key norm scale and bias
    yarn: bool = False
    yarn_factor: float = 4.0
    yarn_orig_ctx: int = 64
    yarn_log_mul: float = 0.0707
    rms_eps: float = 1e-6
    rope_base: float = 10000.0
    n_ctx: int = 256


SHARED = GlmDsaConfig(idx_types=(True, False, True), yarn=True)

#: the cases the llama.cpp fixtures hold: name -> (config, weight type of the matrices)
CASES = {
    "f32": (GlmDsaConfig(), "F32"),
    "q8_0": (GlmDsaConfig(), "Q8_0"),
    "f32-shared-yarn": (SHARED, "F32"),
    "q8_0-shared-yarn": (SHARED, "Q8_0"),
}


def metadata(cfg: GlmDsaConfig) -> dict:
    a = ARCH
    meta = {
        f"{a}.context_length": cfg.n_ctx, f"{a}.embedding_length": cfg.n_embd,
        f"{a}.block_count": cfg.n_layer + cfg.n_nextn, f"{a}.feed_forward_length": cfg.n_ff,
        f"{a}.attention.head_count": cfg.n_head, f"{a}.attention.head_count_kv": 1,
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
        f"{a}.attention.indexer.head_count": cfg.idx_head,
        f"{a}.attention.indexer.key_length": cfg.idx_dim,
        f"{a}.attention.indexer.top_k": cfg.idx_top_k,
    }
    if cfg.n_nextn:
        meta[f"{a}.nextn_predict_layers"] = cfg.n_nextn
    if cfg.idx_types is not None:
        meta[f"{a}.attention.indexer.types"] = [bool(t) for t in cfg.idx_types]
    if cfg.yarn:
        meta |= {f"{a}.rope.scaling.type": "yarn", f"{a}.rope.scaling.factor": cfg.yarn_factor,
                 f"{a}.rope.scaling.original_context_length": cfg.yarn_orig_ctx,
                 f"{a}.rope.scaling.yarn_log_multiplier": cfg.yarn_log_mul}
    return meta


def _full(cfg: GlmDsaConfig, il: int) -> bool:
    return il >= cfg.n_layer or cfg.idx_types is None or bool(cfg.idx_types[il])


def random_weights(cfg: GlmDsaConfig, rng) -> dict:
    """Random float32 weights with llama.cpp's names, sized so activations stay O(1)."""
    H, NH = cfg.n_embd, cfg.n_head
    NK = cfg.n_nope + cfg.n_rot
    E, F = cfg.n_expert, cfg.n_ff_exp
    D, IH = cfg.idx_dim, cfg.idx_head
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
        w[p + "attn_q_a.weight"] = mat(cfg.n_lora_q, H, scale=1.0)
        w[p + "attn_q_a_norm.weight"] = norm(cfg.n_lora_q)
        w[p + "attn_q_b.weight"] = mat(NH * NK, cfg.n_lora_q) * f(3.0)  # sharp attention
        w[p + "attn_kv_a_mqa.weight"] = mat(cfg.n_lora_kv + cfg.n_rot, H, scale=1.0)
        w[p + "attn_kv_a_norm.weight"] = norm(cfg.n_lora_kv)
        w[p + "attn_k_b.weight"] = mat(NH, cfg.n_lora_kv, cfg.n_nope, scale=1.5)
        w[p + "attn_v_b.weight"] = mat(NH, cfg.n_v, cfg.n_lora_kv)
        w[p + "attn_output.weight"] = mat(H, NH * cfg.n_v)
        if _full(cfg, il):
            w[p + "indexer.attn_q_b.weight"] = mat(IH * D, cfg.n_lora_q, scale=1.0)
            w[p + "indexer.attn_k.weight"] = mat(D, H, scale=1.0)
            if cfg.k_norm:
                w[p + "indexer.k_norm.weight"] = norm(D)
                w[p + "indexer.k_norm.bias"] = (0.1 * rng.standard_normal(D)).astype(f)
            w[p + "indexer.proj.weight"] = mat(IH, H, scale=1.0)
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


def write_model(path, cfg: GlmDsaConfig = GlmDsaConfig(), weight_type: str = "F32",
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


# --- a float64 indexer --------------------------------------------------------------------------


def rope_pairs(x, positions, base, n_rot):
    """llama.cpp's "norm" rope of the first n_rot dims of the last axis of x (k, ..., d), float64
    (no rope scaling)."""
    inv = base ** (-np.arange(0, n_rot, 2) / n_rot)
    ang = np.asarray(positions, np.float64)[:, None] * inv[None, :]
    shape = (len(ang),) + (1,) * (x.ndim - 2) + (n_rot // 2,)
    c, s = np.cos(ang).reshape(shape), np.sin(ang).reshape(shape)
    out = x.copy()
    a, b = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
    out[..., 0:n_rot:2] = a * c - b * s
    out[..., 1:n_rot:2] = a * s + b * c
    return out


def reference_indexer_scores(w: dict, cfg: GlmDsaConfig, prefix: str, h, qa):
    """The lightning indexer's scores (T, T) of the block under ``prefix`` (``blk.N.``) in float64,
    for rows at positions 0..T-1, from the layer's normed input ``h`` (T, n_embd) and its normed
    low-rank query ``qa`` (T, n_lora_q); score[t, j] for every j (mask j > t yourself). No
    Hadamard rotation: it is orthonormal, so it cannot change a dot product."""
    p = prefix
    T, IH, D = len(h), cfg.idx_head, cfg.idx_dim
    pos = np.arange(T)
    q = rope_pairs((qa @ w[p + "indexer.attn_q_b.weight"].T).reshape(T, IH, D), pos,
                   cfg.rope_base, cfg.n_rot)
    k = h @ w[p + "indexer.attn_k.weight"].T
    k = (k - k.mean(-1, keepdims=True)) / k.std(-1, keepdims=True)  # epsilon 0, as llama.cpp
    k = k * w.get(p + "indexer.k_norm.weight", 1.0) + w.get(p + "indexer.k_norm.bias", 0.0)
    k = rope_pairs(k[:, None], pos, cfg.rope_base, cfg.n_rot)[:, 0]
    wts = h @ w[p + "indexer.proj.weight"].T / np.sqrt(D * IH)
    return np.einsum("th,thj->tj", wts, np.maximum(np.einsum("thd,jd->thj", q, k), 0))


__all__ = ["ARCH", "CASES", "GlmDsaConfig", "metadata", "random_weights", "reference_indexer_scores",
           "rope_pairs", "weights_digest", "write_case", "write_model"]
