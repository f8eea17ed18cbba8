"""Ours against llama.cpp on the same GGUF, alternated round by round, so that each pair of
measurements runs under nearly the same machine load (on a shared machine the load moves both
sides' speeds by 2-4x between minutes; only same-round ratios mean much).

Each side runs in its own child process that loads the model once and answers commands
("prefill", "decode", "rk", "rss"); the parent alternates them (ours, llama.cpp, then llama.cpp,
ours, ...) for ``--rounds`` rounds and prints decode and prefill t/s per round, the medians of
the per-round ratios, r(1..8) and each process's peak resident memory. Ours also reports the
GB/s of the weights a decode step reads (for a MoE model, only the experts it used).

    python benchmarks/paired.py MODEL.gguf [MODEL.gguf ...] --rounds 5 --threads 2

Used by benchmarks/bench_moe.py on its synthetic MoE model.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


# --- the measurements (each side in its own child process, alternated) -------------------------
# Both children load their model and then wait for commands on stdin ("prefill", "decode",
# "rk", "rss"), answering one JSON line each; the parent alternates them (ours, llama.cpp, then
# llama.cpp, ours, ...) so each pair of measurements runs under nearly the same machine load.

COMMON = """
import json, resource, sys, time
import numpy as np
path, threads, n_prompt, n_decode, repeat = (sys.argv[1], int(sys.argv[2]), int(sys.argv[3]),
                                             int(sys.argv[4]), int(sys.argv[5]))
KS = (1, 2, 3, 4, 5, 6, 7, 8)
def best(f):
    return min(f() for _ in range(repeat))
def peak_rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
def serve(handlers):
    print("READY", flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "quit":
            break
        print("RESULT " + json.dumps(handlers[cmd]()), flush=True)
"""

OURS_CHILD = COMMON + """
sys.path.insert(0, sys.argv[6])
from ds4tools import Engine
from ds4tools.bench import measure
eng = Engine(path, n_ctx=1024, threads=threads)
n_vocab = eng.hparams.n_vocab
prompt = np.random.default_rng(0).integers(3, n_vocab, n_prompt)
eng.forward(prompt[:8], 0, logits="last")
eng.forward(prompt[:1], 8, logits="last")
eng.forward(prompt, 0, logits="last")
def prefill():
    eng.cache.clear()
    t = time.perf_counter(); eng.forward(prompt, 0, logits="last"); return time.perf_counter() - t
def decode():
    eng.cache.truncate(n_prompt)
    t = time.perf_counter()
    tok = int(prompt[-1])
    for i in range(n_decode):
        tok = int(np.argmax(eng.forward([tok], n_prompt + i, logits="last").logits[0]))
    return (time.perf_counter() - t) / n_decode
def h_prefill():
    return {"prefill_tps": n_prompt / best(prefill)}
def h_decode():
    prefill()
    measure.reset_expert_reads(eng)
    t = best(decode)
    wb = measure.decode_weight_bytes(eng)
    return {"decode_tps": 1 / t, "weight_bytes": wb, "weight_gbps": wb / t / 1e9}
def h_rk():
    prefill()
    times = measure.verify_seconds(eng, n_prompt, KS, max(repeat, 5), prompt)
    return {"r": {k: v / times[1] for k, v in times.items()}}
serve({"prefill": h_prefill, "decode": h_decode, "rk": h_rk,
       "rss": lambda: {"peak_rss_mb": peak_rss_mb()}})
"""

def llama_cpp_context(context_params: str = "") -> str:
    """A llama.cpp child's start (llama-cpp-python's low-level API): the model at ``path``, a
    1024-token context on ``threads`` threads, and ``forward(tokens, pos0, all_logits)``.
    ``context_params``: more lines setting ``cp`` (the context parameters) before it is made.
    The scripts that measure against llama.cpp (this one, bench_engine, bench_deepseek4) all
    start their children with it."""
    return """
