"""Stage 4: the self-distilled DSpark dataset.

Per train window: the raw outputs of the target layers in target_layer_ids (the draft's context
features). Per anchor: two target rollouts of block_size tokens (greedy, and sampled at T=1) and the
target's final-normed hidden state along each (its softmax is lm_head of that, recomputed at training
time, as DeepSpec does with target_last_hidden_states).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .common import Log, Plan, Timer, adapt_threads, read_json, write_json
from .model import DraftShape, Qwen3Target, TargetShape
from .rollout import rollout


def shard_path(work: Path, index: int) -> Path:
    return work / "dspark_data" / f"shard_{index:04d}.npz"


def build_dataset(plan: Plan, work: Path, log: Log) -> dict:
    tokens = np.load(work / "train_tokens.npy")
    dshape = DraftShape()
    model = Qwen3Target(TargetShape())
    model.load_state_dict(torch.load(work / "target_shipped.pt"))
    model.eval()
    (work / "dspark_data").mkdir(exist_ok=True)
    n_shards = -(-plan.ds_windows // plan.ds_gen_batch)
    wall_path = work / "dspark_data_wall.json"
    timer, wall = Timer(), (read_json(wall_path) if wall_path.exists() else 0.0)
    a_count, t_len, bs = plan.ds_anchors_per_window, plan.ds_window_len, dshape.block_size
    for shard in range(n_shards):
        path = shard_path(work, shard)
        if path.exists():
            continue
        adapt_threads()
        rng = np.random.default_rng([plan.seed, 4, shard])
        nb = min(plan.ds_gen_batch, plan.ds_windows - shard * plan.ds_gen_batch)
        starts = rng.integers(0, len(tokens) - t_len, size=nb)
        ids = torch.from_numpy(np.stack([tokens[s:s + t_len] for s in starts]).astype(np.int64))
        anchors = np.stack([
            np.sort(rng.choice(np.arange(plan.ds_min_anchor, t_len), size=a_count, replace=False))
            for _ in range(nb)
        ])
        anchors_t = torch.from_numpy(np.concatenate([anchors, anchors], axis=1)).long()
        temps = torch.cat([torch.zeros(nb, a_count), torch.ones(nb, a_count)], dim=1)
        gen = torch.Generator().manual_seed(plan.seed * 1000 + shard)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ro = rollout(model, ids, anchors_t, bs, temps, gen, capture=tuple(dshape.target_layer_ids))
        feats = torch.cat([ro.features[i] for i in dshape.target_layer_ids], dim=-1)
        tmp = path.with_suffix(".tmp.npz")
        np.savez(
            tmp,
            ids=ids.numpy().astype(np.uint16),
            features=feats.float().numpy().astype(np.float16),
            anchors=anchors.astype(np.int16),
            roll_tokens=ro.tokens.numpy().astype(np.uint16),
            roll_hidden=ro.hidden.float().numpy().astype(np.float16),
        )
        tmp.replace(path)
        wall += timer.lap()
        write_json(wall_path, round(wall, 1))
        if (shard + 1) % max(1, n_shards // 20) == 0 or shard + 1 == n_shards:
            log(f"dspark data: shard {shard + 1}/{n_shards} ({(shard + 1) * plan.ds_gen_batch} windows) "
                f"wall {wall:.0f}s")
    metrics = {
        "windows": plan.ds_windows,
        "window_len": t_len,
        "anchors": plan.ds_windows * a_count,
        "blocks": 2 * plan.ds_windows * a_count,
        "rollouts_per_anchor": "greedy + one sample at T=1",
        "wall_s": round(wall, 1),
    }
    write_json(work / "dspark_data_metrics.json", metrics)
    return metrics


def load_dataset(plan: Plan, work: Path) -> dict:
    n_shards = -(-plan.ds_windows // plan.ds_gen_batch)
    first = np.load(shard_path(work, 0))
    # Preallocate: concatenating the shards would briefly need twice the (GB-sized) dataset.
    data = {k: np.empty((plan.ds_windows,) + first[k].shape[1:], first[k].dtype) for k in first.files}
    row = 0
    for i in range(n_shards):
        shard = np.load(shard_path(work, i))
        n = shard["ids"].shape[0]
        for k in data:
            data[k][row:row + n] = shard[k]
        row += n
    if row != plan.ds_windows:
        raise RuntimeError(f"dspark data holds {row} windows, the plan says {plan.ds_windows}")
    return data
