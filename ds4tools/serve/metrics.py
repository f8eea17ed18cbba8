"""Server counters and their Prometheus text exposition (GET /metrics).

Every figure is kept under one lock: the event loop counts requests, the slot threads count
tokens and speculative statistics as generations end."""
from __future__ import annotations

import threading
import time
from collections import Counter


class Metrics:
    def __init__(self):
        self._lock = threading.Lock()
        self.started = time.time()
        self.requests = Counter()        # (endpoint, status) -> count
        self.rejected = 0                # 503: the queue was full
        self.cancelled = 0               # generations stopped because the client went away
        self.completed = 0               # generations run to their end
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.prefill_seconds = 0.0
        self.decode_seconds = 0.0
        self.decode_tokens = 0
        self.spec_steps = 0
        self.spec_drafted = 0
        self.spec_accepted = 0
        self.spec_committed = 0
        self.last_decode_tps = 0.0

    def count_request(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[(endpoint, int(status))] += 1

    def count_rejected(self) -> None:
        with self._lock:
            self.rejected += 1

    def count_generation(self, stats, spec, *, cancelled: bool) -> None:
        """One finished generation: its GenerationStats and SpecStats (or None)."""
        with self._lock:
            if cancelled:
                self.cancelled += 1
            else:
                self.completed += 1
            if stats is not None:
                self.prompt_tokens += stats.prompt_tokens
                self.generated_tokens += stats.generated_tokens
                self.prefill_seconds += stats.prefill_seconds
                self.decode_seconds += stats.decode_seconds
                self.decode_tokens += stats.decode_tokens
                if stats.decode_seconds > 0:
                    self.last_decode_tps = stats.decode_tps
            if spec is not None:
                self.spec_steps += spec.steps
                self.spec_drafted += spec.drafted
                self.spec_accepted += spec.accepted
                self.spec_committed += spec.committed

    def render(self, slots_total: int, slots_busy: int, queued: int) -> str:
        with self._lock:
            lines = []

            def metric(name, kind, help_, samples):
                lines.append(f"# HELP ds4tools_{name} {help_}")
                lines.append(f"# TYPE ds4tools_{name} {kind}")
                for labels, value in samples:
                    lab = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
                    lines.append(f"ds4tools_{name}{lab} {_fmt(value)}")

            metric("requests_total", "counter", "HTTP requests answered, by endpoint and status.",
                   [({"endpoint": e, "status": str(s)}, n) for (e, s), n in sorted(self.requests.items())]
                   or [({}, 0)])
            metric("requests_rejected_total", "counter", "Requests refused with 503: the queue was full.",
                   [({}, self.rejected)])
            metric("generations_total", "counter", "Generations run, by how they ended.",
                   [({"end": "completed"}, self.completed), ({"end": "cancelled"}, self.cancelled)])
            metric("prompt_tokens_total", "counter", "Prompt tokens prefilled.", [({}, self.prompt_tokens)])
            metric("generated_tokens_total", "counter", "Tokens generated.", [({}, self.generated_tokens)])
            metric("prefill_seconds_total", "counter", "Seconds spent in prefill.", [({}, self.prefill_seconds)])
            metric("decode_seconds_total", "counter", "Seconds spent decoding after the first token.",
                   [({}, self.decode_seconds)])
            metric("prompt_tokens_per_second", "gauge", "Prefill speed over all requests.",
                   [({}, self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0)])
            metric("tokens_per_second", "gauge", "Decode speed over all requests (tokens after the first).",
                   [({}, self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0)])
            metric("last_tokens_per_second", "gauge", "Decode speed of the last finished request.",
                   [({}, self.last_decode_tps)])
            metric("speculative_steps_total", "counter", "Speculative verify steps.", [({}, self.spec_steps)])
            metric("speculative_drafted_tokens_total", "counter", "Draft tokens proposed.",
                   [({}, self.spec_drafted)])
            metric("speculative_accepted_tokens_total", "counter", "Draft tokens accepted by the target.",
                   [({}, self.spec_accepted)])
            metric("speculative_acceptance_ratio", "gauge", "Accepted over drafted tokens.",
                   [({}, self.spec_accepted / self.spec_drafted if self.spec_drafted else 0.0)])
            metric("speculative_tau", "gauge", "Tokens committed per verify step (tau).",
                   [({}, self.spec_committed / self.spec_steps if self.spec_steps else 0.0)])
            metric("slots_total", "gauge", "Generation slots.", [({}, slots_total)])
            metric("slots_busy", "gauge", "Slots generating now.", [({}, slots_busy)])
            metric("queue_waiting", "gauge", "Requests waiting for a slot.", [({}, queued)])
            metric("uptime_seconds", "gauge", "Seconds since the server started.",
                   [({}, time.time() - self.started)])
            return "\n".join(lines) + "\n"


def _fmt(v) -> str:
    if isinstance(v, int):
        return str(v)
    return repr(float(v))
