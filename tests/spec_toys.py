"""Tiny synthetic targets and drafters for testing the speculative loop's statistics.

``ToyTarget`` is a second-order Markov chain dressed as a model: row i's logits depend on the
token at its position and the one before it, which comes from the previous row or from the
"cache" (the committed tokens), so a rollback bug changes the distribution.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ds4tools.engine.speculative.drafter import Drafter, Proposal


@dataclass
class ToyResult:
    logits: np.ndarray
    hidden: dict
    final_hidden: np.ndarray | None = None


class ToyCache:
    def __init__(self, n_ctx):
        self.tokens = np.zeros(n_ctx, np.int64)
        self.length = 0
        self.n_ctx = n_ctx

    def truncate(self, n):
        assert 0 <= n <= self.length
        self.length = n

    def clear(self):
        self.length = 0


class ToyTarget:
    def __init__(self, vocab=6, seed=0, n_ctx=1 << 20, sharpness=1.5):
        rng = np.random.default_rng(seed)
        self.vocab = vocab
        self.table = (rng.standard_normal((vocab, vocab, vocab)) * sharpness).astype(np.float32)
        self.n_ctx = n_ctx
        self.cache = ToyCache(n_ctx)

    def logits_after(self, prev, cur):
        return self.table[prev, cur]

    def forward(self, tokens, start_pos, hidden_layers=(), want_final_hidden=False, logits="all"):
        tokens = [int(t) for t in tokens]
        assert 0 <= start_pos <= self.cache.length
        self.cache.tokens[start_pos:start_pos + len(tokens)] = tokens
        self.cache.length = start_pos + len(tokens)
        rows = []
        for i, t in enumerate(tokens):
            p = start_pos + i
            prev = int(self.cache.tokens[p - 1]) if p > 0 else 0
            rows.append(self.logits_after(prev, t))
        lg = np.stack(rows)
        return ToyResult(lg[-1:] if logits == "last" else lg, {})


class ToyDrafter(Drafter):
    """Drafts from its own second-order table: ``mode`` "same" (the target's table: q = p),
    "other" (an unrelated table), "disjoint" (uniform over tokens the target's filtered p gives
    no mass), "onehot" (argmax of an unrelated table, q None); ``cut`` draws a random proposal
    length before drafting (a confidence cut decided without looking at the target)."""

    def __init__(self, target: ToyTarget, mode: str, k: int = 4, cut: bool = False, seed=1):
        self.name = f"toy-{mode}"
        self.target, self.mode, self.k, self.cut = target, mode, k, cut
        rng = np.random.default_rng(seed)
        self.other = (rng.standard_normal(target.table.shape) * 1.5).astype(np.float32)
        self.history: list[int] = []
        self._q = {}

    def _dist(self, state, sampler):
        # q for a state depends only on the state: computed once (the test's hot loop)
        key = (state, id(sampler))
        if key not in self._q:
            prev, cur = state
            if self.mode == "same":
                q = sampler.distribution(self.target.logits_after(prev, cur))
            elif self.mode == "other":
                q = sampler.distribution(self.other[prev, cur])
            elif self.mode == "disjoint":
                p = sampler.distribution(self.target.logits_after(prev, cur))
                q = (p == 0).astype(np.float64)
                q /= q.sum()
            elif self.mode == "onehot":
                q = None
            else:
                raise ValueError(self.mode)
            self._q[key] = (q, None if q is None else np.cumsum(q))
        return self._q[key]

    def start(self, prompt, prefill):
        self.history = list(prompt)

    def commit(self, anchor, proposal, n_accepted, verify):
        self.history += [anchor] + list(proposal.tokens[:n_accepted])

    def propose(self, anchor, max_tokens, sampler, rng):
        n = min(self.k, max_tokens)
        cut = False
        if self.cut:
            n2 = int(rng.integers(0, n + 1))
            cut, n = n2 < n, n2
        prev, cur = (self.history[-1] if self.history else 0), int(anchor)
        toks, qs = [], []
        V = self.target.vocab
        for _ in range(n):
            q, cdf = self._dist((prev, cur), sampler)
            if q is None:
                t = int(np.argmax(self.other[prev, cur]))
            else:
                t = min(int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right")), V - 1)
            toks.append(t)
            qs.append(q)
            prev, cur = cur, t
        q_arr = None if self.mode == "onehot" or not toks else np.stack(qs)
        return Proposal(toks, q_arr, cut=cut)
