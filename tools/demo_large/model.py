"""The large target's shape, its size arithmetic, and a device-clean forward for training.

Same module tree (hence the same Hugging Face tensor names) as tools/demo/model.Qwen3Target; the
subclass only changes how the forward pass is run: RoPE tables on the model's device, cached per
length, and grouped-query attention by repeating K/V heads (no reliance on SDPA's enable_gqa, which
not every installed PyTorch routes to a fused kernel).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from demo.model import Qwen3Target, TargetShape, rope_cos_sin, apply_rope

#: Qwen3, 12 layers of hidden 640, 10 query heads / 2 KV heads of 64, SwiGLU 1536, untied output.
LARGE_SHAPE = TargetShape(
    vocab_size=16384,
    hidden_size=640,
    num_hidden_layers=12,
    num_attention_heads=10,
    num_key_value_heads=2,
    head_dim=64,
    intermediate_size=1536,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=1024,
)

Q8_0_MIN_BYTES = 64 * 2**20  # twice the 32 MiB L3 of the development machine


def size_arithmetic(s: TargetShape = LARGE_SHAPE) -> dict:
    """Parameter counts of the trunk (the NextN/MTP layer excluded) and its GGUF Q8_0 size.

    Q8_0 stores every 2-D weight (token_embd and output included) as blocks of 32 int8 + one f16
    scale: 34 bytes per 32 weights; the 1-D RMSNorm weights stay f32 (4 bytes each).
    """
    h, v, L = s.hidden_size, s.vocab_size, s.num_hidden_layers
    q = h * s.num_attention_heads * s.head_dim
    kv = 2 * h * s.num_key_value_heads * s.head_dim
    o = s.num_attention_heads * s.head_dim * h
    mlp = 3 * h * s.intermediate_size
    per_layer_2d = q + kv + o + mlp
    per_layer_1d = 2 * h + 2 * s.head_dim
    embed = output = v * h
    matrices = embed + output + L * per_layer_2d
    norms = L * per_layer_1d + h
    for n in (h, s.intermediate_size, s.head_dim):
        assert n % 32 == 0, "Q8_0 blocks run along rows of 32"
    q8 = matrices * 34 // 32 + norms * 4
    return {
        "per_layer_matrices": per_layer_2d, "embed": embed, "output": output,
        "matrices": matrices, "norm_weights": norms, "parameters": matrices + norms,
        "q8_0_bytes": q8, "q8_0_mib": round(q8 / 2**20, 2), "q8_0_min_bytes": Q8_0_MIN_BYTES,
        "bf16_bytes": 2 * (matrices + norms),
    }


class LargeTarget(Qwen3Target):
    def __init__(self, s: TargetShape = LARGE_SHAPE):
        super().__init__(s)
        self._rope_cache: dict = {}

    def rope(self, positions):
        dev = self.model.embed_tokens.weight.device
        if positions.dim() == 1:
            key = (int(positions.shape[0]), int(positions[0]) if len(positions) else 0, str(dev))
            hit = self._rope_cache.get(key)
            if hit is None:
                cos, sin = rope_cos_sin(positions.cpu(), self.shape.head_dim, self.shape.rope_theta)
                hit = self._rope_cache[key] = (cos.to(dev), sin.to(dev))
            return hit
        cos, sin = rope_cos_sin(positions.cpu(), self.shape.head_dim, self.shape.rope_theta)
        return cos.to(dev), sin.to(dev)

    def trunk_forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, T] -> final-normed hidden [B, T, H]; same equations as Qwen3Target.forward."""
        s = self.shape
        cos, sin = self.rope(torch.arange(ids.shape[1]))
        groups = s.num_attention_heads // s.num_key_value_heads
        x = self.model.embed_tokens(ids)
        for i in range(s.num_hidden_layers):
            layer = self.model.layers[i]
            attn = layer.self_attn
            u = layer.input_layernorm(x)
            k, v = attn.project_kv(u, cos, sin)
            q = attn.project_q(u, cos, sin)
            if groups > 1:
                k = k.repeat_interleave(groups, dim=1)
                v = v.repeat_interleave(groups, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            b, _, t, _ = out.shape
            x = x + attn.o_proj(out.transpose(1, 2).reshape(b, t, s.num_attention_heads * s.head_dim))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.norm(x)

    def forward(self, ids, capture=()):
        if capture:
            return super().forward(ids, capture)
        return self.trunk_forward(ids), {}


def trunk_state_dict(model: Qwen3Target) -> dict:
    """State dict without the (untrained, later-stage) NextN/MTP layer."""
    prefix = f"model.layers.{model.shape.num_hidden_layers}."
    return {k: v for k, v in model.state_dict().items() if not k.startswith(prefix)}


__all__ = ["LARGE_SHAPE", "LargeTarget", "size_arithmetic", "trunk_state_dict", "apply_rope"]
