"""Reference outputs of the shipped weights (torch, fp32) for the torch-free tests and the engine.

For a few prompts: the target's last-position logits, its greedy continuation (with the top-1/top-2
margin of each step, so a re-implementation can tell a near-tie from a bug), the MTP layer's argmax
per prompt row, and one DSpark block drafted from the first greedy token.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from .evaluate import generate
from .dspark_draft import block_forward, propose

N_PROMPTS, N_GREEDY = 4, 16


@torch.no_grad()
def build_reference(target, draft, prompts: list[np.ndarray]) -> dict:
    out = []
    for index, prompt in enumerate(prompts[:N_PROMPTS]):
        ids = torch.from_numpy(prompt.astype(np.int64))[None]
        h, _ = target(ids)
        logits = target.lm_head(h)[0]
        nll = F.cross_entropy(logits[:-1], ids[0, 1:])
        last = logits[-1]
        top = torch.topk(last, 8)
        seq = generate(target, prompt, N_GREEDY, 0.0, None)
        full = torch.from_numpy(seq)[None]
        hf, _ = target(full)
        lg = target.lm_head(hf)[0, len(prompt) - 1:-1]
        top2 = torch.topk(lg, 2).values
        mtp_logits = target.lm_head(target.mtp_hidden(h, ids))[0]
        mtp_top2 = torch.topk(mtp_logits, 2)
        # One DSpark block: context = the prompt, anchor = the first greedy token at position P.
        ctx_ids = torch.from_numpy(seq[:len(prompt) + 1])[None]
        _, feats = target(ctx_ids, capture=tuple(draft.dshape.target_layer_ids))
        feats = torch.cat([feats[i] for i in draft.dshape.target_layer_ids], dim=-1)
        anchors = torch.tensor([[len(prompt)]])
        hid, anchor_tok = block_forward(draft, target, feats, ctx_ids, anchors)
        drafts, confs, gaps = propose(draft, target, hid, anchor_tok, margins=True)
        base = target.lm_head(hid)[0, 0]
        out.append({
            "prompt_index": index,
            "n_tokens": len(prompt),
            "mean_nll": round(float(nll), 5),
            "last_logits_top8_ids": top.indices.tolist(),
            "last_logits_top8_values": [round(v, 4) for v in top.values.tolist()],
            "greedy_tokens": seq[len(prompt):].tolist(),
            "greedy_margins": [round(v, 4) for v in (top2[:, 0] - top2[:, 1]).tolist()],
            "mtp_top1": mtp_top2.indices[:, 0].tolist(),
            "mtp_margins": [round(v, 4) for v in (mtp_top2.values[:, 0] - mtp_top2.values[:, 1]).tolist()],
            "dspark_anchor_position": len(prompt),
            "dspark_anchor_token": int(seq[len(prompt)]),
            "dspark_draft_tokens": drafts[0, 0].tolist(),
            "dspark_margins": [round(v, 4) for v in gaps[0, 0].tolist()],
            "dspark_confidence": [round(v, 5) for v in confs[0, 0].tolist()],
            "dspark_base_logits_slot0_top4_ids": torch.topk(base[0], 4).indices.tolist(),
            "dspark_base_logits_slot0_top4_values": [round(v, 4) for v in torch.topk(base[0], 4).values.tolist()],
        })
    return {"dtype": "fp32 compute on the shipped f16 weights", "prompts": out}
