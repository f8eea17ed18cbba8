"""Stage 5: train the DSpark draft on the self-distilled dataset with DeepSpec's loss."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .common import Log, Plan, Timer, adapt_threads, cosine_lr, save_atomic, step_rng, write_json
from .corpus import SPECIALS
from .dspark_data import load_dataset
from .model import DraftShape, DSparkDraft, Qwen3Target, TargetShape, block_mask
from .train_target import make_optimizer

MASK_ID = SPECIALS.index("<|mask|>")
CE_W, L1_W, CONF_W, DECAY_GAMMA = 0.1, 0.9, 1.0, 4.0
VAL_WINDOWS = 24  # the dataset's last windows, never trained on


def init_draft(draft: DSparkDraft, target: Qwen3Target, seed: int) -> None:
    """Layers from the target's last ones, fc picking the last target layer, Markov bias off."""
    g = torch.Generator().manual_seed(seed + 11)
    n_t, n_d, hsz = target.shape.num_hidden_layers, len(draft.layers), target.shape.hidden_size
    with torch.no_grad():
        for i, layer in enumerate(draft.layers):
            layer.load_state_dict(target.model.layers[n_t - n_d + i].state_dict())
        n_feat = len(draft.dshape.target_layer_ids)
        w = torch.randn(hsz, n_feat * hsz, generator=g) * 0.02 / n_feat ** 0.5
        w[:, (n_feat - 1) * hsz:] += torch.eye(hsz)
        draft.fc.weight.copy_(w)
        draft.hidden_norm.weight.fill_(1.0)
        draft.norm.weight.copy_(target.model.norm.weight)
        draft.markov_head.markov_w1.weight.copy_(
            torch.randn(draft.markov_head.markov_w1.weight.shape, generator=g) * 0.02)
        draft.markov_head.markov_w2.weight.zero_()
        draft.confidence_head.proj.weight.zero_()
        draft.confidence_head.proj.bias.zero_()


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


def batch_tensors(data: dict, windows: np.ndarray, rng: np.random.Generator | None = None, per_window: int = 0,
                  sampled_per_window: int | None = None):
    """Tensors for the given windows; with rng, only `per_window` random anchors of each window
    (their greedy rollouts, and the sampled rollouts of the first `sampled_per_window` of them),
    so a step sees more windows for the same number of blocks."""
    ids = torch.from_numpy(data["ids"][windows].astype(np.int64))
    feats = torch.from_numpy(data["features"][windows].astype(np.float32))
    a_count = data["anchors"].shape[1]
    if rng is None or per_window <= 0 or per_window >= a_count:
        pick = np.tile(np.arange(a_count), (len(windows), 1))
    else:
        pick = np.stack([np.sort(rng.choice(a_count, per_window, replace=False)) for _ in windows])
    n_sampled = pick.shape[1] if sampled_per_window is None else sampled_per_window
    rows = np.concatenate([pick, pick[:, :n_sampled] + a_count], axis=1)  # greedy rows, then sampled
    w_idx = np.asarray(windows)[:, None]
    anchors = torch.from_numpy(data["anchors"][w_idx, rows % a_count].astype(np.int64))
    roll = torch.from_numpy(data["roll_tokens"][w_idx, rows].astype(np.int64))
    roll_hidden = torch.from_numpy(data["roll_hidden"][w_idx, rows].astype(np.float32))
    return ids, feats, anchors, roll, roll_hidden


def dspark_loss(draft, target, ids, feats, anchors, roll, roll_hidden):
    hid, anchor_tok = block_forward(draft, target, feats, ids, anchors)
    bs = hid.shape[2]
    prev = torch.cat([anchor_tok.unsqueeze(-1), roll[..., :-1]], dim=-1)  # teacher-forced Markov input
    z = target.lm_head(hid).float() + draft.markov_bias(prev).float()
    conf_logit = draft.confidence_logit(hid, prev).float()
    with torch.no_grad():
        p_target = torch.softmax(target.lm_head(roll_hidden).float(), dim=-1)
    logp = F.log_softmax(z, dim=-1)
    l1 = (logp.exp() - p_target).abs().sum(-1)
    ce = -torch.gather(logp, -1, roll.unsqueeze(-1)).squeeze(-1)
    accept = (1.0 - 0.5 * l1).clamp(0.0, 1.0).detach()
    bce = F.binary_cross_entropy_with_logits(conf_logit, accept, reduction="none")
    w = torch.exp(-torch.arange(bs, dtype=torch.float32) / DECAY_GAMMA).expand_as(l1)
    norm = w.sum()
    loss = (CE_W * (w * ce).sum() + L1_W * (w * l1).sum() + CONF_W * (w * bce).sum()) / norm
    with torch.no_grad():
        stats = {
            "ce": float((w * ce).sum() / norm), "l1": float((w * l1).sum() / norm),
            "bce": float((w * bce).sum() / norm),
            "accept": accept.mean(dim=(0, 1)),  # 1 - TV per position (teacher-forced)
        }
    return loss, stats


@torch.no_grad()
def validate(draft, target, data, val_idx) -> dict:
    """Own-chain accepted length against the stored greedy rollouts of never-trained windows."""
    a_count = data["anchors"].shape[1]
    accepted, first = [], []
    for w in val_idx:
        ids, feats, anchors, roll, _ = batch_tensors(data, np.array([w]))
        anchors, roll = anchors[:, :a_count], roll[:, :a_count]
        hid, anchor_tok = block_forward(draft, target, feats, ids, anchors)
        drafts, _ = propose(draft, target, hid, anchor_tok)
        match = (drafts == roll).int().cumprod(-1)
        accepted.append(match.sum(-1).flatten())
        first.append(match[..., 0].flatten())
    acc = torch.cat(accepted).float()
    return {"tau": float(1 + acc.mean()), "pos1": float(torch.cat(first).float().mean())}


