"""Speculative-decoding statistics, with vLLM's / llama.cpp's definitions (speculative.md §6).

tau   = committed tokens per verify step: 1 + accepted / steps (the bonus token counted), less
        the tokens -n cut off the last step;
alpha = accepted / verified drafts (drafts a cut removed are not verified).

Costs and the measured speedup are in units of plain decoding at the same context lengths: a
one-token step costs more as the context grows (attention reads every cached row), so one
figure taken after the prefill would flatter plain decoding on a long run. ``PlainCostCurve``
holds one-token steps timed along the run and interpolates between them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


class PlainCostCurve:
    """Plain one-token decode step costs timed at a few positions of one run: (forward
    seconds, forward + sampling seconds) at any position, linear between the timed ones
    (attention is linear in the context) and extrapolated from the last two past the end."""

    def __init__(self):
        self.positions: list[int] = []
        self.forward: list[float] = []
        self.step: list[float] = []

    def add(self, pos: int, forward_seconds: float, step_seconds: float) -> None:
        self.positions.append(int(pos))
        self.forward.append(float(forward_seconds))
        self.step.append(float(step_seconds))

    def _at(self, values: list[float], where) -> np.ndarray:
        where = np.asarray(where, np.float64)
        xs, ys = np.asarray(self.positions, np.float64), np.asarray(values, np.float64)
        out = np.interp(where, xs, ys)  # constant beyond the ends ...
        if len(xs) >= 2 and xs[-1] > xs[-2]:  # ... but past the last timing the trend goes on
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
            past = where > xs[-1]
            out[past] = np.maximum(ys[-1] + slope * (where[past] - xs[-1]), 0.0)
        return out

    def total_forward(self, positions) -> float:
        """Seconds of plain one-token forwards at each of ``positions``."""
        return float(self._at(self.forward, positions).sum()) if self.positions and len(positions) else 0.0

    def total_step(self, positions) -> float:
        """Seconds of plain decode steps (forward + sampling) at each of ``positions``."""
        return float(self._at(self.step, positions).sum()) if self.positions and len(positions) else 0.0



@dataclass
class SpecStats:
    method: str = ""
    steps: int = 0                 # verify forwards
    drafted: int = 0               # tokens the drafter proposed (after its own cuts)
    verified: int = 0              # drafts the target checked
    accepted: int = 0              # drafts the target kept
    committed: int = 0             # tokens the steps added to the output (accepted + bonus, less -n's cut)
    confidence_cuts: int = 0       # steps whose proposal a confidence / margin cut shortened
    strict_fallbacks: int = 0      # strict-mode steps that fell back to one token
    accepted_hist: list = field(default_factory=list)   # [count of steps accepting 0, 1, ...]
    reached: list = field(default_factory=list)         # per draft position: steps verifying it
    kept: list = field(default_factory=list)            # per draft position: steps accepting it
    target_verify_seconds: float = 0.0
    draft_seconds: float = 0.0
    sampling_seconds: float = 0.0
    other_seconds: float = 0.0
    #: plain one-token forwards at each step's position: what r and c are in units of
    plain_forward_seconds: float = 0.0
    #: plain decoding of the same decode tokens at the same positions (forward + sampling each)
    plain_decode_seconds: float = 0.0
    calibration_seconds: float = 0.0      # spent timing plain steps (in total_seconds only)
    decode_tokens: int = 0
    decode_seconds: float = 0.0

    def record_step(self, n_drafted: int, n_verified: int, n_accepted: int, cut: bool) -> None:
        self.steps += 1
        self.drafted += n_drafted
        self.verified += n_verified
        self.accepted += n_accepted
        self.confidence_cuts += int(cut)
        for lst, size in ((self.accepted_hist, n_accepted + 1), (self.reached, n_verified),
                          (self.kept, n_accepted)):
            if len(lst) < size:
                lst.extend([0] * (size - len(lst)))
        self.accepted_hist[n_accepted] += 1
        for i in range(n_verified):
            self.reached[i] += 1
        for i in range(n_accepted):
            self.kept[i] += 1

    def merge(self, other: "SpecStats") -> "SpecStats":
        """Add another run's counts and times into this one (e.g. over a prompt set)."""
        for name in ("steps", "drafted", "verified", "accepted", "committed", "confidence_cuts",
                     "strict_fallbacks", "target_verify_seconds", "draft_seconds",
                     "sampling_seconds", "other_seconds", "plain_forward_seconds",
                     "plain_decode_seconds", "calibration_seconds", "decode_tokens",
                     "decode_seconds"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ("accepted_hist", "reached", "kept"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if len(mine) < len(theirs):
                mine.extend([0] * (len(theirs) - len(mine)))
            for i, v in enumerate(theirs):
                mine[i] += v
        return self

    @property
    def tau(self) -> float:
        """Committed tokens per verify step; a bonus token that -n cut off is not counted."""
        return self.committed / self.steps if self.steps else 0.0

    @property
    def single_forward_seconds(self) -> float:
        """Mean plain one-token forward at the steps' positions."""
        return self.plain_forward_seconds / self.steps if self.steps else 0.0

    @property
    def plain_step_seconds(self) -> float:
        """Mean plain decode step over the decode tokens' positions."""
        return self.plain_decode_seconds / self.decode_tokens if self.decode_tokens else 0.0

    @property
    def alpha(self) -> float:
        return self.accepted / self.verified if self.verified else 0.0

    @property
    def accept_per_position(self) -> list[float]:
        """Unconditional P(draft i accepted) per step (tau = 1 + their sum, less the bonus
        tokens -n cut off)."""
        return [k / self.steps for k in self.kept] if self.steps else []

    @property
    def accept_per_position_conditional(self) -> list[float]:
        """P(draft i accepted | it was verified and drafts before it were accepted)."""
        reach_prev = [self.steps] + self.kept[:-1]
        return [k / r if r else 0.0 for k, r in zip(self.kept, reach_prev)]

    def verify_cost_ratio(self) -> float:
        """Verify forward time over plain one-token forwards at the same positions: r(k) at
        the mean k."""
        if not self.steps or self.plain_forward_seconds <= 0:
            return 0.0
        return self.target_verify_seconds / self.plain_forward_seconds

    def draft_cost_ratio(self) -> float:
        """Drafting time over plain one-token forwards at the steps' positions."""
        if not self.steps or self.plain_forward_seconds <= 0:
            return 0.0
        return self.draft_seconds / self.plain_forward_seconds

    @property
    def predicted_speedup(self) -> float:
        """tau / (r(k) + c): what the acceptance would buy if verify and draft cost were all."""
        r, c = self.verify_cost_ratio(), self.draft_cost_ratio()
        return self.tau / (r + c) if r + c > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def measured_speedup(self) -> float:
        """Plain decoding's time for the same decode tokens at the same positions (timed plain
        steps along the run) over the time speculative decoding took."""
        if self.plain_decode_seconds <= 0 or self.decode_seconds <= 0:
            return 0.0
        return self.plain_decode_seconds / self.decode_seconds

    def as_dict(self) -> dict:
        hist = {str(i): n for i, n in enumerate(self.accepted_hist)}
        return {
            "method": self.method, "steps": self.steps, "drafted": self.drafted,
            "verified": self.verified, "accepted": self.accepted, "committed": self.committed,
            "tau": self.tau,
            "alpha": self.alpha, "accept_per_position": self.accept_per_position,
            "accept_per_position_conditional": self.accept_per_position_conditional,
            "accepted_length_histogram": hist, "confidence_cuts": self.confidence_cuts,
            "strict_fallbacks": self.strict_fallbacks,
            "time_split": {"target_verify": self.target_verify_seconds,
                           "draft": self.draft_seconds, "sampling": self.sampling_seconds,
                           "other": self.other_seconds},
            "decode_tps": self.decode_tps,
            "verify_cost_ratio": self.verify_cost_ratio(), "draft_cost_ratio": self.draft_cost_ratio(),
            "predicted_speedup": self.predicted_speedup, "measured_speedup": self.measured_speedup,
            "plain_decode_seconds": self.plain_decode_seconds,
            "calibration_seconds": self.calibration_seconds,
        }

    def summary_lines(self) -> list[str]:
        per = " ".join(f"{a:.2f}" for a in self.accept_per_position)
        hist = " ".join(str(n) for n in self.accepted_hist)
        ts = self.target_verify_seconds, self.draft_seconds, self.sampling_seconds, self.other_seconds
        total = sum(ts) or 1.0
        return [
            f"spec {self.method}: {self.steps} steps, drafted {self.drafted}, verified "
            f"{self.verified}, accepted {self.accepted}: tau {self.tau:.2f}, alpha {self.alpha:.2f}",
            f"spec accept per position: {per or '-'}; accepted-length histogram: {hist or '-'}",
            f"spec cuts: {self.confidence_cuts} confidence/margin, {self.strict_fallbacks} strict fallbacks",
            "spec time: " + ", ".join(f"{n} {s:.3f} s ({100 * s / total:.0f}%)" for n, s in
                                      zip(("verify", "draft", "sampling", "other"), ts)),
            f"spec speedup: predicted {self.predicted_speedup:.2f}x (tau / (r {self.verify_cost_ratio():.2f}"
            f" + c {self.draft_cost_ratio():.2f})), measured {self.measured_speedup:.2f}x vs plain "
            f"decoding at the same positions (mean step {1e3 * self.plain_step_seconds:.2f} ms)",
        ]
