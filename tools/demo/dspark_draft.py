"""The DSpark draft at inference, in torch (the card's "Architecture"): a block's forward and its
greedy Markov chain. Used by evaluate.py and reference.py; the draft itself is trained by
``ds4tools distill`` (import_distilled.py)."""
from __future__ import annotations

import torch

from .corpus import SPECIALS
from .model import DSparkDraft, Qwen3Target, block_mask

MASK_ID = SPECIALS.index("<|mask|>")


def block_forward(draft: DSparkDraft, target: Qwen3Target, features, ids, anchors):
    """Draft hidden for blocks [anchor, mask x (bs-1)]: features [B, T, F], ids [B, T], anchors [B, R]
    -> hid [B, R, bs, H] (post final norm) and the anchor tokens [B, R]."""
    bsz, t_len = ids.shape
    r, bs = anchors.shape[1], draft.dshape.block_size
    ctx = draft.context(features)
    ctx_pos = torch.arange(t_len).expand(bsz, -1)
    anchor_tok = torch.gather(ids, 1, anchors)
    block_ids = torch.full((bsz, r, bs), MASK_ID, dtype=torch.long)
    block_ids[:, :, 0] = anchor_tok
    emb = target.model.embed_tokens(block_ids.view(bsz, r * bs))
    block_pos = (anchors.unsqueeze(-1) + torch.arange(bs)).view(bsz, r * bs)
    hid = draft.backbone(ctx, ctx_pos, emb, block_pos, block_mask(anchors, t_len, bs))
    return hid.view(bsz, r, bs, -1), anchor_tok


def propose(draft: DSparkDraft, target: Qwen3Target, hid, anchor_tok, margins: bool = False):
    """Greedy Markov chain over a block: drafts [.., bs], confidence probabilities [.., bs]
    (and, if asked, the top-1 minus top-2 corrected logit of each slot)."""
    base = target.lm_head(hid).float()
    prev = anchor_tok
    drafts, confs, gaps = [], [], []
    for k in range(hid.shape[-2]):
        z = base[..., k, :] + draft.markov_bias(prev).float()
        confs.append(torch.sigmoid(draft.confidence_logit(hid[..., k, :], prev).float()))
        top2 = torch.topk(z, 2).values
        gaps.append(top2[..., 0] - top2[..., 1])
        prev = z.argmax(-1)
        drafts.append(prev)
    out = (torch.stack(drafts, -1), torch.stack(confs, -1))
    return out + (torch.stack(gaps, -1),) if margins else out
