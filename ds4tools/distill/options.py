"""What a distill run is asked to do (``DistillOptions``), checked before anything is read or
written: every wrong value is one ``UsageError`` line (exit 2). Torch-free.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

from ..errors import UsageError

__all__ = ["KINDS", "DistillOptions", "parse_duration", "format_duration", "DEFAULTS"]

KINDS = ("dspark", "mtp")

#: per-kind defaults: the bundled demo's recipe (tools/demo, ds4tools/data/demo/README.md), but
#: 16 windows x 24 DSpark blocks a step rather than 8 x 48 (held-out tau 1.50 against 1.47 after
#: 300 steps on the demo, as the demo found: more windows beat more anchors per window)
DEFAULTS = {
    "dspark": {"layers": 2, "block_size": 8, "lr": 3e-3, "batch": 16, "warmup": 100},
    "mtp": {"layers": 1, "block_size": None, "lr": 2e-3, "batch": 16, "warmup": 30},
}
#: most DSpark block slots (ds4 runs blocks of at most 16; llama.cpp takes any)
MAX_BLOCK = 16


_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text) -> float:
    """Seconds of a duration: ``90``, ``90s``, ``2m``, ``1h30m``, ``1.5h``."""
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        s = str(text).strip().lower()
        parts = re.fullmatch(r"((?:\d+(?:\.\d+)?[hms])+|\d+(?:\.\d+)?)", s)
        if not parts:
            raise UsageError(f"--time {text!r}: expected a duration such as 90s, 30m, 1h or 1h30m")
        if s[-1].isdigit():
            value = float(s)
        else:
            value = sum(float(n) * _UNITS[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)([hms])", s))
    if not value > 0:
        raise UsageError(f"--time {text}: must be more than zero")
    return value


def format_duration(seconds: float) -> str:
    seconds = float(seconds)
    if seconds >= 3600:
        return f"{seconds / 3600:.2f} h"
    if seconds >= 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.1f} s"


@dataclass
class DistillOptions:
    """One ``ds4tools distill`` request (None: the kind's default, ``DEFAULTS``)."""
    kind: str
    data: list[str] = field(default_factory=list)
    #: continuations of prompts from --data sampled from the target (half greedy, half T = 1)
    self_generate: int = 0
    block_size: int | None = None
    layers: int | None = None
    #: DeepSpec numbering: the layers whose raw outputs feed the draft (-1: the embedding)
    target_layers: list[int] | None = None
    steps: int | None = None
    time_s: float | None = None
    threads: int | None = None
    resume: str | None = None
    seed: int = 0
    eval_prompts: str | None = None
    include: list[str] = field(default_factory=list)
    exclude: list[str] = field(default_factory=list)
    #: tokens per training window (default: 512, at most the target's context)
    seq_len: int | None = None
    #: windows of --data text (default 1024, fewer when they would not leave 75% of --time to
    #: train); --self-generate adds its own
    windows: int | None = None
    markov_rank: int = 64
    lr: float | None = None
    #: windows per training step
    batch: int | None = None
    #: DSpark: anchors (blocks) per window per step
    anchors: int = 24
    #: DSpark: anchors of every text window with the target's greedy continuation from them
    #: (computed with the features); a step takes them first, then random text anchors
    rollouts: int = 0
    type: str = "Q8_0"
    #: torch compute: "bf16" (autocast, as the demo trained; float32 master weights) or "fp32"
    precision: str = "bf16"
    #: held-out anchors (DSpark) the evaluation measures at most
    eval_anchors: int = 2000
    #: tokens generated per evaluation prompt (0: no prompt evaluation)
    eval_tokens: int = 128
    overwrite: bool = False
    progress: bool | None = None
    #: seconds between checkpoints (0: after every step)
    checkpoint_seconds: float = 60.0

    def default(self, name: str):
        value = getattr(self, name, None)
        return DEFAULTS[self.kind][name] if value is None else value

    def check(self) -> None:
        """Refuse wrong values and combinations (UsageError, exit 2)."""
        if self.kind not in KINDS:
            raise UsageError(f"--kind {self.kind!r}: use {' or '.join(KINDS)}")
        if not self.data:
            raise UsageError("no training text: pass --data PATH (text files or folders; the "
                             "prompts of --self-generate come from them too)")
        if (self.steps is None) == (self.time_s is None):
            raise UsageError("give the training budget as --steps N or --time DURATION (one of them)")
        if self.steps is not None and self.steps < 1:
            raise UsageError(f"--steps {self.steps}: must be at least 1")
        if self.time_s is not None and not self.time_s > 0:
            raise UsageError(f"--time {self.time_s}: must be more than zero")
        if self.kind == "mtp":
            if self.block_size is not None:
                raise UsageError("--block-size applies to --kind dspark (an MTP head drafts one "
                                 "token per pass)")
            if self.target_layers is not None:
                raise UsageError("--target-layers applies to --kind dspark (an MTP head reads "
                                 "the target's final hidden state)")
            if self.rollouts:
                raise UsageError("--rollouts applies to --kind dspark (an MTP head is trained on "
                                 "every row of the text)")
            if self.layers not in (None, 1):
                raise UsageError(f"--layers {self.layers}: an MTP head is one decoder layer "
                                 f"(NextN); --layers applies to --kind dspark")
        if self.block_size is not None and not 1 <= self.block_size <= MAX_BLOCK:
            raise UsageError(f"--block-size {self.block_size}: must be in 1..{MAX_BLOCK}")
        if self.layers is not None and not 1 <= self.layers <= 64:
            raise UsageError(f"--layers {self.layers}: must be in 1..64")
        if self.target_layers is not None:
            if not self.target_layers:
                raise UsageError("--target-layers: give at least one layer")
            if any(b <= a for a, b in zip(self.target_layers, self.target_layers[1:])):
                raise UsageError(f"--target-layers {_ids(self.target_layers)}: must be strictly "
                                 f"increasing")
        for name, value, low in (("--self-generate", self.self_generate, 0),
                                 ("--windows", self.windows, 0), ("--seed", self.seed, 0),
                                 ("--markov-rank", self.markov_rank, 1),
                                 ("--batch", self.batch, 1), ("--anchors", self.anchors, 1),
                                 ("--rollouts", self.rollouts, 0),
                                 ("--threads", self.threads, 1), ("--seq-len", self.seq_len, 16),
                                 ("--eval-anchors", self.eval_anchors, 1),
                                 ("--eval-tokens", self.eval_tokens, 0)):
            if value is not None and value < low:
                raise UsageError(f"{name} {value}: must be at least {low}")
        if self.lr is not None and not 0 < self.lr < 1:
            raise UsageError(f"--lr {self.lr}: must be in (0, 1)")
        if (self.windows if self.windows is not None else 1) + self.self_generate < 1:
            raise UsageError("--windows 0 without --self-generate leaves nothing to train on")
        if self.precision not in ("bf16", "fp32"):
            raise UsageError(f"--precision {self.precision}: use bf16 or fp32")
        if self.type not in ("Q8_0", "F16", "F32"):
            raise UsageError(f"--type {self.type}: drafts are written as Q8_0, F16 or F32")

    def signature(self) -> dict:
        """What a resumed run must share with the run it continues (not threads, the
        evaluation, the output's type)."""
        d = asdict(self)
        for k in ("threads", "resume", "eval_prompts", "eval_anchors", "eval_tokens", "type",
                  "overwrite", "progress", "checkpoint_seconds"):
            d.pop(k)
        return d


def _ids(ids) -> str:
    return ",".join(str(i) for i in ids)
