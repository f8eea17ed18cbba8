"""Torch modules of the drafts, written to compute what the engine computes (generalized from
the demo's tools/demo/model.py): RMSNorm in float32, RoPE from the engine's own tables with the
target's pairing (qwen3 "neox" halves, llama "norm" adjacent pairs, rotating the first n_rot
dimensions), GQA attention at scale 1/sqrt(head_dim), a SwiGLU feed-forward, pre-norm layers.

Parameter names follow llama.cpp's per-layer names (``attn_q``, ``ffn_down``...) and a Linear's
weight is [out, in], the numpy order of the GGUF tensor, so export only renames.

- ``DSparkDraft``: DeepSpec's Qwen3 DSpark draft (fc + hidden_norm over the target features,
  decoder layers whose context K/V come from those features, final norm, vanilla Markov head,
  confidence head); the embedding and output head are the target's, frozen, passed in.
- ``MtpHead``: a NextN layer (enorm / hnorm / e_proj / h_proj, one decoder layer, the shared
  head norm) in ds4's split layout.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Shape", "RMSNorm", "Rope", "DecoderLayer", "DSparkDraft", "MtpHead", "block_mask"]


@dataclass(frozen=True)
class Shape:
    """A decoder layer's shape (the target's)."""
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    eps: float
    n_vocab: int
    qk_norm: bool = True


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


class Rope:
    """The engine's rope: ``cos``/``sin`` (n_positions, n_rot / 2) tables (kernels.rope_tables,
    scaling and frequency factors included), ``neox`` the pairing."""

    def __init__(self, cos, sin, neox: bool):
        self.cos = torch.as_tensor(cos, dtype=torch.float32)
        self.sin = torch.as_tensor(sin, dtype=torch.float32)
        self.neox = neox
        self.half = self.cos.shape[1]

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [B, heads, T, d]; positions [B, T] (or [T])."""
        c = self.cos[positions]
        s = self.sin[positions]
        if c.dim() == 3:
            c, s = c.unsqueeze(1), s.unsqueeze(1)
        c, s = c.to(x.dtype), s.to(x.dtype)
        h = self.half
        rot, rest = x[..., :2 * h], x[..., 2 * h:]
        if self.neox:
            a, b = rot[..., :h], rot[..., h:]
            out = torch.cat([a * c - b * s, a * s + b * c], dim=-1)
        else:
            a, b = rot[..., 0::2], rot[..., 1::2]
            out = torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(-2)
        return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out


def _linear(n_in: int, n_out: int) -> nn.Linear:
    return nn.Linear(n_in, n_out, bias=False)


class DecoderLayer(nn.Module):
    """A llama / qwen3 decoder layer under llama.cpp's names."""

    def __init__(self, s: Shape):
        super().__init__()
        self.s = s
        self.attn_norm = RMSNorm(s.n_embd, s.eps)
        self.attn_q = _linear(s.n_embd, s.n_head * s.head_dim)
        self.attn_k = _linear(s.n_embd, s.n_head_kv * s.head_dim)
        self.attn_v = _linear(s.n_embd, s.n_head_kv * s.head_dim)
        self.attn_output = _linear(s.n_head * s.head_dim, s.n_embd)
        if s.qk_norm:
            self.attn_q_norm = RMSNorm(s.head_dim, s.eps)
            self.attn_k_norm = RMSNorm(s.head_dim, s.eps)
        self.ffn_norm = RMSNorm(s.n_embd, s.eps)
        self.ffn_gate = _linear(s.n_embd, s.n_ff)
        self.ffn_up = _linear(s.n_embd, s.n_ff)
        self.ffn_down = _linear(s.n_ff, s.n_embd)

    def kv(self, u: torch.Tensor, rope: Rope, positions):
        """K (normed, roped) and V of rows u [B, T, H]: each [B, n_kv, T, d]."""
        b, t, _ = u.shape
        s = self.s
        k = self.attn_k(u).view(b, t, s.n_head_kv, s.head_dim)
        if s.qk_norm:
            k = self.attn_k_norm(k)
        v = self.attn_v(u).view(b, t, s.n_head_kv, s.head_dim)
        return rope(k.transpose(1, 2), positions), v.transpose(1, 2)

    def q(self, u: torch.Tensor, rope: Rope, positions):
        b, t, _ = u.shape
        s = self.s
        q = self.attn_q(u).view(b, t, s.n_head, s.head_dim)
        if s.qk_norm:
            q = self.attn_q_norm(q)
        return rope(q.transpose(1, 2), positions)

    def forward(self, x, rope: Rope, positions, past_k=None, past_v=None, mask=None, causal=False):
        """Rows x [B, T, H] at ``positions``; they attend to ``past_k``/``past_v`` (already
        normed and roped) and to themselves, under ``mask`` (bool [B, 1, T, T_past + T]) or
        causally."""
        u = self.attn_norm(x)
        k, v = self.kv(u, rope, positions)
        if past_k is not None:
            k = torch.cat([past_k, k], dim=2)
            v = torch.cat([past_v, v], dim=2)
        q = self.q(u, rope, positions)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                           enable_gqa=True)
        b, _, t, _ = a.shape
        x = x + self.attn_output(a.transpose(1, 2).reshape(b, t, -1))
        w = self.ffn_norm(x)
        return x + self.ffn_down(F.silu(self.ffn_gate(w)) * self.ffn_up(w))


