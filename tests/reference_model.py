"""A float64 numpy reference of the llama / qwen3 decoder, written from the equations.

It shares no code with ds4tools.engine: weights come in as plain float arrays keyed by
llama.cpp's tensor names, and every step is the textbook formula:

    rmsnorm(x) = x / sqrt(mean(x**2) + eps) * w
    rope:  angle(p, i) = p * base ** (-2 i / n_rot) (/ freq_factor[i]) (* freq_scale)
           llama.cpp's llama rotates pairs (x[2i], x[2i+1]), qwen3 (and Hugging Face's
           rotate_half for both) pairs (x[i], x[i + n_rot/2])
    attention: softmax(q k^T / sqrt(head_dim)) v over positions <= the query's, kv head
           h // (n_head / n_head_kv) for query head h
    ffn: (silu(h Wg^T) * (h Wu^T)) Wd^T,  silu(g) = g / (1 + exp(-g))
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class RefConfig:
    arch: str            # "llama" | "qwen3"
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    rms_eps: float = 1e-6
    rope_base: float = 10000.0
    n_rot: int | None = None
    freq_scale: float = 1.0
    rope_style: str | None = None   # "norm" (adjacent pairs) | "neox" (halves); default by arch

    @property
    def neox(self) -> bool:
        return (self.rope_style or ("neox" if self.arch == "qwen3" else "norm")) == "neox"


def rmsnorm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x, positions, cfg: RefConfig, freq_factors=None):
    """x (T, heads, head_dim) float64 -> rotated copy."""
    n_rot = cfg.n_rot or cfg.head_dim
    half = n_rot // 2
    i = np.arange(half)
    inv = cfg.rope_base ** (-2.0 * i / n_rot)
    if freq_factors is not None:
        inv = inv / np.asarray(freq_factors, np.float64)
    ang = np.asarray(positions, np.float64)[:, None] * inv[None, :] * cfg.freq_scale  # (T, half)
    c = np.cos(ang)[:, None, :]
    s = np.sin(ang)[:, None, :]
    out = x.copy()
    if cfg.neox:                     # halves
        a, b = x[..., :half], x[..., half:n_rot]
        out[..., :half] = a * c - b * s
        out[..., half:n_rot] = a * s + b * c
    else:                            # llama.cpp "norm": adjacent pairs
        a, b = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
        out[..., 0:n_rot:2] = a * c - b * s
        out[..., 1:n_rot:2] = a * s + b * c
    return out


def reference_forward(w: dict, cfg: RefConfig, tokens, hidden_layers=()):
    """Logits (T, n_vocab) float64 for tokens at positions 0..T-1, plus {layer: raw output}
    and the final normed hidden state. ``w``: name -> float array (llama.cpp names)."""
    W = {k: np.asarray(v, np.float64) for k, v in w.items()}
    tokens = np.asarray(tokens)
    T = len(tokens)
    pos = np.arange(T)
    x = W["token_embd.weight"][tokens]
    group = cfg.n_head // cfg.n_head_kv
    hidden = {}
    ff = W.get("rope_freqs.weight")
    for il in range(cfg.n_layer):
        p = f"blk.{il}."
        h = rmsnorm(x, W[p + "attn_norm.weight"], cfg.rms_eps)
        q = h @ W[p + "attn_q.weight"].T
        k = h @ W[p + "attn_k.weight"].T
        v = h @ W[p + "attn_v.weight"].T
        for name, arr in (("attn_q.bias", q), ("attn_k.bias", k), ("attn_v.bias", v)):
            if p + name in W:
                arr += W[p + name]
        q = q.reshape(T, cfg.n_head, cfg.head_dim)
        k = k.reshape(T, cfg.n_head_kv, cfg.head_dim)
        v = v.reshape(T, cfg.n_head_kv, cfg.head_dim)
        if p + "attn_q_norm.weight" in W:
            q = rmsnorm(q, W[p + "attn_q_norm.weight"], cfg.rms_eps)
            k = rmsnorm(k, W[p + "attn_k_norm.weight"], cfg.rms_eps)
        q = rope(q, pos, cfg, ff)
        k = rope(k, pos, cfg, ff)
        att = np.empty((T, cfg.n_head, cfg.head_dim))
        causal = np.tril(np.ones((T, T), bool))
        for hh in range(cfg.n_head):
            g = hh // group
            s = q[:, hh, :] @ k[:, g, :].T / np.sqrt(cfg.head_dim)
            s = np.where(causal, s, -np.inf)
            s = np.exp(s - s.max(axis=1, keepdims=True))
            s /= s.sum(axis=1, keepdims=True)
            att[:, hh, :] = s @ v[:, g, :]
        o = att.reshape(T, -1) @ W[p + "attn_output.weight"].T
        if p + "attn_output.bias" in W:
            o += W[p + "attn_output.bias"]
        x = x + o
        h = rmsnorm(x, W[p + "ffn_norm.weight"], cfg.rms_eps)
        g = h @ W[p + "ffn_gate.weight"].T
        u = h @ W[p + "ffn_up.weight"].T
        x = x + (g / (1.0 + np.exp(-g)) * u) @ W[p + "ffn_down.weight"].T
        if il in hidden_layers:
            hidden[il] = x.copy()
    final = rmsnorm(x, W["output_norm.weight"], cfg.rms_eps)
    out_w = W.get("output.weight", W["token_embd.weight"])
    return final @ out_w.T, hidden, final


def random_weights(cfg: RefConfig, rng, *, tied=False, biases=False, scale=0.5) -> dict:
    """Random float32 weights with llama.cpp names, sized so activations stay O(1)."""
    H, Q, KV, F = cfg.n_embd, cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim, cfg.n_ff
    f = np.float32

    def mat(n_out, n_in):
        return (rng.standard_normal((n_out, n_in)) * scale / np.sqrt(n_in)).astype(f)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(f)

    w = {"token_embd.weight": rng.standard_normal((cfg.n_vocab, H)).astype(f),
         "output_norm.weight": norm(H)}
    if not tied:
        w["output.weight"] = mat(cfg.n_vocab, H) * f(4.0)
    for il in range(cfg.n_layer):
        p = f"blk.{il}."
        w[p + "attn_norm.weight"] = norm(H)
        w[p + "attn_q.weight"] = mat(Q, H) * f(3.0)  # sharper attention than uniform
        w[p + "attn_k.weight"] = mat(KV, H) * f(3.0)
        w[p + "attn_v.weight"] = mat(KV, H)
        w[p + "attn_output.weight"] = mat(H, Q)
        w[p + "ffn_norm.weight"] = norm(H)
        w[p + "ffn_gate.weight"] = mat(F, H)
        w[p + "ffn_up.weight"] = mat(F, H)
        w[p + "ffn_down.weight"] = mat(H, F)
        if cfg.arch == "qwen3":
            w[p + "attn_q_norm.weight"] = norm(cfg.head_dim)
            w[p + "attn_k_norm.weight"] = norm(cfg.head_dim)
        if biases:
            w[p + "attn_q.bias"] = (0.1 * rng.standard_normal(Q)).astype(f)
            w[p + "attn_k.bias"] = (0.1 * rng.standard_normal(KV)).astype(f)
            w[p + "attn_v.bias"] = (0.1 * rng.standard_normal(KV)).astype(f)
            w[p + "attn_output.bias"] = (0.1 * rng.standard_normal(H)).astype(f)
    return w


# --- synthetic GGUF models (written with the gguf package) -------------------------------------


def config_metadata(cfg: RefConfig, n_ctx: int = 512) -> dict:
    """llama.cpp's hyper-parameter keys for cfg."""
    a = cfg.arch
    return {
        f"{a}.context_length": n_ctx, f"{a}.embedding_length": cfg.n_embd,
        f"{a}.block_count": cfg.n_layer, f"{a}.feed_forward_length": cfg.n_ff,
        f"{a}.attention.head_count": cfg.n_head, f"{a}.attention.head_count_kv": cfg.n_head_kv,
        f"{a}.attention.key_length": cfg.head_dim, f"{a}.attention.value_length": cfg.head_dim,
        f"{a}.attention.layer_norm_rms_epsilon": cfg.rms_eps, f"{a}.rope.freq_base": cfg.rope_base,
        f"{a}.rope.dimension_count": cfg.n_rot or cfg.head_dim, f"{a}.vocab_size": cfg.n_vocab,
    }


