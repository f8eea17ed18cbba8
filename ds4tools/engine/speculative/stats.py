"""Speculative-decoding statistics, with vLLM's / llama.cpp's definitions (speculative.md §6).

tau   = committed tokens per verify step = 1 + accepted / steps (the bonus token counted);
alpha = accepted / verified drafts (drafts a cut removed are not verified).
"""
from __future__ import annotations

from dataclasses import dataclass, field



@dataclass
class SpecStats:
    method: str = ""
    steps: int = 0                 # verify forwards
    drafted: int = 0               # tokens the drafter proposed (after its own cuts)
    verified: int = 0              # drafts the target checked
    accepted: int = 0              # drafts the target kept
    confidence_cuts: int = 0       # steps whose proposal a confidence / margin cut shortened
    strict_fallbacks: int = 0      # strict-mode steps that fell back to one token
    accepted_hist: list = field(default_factory=list)   # [count of steps accepting 0, 1, ...]
    reached: list = field(default_factory=list)         # per draft position: steps verifying it
    kept: list = field(default_factory=list)            # per draft position: steps accepting it
    target_verify_seconds: float = 0.0
    draft_seconds: float = 0.0
    sampling_seconds: float = 0.0
    other_seconds: float = 0.0
    single_forward_seconds: float = 0.0   # calibrated one-token target forward (plain step)
    plain_step_seconds: float = 0.0       # one-token forward + sampling: a plain decode step
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
        for name in ("steps", "drafted", "verified", "accepted", "confidence_cuts", "strict_fallbacks",
                     "target_verify_seconds", "draft_seconds", "sampling_seconds", "other_seconds",
                     "decode_tokens", "decode_seconds"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ("accepted_hist", "reached", "kept"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if len(mine) < len(theirs):
                mine.extend([0] * (len(theirs) - len(mine)))
            for i, v in enumerate(theirs):
                mine[i] += v
        # calibration: keep the fastest plain step seen (the least disturbed measurement)
        for name in ("single_forward_seconds", "plain_step_seconds"):
            a, b = getattr(self, name), getattr(other, name)
            setattr(self, name, min(a, b) if a > 0 and b > 0 else max(a, b))
        return self

    @property
    def tau(self) -> float:
        return 1.0 + self.accepted / self.steps if self.steps else 0.0

    @property
    def alpha(self) -> float:
        return self.accepted / self.verified if self.verified else 0.0

    @property
    def accept_per_position(self) -> list[float]:
        """Unconditional P(draft i accepted) per step (tau = 1 + their sum)."""
        return [k / self.steps for k in self.kept] if self.steps else []

    @property
    def accept_per_position_conditional(self) -> list[float]:
        """P(draft i accepted | it was verified and drafts before it were accepted)."""
        reach_prev = [self.steps] + self.kept[:-1]
        return [k / r if r else 0.0 for k, r in zip(self.kept, reach_prev)]

    def verify_cost_ratio(self) -> float:
        """Mean verify forward time over a calibrated one-token forward: r(k) at the mean k."""
        if not self.steps or self.single_forward_seconds <= 0:
            return 0.0
        return self.target_verify_seconds / self.steps / self.single_forward_seconds

    def draft_cost_ratio(self) -> float:
        if not self.steps or self.single_forward_seconds <= 0:
            return 0.0
        return self.draft_seconds / self.steps / self.single_forward_seconds

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
        """Decode tokens/s over the calibrated plain decode step rate (1 / plain_step_seconds)."""
        if self.plain_step_seconds <= 0 or self.decode_seconds <= 0:
            return 0.0
        return self.decode_tps * self.plain_step_seconds

    def as_dict(self) -> dict:
        hist = {str(i): n for i, n in enumerate(self.accepted_hist)}
        return {
            "method": self.method, "steps": self.steps, "drafted": self.drafted,
            "verified": self.verified, "accepted": self.accepted, "tau": self.tau,
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
            f" + c {self.draft_cost_ratio():.2f})), measured {self.measured_speedup:.2f}x vs a "
            f"plain step of {1e3 * self.plain_step_seconds:.2f} ms",
        ]
