"""Turning logits into the next token: greedy, or sampling after top-k / top-p / min-p.

``Sampler.distribution(logits)`` is the exact full-vocabulary distribution plain decoding draws
from (a pure function of the logits and the settings), so the speculative verifier can compare
target and draft rows with it. The filters run in llama.cpp's default order: top-k, then
top-p and min-p on the untempered probabilities, then the temperature on what is left.
Greedy (temperature <= 0) is one-hot on the argmax, ties going to the lowest id.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Sampler:
    temperature: float = 0.8
    top_k: int = 40          # <= 0: off
    top_p: float = 0.95      # >= 1: off
    min_p: float = 0.05      # <= 0: off

    def __post_init__(self):
        for name in ("temperature", "top_p", "min_p"):
            v = getattr(self, name)
            if not np.isfinite(v):
                raise ValueError(f"{name.replace('_', '-')} must be a finite number, got {v}")
        if self.top_p <= 0:
            raise ValueError(f"top-p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min-p must be in [0, 1], got {self.min_p}")
        if self.temperature < 0:
            raise ValueError(f"temperature must not be negative, got {self.temperature}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def candidates(self, logits: np.ndarray) -> np.ndarray:
        """Ids that survive top-k, top-p and min-p, best first (ties: lower id first)."""
        lg = np.asarray(logits, np.float64)
        n = lg.shape[0]
        if 0 < self.top_k < n:
            kth = np.partition(lg, n - self.top_k)[n - self.top_k]
            above = np.flatnonzero(lg > kth)
            ties = np.flatnonzero(lg == kth)[: self.top_k - above.size]
            ids = np.concatenate([above, ties])
        else:
            ids = np.arange(n)
        ids = ids[np.lexsort((ids, -lg[ids]))]  # by logit descending, then id
        if self.top_p < 1.0 and ids.size > 1:
            p = np.exp(lg[ids] - lg[ids[0]])
            cum = np.cumsum(p / p.sum())
            keep = int(np.searchsorted(cum, self.top_p, side="left")) + 1  # first reaching p
            ids = ids[:max(1, keep)]
        if self.min_p > 0.0 and ids.size > 1:
            ids = ids[lg[ids] >= lg[ids[0]] + np.log(self.min_p)]
        return ids

    def distribution(self, logits: np.ndarray) -> np.ndarray:
        """Probabilities over the whole vocabulary (float64, sums to 1)."""
        lg = np.asarray(logits, np.float64)
        p = np.zeros(lg.shape[0], np.float64)
        if self.greedy:
            p[int(np.argmax(lg))] = 1.0
            return p
        ids = self.candidates(lg)
        z = (lg[ids] - lg[ids[0]]) / self.temperature
        e = np.exp(z)
        p[ids] = e / e.sum()
        return p

    def sample(self, logits: np.ndarray, rng: np.random.Generator) -> int:
        """One token: the argmax when greedy (no random draw), else a draw from distribution()."""
        if self.greedy:
            return int(np.argmax(np.asarray(logits)))
        p = self.distribution(logits)
        return draw(p, rng)


def draw(p: np.ndarray, rng: np.random.Generator) -> int:
    """Inverse-CDF draw of one index from probabilities p, with one uniform from rng."""
    cum = np.cumsum(p)
    i = int(np.searchsorted(cum, rng.random() * cum[-1], side="right"))
    i = min(i, p.shape[0] - 1)
    while p[i] == 0.0 and i > 0:  # rounding at the very top can land past the last candidate
        i -= 1
    return i
