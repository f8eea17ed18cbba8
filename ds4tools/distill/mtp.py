"""MTP: a NextN head (the token embedding and the target's final hidden state -> one decoder
layer -> the target's head) that predicts token i+2, trained on the frozen target as the demo
trains its MTP layer (tools/demo/train_mtp.py):

    loss = 0.9 KL(p_target(i+1) || p_mtp(i)) + 0.1 CE(t_(i+2))

over every row i of a window, teacher-forced: row i takes the target's final hidden h_i and the
embedding of t_(i+1); its target distribution is the target's at row i+1.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from .model import MtpHead, Shape

__all__ = ["DISTILL_W", "CE_W", "build", "init_from_target", "sample_batch", "loss_and_stats",
           "export_arrays"]

DISTILL_W, CE_W = 0.9, 0.1


def build(shape: Shape) -> MtpHead:
    return MtpHead(shape)


@torch.no_grad()
def init_from_target(head: MtpHead, target, seed: int) -> None:
    """The demo's initialization: the decoder layer from the target's last one, e/h projections
    small and random, enorm / hnorm at one, the shared head norm the target's final norm."""
    from .dspark import _copy_layer
    g = torch.Generator().manual_seed(seed + 7)
    _copy_layer(head.layer, target.layer(target.hp.n_layer - 1))
    head.enorm.weight.fill_(1.0)
    head.hnorm.weight.fill_(1.0)
    head.norm.weight.copy_(torch.from_numpy(target.output_norm()))
    for proj in (head.e_proj, head.h_proj):
        proj.weight.copy_(torch.randn(proj.weight.shape, generator=g) * 0.02)


def sample_batch(store, windows: np.ndarray, rng=None, *_):
    idx = np.sort(windows)
    tokens = torch.from_numpy(np.asarray(store.tokens[idx], np.int64))
    final = torch.from_numpy(np.asarray(store.final[idx], np.float32))
    return tokens, final


def loss_and_stats(head: MtpHead, embed, lm_head, rope, batch):
    tokens, final = batch
    t = tokens.shape[1]
    with torch.no_grad():
        target_logp = F.log_softmax(F.linear(final[:, 1:], lm_head).float(), dim=-1)  # rows 1..T-1
    y = head(final[:, :t - 1], F.embedding(tokens[:, 1:], embed), rope)              # rows 0..T-2
    logp = F.log_softmax(F.linear(y, lm_head).float(), dim=-1)
    kl = (target_logp.exp() * (target_logp - logp)).sum(-1).mean()
    ce = F.nll_loss(logp[:, :t - 2].reshape(-1, logp.shape[-1]), tokens[:, 2:].reshape(-1))
    loss = DISTILL_W * kl + CE_W * ce
    with torch.no_grad():
        agree = (logp.argmax(-1) == target_logp.argmax(-1)).float().mean()
        stats = {"kl": float(kl), "ce": float(ce), "agree": float(agree)}
    return loss, stats


def export_arrays(head: MtpHead) -> dict:
    """The trained head under ds4's MTP names (mtp.0.*), float32 numpy [out, in]."""
    out = {}
    for key, value in head.state_dict().items():
        name = key[len("layer."):] if key.startswith("layer.") else key
        out["mtp.0." + name] = value.detach().float().numpy().copy()
    return out
