"""Stage 2: train the Qwen3 target (next-token CE on random windows of the train split)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .common import Log, Plan, Timer, adapt_threads, cosine_lr, cpu_seconds, save_atomic, step_rng, write_json
from .model import Qwen3Target, TargetShape


def init_weights(model: Qwen3Target, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    n_layers = model.shape.num_hidden_layers
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)  # every 1-D tensor of the target is an RMSNorm weight
                continue
            std = 0.02
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                std = 0.02 / (2 * n_layers) ** 0.5  # keep the residual stream's growth in check
            p.copy_(torch.randn(p.shape, generator=g) * std)


def random_windows(tokens: np.ndarray, rng: np.random.Generator, batch: int, length: int) -> torch.Tensor:
    starts = rng.integers(0, len(tokens) - length, size=batch)
    return torch.from_numpy(np.stack([tokens[s:s + length] for s in starts]).astype(np.int64))


def make_optimizer(params, lr: float, wd: float):
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr, betas=(0.9, 0.95), eps=1e-8,
    )


@torch.no_grad()
def sequence_loss(model: Qwen3Target, seqs: list[np.ndarray], seg: int) -> tuple[float, int]:
    """Mean next-token NLL (nats) over all positions of the given token arrays, fp32, in segments."""
    total, count = 0.0, 0
    for arr in seqs:
        for s in range(0, len(arr) - 1, seg):
            chunk = torch.from_numpy(arr[s:s + seg + 1].astype(np.int64))[None]
            if chunk.shape[1] < 2:
                continue
            h, _ = model(chunk[:, :-1])
            nll = F.cross_entropy(model.lm_head(h)[0], chunk[0, 1:], reduction="sum")
            total += float(nll)
            count += chunk.shape[1] - 1
    return total / max(count, 1), count


def fixed_train_windows(tokens: np.ndarray, seed: int, n: int, length: int) -> list[np.ndarray]:
    rng = np.random.default_rng([seed, 99])
    return [tokens[s:s + length + 1] for s in rng.integers(0, len(tokens) - length - 1, size=n)]


def train_target(plan: Plan, work: Path, log: Log) -> dict:
    tokens = np.load(work / "train_tokens.npy")
    heldout = list(np.load(work / "heldout_tokens.npz").values())
    shape = TargetShape()
    model = Qwen3Target(shape)
    init_weights(model, plan.seed)
    params = model.trunk_parameters()
    opt = make_optimizer(params, plan.target_lr, plan.target_wd)
    ckpt_path = work / "target_ckpt.pt"
    start, history, heldout_history, compute_s, cpu_s = 0, [], [], 0.0, 0.0
    if ckpt_path.exists():
        ck = torch.load(ckpt_path, weights_only=False)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        start, history, compute_s, cpu_s = ck["step"], ck["history"], ck["compute_s"], ck["cpu_s"]
        heldout_history = ck["heldout_history"]
        log(f"target: resumed at step {start}")
    n_trunk = sum(p.numel() for p in params)
    log(f"target: {n_trunk:,} parameters (MTP layer excluded), {plan.target_steps} steps of "
        f"{plan.target_batch}x{plan.target_seq} tokens, {len(tokens):,} train tokens")
    model.train()
    timer, cpu0, ema = Timer(), cpu_seconds(), None
    for step in range(start, plan.target_steps):
        adapt_threads()
        lr = cosine_lr(step, plan.target_steps, plan.target_lr, plan.target_warmup, plan.target_min_lr_frac)
        for group in opt.param_groups:
            group["lr"] = lr
        batch_n, seq = plan.target_batch, plan.target_seq
        if step >= plan.target_long_from * plan.target_steps:
            batch_n, seq = max(1, batch_n * seq // shape.max_position_embeddings), shape.max_position_embeddings
        batch = random_windows(tokens, step_rng(plan.seed, "target", step), batch_n, seq + 1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h, _ = model(batch[:, :-1])
            logits = model.lm_head(h)
        loss = F.cross_entropy(logits.float().reshape(-1, shape.vocab_size), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        value = float(loss.detach())
        ema = value if ema is None else 0.98 * ema + 0.02 * value
        compute_s += timer.lap()
        if (step + 1) % plan.log_every == 0 or step + 1 == plan.target_steps:
            history.append((step + 1, round(ema, 4)))
            cpu_now = cpu_seconds()
            cpu_s += cpu_now - cpu0
            cpu0 = cpu_now
            log(f"target step {step + 1}/{plan.target_steps} loss {value:.3f} ema {ema:.3f} lr {lr:.2e} "
                f"wall {compute_s:.0f}s")
        if (step + 1) % plan.target_eval_every == 0:
            model.eval()
            ho_loss, _ = sequence_loss(model, heldout, 512)
            model.train()
            heldout_history.append((step + 1, round(ho_loss, 4)))
            log(f"target step {step + 1}: held-out loss {ho_loss:.4f}")
            timer.lap()  # evaluation time is not training time
        if (step + 1) % plan.checkpoint_every == 0 or step + 1 == plan.target_steps:
            save_atomic({"model": model.state_dict(), "opt": opt.state_dict(), "step": step + 1,
                         "history": history, "heldout_history": heldout_history,
                         "compute_s": compute_s, "cpu_s": cpu_s}, ckpt_path)
    model.eval()
    heldout_loss, heldout_tokens = sequence_loss(model, heldout, 512)
    train_loss, _ = sequence_loss(model, fixed_train_windows(tokens, plan.seed, 64, 512), 512)
    metrics = {
        "parameters_trunk": n_trunk,
        "steps": plan.target_steps,
        "tokens_seen": plan.target_steps * plan.target_batch * plan.target_seq,
        "epochs": plan.target_steps * plan.target_batch * plan.target_seq / len(tokens),
        "wall_s": round(compute_s, 1),
        "heldout_loss_fp32_weights": round(heldout_loss, 4),
        "heldout_tokens": heldout_tokens,
        "train_windows_loss_fp32_weights": round(train_loss, 4),
        "loss_history": history,
        "heldout_loss_history": heldout_history + [(plan.target_steps, round(heldout_loss, 4))],
        "cpu_s": round(cpu_s, 1),
        "windows": f"{plan.target_batch}x{plan.target_seq}, the last "
                   f"{1 - plan.target_long_from:.0%} of steps "
                   f"{plan.target_batch * plan.target_seq // shape.max_position_embeddings}x{shape.max_position_embeddings}",
    }
    torch.save(model.state_dict(), work / "target_final.pt")
    write_json(work / "target_metrics.json", metrics)
    log(f"target: done; held-out loss {heldout_loss:.4f} nats/token, train windows {train_loss:.4f}")
    return metrics
