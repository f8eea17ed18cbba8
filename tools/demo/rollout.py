"""Target rollouts that branch off a window's shared KV cache, many anchors at once."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .model import Qwen3Target


@dataclass
class Rollouts:
    tokens: torch.Tensor  # [B, R, steps]: token k+1 after the anchor, k = 0..steps-1
    hidden: torch.Tensor  # [B, R, steps, H]: final-normed target hidden that predicted tokens[..., k]
    window_hidden: torch.Tensor  # [B, T, H]: final-normed hidden of the window itself
    features: dict  # layer -> raw output [B, T, H] of the window


def pick(logits: torch.Tensor, temperature: torch.Tensor, generator) -> torch.Tensor:
    """Greedy where temperature == 0, else a sample from softmax(logits / temperature)."""
    logits = logits.float()
    greedy = logits.argmax(-1)
    if not bool((temperature > 0).any()):
        return greedy
    t = temperature.clamp_min(1e-6).unsqueeze(-1)
    probs = torch.softmax(logits / t, dim=-1)
    flat = probs.reshape(-1, probs.shape[-1])
    sampled = torch.multinomial(flat, 1, generator=generator).view(greedy.shape)
    return torch.where(temperature > 0, sampled, greedy)


@torch.no_grad()
def rollout(model: Qwen3Target, ids: torch.Tensor, anchors: torch.Tensor, steps: int,
            temperature: torch.Tensor, generator=None, capture=()) -> Rollouts:
    """For each (window b, row r), continue the text ids[b, :anchors[b, r] + 1] for `steps` tokens.

    ids [B, T]; anchors [B, R] (window positions); temperature [B, R] (0 = greedy).
    Row r attends to the window's keys at positions <= its anchor and to its own rollout keys.
    """
    b, t = ids.shape
    r = anchors.shape[1]
    h, feats, kvs = model.prefill_kv(ids, capture)
    gather = anchors.unsqueeze(-1).expand(-1, -1, h.shape[-1])
    hid = torch.gather(h, 1, gather)
    head = model.lm_head
    hiddens = [hid]
    tok = pick(head(hid), temperature, generator)
    tokens = [tok]
    window_ok = torch.arange(t).view(1, 1, -1) <= anchors.unsqueeze(-1)  # [B, R, T]
    own = torch.eye(r, dtype=torch.bool)
    past = [list(kv) for kv in kvs]  # per layer [K, V], grows by R rows per step (step-major)
    for j in range(1, steps):
        mask = torch.cat([window_ok] + [own.expand(b, -1, -1)] * j, dim=-1).unsqueeze(1)
        hid, _, new_kv = model.forward_cached(tok, anchors + j, [tuple(p) for p in past], mask)
        for layer, (k, v) in enumerate(new_kv):
            past[layer][0] = torch.cat([past[layer][0], k], dim=2)
            past[layer][1] = torch.cat([past[layer][1], v], dim=2)
        hiddens.append(hid)
        tok = pick(head(hid), temperature, generator)
        tokens.append(tok)
    return Rollouts(torch.stack(tokens, -1), torch.stack(hiddens, 2), h, feats)
