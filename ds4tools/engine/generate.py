"""Plain decoding: prefill the prompt, then one token at a time, with timings.

Stats follow one convention (docs/engine.md): the prefill step is the prompt's forward plus the
choice of the first new token (time to first token); every later token costs one decode step
(a one-token forward plus sampling). So ``decode_tokens`` = generated tokens - 1 and
``decode_tps`` = decode_tokens / decode_seconds: the steady-state speed.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Iterator

import numpy as np

from .sampling import Sampler
from .transformer import Transformer


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    total_seconds: float = 0.0
    #: "length" | "eog" | "context" | "interrupted" (the caller stopped the iteration: Ctrl-C,
    #: or a loop that broke off early)
    stop_reason: str = ""
    seed: int | None = None
    #: the throwaway generation that loaded the compiled kernels before this one (0 once warm);
    #: outside every other figure
    warmup_seconds: float = 0.0
    #: generation stopped inside a multi-byte UTF-8 character: the text lacks its first bytes,
    #: which the last token(s) hold
    text_truncated: bool = False

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["prefill_tps"] = self.prefill_tps
        d["decode_tps"] = self.decode_tps
        return d

    def summary_lines(self) -> list[str]:
        return [
            f"prompt tokens: {self.prompt_tokens}",
            f"prefill: {self.prefill_seconds:.3f} s, {self.prefill_tps:.1f} t/s",
            f"decode: {self.decode_tokens} tokens in {self.decode_seconds:.3f} s, "
            f"{self.decode_tps:.1f} t/s",
            f"generated tokens: {self.generated_tokens} (stop: {self.stop_reason})",
            f"total time: {self.total_seconds:.3f} s (warm-up before it: {self.warmup_seconds:.3f} s)",
            f"seed: {self.seed}",
        ]


def decode(model: Transformer, prompt: list[int], max_tokens: int, sampler: Sampler,
           rng: np.random.Generator, eog_ids=frozenset(), stats: GenerationStats | None = None
           ) -> Iterator[int]:
    """Yield up to ``max_tokens`` new token ids after ``prompt`` (an end-of-generation token
    stops the loop and is not yielded). ``stats`` is filled in as it goes: it is complete
    once the generator is exhausted or closed."""
    stats = stats if stats is not None else GenerationStats()
    stats.prompt_tokens = len(prompt)
    clock = time.perf_counter
    start = clock()
    cache = model.cache
    cache.clear()
    try:
        if max_tokens <= 0:
            stats.stop_reason = "length"
            return
        t0 = clock()
        logits = model.forward(prompt, 0, logits="last").logits[-1]
        token = sampler.sample(logits, rng)
        stats.prefill_seconds = clock() - t0
        pos = len(prompt)
        while True:
            if token in eog_ids:
                stats.stop_reason = "eog"
                return
            stats.generated_tokens += 1
            yield token
            if stats.generated_tokens >= max_tokens:
                stats.stop_reason = "length"
                return
            if pos >= model.n_ctx:
                stats.stop_reason = "context"
                return
            t0 = clock()
            logits = model.forward([token], pos, logits="last").logits[-1]
            token = sampler.sample(logits, rng)
            stats.decode_seconds += clock() - t0
            stats.decode_tokens += 1
            pos += 1
    finally:
        stats.stop_reason = stats.stop_reason or "interrupted"
        stats.total_seconds = clock() - start
