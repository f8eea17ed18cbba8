"""Torch modules for the demo model: a Qwen3 target with one NextN/MTP layer, and a DSpark draft.

Module attribute names are chosen so that ``state_dict()`` keys are already the Hugging Face /
DeepSpec tensor names (``model.layers.6.eh_proj.weight``, ``markov_head.markov_w1.weight`` ...);
export.py only casts and writes them. The equations are written out in the model card
("Architecture"), which is the contract the numba engine implements.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class TargetShape:
    vocab_size: int = 2048
    hidden_size: int = 192
    num_hidden_layers: int = 6
    num_attention_heads: int = 3
    num_key_value_heads: int = 1
    head_dim: int = 64
    intermediate_size: int = 576
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 1024

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class DraftShape:
    block_size: int = 8
    #: DeepSpec numbering (the raw output of layer i); llama.cpp exposes only the inputs of
    #: layers 0..n-1 to a draft, so never the last layer (ds4tools distill's default for 6 layers)
    target_layer_ids: tuple = (1, 3, 4)
    num_draft_layers: int = 2
    markov_rank: int = 64


# --------------------------------------------------------------------------------------------
# Building blocks


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * self.weight.float()).to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float):
    """cos/sin tables for rotate-half RoPE; positions [..., T] -> [..., T, head_dim] each."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = positions.to(torch.float64).unsqueeze(-1) * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, d]; cos/sin [B, T, d] or [T, d]."""
    if cos.dim() == 3:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, s: TargetShape):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = s.num_attention_heads, s.num_key_value_heads, s.head_dim
        self.q_proj = nn.Linear(s.hidden_size, self.n_heads * s.head_dim, bias=False)
        self.k_proj = nn.Linear(s.hidden_size, self.n_kv * s.head_dim, bias=False)
        self.v_proj = nn.Linear(s.hidden_size, self.n_kv * s.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * s.head_dim, s.hidden_size, bias=False)
        self.q_norm = RMSNorm(s.head_dim, s.rms_norm_eps)
        self.k_norm = RMSNorm(s.head_dim, s.rms_norm_eps)

    def project_kv(self, u: torch.Tensor, cos, sin):
        """K (normed, roped) and V for rows u [B, T, H]: each [B, n_kv, T, d]."""
        b, t, _ = u.shape
        k = self.k_norm(self.k_proj(u).view(b, t, self.n_kv, self.head_dim)).transpose(1, 2)
        v = self.v_proj(u).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def project_q(self, u: torch.Tensor, cos, sin):
        b, t, _ = u.shape
        q = self.q_norm(self.q_proj(u).view(b, t, self.n_heads, self.head_dim)).transpose(1, 2)
        return apply_rope(q, cos, sin)

    def attend(self, q, k, v, mask=None, causal=False):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)
        b, _, t, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, s: TargetShape):
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.up_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.down_proj = nn.Linear(s.intermediate_size, s.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, s: TargetShape):
        super().__init__()
        self.self_attn = Attention(s)
        self.mlp = MLP(s)
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)

    def forward(self, x, cos, sin):
        """Plain causal self-attention layer over x [B, T, H]."""
        u = self.input_layernorm(x)
        attn = self.self_attn
        k, v = attn.project_kv(u, cos, sin)
        x = x + attn.attend(attn.project_q(u, cos, sin), k, v, causal=True)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_with_kv(self, x, cos, sin, past_k, past_v, mask):
        """Rows x attend to cached keys (past_k/past_v, already roped) plus their own keys.

        Returns the new hidden rows and this layer's K/V for the rows (so callers can grow caches).
        mask: bool [B, 1, T_new, T_past + T_new] (True = may attend).
        """
        u = self.input_layernorm(x)
        attn = self.self_attn
        k, v = attn.project_kv(u, cos, sin)
        kk = torch.cat([past_k, k], dim=2)
        vv = torch.cat([past_v, v], dim=2)
        x = x + attn.attend(attn.project_q(u, cos, sin), kk, vv, mask=mask)
        return x + self.mlp(self.post_attention_layernorm(x)), k, v


