"""Turning logits into the next token: greedy, or sampling after top-k / top-p / min-p.

``Sampler.distribution(logits)`` is the exact full-vocabulary distribution plain decoding draws
from (a pure function of the logits and the settings), so the speculative verifier can compare
target and draft rows with it. The filters run in llama.cpp's default order: top-k, then
top-p and min-p on the untempered probabilities, then the temperature on what is left.
Greedy (temperature <= 0) is one-hot on the argmax, ties going to the lowest id.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numba import njit


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
        lg = np.ascontiguousarray(logits, np.float32)
        p = np.zeros(lg.shape[0], np.float64)
        if self.greedy:
            p[int(np.argmax(lg))] = 1.0
            return p
        _distribution(lg, float(self.temperature), int(self.top_k), float(self.top_p),
                      float(self.min_p), p)
        return p

    def sample(self, logits: np.ndarray, rng: np.random.Generator) -> int:
        """One token: the argmax when greedy (no random draw), else a draw from distribution()."""
        if self.greedy:
            return int(np.argmax(np.asarray(logits)))
        p = self.distribution(logits)
        return draw(p, rng)


def draw(p: np.ndarray, rng: np.random.Generator) -> int:
    """Inverse-CDF draw of one index from probabilities p, with one uniform from rng."""
    return _draw(np.ascontiguousarray(p, np.float64), rng.random())


@njit(cache=True)
def _draw(p, u):
    # the first index whose cumulative mass exceeds u * total (np.searchsorted side="right")
    total = 0.0
    for i in range(p.shape[0]):
        total += p[i]
    target = u * total
    cum = 0.0
    i = 0
    n = p.shape[0]
    while i < n:
        cum += p[i]
        if cum > target:
            break
        i += 1
    i = min(i, n - 1)
    while p[i] == 0.0 and i > 0:  # rounding at the very top can land past the last candidate
        i -= 1
    return i


@njit(cache=True)
def _distribution(lg, temperature, top_k, top_p, min_p, p):
    """Sampler.distribution's kernel: the same filters as ``candidates`` (llama.cpp's order),
    with the sort skipped when only a temperature and min-p apply (the common T=1 case)."""
    n = lg.shape[0]
    top = np.float64(lg[0])
    for i in range(n):
        if np.float64(lg[i]) > top:
            top = np.float64(lg[i])
    floor = -math.inf if min_p <= 0.0 else np.float64(top) + math.log(min_p)
    if (top_k <= 0 or top_k >= n) and top_p >= 1.0:
        total = 0.0
        for i in range(n):
            v = np.float64(lg[i])
            if v >= floor:
                e = math.exp((v - top) / temperature)
                p[i] = e
                total += e
        for i in range(n):
            p[i] /= total
        return
    if 0 < top_k < n:
        # only the top_k ids need sorting: those above the k-th largest logit, then ties at it
        kth = np.partition(lg, n - top_k)[n - top_k]
        sel = np.empty(top_k, np.int64)
        c = 0
        for i in range(n):
            if lg[i] > kth:
                sel[c] = i
                c += 1
        for i in range(n):
            if c == top_k:
                break
            if lg[i] == kth:
                sel[c] = i
                c += 1
        order = sel[np.argsort(-lg[sel], kind="mergesort")]
    else:
        order = np.argsort(-lg, kind="mergesort")  # by logit descending, ties: lower id first
    m = order.shape[0]
    if top_p < 1.0 and m > 1:
        z = 0.0
        for j in range(m):
            z += math.exp(np.float64(lg[order[j]]) - top)
        cum = 0.0
        keep = m
        for j in range(m):
            cum += math.exp(np.float64(lg[order[j]]) - top) / z
            if cum >= top_p:
                keep = j + 1
                break
        m = keep
    if min_p > 0.0 and m > 1:
        j = 1
        while j < m and np.float64(lg[order[j]]) >= floor:
            j += 1
        m = j
    total = 0.0
    for j in range(m):
        e = math.exp((np.float64(lg[order[j]]) - top) / temperature)
        p[order[j]] = e
        total += e
    for j in range(m):
        p[order[j]] /= total
