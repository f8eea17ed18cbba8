"""DSpark: the draft, its initialization from the target, a training batch and DeepSpec's loss
(docs/distill.md; DeepSpec's recipe, deepspec/modeling/dspark/loss.py).

A batch takes windows of the training text and, in each, anchors a: the block
``[x_a, mask x (B-1)]`` at positions a..a+B-1 sees the target features of the window's rows
before a. At a random text anchor, slot k is trained towards the token at a+k+1 of the window
and towards the target's distribution there (softmax of the target's head on its final hidden
state at a+k); at a rollout anchor (``--rollouts``), towards the target's own greedy
continuation from a and its distributions along it, which is what verification accepts. On a
greedy self-generated window the text itself is that continuation.

    loss = 0.1 CE + 0.9 L1(p_draft, p_target) + 1.0 BCE(confidence, 1 - L1 / 2)

each term weighted by exp(-k / 4) over the slots (positions past the window's end left out),
the Markov head teacher-forced on the window's tokens.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from .features import MIN_ANCHOR
from .model import DSparkDraft, Shape

__all__ = ["CE_W", "L1_W", "CONF_W", "DECAY_GAMMA", "build", "init_from_target", "sample_batch",
           "loss_and_stats", "export_arrays", "MIN_ANCHOR"]

CE_W, L1_W, CONF_W, DECAY_GAMMA = 0.1, 0.9, 1.0, 4.0


def build(shape: Shape, n_targets: int, n_layers: int, rank: int) -> DSparkDraft:
    return DSparkDraft(shape, n_targets, n_layers, rank)


def _copy_layer(layer, w: dict) -> None:
    for name, value in w.items():
        mod = getattr(layer, name, None)
        if mod is None:
            continue  # a llama layer has no q/k norm to copy; the draft's start at one
        if value is None:
            continue
        mod.weight.copy_(torch.from_numpy(np.asarray(value, np.float32)))


@torch.no_grad()
def init_from_target(draft: DSparkDraft, target, seed: int) -> None:
    """The demo's initialization: the draft layers from the target's last ones, fc passing the
    last target feature through (plus small noise), the final norm the target's, the Markov
    bias and the confidence head at zero."""
    g = torch.Generator().manual_seed(seed + 11)
    n_t, n_d = target.hp.n_layer, len(draft.layers)
    for i, layer in enumerate(draft.layers):
        _copy_layer(layer, target.layer(max(0, n_t - n_d + i)))
    hsz = draft.s.n_embd
    n_feat = draft.fc.weight.shape[1] // hsz
    w = torch.randn(hsz, n_feat * hsz, generator=g) * 0.02 / n_feat ** 0.5
    w[:, (n_feat - 1) * hsz:] += torch.eye(hsz)
    draft.fc.weight.copy_(w)
    draft.hidden_norm.weight.fill_(1.0)
    draft.norm.weight.copy_(torch.from_numpy(target.output_norm()))
    draft.markov_w1.weight.copy_(torch.randn(draft.markov_w1.weight.shape, generator=g) * 0.02)
    draft.markov_w2.weight.zero_()
    draft.conf_proj.weight.zero_()
    draft.conf_proj.bias.zero_()


def sample_batch(store, windows: np.ndarray, rng: np.random.Generator, anchors: int, block: int,
                 rollouts: int = 0):
    """Tensors of one step: ``windows`` (indices into the store) and ``anchors`` blocks in each:
    up to ``rollouts`` of the window's rollout anchors (labels: the target's greedy
    continuation; teacher: the target's hidden along it), the rest at random positions of the
    text (labels: the window's next tokens; teacher: the target's hidden along the window).

    Returns tokens [b, T], feats [b, T, F], anchors [b, A], labels [b, A, bs], teacher hidden
    [b, A, bs, H] and valid [b, A, bs] (a label inside the window, or a rollout's)."""
    seq = store.tokens.shape[1]
    idx = np.sort(windows)
    n_roll = store.n_rollout_windows if getattr(store, "roll_anchors", None) is not None else 0
    count = min(anchors, seq - 1 - MIN_ANCHOR)
    pos = np.empty((len(idx), count), np.int64)
    labels = np.empty((len(idx), count, block), np.int64)
    valid = np.ones((len(idx), count, block), bool)
    teacher = np.empty((len(idx), count, block, store.final.shape[2]), np.float32)
    tokens = np.asarray(store.tokens[idx], np.int64)
    for r, w in enumerate(idx):
        k = 0
        if rollouts and w < n_roll:
            have = store.roll_anchors.shape[1]
            pick = np.sort(rng.choice(have, size=min(rollouts, have, count), replace=False))
            k = len(pick)
            pos[r, :k] = store.roll_anchors[w][pick]
            labels[r, :k] = store.roll_tokens[w][pick]
            teacher[r, :k] = store.roll_hidden[w][pick]
        text = np.sort(rng.choice(np.arange(MIN_ANCHOR, seq - 1), size=count - k, replace=False))
        pos[r, k:] = text
        at = text[:, None] + np.arange(block)               # hidden at a+k predicts a+k+1
        valid[r, k:] = at + 1 < seq
        labels[r, k:] = tokens[r][np.minimum(at + 1, seq - 1)]
        teacher[r, k:] = store.final[w][np.minimum(at, seq - 1)]
    feats = torch.from_numpy(np.asarray(store.feats[idx], np.float32))
    return (torch.from_numpy(tokens), feats, torch.from_numpy(pos), torch.from_numpy(labels),
            torch.from_numpy(teacher), torch.from_numpy(valid))


def loss_and_stats(draft: DSparkDraft, embed, lm_head, rope, mask_id: int, block: int, batch):
    """(loss, stats) of one batch; ``embed`` / ``lm_head`` the target's frozen [V, H] tensors."""
    tokens, feats, anchors, labels, teacher, valid = batch
    b = tokens.shape[0]
    a = anchors.shape[1]
    anchor_tok = torch.gather(tokens, 1, anchors)
    ids = torch.full((b, a, block), mask_id, dtype=torch.long)
    ids[:, :, 0] = anchor_tok
    hid = draft.blocks(feats, F.embedding(ids.view(b, a * block), embed), anchors, block, rope)
    prev = torch.cat([anchor_tok.unsqueeze(-1), labels[..., :-1]], dim=-1)  # teacher-forced
    z = F.linear(hid, lm_head).float() + draft.markov_bias(prev).float()
    conf_logit = draft.confidence_logit(hid, prev).float()
    with torch.no_grad():
        p_target = torch.softmax(F.linear(teacher, lm_head).float(), dim=-1)
    logp = F.log_softmax(z, dim=-1)
    l1 = (logp.exp() - p_target).abs().sum(-1)
    ce = -torch.gather(logp, -1, labels.unsqueeze(-1)).squeeze(-1)
    accept = (1.0 - 0.5 * l1).clamp(0.0, 1.0).detach()
    bce = F.binary_cross_entropy_with_logits(conf_logit, accept, reduction="none")
    w = torch.exp(-torch.arange(block, dtype=torch.float32) / DECAY_GAMMA) * valid
    norm = w.sum()
    loss = (CE_W * (w * ce).sum() + L1_W * (w * l1).sum() + CONF_W * (w * bce).sum()) / norm
    with torch.no_grad():
        n_valid = valid.sum(dim=(0, 1)).clamp(min=1)
        acc = (accept * valid).sum(dim=(0, 1)) / n_valid      # 1 - TV per slot (teacher-forced)
        top1 = ((z.argmax(-1) == p_target.argmax(-1)) & valid).sum(dim=(0, 1)) / n_valid
        stats = {"ce": float((w * ce).sum() / norm), "l1": float((w * l1).sum() / norm),
                 "bce": float((w * bce).sum() / norm), "accept": acc.numpy(), "top1": top1.numpy()}
    return loss, stats


def tau_estimate(accept) -> float:
    """DeepSpec's tau_prob: 1 + sum_k prod_{j<=k} a_j, from the per-slot acceptance."""
    return float(1.0 + np.cumprod(np.asarray(accept, np.float64)).sum())


def export_arrays(draft: DSparkDraft) -> dict:
    """The trained weights under the dflash tensor names, float32 numpy [out, in]."""
    names = {"fc.weight": "fc.weight", "hidden_norm.weight": "enc.output_norm.weight",
             "norm.weight": "output_norm.weight", "markov_w1.weight": "markov_w1.weight",
             "markov_w2.weight": "markov_w2.weight", "conf_proj.weight": "conf_proj.weight",
             "conf_proj.bias": "conf_proj.bias"}
    out = {}
    for key, value in draft.state_dict().items():
        if key.startswith("layers."):
            _, i, rest = key.split(".", 2)
            name = f"blk.{i}.{rest}"
        else:
            name = names[key]
        out[name] = value.detach().float().numpy().copy()
    return out
