"""The acceptance rules: which drafts the target keeps, and the token that follows them.

Both are pure functions of the target's rows, the drafts and (for sampling) fresh uniforms,
so they can be tested alone. Row i of the target's verify forward is its next-token
distribution after the anchor and drafts d_1..d_i; row n follows the last draft.
"""
from __future__ import annotations

import numpy as np

from ..sampling import draw

#: below this residual mass, p and q agree wherever p has mass; fall back to p
RESIDUAL_EPS = 1e-12


def accept_greedy(target_logits: np.ndarray, drafts) -> tuple[int, int]:
    """Greedy verification: the longest prefix of drafts equal to the target's argmax, and the
    target's argmax after it (the correction, or the bonus token when all matched).

    ``target_logits``: (n + 1, n_vocab) rows for [anchor, d_1..d_n]."""
    n = len(drafts)
    top = np.argmax(target_logits[: n + 1], axis=1)
    m = 0
    while m < n and int(top[m]) == int(drafts[m]):
        m += 1
    return m, int(top[m])


def accept_sampled(p: np.ndarray, drafts, q: np.ndarray | None, rng: np.random.Generator
                   ) -> tuple[int, int]:
    """Rejection sampling (lossless at any temperature).

    ``p``: (n + 1, n_vocab) target distributions (Sampler.distribution of each verify row),
    or any object whose ``p[i]`` gives row i (``LazyRows``: rows past the first rejection are
    never computed);
    ``q``: (n, n_vocab) the distributions the drafts were drawn from, or None for one-hot
    drafts. Draft d_i is kept with probability min(1, p_i(d_i) / q_i(d_i)); at the first
    rejection the next token is drawn from norm(max(0, p_i - q_i)); if all are kept, from
    p_n (the bonus token). Returns (accepted count, next token)."""
    n = len(drafts)
    for i in range(n):
        d = int(drafts[i])
        pi = p[i]
        qd = 1.0 if q is None else float(q[i, d])
        pd = float(pi[d])
        if qd <= 0.0:
            raise ValueError(f"draft {i + 1} (token {d}) has zero probability under its own q")
        if rng.random() * qd < pd:  # u < p/q without dividing; always true when p >= q
            continue
        if q is None:
            residual = pi.copy()
            residual[d] = 0.0
        else:
            residual = np.maximum(pi - q[i], 0.0)
        total = residual.sum()
        return i, draw(residual if total > RESIDUAL_EPS else pi, rng)
    return n, draw(p[n], rng)


class LazyRows:
    """Row i = fn(rows[i]), computed on first use and kept."""

    def __init__(self, rows, fn):
        self.rows, self.fn, self._done = rows, fn, {}

    def __getitem__(self, i: int):
        if i not in self._done:
            self._done[i] = self.fn(self.rows[i])
        return self._done[i]
