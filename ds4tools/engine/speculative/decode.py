"""The speculative decoding loop: propose, verify in one batched forward, accept, commit.

The target's KV cache holds every committed token except the anchor (the newest one, already
emitted, not yet run). Each step the drafter proposes d_1..d_n after the anchor, the target
runs [anchor, d_1..d_n] in one forward (row i is its distribution after d_i), the acceptance
rule keeps a prefix d_1..d_m and picks the token that follows, the cache is truncated to the
committed length and the drafter is told. Greedy output equals plain greedy decoding token for
token: a row's logits are bit-identical whether its token was decoded alone or in a batch.
"""
from __future__ import annotations

import contextlib
import time
from typing import Iterator

import numpy as np

from ..generate import GenerationStats
from .acceptance import LazyRows, accept_greedy, accept_sampled
from .drafter import Drafter, Proposal
from .stats import PlainCostCurve, SpecStats


def next_calibration(pos: int) -> int:
    """Where to time the next plain step after one at ``pos``: often while the context is
    short, every 256 positions once it is long (3 one-token forwards each time: about 1% of a
    long run's steps)."""
    return pos + min(256, max(32, pos // 2))


def calibrate_plain_step(model, token: int, pos: int, sampler, rng, repeats: int = 3):
    """Time a plain one-token decode step at ``pos`` (its cache row is rewritten by the next
    verify); returns (forward seconds, forward + sampling seconds). ``rng`` is a throwaway.

    The median of the repeats: the minimum is a quiet-machine figure that the decode steps it
    is compared with do not get on a busy one, and the first repeat may pay a page fault for a
    new cache row."""
    clock = time.perf_counter
    fwd, step = [], []
    for _ in range(repeats):
        t0 = clock()
        logits = model.forward([token], pos, logits="last").logits[-1]
        t1 = clock()
        sampler.sample(logits, rng)
        t2 = clock()
        fwd.append(t1 - t0)
        step.append(t2 - t0)
    model.cache.truncate(pos)
    return float(np.median(fwd)), float(np.median(step))


def speculative_decode(model, drafter: Drafter, prompt: list[int], max_tokens: int, sampler,
                       rng: np.random.Generator, eog_ids=frozenset(),
                       stats: GenerationStats | None = None, spec: SpecStats | None = None,
                       strict: bool = False, calibrate: bool = True, on_step=None
                       ) -> Iterator[int]:
    """Yield up to ``max_tokens`` new token ids after ``prompt``, as ``generate.decode`` does
    (same stop rules, same GenerationStats conventions), drafting with ``drafter``.

    ``strict``: a step commits its drafts only if the target accepted all of them, otherwise
    only the first token the standard rule would commit (lossless at greedy only; refused for
    sampling). ``on_step(spec_stats, proposal, n_accepted, seconds)``: per-step hook (timing
    logs)."""
    if strict and not sampler.greedy:
        raise ValueError("strict block acceptance is lossless only at temperature 0: with "
                         "sampling, dropping an accepted prefix after a later rejection biases "
                         "the output distribution")
    stats = stats if stats is not None else GenerationStats()
    spec = spec if spec is not None else SpecStats(method=drafter.name)
    stats.prompt_tokens = len(prompt)
    clock = time.perf_counter
    start = clock()
    cache = model.cache
    cache.clear()
    layers, want_final = drafter.hidden_layers, drafter.wants_final_hidden
    # the drafter runs the target's kernels: the same thread setting as the target's forward
    threads = getattr(model, "threads", contextlib.nullcontext)
    curve, step_positions = PlainCostCurve(), []
    try:
        if max_tokens <= 0:
            stats.stop_reason = "length"
            return
        t0 = clock()
        pre = model.forward(prompt, 0, hidden_layers=layers, want_final_hidden=want_final,
                            logits="last")
        token = sampler.sample(pre.logits[-1], rng)
        with threads():
            drafter.start(list(prompt), pre)
        stats.prefill_seconds = clock() - t0
        pos = len(prompt)
        next_timing = pos
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

            if calibrate and pos >= next_timing:  # plain steps along the run, outside the steps' times
                t0 = clock()
                curve.add(pos, *calibrate_plain_step(model, token, pos, sampler, np.random.default_rng(0)))
                spec.calibration_seconds += clock() - t0
                next_timing = next_calibration(pos)

            step_start = clock()
            limit = min(max_tokens - stats.generated_tokens, model.n_ctx - pos - 1)
            with threads():
                proposal = drafter.propose(token, limit, sampler, rng) if limit > 0 else Proposal()
            t_drafted = clock()
            drafts = [int(t) for t in proposal.tokens]
            if len(drafts) > limit:
                raise RuntimeError(f"{drafter.name} proposed {len(drafts)} drafts, over the limit {limit}")
            verify = model.forward([token] + drafts, pos, hidden_layers=layers,
                                   want_final_hidden=want_final, logits="all")
            t_verified = clock()
            if sampler.greedy:
                m, nxt = accept_greedy(verify.logits, drafts)
            else:
                p = LazyRows(verify.logits, sampler.distribution)
                m, nxt = accept_sampled(p, drafts, proposal.q, rng)
            if strict and m < len(drafts):
                spec.strict_fallbacks += 1
                m, nxt = 0, (drafts[0] if m >= 1 else nxt)
            t_accepted = clock()
            cache.truncate(pos + 1 + m)
            with threads():
                drafter.commit(token, proposal, m, verify)
            t_committed = clock()

            spec.record_step(len(drafts), len(drafts), m, proposal.cut)
            step_positions.append(pos)
            spec.draft_seconds += (t_drafted - step_start) + (t_committed - t_accepted)
            spec.target_verify_seconds += t_verified - t_drafted
            spec.sampling_seconds += t_accepted - t_verified
            step_seconds = t_committed - step_start
            stats.decode_seconds += step_seconds
            if on_step is not None:
                on_step(spec, proposal, m, step_seconds)
            spec.other_seconds += clock() - t_committed

            # tau counts what the step committed: each draft up to an end of generation, and
            # the bonus token, unless -n ends the run before it
            for d in drafts[:m]:
                spec.committed += 1
                if d in eog_ids:
                    stats.stop_reason = "eog"
                    return
                stats.generated_tokens += 1
                yield d
                if stats.generated_tokens >= max_tokens:
                    stats.stop_reason = "length"
                    return
            spec.committed += 1
            pos += 1 + m
            token = nxt
    finally:
        stats.stop_reason = stats.stop_reason or "interrupted"
        stats.decode_tokens = max(0, stats.generated_tokens - 1)
        spec.decode_tokens = stats.decode_tokens
        spec.decode_seconds = stats.decode_seconds
        # plain decoding makes decode token i with a one-token step at position prompt + i
        spec.plain_forward_seconds += curve.total_forward(step_positions)
        spec.plain_decode_seconds += curve.total_step(
            np.arange(len(prompt), len(prompt) + stats.decode_tokens))
        stats.total_seconds = clock() - start
