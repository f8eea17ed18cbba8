"""Per-step times of every stage at the plan's shapes, on random data (run it on an idle machine)."""
from __future__ import annotations

import os
import time

import numpy as np
import torch
import torch.nn.functional as F

from .common import Log, Plan
from .model import DraftShape, DSparkDraft, Qwen3Target, TargetShape
from .rollout import rollout
from .train_dspark import dspark_loss
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
    s, d = TargetShape(), DraftShape()
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

    nb, a, t_len = plan.ds_gen_batch, plan.ds_anchors_per_window, plan.ds_window_len
    ids = torch.randint(0, v, (nb, t_len))
    anchors = torch.from_numpy(np.sort(np.random.default_rng(0).choice(
        np.arange(plan.ds_min_anchor, t_len), size=(nb, a)), axis=1)).long()
    anchors = torch.cat([anchors, anchors], 1)
    temps = torch.cat([torch.zeros(nb, a), torch.ones(nb, a)], 1)

    def data_step():
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
            rollout(target, ids, anchors, d.block_size, temps, torch.Generator().manual_seed(0),
                    capture=d.target_layer_ids)

    out["dspark_data"] = {**_best(data_step, 1, 3),
                          "what": f"{nb} windows x {a} anchors x 2 rollouts"}
    log(f"bench dspark data {out['dspark_data']['seconds_per_step']:.3f} s/shard")

    draft = DSparkDraft(s, d)
    for p in target.parameters():
        p.requires_grad_(False)
    dopt = make_optimizer(list(draft.parameters()), 1e-3, 0.0)
    w = plan.ds_windows_per_step
    greedy = plan.ds_anchors_per_step or a
    blocks = greedy + (greedy if plan.ds_sampled_per_step < 0 else plan.ds_sampled_per_step)
    feats = torch.randn(w, t_len, len(d.target_layer_ids) * s.hidden_size)
    dids = torch.randint(0, v, (w, t_len))
    danchors = torch.sort(torch.randint(plan.ds_min_anchor, t_len, (w, blocks)), dim=1).values
    roll = torch.randint(0, v, (w, blocks, d.block_size))
    roll_hidden = torch.randn(w, blocks, d.block_size, s.hidden_size)

    def draft_step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, _ = dspark_loss(draft, target, dids, feats, danchors, roll, roll_hidden)
        dopt.zero_grad()
        loss.backward()
        dopt.step()

    out["dspark"] = {**_best(draft_step),
                     "what": f"{w} windows x {blocks} blocks, fwd+bwd+AdamW"}
    log(f"bench dspark {out['dspark']['seconds_per_step']:.3f} s/step")
    return out