import llama_cpp as L
L.llama_backend_init()
mp = L.llama_model_default_params()
mp.use_extra_bufts = False  # its AMX / repacked weight buffers crash in some VMs
model = L.llama_model_load_from_file(path.encode(), mp)
cp = L.llama_context_default_params()
cp.n_ctx, cp.n_batch, cp.n_ubatch = 1024, 512, 512
cp.n_threads = cp.n_threads_batch = threads
""" + context_params + """
ctx = L.llama_init_from_model(model, cp)
mem = L.llama_get_memory(ctx)
n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
batch = L.llama_batch_init(512, 0, 1)
def forward(tokens, pos0, all_logits):
    for i, t in enumerate(tokens):
        batch.token[i], batch.pos[i], batch.n_seq_id[i] = int(t), pos0 + i, 1
        batch.seq_id[i][0] = 0
        batch.logits[i] = 1 if all_logits or i == len(tokens) - 1 else 0
    batch.n_tokens = len(tokens)
    assert L.llama_decode(ctx, batch) == 0
"""


LLAMA_CPP_CHILD = COMMON + llama_cpp_context() + """
prompt = np.random.default_rng(0).integers(3, n_vocab, n_prompt)
forward(prompt[:8], 0, False)
def prefill():
    L.llama_memory_clear(mem, True)
    t = time.perf_counter(); forward(prompt, 0, False); return time.perf_counter() - t
prefill()
def decode():
    L.llama_memory_seq_rm(mem, 0, n_prompt, -1)
    t = time.perf_counter()
    tok = int(prompt[-1])
    for i in range(n_decode):
        forward([tok], n_prompt + i, False)
        tok = int(np.argmax(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))))
    return (time.perf_counter() - t) / n_decode
def h_rk():
    prefill()
    times = {k: float("inf") for k in KS}
    for _ in range(max(repeat, 5)):
        for k in KS:
            L.llama_memory_seq_rm(mem, 0, n_prompt, -1)
            t = time.perf_counter(); forward(prompt[:k], n_prompt, True)
            times[k] = min(times[k], time.perf_counter() - t)
    return {"r": {k: v / times[1] for k, v in times.items()}}
def h_decode():
    prefill()
    return {"decode_tps": 1 / best(decode)}
serve({"prefill": lambda: {"prefill_tps": n_prompt / best(prefill)}, "decode": h_decode,
       "rk": h_rk, "rss": lambda: {"peak_rss_mb": peak_rss_mb()}})