def block_mask(anchors: torch.Tensor, ctx_len: int, block_size: int) -> torch.Tensor:
    """DSpark's attention mask for anchor-first blocks, one block per anchor: anchors [B, A]
    (the anchor's position) -> bool [B, 1, A * bs, ctx_len + A * bs]: a block row sees the
    context rows strictly before its anchor and every row of its own block."""
    b, a = anchors.shape
    q_block = torch.arange(a * block_size) // block_size
    ctx_ok = torch.arange(ctx_len).view(1, 1, -1) < anchors[:, q_block].unsqueeze(-1)
    blk_ok = q_block.view(-1, 1) == q_block.view(1, -1)
    return torch.cat([ctx_ok, blk_ok.unsqueeze(0).expand(b, -1, -1)], dim=-1).unsqueeze(1)


class DSparkDraft(nn.Module):
    """DeepSpec's Qwen3DSparkModel without its (the target's, frozen) embedding and head."""

    def __init__(self, s: Shape, n_targets: int, n_layers: int, rank: int):
        super().__init__()
        self.s = s
        self.fc = _linear(n_targets * s.n_embd, s.n_embd)
        self.hidden_norm = RMSNorm(s.n_embd, s.eps)
        self.layers = nn.ModuleList([DecoderLayer(s) for _ in range(n_layers)])
        self.norm = RMSNorm(s.n_embd, s.eps)
        self.markov_w1 = nn.Embedding(s.n_vocab, rank)
        self.markov_w2 = _linear(rank, s.n_vocab)
        self.conf_proj = nn.Linear(s.n_embd + rank, 1)

    def blocks(self, feats, block_embed, anchors, block_size: int, rope: Rope):
        """Slot outputs (after the final norm) [B, A, bs, H] of the blocks [anchor, mask...]:
        feats [B, T, F] (the target features of the window), block_embed [B, A * bs, H],
        anchors [B, A]."""
        b, t, _ = feats.shape
        a = anchors.shape[1]
        ctx = self.hidden_norm(self.fc(feats))
        ctx_pos = torch.arange(t)
        block_pos = (anchors.unsqueeze(-1) + torch.arange(block_size)).view(b, a * block_size)
        mask = block_mask(anchors, t, block_size)
        x = block_embed
        for layer in self.layers:
            # context rows enter K/V straight from ctx (no attn_norm), as DeepSpec and the engine
            ck, cv = layer.kv(ctx, rope, ctx_pos)
            x = layer(x, rope, block_pos, ck, cv, mask)
        return self.norm(x).view(b, a, block_size, -1)

    def markov_bias(self, prev):
        return self.markov_w2(self.markov_w1(prev))

    def confidence_logit(self, hid, prev):
        feats = torch.cat([hid, self.markov_w1(prev).to(hid.dtype)], dim=-1)
        return self.conf_proj(feats).squeeze(-1)


class MtpHead(nn.Module):
    """A NextN layer: row i takes the target's final normed hidden h_i and the embedding of
    t_(i+1), and its logits (through the target's head) predict t_(i+2)."""

    def __init__(self, s: Shape):
        super().__init__()
        self.s = s
        self.enorm = RMSNorm(s.n_embd, s.eps)
        self.hnorm = RMSNorm(s.n_embd, s.eps)
        self.e_proj = _linear(s.n_embd, s.n_embd)
        self.h_proj = _linear(s.n_embd, s.n_embd)
        self.layer = DecoderLayer(s)
        self.norm = RMSNorm(s.n_embd, s.eps)

    def forward(self, hidden, next_embed, rope: Rope):
        """hidden, next_embed [B, T, H] -> shared_head_norm(y) [B, T, H], causal over the rows,
        row i at rope position i."""
        x = self.e_proj(self.enorm(next_embed)) + self.h_proj(self.hnorm(hidden))
        x = self.layer(x, rope, torch.arange(x.shape[1]), causal=True)
        return self.norm(x)