def byte_level_tokenizer_metadata(n_vocab: int) -> dict:
    """A gpt2-model tokenizer of exactly n_vocab tokens: a byte-level BPE trained on the
    fixtures' corpus, with <|endoftext|> as BOS/EOS."""
    import json
    from tests.fixtures.hf_models import train_byte_level_bpe
    tok = train_byte_level_bpe("gpt2", vocab_size=n_vocab, specials=["<|endoftext|>"])
    model = json.loads(tok.to_str())["model"]
    tokens = [None] * len(model["vocab"])
    for t, i in model["vocab"].items():
        tokens[i] = t
    pad = n_vocab - len(tokens)
    tokens += [f"<|unused{i}|>" for i in range(pad)]
    types = [3 if t == "<|endoftext|>" else 5 if t.startswith("<|unused") else 1 for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2",
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.merges": merges, "tokenizer.ggml.bos_token_id": 0,
            "tokenizer.ggml.eos_token_id": 0, "tokenizer.ggml.add_bos_token": False}


def _add_key(writer, key, value):
    from gguf import GGUFValueType as V
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value) if value >= 0 else writer.add_int32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, list) and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        writer.add_key_value(key, value, V.ARRAY, sub_type=V.INT32)
    elif isinstance(value, list) and value and all(isinstance(v, float) for v in value):
        writer.add_key_value(key, value, V.ARRAY, sub_type=V.FLOAT32)
    else:
        writer.add_array(key, value)


