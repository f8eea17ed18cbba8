"""Timing primitives: one measurement each, best of N, nothing printed.

Shared by ``ds4tools bench`` and ``benchmarks/bench_engine.py`` / ``bench_spec.py``. Every
function takes an ``Engine`` (or anything with its ``forward`` / ``cache`` / ``model`` /
``weights``), assumes warm kernels (the caller runs a warm-up first) and times with
``time.perf_counter``.
"""
from __future__ import annotations

import os
import time

import numpy as np


def best_of(fn, repeat: int) -> float:
    """The shortest wall time of ``repeat`` calls of ``fn()``, in seconds."""
    best = float("inf")
    for _ in range(max(1, int(repeat))):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def last_level_cache_bytes(default: int = 64 << 20) -> int:
    """The largest CPU cache of this machine in bytes, from sysfs (``default`` where unknown):
    a buffer several times this size is read from memory, not from cache."""
    best = 0
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        names = os.listdir(base)
    except OSError:
        return default
    for name in names:
        try:
            with open(os.path.join(base, name, "size")) as f:
                text = f.read().strip().upper()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text[:-1] if text[-1:] in "KMG" else text
        if digits.isdigit():
            best = max(best, int(digits) * scale)
    return best or default


def memcpy_bandwidth(nbytes: int = 1 << 30, repeat: int = 5) -> float:
    """GB/s of a numpy copy of a large buffer (bytes read per second), best of ``repeat``."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    best = best_of(lambda: np.copyto(dst, src), repeat)
    return nbytes / best / 1e9


def decode_weight_bytes(engine, rows: int = 1) -> int:
    """Bytes of weights one forward of ``rows`` tokens reads (default: a decode step): every
    matrix but the embedding (one row); of a mixture-of-experts tensor only the experts the
    forwards of that many rows used, on average since ``reset_expert_reads`` (each expert
    counted once per forward however many rows chose it). Before any such forward: the top-k
    experts of one row."""
    total = 0.0
    for lin in engine.weights.linears():
        per_call = getattr(lin, "bytes_per_call", None)
        total += per_call(rows) if per_call is not None else lin.nbytes
    return int(round(total))


def reset_expert_reads(engine) -> None:
    """Forget the experts recorded so far (see decode_weight_bytes)."""
    for lin in engine.weights.linears():
        reset = getattr(lin, "reset_reads", None)
        if reset is not None:
            reset()


def forward_weight_bytes(engine) -> int:
    """Bytes of weights the last forward read: every matrix but the embedding, of an expert
    tensor the experts that forward used."""
    total = 0
    for lin in engine.weights.linears():
        last = getattr(lin, "last_read", None)
        total += last * lin.expert_nbytes if last is not None else lin.nbytes
    return total


def prefill_seconds(engine, tokens, repeat: int) -> float:
    """Best time of the forward of ``tokens`` from an empty cache (logits of the last row only,
    as a prompt's prefill)."""
    def prefill():
        engine.cache.clear()
        engine.forward(tokens, 0, logits="last")
    return best_of(prefill, repeat)


def verify_seconds(engine, depth: int, ks, rounds: int, tokens=None) -> dict:
    """{k: best time of a forward of k tokens at context ``depth``, logits for every row} (a
    verify step). The cache must hold at least ``depth`` rows; it is left at ``depth``. The k
    values are interleaved within each round, so load changes hit them alike. ``tokens``: the
    ids fed (default: token 0 repeated; the values do not change the time)."""
    ks = list(ks)
    feed = np.asarray(tokens if tokens is not None else np.zeros(max(ks), np.int64))
    times = {k: float("inf") for k in ks}
    for _ in range(max(1, int(rounds))):
        for k in ks:
            engine.cache.truncate(depth)
            t = time.perf_counter()
            engine.forward(feed[:k], depth, logits="all")
            times[k] = min(times[k], time.perf_counter() - t)
    engine.cache.truncate(depth)
    return times


def cost_ratios(times: dict) -> dict:
    """r(k) = time(k-token forward) / time(1-token forward), from verify_seconds' result."""
    return {k: t / times[1] for k, t in times.items()}


def generation(engine, prompt: list[int], n: int, sampler, seed: int, drafter=None,
               strict: bool = False):
    """Generate ``n`` tokens after the token ids ``prompt`` (no stop at end-of-generation
    tokens), plainly or drafting with ``drafter``; returns (tokens, GenerationStats, SpecStats
    or None). The speeds are the stats' ``decode_tps`` (the steps after the first token)."""
    from ..engine.generate import GenerationStats, decode
    from ..engine.speculative import SpecStats, speculative_decode
    stats = GenerationStats(seed=int(seed))
    rng = np.random.default_rng(int(seed))
    if drafter is None:
        spec = None
        it = decode(engine.model, prompt, n, sampler, rng, frozenset(), stats)
    else:
        spec = SpecStats(method=drafter.name)
        it = speculative_decode(engine.model, drafter, prompt, n, sampler, rng, frozenset(), stats,
                                spec, strict=strict)
    tokens = list(it)
    return tokens, stats, spec
