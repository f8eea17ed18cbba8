"""The drafter interface: what the decoding loop asks of MTP, DSpark and prompt lookup alike."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Proposal:
    """Draft tokens d_1..d_n for the positions after the anchor.

    ``q[i]`` is the exact distribution d_{i+1} was drawn from (after the same temperature and
    filters as plain sampling, Markov-corrected for DSpark). ``q is None`` means every draft was
    chosen deterministically (one-hot q): greedy drafters, prompt lookup.
    """
    tokens: list[int] = field(default_factory=list)
    q: np.ndarray | None = None                # (n, n_vocab) float64, or None for one-hot drafts
    confidence: np.ndarray | None = None       # per drafted position, where the drafter has one
    cut: bool = False                          # a confidence/margin cut shortened the proposal
    seconds: float = 0.0                       # time spent drafting (filled by the loop)

    def __len__(self) -> int:
        return len(self.tokens)


class Drafter:
    """A source of draft tokens, kept in step with the target's committed sequence.

    The loop calls ``start`` once after the target's prefill, then for every step
    ``propose`` (drafts after ``anchor``, the last committed token, which the target has not
    processed yet) and ``commit`` with the verify forward's result and how many drafts the
    target accepted: the drafter keeps what matches the committed tokens and rolls back the
    rest of its own state.
    """
    name = "drafter"
    #: the target layers whose raw outputs the drafter needs from every target forward
    hidden_layers: tuple[int, ...] = ()
    #: whether it needs the target's final normed hidden state (MTP heads)
    wants_final_hidden: bool = False

    def start(self, prompt: list[int], prefill) -> None:
        """The target has run ``prompt``; ``prefill`` is its ForwardResult over every prompt row
        (with ``hidden`` / ``final_hidden`` as this drafter asked)."""

    def propose(self, anchor: int, max_tokens: int, sampler, rng: np.random.Generator) -> Proposal:
        raise TypeError(f"{type(self).__name__} does not implement propose()")

    def commit(self, anchor: int, proposal: Proposal, n_accepted: int, verify) -> None:
        """The target verified ``[anchor] + proposal.tokens`` in ``verify`` (a ForwardResult over
        those rows) and committed ``anchor`` and the first ``n_accepted`` drafts."""

    def describe(self) -> str:
        """One line for stderr at load: what runs."""
        return self.name
