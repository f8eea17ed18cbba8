"""Synthetic deepseek4 (DeepSeek V4 Flash) GGUFs: random weights, tiny shapes, llama.cpp's keys and
tensor names, written deterministically from a seed (the llama.cpp fixtures were captured from
these very files: ``weights_digest`` checks that a regenerated file still is one of them).

What the default case exercises: four hyper-connection streams (llama.cpp asserts hc = 4) with
Sinkhorn mixing and the head's collapse, attention sinks, the q low-rank path, the one shared
KV head with its norm, the grouped low-rank output projection, an 8-token sliding window, the
three attention kinds by ``compress_ratios`` = (0, 4, 128, 4): raw window only; window plus
overlapping ratio-4 compressed entries chosen by the indexer (top 3); window plus every
ratio-128 compressed entry. The 132-token prompt lets the indexer choose among up to 33 entries
and completes one ratio-128 block. Layer 0 is hash-routed (token id -> experts), the others
score by sqrt(softplus) with the selection bias; a shared expert; the SwiGLU clamp; YaRN on the
compressed layers' rope. The indexer key length is 64 (llama.cpp's Hadamard rotation needs a
multiple of 64); the attention head (32) differs from it, so only the indexer is rotated.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tests.llamacpp_families import weights_digest
from tests.reference_model import _add_key, byte_level_tokenizer_metadata

ARCH = "deepseek4"

#: prompt length of the llama.cpp fixtures (tools/capture_llamacpp_fixtures.py reads it)
N_PROMPT = 132


@dataclass(frozen=True)
class Deepseek4Config:
    n_vocab: int = 300
    n_embd: int = 64
    n_layer: int = 4               # decoder blocks, not counting the MTP one
    n_nextn: int = 0
    n_head: int = 4
    head_dim: int = 32             # the shared KV head's width, also the query heads'
    n_rot: int = 16                # the last n_rot dims of a head are rotated
    n_lora_q: int = 32
    o_groups: int = 2
    o_lora_rank: int = 16
    n_swa: int = 8
    compress_ratios: tuple = (0, 4, 128, 4)
    idx_head: int = 16             # many heads: a score of exactly 0 (every head negative,
                                   # a tie llama.cpp breaks its own way) stays improbable
    idx_dim: int = 64
    idx_top_k: int = 3
    hc: int = 4
    sinkhorn_iters: int = 3
    hc_eps: float = 1e-6
    n_hash_layers: int = 1
    n_ff_exp: int = 32
    n_expert: int = 8
    n_expert_used: int = 2
    n_expert_shared: int = 1
    normalize_weights: bool = True
    weights_scale: float = 1.5
    swiglu_clamp: float = 0.7      # the routed experts' (and, absent its own key, the shared's)
    yarn: bool = True
    yarn_factor: float = 4.0
    yarn_orig_ctx: int = 64
    rms_eps: float = 1e-6
    rope_base: float = 10000.0
    compress_rope_base: float = 160000.0
    n_ctx: int = 256


#: the cases the llama.cpp fixtures hold: name -> (config, weight type of the matrices)
CASES = {
    "f32": (Deepseek4Config(), "F32"),
    "q8_0": (Deepseek4Config(), "Q8_0"),
}


def metadata(cfg: Deepseek4Config) -> dict:
    a = ARCH
    n_all = cfg.n_layer + cfg.n_nextn
    ratios = list(cfg.compress_ratios) + [0] * cfg.n_nextn
    meta = {
        f"{a}.context_length": cfg.n_ctx, f"{a}.embedding_length": cfg.n_embd,
        f"{a}.block_count": n_all, f"{a}.feed_forward_length": cfg.n_ff_exp,
        f"{a}.attention.head_count": cfg.n_head, f"{a}.attention.head_count_kv": 1,
        f"{a}.attention.key_length": cfg.head_dim, f"{a}.attention.value_length": cfg.head_dim,
        f"{a}.attention.q_lora_rank": cfg.n_lora_q,
        f"{a}.attention.layer_norm_rms_epsilon": cfg.rms_eps,
        f"{a}.attention.sliding_window": cfg.n_swa,
        f"{a}.attention.output_group_count": cfg.o_groups,
        f"{a}.attention.output_lora_rank": cfg.o_lora_rank,
        f"{a}.attention.compress_rope_freq_base": cfg.compress_rope_base,
        f"{a}.attention.compress_ratios": [int(r) for r in ratios],
        f"{a}.attention.indexer.head_count": cfg.idx_head,
        f"{a}.attention.indexer.key_length": cfg.idx_dim,
        f"{a}.attention.indexer.top_k": cfg.idx_top_k,
        f"{a}.rope.freq_base": cfg.rope_base, f"{a}.rope.dimension_count": cfg.n_rot,
        f"{a}.vocab_size": cfg.n_vocab,
        f"{a}.expert_count": cfg.n_expert, f"{a}.expert_used_count": cfg.n_expert_used,
        f"{a}.expert_shared_count": cfg.n_expert_shared,
        f"{a}.expert_feed_forward_length": cfg.n_ff_exp,
        f"{a}.expert_gating_func": 4,  # sqrt(softplus)
        f"{a}.expert_weights_norm": cfg.normalize_weights,
        f"{a}.expert_weights_scale": float(cfg.weights_scale),
        f"{a}.swiglu_clamp_exp": [float(cfg.swiglu_clamp)] * n_all,
        f"{a}.hyper_connection.count": cfg.hc,
        f"{a}.hyper_connection.sinkhorn_iterations": cfg.sinkhorn_iters,
        f"{a}.hyper_connection.epsilon": float(cfg.hc_eps),
        f"{a}.hash_layer_count": cfg.n_hash_layers,
    }
    if cfg.n_nextn:
        meta[f"{a}.nextn_predict_layers"] = cfg.n_nextn
    if cfg.yarn:
        meta |= {f"{a}.rope.scaling.type": "yarn", f"{a}.rope.scaling.factor": cfg.yarn_factor,
                 f"{a}.rope.scaling.original_context_length": cfg.yarn_orig_ctx}
    return meta


def random_weights(cfg: Deepseek4Config, rng) -> dict:
    """Random weights with llama.cpp's names (float32, int32 for the hash table), sized so
    activations stay O(1)."""
    H, NH, D = cfg.n_embd, cfg.n_head, cfg.head_dim
    HC = cfg.hc
    mix = (2 + HC) * HC
    E, F = cfg.n_expert, cfg.n_ff_exp
    f = np.float32

    def mat(*shape, scale=0.5):
        return (rng.standard_normal(shape) * scale / np.sqrt(shape[-1])).astype(f)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(f)

    def small(*shape, scale=0.3):
        return (scale * rng.standard_normal(shape)).astype(f)

    w = {"token_embd.weight": rng.standard_normal((cfg.n_vocab, H)).astype(f),
         "output_norm.weight": norm(H), "output.weight": mat(cfg.n_vocab, H) * f(4.0),
         "output_hc_fn.weight": mat(HC, HC * H, scale=1.0),
         "output_hc_base.weight": small(HC), "output_hc_scale.weight": (1.0 + small(1)).astype(f)}
    for il in range(cfg.n_layer + cfg.n_nextn):
        p = f"blk.{il}."
        ratio = cfg.compress_ratios[il] if il < cfg.n_layer else 0
        w[p + "attn_norm.weight"] = norm(H)
        w[p + "attn_sinks.weight"] = small(NH, scale=1.0)
        w[p + "attn_q_a.weight"] = mat(cfg.n_lora_q, H, scale=1.0)
        w[p + "attn_q_a_norm.weight"] = norm(cfg.n_lora_q)
        w[p + "attn_q_b.weight"] = mat(NH * D, cfg.n_lora_q, scale=1.0)
        w[p + "attn_kv.weight"] = mat(D, H, scale=1.0)
        w[p + "attn_kv_a_norm.weight"] = norm(D)
        # (o_groups * o_lora_rank, n_head * D / o_groups): group g's rows g*rank..(g+1)*rank-1
        w[p + "attn_output_a.weight"] = mat(cfg.o_groups * cfg.o_lora_rank, NH * D // cfg.o_groups,
                                            scale=1.0)
        w[p + "attn_output_b.weight"] = mat(H, cfg.o_groups * cfg.o_lora_rank)
        for kind in ("attn", "ffn"):
            w[p + f"hc_{kind}_fn.weight"] = mat(mix, HC * H, scale=1.0)
            w[p + f"hc_{kind}_base.weight"] = small(mix)
            w[p + f"hc_{kind}_scale.weight"] = (1.0 + small(3)).astype(f)
        if ratio:
            coff = 2 if ratio == 4 else 1
            w[p + "attn_compressor_kv.weight"] = mat(coff * D, H, scale=1.0)
            w[p + "attn_compressor_gate.weight"] = mat(coff * D, H, scale=2.0)
            w[p + "attn_compressor_ape.weight"] = small(ratio, coff * D, scale=0.5)
            w[p + "attn_compressor_norm.weight"] = norm(D)
            if ratio == 4:
                I, IH = cfg.idx_dim, cfg.idx_head
                w[p + "indexer.proj.weight"] = mat(IH, H, scale=1.0)
                w[p + "indexer.attn_q_b.weight"] = mat(IH * I, cfg.n_lora_q, scale=1.0)
                w[p + "indexer_compressor_kv.weight"] = mat(2 * I, H, scale=1.0)
                w[p + "indexer_compressor_gate.weight"] = mat(2 * I, H, scale=2.0)
                w[p + "indexer_compressor_ape.weight"] = small(ratio, 2 * I, scale=0.5)
                w[p + "indexer_compressor_norm.weight"] = norm(I)
        w[p + "ffn_norm.weight"] = norm(H)
        w[p + "ffn_gate_inp.weight"] = mat(E, H, scale=2.0)
        if il < cfg.n_hash_layers:
            # token id -> its experts (distinct per token, like the real table)
            w[p + "ffn_gate_tid2eid.weight"] = np.stack(
                [rng.permutation(E)[:cfg.n_expert_used] for _ in range(cfg.n_vocab)]).astype(np.int32)
        else:
            w[p + "exp_probs_b.bias"] = small(E, scale=0.05)
        w[p + "ffn_gate_exps.weight"] = mat(E, F, H, scale=1.0)
        w[p + "ffn_up_exps.weight"] = mat(E, F, H, scale=1.0)
        w[p + "ffn_down_exps.weight"] = mat(E, H, F)
        S = F * cfg.n_expert_shared
        w[p + "ffn_gate_shexp.weight"] = mat(S, H, scale=1.0)
        w[p + "ffn_up_shexp.weight"] = mat(S, H, scale=1.0)
        w[p + "ffn_down_shexp.weight"] = mat(H, S)
        if il >= cfg.n_layer:  # the MTP block's own tensors
            w[p + "nextn.eh_proj.weight"] = mat(H, 2 * H)
            w[p + "nextn.enorm.weight"] = norm(H)
            w[p + "nextn.hnorm.weight"] = norm(H)
            w[p + "nextn.shared_head_norm.weight"] = norm(H)
    return w


#: float matrices llama.cpp's quantizer leaves in float (and ds4's files keep F16 / F32)
_FLOAT_KEPT = ("ffn_gate_inp", "hc_", "output_hc_", "_ape.")


def _type_of(name: str, a: np.ndarray, weight_type: str, kept_type: str) -> str:
    if a.dtype == np.int32:
        return "I32"
    if a.ndim == 1:
        return "F32"
    if any(s in name for s in _FLOAT_KEPT):
        return kept_type
    return weight_type


def write_gguf_i32(path, metadata: dict, tensors: dict, types: dict) -> dict:
    """Like tests.reference_model.write_gguf, with int32 tensors stored as I32."""
    import gguf
    from ds4tools import formats
    writer = gguf.GGUFWriter(str(path), ARCH)
    for k, v in metadata.items():
        if k != "general.architecture":
            _add_key(writer, k, v)
    stored = {}
    for name, w in tensors.items():
        t = types[name]
        if t == "I32":
            stored[name] = np.ascontiguousarray(w, np.int32)
            writer.add_tensor(name, stored[name])
            continue
        w = np.ascontiguousarray(w, np.float32)
        fmt = formats.get_format(t)
        raw = formats.quantize(w, fmt)
        stored[name] = formats.dequantize(raw, fmt, w.shape)
        if fmt.name == "F32":
            writer.add_tensor(name, w)
        else:
            writer.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType(int(fmt.ggml_type)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


def write_model(path, cfg: Deepseek4Config = Deepseek4Config(), weight_type: str = "F32",
                seed: int = 0, *, drop=(), override=None, extra_metadata=None,
                drop_metadata=(), kept_type: str = "F32") -> dict:
    """Write the model; returns the stored (dequantized) weights. ``kept_type``: the type of the
    router, hyper-connection and position-embedding matrices (ds4's files: F16). For bad
    files: ``drop`` tensor names to leave out, ``override`` name -> array to write instead,
    ``extra_metadata`` keys to write over the config's, ``drop_metadata`` keys to leave out."""
    w = random_weights(cfg, np.random.default_rng(seed))
    for name in drop:
        del w[name]
    w.update(override or {})
    types = {n: _type_of(n, np.asarray(a), weight_type, kept_type) for n, a in w.items()}
    meta = metadata(cfg) | byte_level_tokenizer_metadata(cfg.n_vocab) | (extra_metadata or {})
    meta = {k: v for k, v in meta.items() if k not in drop_metadata}
    return write_gguf_i32(path, meta, w, types)


def write_case(path, case: str, seed: int = 0) -> dict:
    cfg, weight_type = CASES[case]
    return write_model(path, cfg, weight_type, seed)


__all__ = ["ARCH", "CASES", "N_PROMPT", "Deepseek4Config", "metadata", "random_weights",
           "weights_digest", "write_case", "write_model"]
