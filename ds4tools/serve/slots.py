"""Generation slots: one worker thread per slot, each with its own engine (its own KV cache and
drafter; the weights are shared read-only, ``Engine.clone``), fed from one bounded queue.

The event loop submits a ``Job`` and reads its events (``("text", str)``, then one
``("done", result)`` or ``("error", APIError)``) from an asyncio queue that the worker fills with
``call_soon_threadsafe``. A job whose client went away is cancelled: its worker checks after
every token and stops, freeing the slot; a job cancelled while still queued never starts.
Admission is bounded: at most ``slots + queue_size`` jobs are admitted (running or waiting);
past that ``submit`` raises ``QueueFull`` (the server answers 503 with Retry-After).
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
import time

from ..errors import Ds4Error
from .errors import APIError

log = logging.getLogger("ds4tools.serve")


class QueueFull(Exception):
    pass


def _workqueue_layer() -> bool:
    """Whether numba runs its parallel kernels on the workqueue layer (known once a parallel
    kernel has run: the slots are warmed up first)."""
    import numba
    try:
        return numba.threading_layer() == "workqueue"
    except ValueError:  # no parallel kernel has run yet: be safe
        return True


class StopScanner:
    """Cuts the generated text at the first stop sequence. Text that may be the start of a stop
    sequence is held back until the next token decides, so a stream never shows part of one."""

    def __init__(self, stops):
        self.stops = list(stops)
        self.held = ""
        self.hit = False

    def feed(self, text: str) -> str:
        """The text that can be shown now."""
        if not self.stops:
            return text
        buf = self.held + text
        found = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if found:
            self.hit = True
            self.held = ""
            return buf[:min(found)]
        keep = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:k]):
                    keep = k
                    break
        self.held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep]

    def flush(self) -> str:
        text, self.held = self.held, ""
        return text


class Job:
    _ids = itertools.count(1)

    def __init__(self, request, loop: asyncio.AbstractEventLoop):
        self.request = request
        self.loop = loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.number = next(self._ids)

    def push(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the loop is closed: the server is shutting down
            self.cancelled.set()

    def cancel(self) -> None:
        self.cancelled.set()


class SlotPool:
    def __init__(self, engines, metrics, *, queue_size: int, threads: int | None = None):
        self.engines = list(engines)
        self.metrics = metrics
        self.queue_size = queue_size
        self.capacity = len(self.engines) + queue_size
        self._threads_per_slot = threads
        self._jobs: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        #: numba's kernels release the GIL, so slots compute at once; its workqueue threading
        #: layer is not thread-safe, though: under it the slots take turns, token by token
        self._step_lock = threading.Lock() if _workqueue_layer() else contextlib.nullcontext()
        self.pending = 0   # admitted and not finished: waiting or running
        self.busy = 0      # running
        self._workers = [threading.Thread(target=self._worker, args=(i, eng), daemon=True,
                                          name=f"ds4tools-slot-{i}")
                         for i, eng in enumerate(self.engines)]
        for w in self._workers:
            w.start()

    @property
    def slots(self) -> int:
        return len(self.engines)

    def counts(self) -> tuple[int, int]:
        """(busy slots, waiting jobs)."""
        with self._lock:
            return self.busy, self.pending - self.busy

    def submit(self, job: Job) -> None:
        with self._lock:
            if self.pending >= self.capacity:
                raise QueueFull()
            self.pending += 1
        self._jobs.put(job)

    def close(self) -> None:
        for _ in self._workers:
            self._jobs.put(None)

    def _worker(self, index: int, engine) -> None:
        from ..engine.api import set_threads
        set_threads(self._threads_per_slot)  # numba's thread count is per calling thread
        while True:
            job = self._jobs.get()
            if job is None:
                return
            with self._lock:
                self.busy += 1
            final = None
            try:
                final = self._run(engine, job)
            except Exception as e:  # never lose the slot: answer 500 and go on
                log.exception("slot %d: generation failed", index)
                final = ("error", APIError(500, f"generation failed: {type(e).__name__}: {e}",
                                           type="server_error", code="internal_error"))
            finally:
                with self._lock:
                    self.busy -= 1
                    self.pending -= 1
            if final is not None:  # after the slot is free: a client that has its answer sees it so
                job.push(final)

    def _run(self, engine, job: Job):
        req = job.request
        if job.cancelled.is_set():
            self.metrics.count_generation(None, None, cancelled=True)
            return None
        t0 = time.perf_counter()
        engine.last_spec_stats = None
        try:
            tokens = engine.generate(req.prompt, req.max_tokens, temperature=req.temperature,
                                     top_k=req.top_k, top_p=req.top_p, min_p=req.min_p,
                                     seed=req.seed, stop_at_eog=not req.ignore_eos)
        except Ds4Error as e:
            return ("error", APIError(400, str(e), code="invalid_value"))
        job.push(("start", None))
        stop = StopScanner(req.stop)
        try:
            while not job.cancelled.is_set():
                with self._step_lock:
                    tok = next(tokens, None)
                if tok is None:
                    break
                text = stop.feed(tok.text)
                if text:
                    job.push(("text", text))
                if stop.hit:
                    break
        except Ds4Error as e:
            return ("error", APIError(500, str(e), type="server_error", code="engine_error"))
        finally:
            tokens.close()  # completes the stats now
        stats, spec = engine.last_stats, engine.last_spec_stats if engine.drafter is not None else None
        cancelled = job.cancelled.is_set()
        self.metrics.count_generation(stats, spec, cancelled=cancelled)
        if cancelled:
            return None
        tail = stop.flush()
        if tail:
            job.push(("text", tail))
        if stop.hit:
            finish = "stop"
        else:
            finish = "length" if stats.stop_reason in ("length", "context") else "stop"
        return ("done", {
            "finish_reason": finish,
            "usage": {"prompt_tokens": stats.prompt_tokens,
                      "completion_tokens": stats.generated_tokens,
                      "total_tokens": stats.prompt_tokens + stats.generated_tokens},
            "ds4tools": extension(stats, spec, time.perf_counter() - t0, stop.hit),
        })


def extension(stats, spec, seconds: float, stopped: bool) -> dict:
    """The response's ``ds4tools`` field: the seed, the stop reason, timings and speeds, and the
    speculative statistics of this request (null without drafting)."""
    out = {
        "seed": stats.seed,
        "stop_reason": "stop_sequence" if stopped else stats.stop_reason,
        "prompt_tokens_per_second": round(stats.prefill_tps, 3),
        "tokens_per_second": round(stats.decode_tps, 3),
        "seconds": round(seconds, 6),
        "speculative": None,
    }
    if spec is not None:
        out["speculative"] = {
            "method": spec.method, "steps": spec.steps, "drafted": spec.drafted,
            "accepted": spec.accepted, "tau": round(spec.tau, 6),
            "acceptance": round(spec.accepted / spec.drafted, 6) if spec.drafted else 0.0,
        }
    return out