class SharedHead(nn.Module):
    def __init__(self, s: TargetShape):
        super().__init__()
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)


class NextNLayer(DecoderLayer):
    """DeepSeek-V3-style NextN/MTP layer: a decoder layer plus enorm/hnorm/eh_proj/shared_head."""

    def __init__(self, s: TargetShape):
        super().__init__(s)
        self.enorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.hnorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * s.hidden_size, s.hidden_size, bias=False)
        self.shared_head = SharedHead(s)

    def mtp_forward(self, h_final, next_embed, cos, sin):
        """Row i: (final-normed target hidden h_i, embedding of t_{i+1}) -> normed hidden for t_{i+2}."""
        x = self.eh_proj(torch.cat([self.enorm(next_embed), self.hnorm(h_final)], dim=-1))
        x = DecoderLayer.forward(self, x, cos, sin)
        return self.shared_head.norm(x)


class TargetInner(nn.Module):
    def __init__(self, s: TargetShape):
        super().__init__()
        self.embed_tokens = nn.Embedding(s.vocab_size, s.hidden_size)
        layers = [DecoderLayer(s) for _ in range(s.num_hidden_layers)] + [NextNLayer(s)]
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)


class Qwen3Target(nn.Module):
    """Qwen3ForCausalLM with the NextN layer stored at model.layers[num_hidden_layers]."""

    def __init__(self, s: TargetShape):
        super().__init__()
        self.shape = s
        self.model = TargetInner(s)
        self.lm_head = nn.Linear(s.hidden_size, s.vocab_size, bias=False)

    @property
    def mtp(self) -> NextNLayer:
        return self.model.layers[self.shape.num_hidden_layers]

    def trunk_parameters(self):
        mtp_ids = {id(p) for p in self.mtp.parameters()}
        return [p for p in self.parameters() if id(p) not in mtp_ids]

    def rope(self, positions):
        return rope_cos_sin(positions, self.shape.head_dim, self.shape.rope_theta)

    def forward(self, ids, capture=()):
        """ids [B, T] -> (final-normed hidden [B, T, H], {layer: raw output [B, T, H]})."""
        cos, sin = self.rope(torch.arange(ids.shape[1]))
        x = self.model.embed_tokens(ids)
        captured = {}
        for i in range(self.shape.num_hidden_layers):
            x = self.model.layers[i](x, cos, sin)
            if i in capture:
                captured[i] = x
        return self.model.norm(x), captured

    def forward_cached(self, ids, positions, caches, mask, capture=()):
        """Decode rows ids [B, T_new] at positions [B, T_new] against per-layer caches.

        caches: list of (K, V) per layer, each [B, n_kv, T_past, d]; returns
        (final-normed hidden, captured raw outputs, list of new (K, V) rows per layer).
        """
        cos, sin = self.rope(positions)
        x = self.model.embed_tokens(ids)
        new_kv, captured = [], {}
        for i in range(self.shape.num_hidden_layers):
            pk, pv = caches[i]
            x, k, v = self.model.layers[i].forward_with_kv(x, cos, sin, pk, pv, mask)
            new_kv.append((k, v))
            if i in capture:
                captured[i] = x
        return self.model.norm(x), captured, new_kv

    def prefill_kv(self, ids, capture=()):
        """Full causal forward that also returns each layer's K/V ([B, n_kv, T, d])."""
        t = ids.shape[1]
        cos, sin = self.rope(torch.arange(t))
        x = self.model.embed_tokens(ids)
        kvs, captured = [], {}
        for i in range(self.shape.num_hidden_layers):
            layer = self.model.layers[i]
            u = layer.input_layernorm(x)
            k, v = layer.self_attn.project_kv(u, cos, sin)
            x = x + layer.self_attn.attend(layer.self_attn.project_q(u, cos, sin), k, v, causal=True)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            kvs.append((k, v))
            if i in capture:
                captured[i] = x
        return self.model.norm(x), captured, kvs

    def mtp_hidden(self, h_final, ids):
        """MTP rows for a sequence: row i uses h_final[:, i] and embed(ids[:, i+1]); T-1 rows."""
        t = ids.shape[1] - 1
        cos, sin = self.rope(torch.arange(t))
        return self.mtp.mtp_forward(h_final[:, :t], self.model.embed_tokens(ids[:, 1:]), cos, sin)