def train_dspark(plan: Plan, work: Path, log: Log) -> dict:
    target = Qwen3Target(TargetShape())
    target.load_state_dict(torch.load(work / "target_shipped.pt"))
    target.eval()
    for p in target.parameters():
        p.requires_grad_(False)
    draft = DSparkDraft(TargetShape(), DraftShape())
    data = load_dataset(plan, work)
    n_win = data["ids"].shape[0]
    n_val = min(VAL_WINDOWS, max(1, n_win // 8))
    train_n = n_win - n_val
    val_idx = np.arange(train_n, n_win)
    params = list(draft.parameters())
    opt = make_optimizer(params, plan.ds_lr, 0.0)
    ckpt_path = work / "dspark_ckpt.pt"
    start, history, val_history, compute_s = 0, [], [], 0.0
    if ckpt_path.exists():
        ck = torch.load(ckpt_path, weights_only=False)
        draft.load_state_dict(ck["draft"])
        opt.load_state_dict(ck["opt"])
        start, history, val_history, compute_s = ck["step"], ck["history"], ck["val"], ck["compute_s"]
        log(f"dspark: resumed at step {start}")
    else:
        init_draft(draft, target, plan.seed)
    log(f"dspark: {sum(p.numel() for p in params):,} trainable parameters, {train_n} train windows "
        f"({train_n * data['anchors'].shape[1] * 2} blocks), {plan.ds_steps} steps")
    timer, ema = Timer(), None
    per_step = plan.ds_windows_per_step
    val_every = max(1, plan.ds_steps // 6)
    for step in range(start, plan.ds_steps):
        adapt_threads()
        lr = cosine_lr(step, plan.ds_steps, plan.ds_lr, plan.ds_warmup, 0.05)
        for group in opt.param_groups:
            group["lr"] = lr
        epoch, offset = divmod(step * per_step, train_n)
        order = step_rng(plan.seed, "dspark-epoch", epoch).permutation(train_n)
        windows = order[np.arange(offset, offset + per_step) % train_n]
        batch = batch_tensors(data, windows, step_rng(plan.seed, "dspark-anchors", step), plan.ds_anchors_per_step,
                              plan.ds_sampled_per_step if plan.ds_sampled_per_step >= 0 else None)
        draft.train()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, stats = dspark_loss(draft, target, *batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        vals = np.array([float(loss.detach()), stats["ce"], stats["l1"], stats["bce"], *stats["accept"].tolist()])
        ema = vals if ema is None else 0.95 * ema + 0.05 * vals
        compute_s += timer.lap()
        if (step + 1) % plan.log_every == 0 or step + 1 == plan.ds_steps:
            history.append((step + 1, *[round(float(v), 4) for v in ema]))
            acc = " ".join(f"{v:.2f}" for v in ema[4:])
            log(f"dspark step {step + 1}/{plan.ds_steps} loss {ema[0]:.3f} ce {ema[1]:.3f} l1 {ema[2]:.3f} "
                f"bce {ema[3]:.3f} accept@k {acc} lr {lr:.2e} wall {compute_s:.0f}s")
        if (step + 1) % val_every == 0 or step + 1 == plan.ds_steps:
            draft.eval()
            v = validate(draft, target, data, val_idx)
            val_history.append((step + 1, round(v["tau"], 4), round(v["pos1"], 4)))
            log(f"dspark validation (train-split windows) step {step + 1}: tau {v['tau']:.3f} "
                f"pos1 {v['pos1']:.3f}")
            compute_s += timer.lap()
        if (step + 1) % plan.checkpoint_every == 0 or step + 1 == plan.ds_steps:
            save_atomic({"draft": draft.state_dict(), "opt": opt.state_dict(), "step": step + 1,
                         "history": history, "val": val_history, "compute_s": compute_s}, ckpt_path)
    torch.save(draft.state_dict(), work / "dspark_final.pt")
    greedy_rows = plan.ds_anchors_per_step or data["anchors"].shape[1]
    blocks_per_window = greedy_rows + (greedy_rows if plan.ds_sampled_per_step < 0 else plan.ds_sampled_per_step)
    metrics = {
        "steps": plan.ds_steps, "windows_per_step": per_step,
        "blocks_per_step": per_step * blocks_per_window,
        "epochs": plan.ds_steps * per_step * blocks_per_window / (train_n * 2 * data["anchors"].shape[1]),
        "wall_s": round(compute_s, 1),
        "parameters_trainable": sum(p.numel() for p in params),
        "loss": f"{CE_W}*CE + {L1_W}*L1(p_draft, p_target) + {CONF_W}*BCE(conf, 1 - L1/2), "
                f"weights exp(-k/{DECAY_GAMMA:g})",
        "loss_history_columns": ["step", "loss", "ce", "l1", "bce"] + [f"accept@{k}" for k in range(8)],
        "loss_history": history,
        "validation_columns": ["step", "tau", "pos1"],
        "validation": val_history,
    }
    write_json(work / "dspark_metrics.json", metrics)
    return metrics
