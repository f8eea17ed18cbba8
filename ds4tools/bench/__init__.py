"""``ds4tools bench``: the llama-bench of this project.

Prefill (pp) and decode (tg) tokens/s, the GB/s of weights a decode step reads next to a
memory copy measured in the same run, the verify-cost curve r(k), and a speculative-decoding
sweep (speedup over plain decoding in the same run, tau, alpha per drafter setting).

- ``measure``: timing primitives (best of N, memcpy bandwidth, prefill, verify forwards,
  generation), shared with ``benchmarks/bench_engine.py``;
- ``sweep``: the drafter options' comma lists expanded into speculative settings;
- ``options``: ``BenchOptions``, parsed and checked from the command line;
- ``runner``: ``run_bench(options)``: the measurements, in order, as a JSON-ready document;
- ``report``: the table.
"""
from .options import BenchOptions
from .report import render_table
from .runner import SCHEMA, run_bench

__all__ = ["BenchOptions", "SCHEMA", "render_table", "run_bench"]