def write_gguf(path, arch: str, metadata: dict, tensors: dict, types: dict | None = None,
               default_type: str = "F32") -> dict:
    """Write a GGUF: ``tensors`` name -> float32 array, stored as ``types[name]`` (2-D tensors
    default to ``default_type``, 1-D to F32). Returns name -> the float32 values as stored
    (dequantized), which is what a reference run on "the file's weights" must use."""
    import gguf
    from ds4tools import formats
    types = types or {}
    writer = gguf.GGUFWriter(str(path), arch)
    for k, v in metadata.items():
        if k != "general.architecture":
            _add_key(writer, k, v)
    stored = {}
    for name, w in tensors.items():
        w = np.ascontiguousarray(w, np.float32)
        t = types.get(name, default_type if w.ndim == 2 else "F32")
        fmt = formats.get_format(t)
        imatrix = np.ones(w.shape[-1], np.float32) if fmt.requires_imatrix else None
        raw = formats.quantize(w, fmt, imatrix=imatrix)
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


def write_random_model(path, cfg: RefConfig, seed: int = 0, *, default_type: str = "F32",
                       types=None, tied=False, biases=False, extra_metadata=None, n_ctx=512,
                       tokenizer=None) -> dict:
    """A random model as a GGUF file; returns the stored (dequantized) weights."""
    rng = np.random.default_rng(seed)
    w = random_weights(cfg, rng, tied=tied, biases=biases)
    meta = config_metadata(cfg, n_ctx)
    meta.update(tokenizer if tokenizer is not None else byte_level_tokenizer_metadata(cfg.n_vocab))
    meta.update(extra_metadata or {})
    return write_gguf(path, cfg.arch, meta, w, types, default_type)
