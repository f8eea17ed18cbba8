"""Per-step times of the torch stages (target, MTP layer) at the plan's shapes, on random data (run
it on an idle machine). The DSpark draft's stage is ``ds4tools distill``, whose costs
docs/distill.md lists."""
from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F

from .common import Log, Plan
from .model import Qwen3Target, TargetShape
from .train_mtp import mtp_losses
from .train_target import make_optimizer


def _best(fn, warm: int = 2, reps: int = 5) -> dict:
    """Best wall time and best process CPU time per call (CPU time barely moves with contention)."""
    for _ in range(warm):
        fn()
    walls, cpus = [], []
    for _ in range(reps):
        t, c = time.time(), time.process_time()
        fn()
        walls.append(time.time() - t)
        cpus.append(time.process_time() - c)
    return {"seconds_per_step": round(min(walls), 4), "cpu_seconds_per_step": round(min(cpus), 4),
            "threads": torch.get_num_threads(), "load_average": round(os.getloadavg()[0], 2)}


def bench(plan: Plan, log: Log, threads: int = 2) -> dict:
    torch.manual_seed(0)
    s = TargetShape()
    target = Qwen3Target(s)
    v = s.vocab_size
    out = {}

    params = target.trunk_parameters()
    opt = make_optimizer(params, 1e-3, 0.1)
    batch = torch.randint(0, v, (plan.target_batch, plan.target_seq + 1))

    def target_step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h, _ = target(batch[:, :-1])
            logits = target.lm_head(h)
        loss = F.cross_entropy(logits.float().reshape(-1, v), batch[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()

    torch.set_num_threads(threads)
    out["target"] = {**_best(target_step),
                     "what": f"fwd+bwd+AdamW, {plan.target_batch}x{plan.target_seq} tokens"}
    log(f"bench target {out['target']['seconds_per_step']:.3f} s/step")
    long_n = max(1, plan.target_batch * plan.target_seq // s.max_position_embeddings)
    batch = torch.randint(0, v, (long_n, s.max_position_embeddings + 1))
    out["target_long"] = {**_best(target_step),
                          "what": f"fwd+bwd+AdamW, {long_n}x{s.max_position_embeddings} tokens"}
    log(f"bench target (long windows) {out['target_long']['seconds_per_step']:.3f} s/step")

    mopt = make_optimizer(list(target.mtp.parameters()), 1e-3, 0.0)
    mbatch = torch.randint(0, v, (plan.mtp_batch, plan.mtp_seq + 1))

    def mtp_step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            kl, ce, _ = mtp_losses(target, mbatch)
        mopt.zero_grad()
        (kl + ce).backward()
        mopt.step()

    out["mtp"] = {**_best(mtp_step),
                  "what": f"frozen target fwd + MTP fwd/bwd, {plan.mtp_batch}x{plan.mtp_seq}"}
    log(f"bench mtp {out['mtp']['seconds_per_step']:.3f} s/step")

    return out
