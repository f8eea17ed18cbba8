"""The training loop: AdamW, linear warm-up then cosine to 5% of the peak, gradient clipping at
1, a step budget (``--steps``) or a wall-clock one (``--time``), checkpoints in the run
directory, tqdm progress on stderr with the loss and the running acceptance estimate.

Resuming is exact: a step's batch depends only on (seed, step) (``step_rng``), and a
checkpoint holds the weights, the optimizer state, torch's RNG state and the schedule, so a run
that is killed and resumed computes the same steps as one that never stopped (with the same
thread count: torch's float sums depend on it). With ``--time`` the step count is fixed once,
from the speed of the first steps, and stored with the checkpoint; the run also stops when the
budget is spent.
"""
from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch

__all__ = ["cosine_lr", "step_rng", "TrainResult", "train_loop", "CHECKPOINT", "save_atomic"]

CHECKPOINT = "checkpoint.pt"
#: steps timed before a --time run fixes its step count
CALIBRATION_STEPS = 8
#: the share of the remaining --time the step count is planned for
TIME_MARGIN = 0.95


def cosine_lr(step: int, total: int, peak: float, warmup: int, min_frac: float = 0.05) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (min_frac + (1 - min_frac) * 0.5 * (1 + math.cos(math.pi * progress)))


def step_rng(seed: int, step: int) -> np.random.Generator:
    """The generator of step ``step``'s batch: the same for a resumed run."""
    return np.random.default_rng([seed, 3, step])


def save_atomic(obj, path: str) -> None:
    tmp = path + ".tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


@dataclass
class TrainResult:
    steps: int
    total_steps: int
    train_seconds: float
    elapsed_seconds: float        # the whole run so far (data preparation included)
    ema: dict
    history: list = field(default_factory=list)
    resumed_from: int = 0
    stopped_by: str = "steps"     # "steps" | "time"


def train_loop(module, task, *, seed: int, steps: int | None, time_s: float | None, lr: float,
               warmup: int, run_dir: str, elapsed: float, checkpoint_seconds: float,
               progress: bool | None, desc: str, on_step=None, bf16: bool = True) -> TrainResult:
    """Train ``module`` on ``task`` (``batch(rng)``, ``loss(module, batch) -> (loss, stats)``,
    ``ema_keys``, ``postfix(ema)``). ``elapsed``: the run's seconds before training (counted in
    ``time_s``). ``on_step(step)``: called after each completed step (tests interrupt there).
    ``bf16``: autocast the forward and backward to bfloat16 (the weights and the optimizer stay
    float32)."""
    from tqdm import tqdm
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    path = os.path.join(run_dir, CHECKPOINT)
    state = {"step": 0, "total": steps, "warmup": warmup if steps is None else min(warmup, max(1, steps // 10)),
             "train_seconds": 0.0, "elapsed": elapsed, "ema": None, "history": []}
    resumed_from = 0
    if os.path.exists(path):
        ck = torch.load(path, weights_only=False)
        module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        torch.set_rng_state(ck["torch_rng"])
        state = ck["state"]
        state["elapsed"] = max(state["elapsed"], elapsed)
        resumed_from = state["step"]

    def save():
        save_atomic({"model": module.state_dict(), "opt": opt.state_dict(),
                     "torch_rng": torch.get_rng_state(), "state": state}, path)

    clock = time.monotonic
    session_start = clock()
    base_elapsed = state["elapsed"]
    last_save = clock()
    calib_t0 = None
    stopped_by = "steps"
    bar = tqdm(total=state["total"], initial=state["step"], desc=desc, unit="step", file=sys.stderr,
               disable=None if progress is None else not progress, dynamic_ncols=True,
               leave=False)
    updating = False
    try:
        while True:
            step = state["step"]
            if state["total"] is not None and step >= state["total"]:
                break
            now_elapsed = base_elapsed + (clock() - session_start)
            if time_s is not None and now_elapsed >= time_s and step > 0:
                stopped_by = "time"
                break
            if state["total"] is None and step == 2:
                calib_t0 = clock()  # after the first steps (allocation, warm caches)
            if state["total"] is None and step == 2 + CALIBRATION_STEPS and calib_t0 is not None:
                per = (clock() - calib_t0) / CALIBRATION_STEPS
                # 5% in hand: a machine that slows down later still ends the schedule (the
                # learning rate annealed) rather than being cut by the budget
                left = max(0.0, time_s - now_elapsed) * TIME_MARGIN
                state["total"] = max(step + 1, step + int(left / max(per, 1e-6)))
                state["warmup"] = min(state["warmup"], max(1, state["total"] // 10))
                bar.reset(total=state["total"])
                bar.update(step)
            total = state["total"] if state["total"] is not None else 10 ** 9
            t0 = clock()
            rate = cosine_lr(step, total, lr, state["warmup"])
            for group in opt.param_groups:
                group["lr"] = rate
            module.train()
            batch = task.batch(step_rng(seed, step))
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss, stats = task.loss(module, batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            updating = True
            opt.step()
            state["step"] = step + 1
            updating = False
            vals = {"loss": float(loss.detach()), **{k: stats[k] for k in task.ema_keys}}
            ema = state["ema"]
            state["ema"] = vals if ema is None else {
                k: 0.95 * np.asarray(ema[k]) + 0.05 * np.asarray(v) for k, v in vals.items()}
            state["train_seconds"] += clock() - t0
            state["elapsed"] = base_elapsed + (clock() - session_start)
            if (step + 1) % 25 == 0 or step == 0 or step + 1 == state["total"]:
                state["history"].append({"step": step + 1, "lr": rate, **_plain(state["ema"])})
            bar.update(1)
            bar.set_postfix(task.postfix(state["ema"]), refresh=False)
            if clock() - last_save >= checkpoint_seconds:
                save()
                last_save = clock()
            if on_step is not None:
                on_step(step + 1)
    except BaseException:
        # Ctrl-C, SIGTERM, an error: keep what is done, unless the optimizer was midway
        # through its update (then the last checkpoint stands)
        if not updating and state["step"] > resumed_from:
            save()
        raise
    finally:
        bar.close()
    if state["total"] is None or stopped_by == "time":
        state["total"] = state["step"]
    save()
    return TrainResult(state["step"], state["total"], state["train_seconds"], state["elapsed"],
                       _plain(state["ema"]), state["history"], resumed_from, stopped_by)


def _plain(ema) -> dict:
    if not ema:
        return {}
    return {k: (np.asarray(v).round(5).tolist()) for k, v in ema.items()}