# --------------------------------------------------------------------------------------------
# DSpark draft


class MarkovHead(nn.Module):
    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, vocab, bias=False)


class ConfidenceHead(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.proj = nn.Linear(dim, 1)


class DSparkDraft(nn.Module):
    """Qwen3DSparkModel without its (frozen, target-shared) embed_tokens and lm_head."""

    def __init__(self, s: TargetShape, d: DraftShape):
        super().__init__()
        self.shape, self.dshape = s, d
        self.fc = nn.Linear(len(d.target_layer_ids) * s.hidden_size, s.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.layers = nn.ModuleList([DecoderLayer(s) for _ in range(d.num_draft_layers)])
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.markov_head = MarkovHead(s.vocab_size, d.markov_rank)
        self.confidence_head = ConfidenceHead(s.hidden_size + d.markov_rank)

    def context(self, features):
        """features [B, T, n_t*H] (raw target layer outputs, concatenated) -> ctx rows [B, T, H]."""
        return self.hidden_norm(self.fc(features))

    def backbone(self, ctx, ctx_pos, block_embed, block_pos, mask):
        """Block rows attend to context rows and block rows under mask; returns hid (post-norm).

        ctx [B, Tc, H] at positions ctx_pos [B, Tc]; block_embed [B, Q, H] at block_pos [B, Q];
        mask bool [B, 1, Q, Tc + Q].
        """
        s = self.shape
        ccos, csin = rope_cos_sin(ctx_pos, s.head_dim, s.rope_theta)
        bcos, bsin = rope_cos_sin(block_pos, s.head_dim, s.rope_theta)
        x = block_embed
        for layer in self.layers:
            attn = layer.self_attn
            # Context rows enter K/V straight from ctx (no input_layernorm), as in DeepSpec.
            ck, cv = attn.project_kv(ctx, ccos, csin)
            u = layer.input_layernorm(x)
            bk, bv = attn.project_kv(u, bcos, bsin)
            q = attn.project_q(u, bcos, bsin)
            x = x + attn.attend(q, torch.cat([ck, bk], 2), torch.cat([cv, bv], 2), mask=mask)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x)

    def markov_bias(self, prev_ids):
        return self.markov_head.markov_w2(self.markov_head.markov_w1(prev_ids))

    def confidence_logit(self, hid, prev_ids):
        feats = torch.cat([hid, self.markov_head.markov_w1(prev_ids).to(hid.dtype)], dim=-1)
        return self.confidence_head.proj(feats).squeeze(-1)


def block_mask(anchors: torch.Tensor, ctx_len: int, block_size: int) -> torch.Tensor:
    """DSpark attention mask for blocks laid out anchor-first, one block per anchor.

    anchors [B, A] (context index of each anchor); returns bool [B, 1, A*bs, ctx_len + A*bs]:
    a block row sees context rows strictly before its anchor and every row of its own block.
    """
    b, a = anchors.shape
    q_block = torch.arange(a * block_size) // block_size  # [Q]
    ctx_ok = torch.arange(ctx_len).view(1, 1, -1) < anchors[:, q_block].unsqueeze(-1)  # [B, Q, Tc]
    blk_ok = q_block.view(-1, 1) == q_block.view(1, -1)  # [Q, Q]
    mask = torch.cat([ctx_ok, blk_ok.unsqueeze(0).expand(b, -1, -1)], dim=-1)
    return mask.unsqueeze(1)


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
