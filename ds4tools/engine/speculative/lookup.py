"""Prompt lookup: draft by copying what followed the latest earlier occurrence of the context's
last 3-, 2- or 1-gram (llama.cpp's n-gram drafting). No model, one-hot drafts.

It is the baseline every trained drafter must beat: on repetitive text (and a tiny model's
greedy output loops) copying is hard to beat.
"""
from __future__ import annotations

from .drafter import Drafter, Proposal


class PromptLookupDrafter(Drafter):
    name = "lookup"

    def __init__(self, max_draft: int, ngram_sizes=(3, 2, 1)):
        if not 1 <= max_draft <= 64:
            raise ValueError(f"--lookup {max_draft}: must be in 1..64")
        self.max_draft = max_draft
        self.ngram_sizes = tuple(sorted(ngram_sizes, reverse=True))
        self.tokens: list[int] = []
        # n-gram -> the position right after its latest occurrence (built incrementally, so a
        # step costs O(n) in the draft length, not in the context length)
        self._index = {n: {} for n in self.ngram_sizes}

    def _extend(self, new_tokens) -> None:
        for t in new_tokens:
            self.tokens.append(int(t))
            end = len(self.tokens)
            for n in self.ngram_sizes:
                if end - 1 >= n:  # index the n-gram ending just before the new token
                    key = tuple(self.tokens[end - 1 - n:end - 1])
                    self._index[n][key] = end - 1

    def start(self, prompt, prefill) -> None:
        self.tokens = []
        self._index = {n: {} for n in self.ngram_sizes}
        self._extend(prompt)

    def propose(self, anchor, max_tokens, sampler, rng) -> Proposal:
        limit = min(self.max_draft, max_tokens)
        ctx = self.tokens + [int(anchor)]
        for n in self.ngram_sizes:
            if len(ctx) <= n:
                continue
            start = self._index[n].get(tuple(ctx[-n:]))
            if start is None:
                continue
            # copy what followed, continuing into the copy itself when it runs off the end
            out = []
            j = start
            while len(out) < limit:
                if j < len(self.tokens):
                    out.append(self.tokens[j])
                elif j == len(self.tokens):
                    out.append(int(anchor))
                else:
                    out.append(out[j - len(self.tokens) - 1])
                j += 1
            return Proposal(out)
        return Proposal([])

    def commit(self, anchor, proposal, n_accepted, verify) -> None:
        self._extend([anchor] + list(proposal.tokens[:n_accepted]))

    def describe(self) -> str:
        return f"lookup: prompt n-gram drafting, up to {self.max_draft} tokens, n-grams {self.ngram_sizes}"