"""


class Child:
    """One side's child process, answering the commands above."""

    def __init__(self, code, path, threads, n_prompt, n_decode, repeat):
        self.p = subprocess.Popen([sys.executable, "-c", code, str(path), str(threads), str(n_prompt),
                                   str(n_decode), str(repeat), os.path.join(HERE, "..")],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self._line()
        if line != "READY":
            raise RuntimeError(f"child failed to start ({line!r})")

    def _line(self) -> str:
        while True:
            line = self.p.stdout.readline()
            if not line or line.strip() in ("READY",) or line.startswith("RESULT "):
                return line.strip()

    def ask(self, cmd: str) -> dict:
        self.p.stdin.write(cmd + "\n")
        self.p.stdin.flush()
        line = self._line()
        if not line.startswith("RESULT "):
            raise RuntimeError(f"child died during {cmd!r}")
        return json.loads(line[len("RESULT "):])

    def close(self) -> None:
        try:
            self.p.stdin.write("quit\n")
            self.p.stdin.close()
        except OSError:
            pass
        self.p.wait(timeout=60)


def have_llama_cpp() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def _fmt_r(r: dict) -> str:
    return " ".join(f"{float(r[k]):.2f}" for k in sorted(r, key=int))


def compare(path, *, threads: int = 2, repeat: int = 3, rounds: int = 5, n_prompt: int = 512,
            n_decode: int = 32, llama_cpp: bool = True, log=print) -> dict:
    """Measure ``path`` on both sides, ``rounds`` times alternated; returns the summary (the
    medians, r, peak RSS and, with llama.cpp, the per-round ratios and their medians)."""
    sides = {"ours": Child(OURS_CHILD, path, threads, n_prompt, n_decode, repeat)}
    if llama_cpp and have_llama_cpp():
        sides["llama.cpp"] = Child(LLAMA_CPP_CHILD, path, threads, n_prompt, n_decode,
                                   repeat)
    res = {name: {"decode": [], "prefill": []} for name in sides}
    med = statistics.median
    try:
        for i in range(rounds):
            order = list(sides) if i % 2 == 0 else list(sides)[::-1]
            for what in ("decode", "prefill"):
                for name in order:
                    res[name][what].append(sides[name].ask(what))
            line = " | ".join(
                f"{n}: decode {res[n]['decode'][-1]['decode_tps']:.1f} t/s, prefill{n_prompt} "
                f"{res[n]['prefill'][-1]['prefill_tps']:.0f} t/s" for n in sides)
            log(f"round {i + 1}: {line}")
        for name in sides:
            res[name]["rk"] = sides[name].ask("rk")["r"]
            res[name]["rss"] = sides[name].ask("rss")["peak_rss_mb"]
    finally:
        for c in sides.values():
            c.close()
    summary = {"rounds": rounds, "threads": threads, "n_prompt": n_prompt}
    for name in sides:
        r = res[name]
        summary[name] = {"decode_tps": med([x["decode_tps"] for x in r["decode"]]),
                         "prefill_tps": med([x["prefill_tps"] for x in r["prefill"]]),
                         "peak_rss_mb": r["rss"], "r": {int(k): v for k, v in r["rk"].items()}}
        if name == "ours":
            summary[name]["weight_bytes_per_token"] = r["decode"][-1]["weight_bytes"]
            summary[name]["weight_gbps"] = med([x["weight_gbps"] for x in r["decode"]])
        log(f"{name}: decode {summary[name]['decode_tps']:.1f} t/s, prefill{n_prompt} "
            f"{summary[name]['prefill_tps']:.0f} t/s (medians of {rounds}), peak RSS "
            f"{r['rss']:.0f} MB, r(1..8) {_fmt_r(r['rk'])}")
    if "llama.cpp" in sides:
        o, t = res["ours"], res["llama.cpp"]
        summary["ratio"] = {
            "decode_per_round": [a["decode_tps"] / b["decode_tps"] for a, b in zip(o["decode"], t["decode"])],
            "prefill_per_round": [a["prefill_tps"] / b["prefill_tps"] for a, b in zip(o["prefill"], t["prefill"])],
            "peak_rss": o["rss"] / t["rss"]}
        summary["ratio"]["decode_median"] = med(summary["ratio"]["decode_per_round"])
        summary["ratio"]["prefill_median"] = med(summary["ratio"]["prefill_per_round"])
        log(f"ours / llama.cpp: decode {summary['ratio']['decode_median']:.2f}, prefill "
            f"{summary['ratio']['prefill_median']:.2f} (medians of the per-round ratios), "
            f"peak RSS {summary['ratio']['peak_rss']:.2f}")
    return summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="+", metavar="MODEL.gguf")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3, help="best of N inside each measurement")
    ap.add_argument("--rounds", type=int, default=5, help="ours / llama.cpp alternated N times")
    ap.add_argument("--n-prompt", type=int, default=512)
    ap.add_argument("--n-decode", type=int, default=32)
    ap.add_argument("--no-llama-cpp", action="store_true")
    args = ap.parse_args(argv)
    log = lambda m: print(m, flush=True)  # noqa: E731
    for path in args.models:
        log(f"model {path}")
        summary = compare(path, threads=args.threads, repeat=args.repeat, rounds=args.rounds,
                          n_prompt=args.n_prompt, n_decode=args.n_decode,
                          llama_cpp=not args.no_llama_cpp, log=log)
        log("SUMMARY " + json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
