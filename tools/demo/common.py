"""Shared plumbing for the demo training stages: the run plan, logging, checkpoints, schedules."""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch


@dataclass(frozen=True)
class Plan:
    """Step counts and batch shapes; fixed counts (not wall-clock budgets) keep runs reproducible."""

    seed: int = 1234
    # target
    target_steps: int = 5200
    target_batch: int = 16
    target_seq: int = 512
    target_lr: float = 3e-3
    target_min_lr_frac: float = 0.05
    target_warmup: int = 100
    target_wd: float = 0.1
    target_long_from: float = 0.85  # the last 15% of steps use 1024-token windows (same tokens/step)
    target_eval_every: int = 1000
    # MTP
    mtp_steps: int = 700
    mtp_batch: int = 16
    mtp_seq: int = 512
    mtp_lr: float = 2e-3
    # DSpark draft: `ds4tools distill --kind dspark` (docs/distill.md, "The 30-minute runs") on the
    # engine's features of the target converted to Q8_0; ds_steps is the step count that run's
    # `--time 30m` fixed (2 threads, idle machine), so the schedule and every batch are that run's
    ds_steps: int = 4424
    ds_windows: int = 2048
    ds_lr: float = 6e-3
    ds_target_layers: str = "1,3,4"  # DeepSpec numbering; never the last layer (llama.cpp)
    ds_threads: int = 2
    ds_eval_anchors: int = 10000
    ds_eval_tokens: int = 128
    # evaluation
    eval_segment: int = 512
    eval_anchor_stride: int = 3
    eval_gen_tokens: int = 256
    checkpoint_every: int = 200
    log_every: int = 25

    def as_dict(self) -> dict:
        return asdict(self)


def smoke_plan() -> Plan:
    return replace(
        Plan(), target_steps=12, target_batch=4, target_seq=128, target_warmup=3,
        target_eval_every=6, mtp_steps=6, mtp_batch=4, mtp_seq=128, ds_windows=16, ds_steps=8,
        ds_threads=1, ds_eval_anchors=200, ds_eval_tokens=0, eval_segment=128,
        eval_anchor_stride=16, eval_gen_tokens=32, checkpoint_every=5, log_every=2,
    )


class Log:
    """Prints progress lines with elapsed time and appends them to a log file."""

    def __init__(self, path: Path):
        self.path = path
        self.t0 = time.time()

    def __call__(self, msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')} +{time.time() - self.t0:7.0f}s] {msg}"
        print(line, flush=True)
        with open(self.path, "a") as f:
            f.write(line + "\n")


def cosine_lr(step: int, total: int, peak: float, warmup: int, min_frac: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (min_frac + (1 - min_frac) * 0.5 * (1 + math.cos(math.pi * progress)))


def step_rng(seed: int, stage: str, step: int) -> np.random.Generator:
    """A generator that depends only on (seed, stage, step): resumed runs draw the same batches."""
    return np.random.default_rng([seed, sum(map(ord, stage)), step])


def save_atomic(obj, path: Path) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def write_json(path: Path, obj) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def read_json(path: Path):
    return json.loads(path.read_text())


SHIP_DTYPE = torch.float16  # f16 rather than bf16: numpy (hence the torch-free tests) reads it


def round_to_shipped_(module: torch.nn.Module) -> None:
    """Round parameters to the shipped dtype in place (kept as fp32): what ships is what is evaluated."""
    with torch.no_grad():
        for p in module.parameters():
            if p.abs().max() >= 65504:
                raise ValueError("a parameter is out of float16 range")
            p.copy_(p.to(SHIP_DTYPE).float())


class Timer:
    def __init__(self):
        self.t = time.time()

    def lap(self) -> float:
        now = time.time()
        dt, self.t = now - self.t, now
        return dt


class ThreadPolicy:
    """torch thread count: fixed, or "auto": 2 threads only while the machine is otherwise idle.

    On 2 shared cores a 2-thread torch step whose threads keep losing the CPU to other jobs spends
    most of its time waiting at OpenMP barriers (measured: 20 s/step against 4.5 s with 1 thread).
    The thread count changes only float summation order, never the step sequence.
    """

    def __init__(self, setting: str, max_threads: int = 2):
        self.auto = setting == "auto"
        self.max_threads = max_threads if self.auto else int(setting)
        torch.set_num_threads(self.max_threads if not self.auto else 1)

    def update(self) -> None:
        if not self.auto:
            return
        others = os.getloadavg()[0] - torch.get_num_threads()
        want = self.max_threads if others < 0.7 else 1
        if want != torch.get_num_threads():
            torch.set_num_threads(want)


THREADS = ThreadPolicy("2")


def set_thread_policy(setting: str) -> None:
    global THREADS
    THREADS = ThreadPolicy(setting)


def adapt_threads() -> None:
    THREADS.update()


def cpu_seconds() -> float:
    """Process CPU time (user+sys): with nice'd runs this tracks compute, not contention."""
    t = os.times()
    return t.user + t.system
