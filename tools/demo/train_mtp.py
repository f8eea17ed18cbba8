"""Stage 3: train the NextN/MTP layer on the frozen target (distillation to the target plus CE)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .common import Log, Plan, Timer, adapt_threads, cosine_lr, save_atomic, step_rng, write_json
from .model import Qwen3Target, TargetShape
from .train_target import make_optimizer, random_windows

DISTILL_WEIGHT, CE_WEIGHT = 0.9, 0.1


def init_mtp(model: Qwen3Target, seed: int) -> None:
    """Decoder part from the target's last layer; eh_proj small random; norms at one."""
    g = torch.Generator().manual_seed(seed + 7)
    mtp = model.mtp
    last = model.model.layers[model.shape.num_hidden_layers - 1]
    with torch.no_grad():
        missing, unexpected = mtp.load_state_dict(last.state_dict(), strict=False)
        assert not unexpected and all(k.startswith(("enorm", "hnorm", "eh_proj", "shared_head")) for k in missing)
        mtp.enorm.weight.fill_(1.0)
        mtp.hnorm.weight.fill_(1.0)
        mtp.shared_head.norm.weight.copy_(model.model.norm.weight)
        mtp.eh_proj.weight.copy_(torch.randn(mtp.eh_proj.weight.shape, generator=g) * 0.02)


def mtp_losses(model: Qwen3Target, batch: torch.Tensor):
    """batch [B, T+1]: returns (distill KL, CE, agreement) over MTP rows 0..T-2."""
    with torch.no_grad():
        h, _ = model(batch[:, :-1])
        target_logp = F.log_softmax(model.lm_head(h[:, 1:]).float(), dim=-1)  # predicts t_{i+2}
    mtp_h = model.mtp_hidden(h, batch[:, :-1])  # rows 0..T-2
    logp = F.log_softmax(model.lm_head(mtp_h).float(), dim=-1)
    kl = (target_logp.exp() * (target_logp - logp)).sum(-1).mean()
    ce = F.nll_loss(logp.reshape(-1, logp.shape[-1]), batch[:, 2:].reshape(-1))
    agree = (logp.argmax(-1) == target_logp.argmax(-1)).float().mean()
    return kl, ce, agree


def train_mtp(plan: Plan, work: Path, log: Log) -> dict:
    tokens = np.load(work / "train_tokens.npy")
    model = Qwen3Target(TargetShape())
    model.load_state_dict(torch.load(work / "target_shipped.pt"))
    for p in model.parameters():
        p.requires_grad_(False)
    params = list(model.mtp.parameters())
    for p in params:
        p.requires_grad_(True)
    ckpt_path = work / "mtp_ckpt.pt"
    opt = make_optimizer(params, plan.mtp_lr, 0.0)
    start, history, compute_s = 0, [], 0.0
    if ckpt_path.exists():
        ck = torch.load(ckpt_path, weights_only=False)
        model.mtp.load_state_dict(ck["mtp"])
        opt.load_state_dict(ck["opt"])
        start, history, compute_s = ck["step"], ck["history"], ck["compute_s"]
        log(f"mtp: resumed at step {start}")
    else:
        init_mtp(model, plan.seed)
    log(f"mtp: {sum(p.numel() for p in params):,} parameters, {plan.mtp_steps} steps")
    timer, ema = Timer(), None
    model.eval()
    for step in range(start, plan.mtp_steps):
        adapt_threads()
        lr = cosine_lr(step, plan.mtp_steps, plan.mtp_lr, 30, 0.05)
        for group in opt.param_groups:
            group["lr"] = lr
        batch = random_windows(tokens, step_rng(plan.seed, "mtp", step), plan.mtp_batch, plan.mtp_seq + 1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            kl, ce, agree = mtp_losses(model, batch)
        loss = DISTILL_WEIGHT * kl + CE_WEIGHT * ce
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        vals = np.array([float(kl.detach()), float(ce.detach()), float(agree)])
        ema = vals if ema is None else 0.95 * ema + 0.05 * vals
        compute_s += timer.lap()
        if (step + 1) % plan.log_every == 0 or step + 1 == plan.mtp_steps:
            history.append((step + 1, *[round(float(v), 4) for v in ema]))
            log(f"mtp step {step + 1}/{plan.mtp_steps} kl {ema[0]:.3f} ce {ema[1]:.3f} "
                f"agree {ema[2]:.3f} lr {lr:.2e} wall {compute_s:.0f}s")
        if (step + 1) % plan.checkpoint_every == 0 or step + 1 == plan.mtp_steps:
            save_atomic({"mtp": model.mtp.state_dict(), "opt": opt.state_dict(), "step": step + 1,
                         "history": history, "compute_s": compute_s}, ckpt_path)
    torch.save(model.mtp.state_dict(), work / "mtp_final.pt")
    metrics = {"steps": plan.mtp_steps, "wall_s": round(compute_s, 1), "loss_history": history,
               "parameters": sum(p.numel() for p in params),
               "loss": f"{DISTILL_WEIGHT}*KL(p_target || p_mtp) + {CE_WEIGHT}*CE(next-next token)"}
    write_json(work / "mtp_metrics.json", metrics)
    return metrics
