"""Engine speed: prefill and decode tokens/s, weight bandwidth, verify cost r(k), warm start.

Models:
  demo     the bundled demo model (Q8_0, converted into the cache on first use), when installed
  q8_0     a synthetic ~350M-parameter qwen3 GGUF (random weights), Q8_0   (made here)
  q4_k_m   the same model as llama.cpp's Q4_K_M mix                         (made here)
  q2_k     the same model as llama.cpp's Q2_K mix                           (made here)
  stories  a stories260K-sized qwen3 (5 layers, 64 wide, vocab 512), Q8_0:  per-token overhead

For each: prefill t/s (a 128-token prompt), decode t/s (greedy steps after it), the GB/s of
weights streamed per second while decoding against a numpy memory copy measured in the same
run, and for the synthetic models the verify-cost curve r(k) = time(forward of k tokens) /
time(forward of 1 token), k = 1..16, at the same context. Then the wall time of a second
`ds4tools run -n 1` on the demo model (the numba cache warm), and a per-kernel breakdown of one
decode step (where the time goes, and how much is Python between kernels).

    python benchmarks/bench_engine.py                   # 2 threads, everything
    python benchmarks/bench_engine.py --models q8_0 --repeat 5
    python benchmarks/bench_engine.py --quick           # tiny synthetic models (smoke run)

When llama-cpp-python is installed, llama.cpp runs the same files with the same threads in the
same run (a child process), for ratios measured under the same machine load.

Reference (the issue): llama.cpp decodes a 363M llama at 29 t/s (Q8_0) and 50 t/s (Q4_K_M) on
this kind of machine with 2 threads. Goals: r(8) <= 1.3; warm start <= 2 s.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

from gguf import GGUFValueType as V  # noqa: E402

from ds4tools.bench.measure import (best_of, cost_ratios, decode_weight_bytes,  # noqa: E402
                                    memcpy_bandwidth, verify_seconds)
from ds4tools.gguf_io import GGUFStreamWriter  # noqa: E402
from paired import llama_cpp_context  # noqa: E402

REFERENCE_TPS = {"q8_0": 29.0, "q4_k_m": 50.0}
# ~350M parameters: 24 layers, hidden 1024, ffn 2816, 16 query / 8 kv heads of 64, vocab 32000
FULL = dict(n_layer=24, n_embd=1024, n_ff=2816, n_head=16, n_head_kv=8, head_dim=64, n_vocab=32000)
QUICK = dict(n_layer=2, n_embd=256, n_ff=512, n_head=4, n_head_kv=2, head_dim=64, n_vocab=2048)
# llama.cpp's stories260K test model's shape (its FFN of 172 rounded up to a whole Q8_0 block)
STORIES = dict(n_layer=5, n_embd=64, n_ff=192, n_head=8, n_head_kv=4, head_dim=8, n_vocab=512)


# --- the synthetic model ----------------------------------------------------------------------


def tensor_shapes(n_layer, n_embd, n_ff, n_head, n_head_kv, head_dim, n_vocab):
    q, kv = n_head * head_dim, n_head_kv * head_dim
    shapes = {"token_embd.weight": (n_vocab, n_embd)}
    for i in range(n_layer):
        p = f"blk.{i}."
        shapes.update({
            p + "attn_norm.weight": (n_embd,), p + "attn_q.weight": (q, n_embd),
            p + "attn_k.weight": (kv, n_embd), p + "attn_v.weight": (kv, n_embd),
            p + "attn_q_norm.weight": (head_dim,), p + "attn_k_norm.weight": (head_dim,),
            p + "attn_output.weight": (n_embd, q), p + "ffn_norm.weight": (n_embd,),
            p + "ffn_gate.weight": (n_ff, n_embd), p + "ffn_up.weight": (n_ff, n_embd),
            p + "ffn_down.weight": (n_embd, n_ff),
        })
    shapes["output_norm.weight"] = (n_embd,)
    shapes["output.weight"] = (n_vocab, n_embd)
    return shapes


def make_f16_model(path, cfg, seed=0) -> int:
    """A qwen3 GGUF with random F16 weights (norms F32, near 1), written one tensor at a time.
    Its tokenizer is a plain SentencePiece-style list (the benchmark feeds token ids)."""
    shapes = tensor_shapes(**cfg)
    rng = np.random.default_rng(seed)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"t{i}" for i in range(cfg["n_vocab"] - len(tokens))]
    types = [2, 3, 3] + [6] * 256 + [1] * (cfg["n_vocab"] - 259)
    a = "qwen3"
    with GGUFStreamWriter(path, a) as w:
        for key, value, vtype in (
                ("general.name", "bench-synthetic-qwen3", V.STRING), (f"{a}.block_count", cfg["n_layer"], V.UINT32),
                (f"{a}.context_length", 4096, V.UINT32), (f"{a}.embedding_length", cfg["n_embd"], V.UINT32),
                (f"{a}.feed_forward_length", cfg["n_ff"], V.UINT32),
                (f"{a}.attention.head_count", cfg["n_head"], V.UINT32),
                (f"{a}.attention.head_count_kv", cfg["n_head_kv"], V.UINT32),
                (f"{a}.attention.key_length", cfg["head_dim"], V.UINT32),
                (f"{a}.attention.value_length", cfg["head_dim"], V.UINT32),
                (f"{a}.attention.layer_norm_rms_epsilon", 1e-6, V.FLOAT32),
                (f"{a}.rope.freq_base", 1000000.0, V.FLOAT32), ("general.file_type", 1, V.UINT32),
                ("tokenizer.ggml.model", "llama", V.STRING)):
            w.add_key(key, value, vtype)
        w.add_key("tokenizer.ggml.tokens", tokens, V.ARRAY, V.STRING)
        w.add_key("tokenizer.ggml.scores", [0.0] * len(tokens), V.ARRAY, V.FLOAT32)
        w.add_key("tokenizer.ggml.token_type", types, V.ARRAY, V.INT32)
        for name, shape in shapes.items():
            w.add_tensor_info(name, shape, "F32" if len(shape) == 1 else "F16")
        w.begin()
        n_params = 0
        for name, shape in shapes.items():
            if len(shape) == 1:
                data = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
            else:
                data = (rng.standard_normal(shape, dtype=np.float32) / np.float32(np.sqrt(shape[1]))).astype(np.float16)
            n_params += data.size
            w.write_tensor(name, data)
        w.commit()
    return n_params


def prepare_models(folder, cfg, names, log) -> dict:
    from ds4tools.quantize import QuantizeOptions, quantize_model
    out = {}
    src = os.path.join(folder, "synthetic-f16.gguf")
    want = [n for n in names if n in ("q8_0", "q4_k_m", "q2_k")]
    if want and not os.path.exists(src):
        t = time.perf_counter()
        n = make_f16_model(src, cfg)
        log(f"made {src}: {n / 1e6:.0f}M parameters in {time.perf_counter() - t:.1f} s")
    for name in want:
        path = os.path.join(folder, f"synthetic-{name}.gguf")
        if not os.path.exists(path):
            quantize_model(src, path, QuantizeOptions(name.upper(), progress=False), report=lambda m: None)
        out[name] = path
    if "stories" in names:
        small = os.path.join(folder, "stories-f16.gguf")
        out["stories"] = os.path.join(folder, "stories-q8_0.gguf")
        if not os.path.exists(out["stories"]):
            make_f16_model(small, STORIES)
            quantize_model(small, out["stories"], QuantizeOptions("Q8_0", progress=False), report=lambda m: None)
    if "demo" in names:
        try:
            from ds4tools.demo import demo_model_path
            out["demo"] = str(demo_model_path(progress=False))
        except Exception as e:  # noqa: BLE001 - the demo checkpoint may not be installed yet
            log(f"demo model: skipped ({e})")
    return out


# --- measurements -----------------------------------------------------------------------------


def measure_model(eng, repeat, n_prompt=512, n_decode=32, ks=(1, 2, 4, 8, 16)) -> dict:
    hp = eng.hparams
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, hp.n_vocab, n_prompt)
    m = eng.model
    eng.forward(prompt[:8], 0, logits="last")  # load / compile everything once

    def prefill():
        eng.cache.clear()
        eng.forward(prompt, 0, logits="last")
    t_prefill = best_of(prefill, repeat)

    def decode():
        eng.cache.truncate(n_prompt)
        tok = int(prompt[-1])
        for i in range(n_decode):
            lg = eng.forward([tok], n_prompt + i, logits="last").logits[0]
            tok = int(np.argmax(lg))
    prefill()
    t_decode = best_of(decode, repeat) / n_decode

    # verify cost at the prompt's context: k rows forwarded after a truncate, logits for all
    times = verify_seconds(eng, n_prompt, ks, max(repeat, 5), prompt)
    weight_bytes = decode_weight_bytes(eng)
    return {
        "prefill_tps": n_prompt / t_prefill,
        "decode_tps": 1.0 / t_decode,
        "decode_ms": t_decode * 1e3,
        "weight_bytes": weight_bytes,
        "weight_gbps": weight_bytes / t_decode / 1e9,
        "r": cost_ratios(times),
        "t1_ms": times[1] * 1e3,
        "n_ctx_measured": n_prompt,
        "threads": eng.threads,
    }


LLAMA_CPP_CHILD = """
import json, sys, time
import numpy as np
path, threads, n_prompt, n_decode, repeat = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
""" + llama_cpp_context() + """
prompt = np.random.default_rng(0).integers(3, n_vocab, n_prompt)
best = lambda f: min(f() for _ in range(repeat))

def prefill():
    L.llama_memory_clear(mem, True)
    t = time.perf_counter(); forward(prompt, 0, False); return time.perf_counter() - t
t_prefill = best(prefill)

def decode():
    L.llama_memory_seq_rm(mem, 0, n_prompt, -1)
    t = time.perf_counter()
    tok = int(prompt[-1])
    for i in range(n_decode):
        forward([tok], n_prompt + i, False)
        tok = int(np.argmax(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))))
    return (time.perf_counter() - t) / n_decode
t_decode = best(decode)
times = {k: float("inf") for k in (1, 2, 4, 8, 16)}
for _ in range(max(repeat, 5)):
    for k in times:
        L.llama_memory_seq_rm(mem, 0, n_prompt, -1)
        t = time.perf_counter(); forward(prompt[:k], n_prompt, True)
        times[k] = min(times[k], time.perf_counter() - t)
print("RESULT " + json.dumps({"prefill_tps": n_prompt / t_prefill, "decode_tps": 1 / t_decode,
                              "r": {k: v / times[1] for k, v in times.items()}}))
"""


def llama_cpp_baseline(path, threads, repeat, n_prompt=512, n_decode=32) -> dict | None:
    """llama.cpp (llama-cpp-python's library) on the same file, same threads, in a child process;
    None when it is not installed or fails."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return None
    r = subprocess.run([sys.executable, "-c", LLAMA_CPP_CHILD, str(path), str(threads), str(n_prompt),
                        str(n_decode), str(repeat)], capture_output=True, text=True, timeout=1800)
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    if r.returncode != 0 or not lines:
        return None
    import json
    return json.loads(lines[-1][len("RESULT "):])


class KernelTimer:
    """Wraps the engine's kernels and matmuls with timers for one profiled run (benchmark only)."""

    def __init__(self):
        self.totals = defaultdict(float)
        self.calls = defaultdict(int)
        self._undo = []

    def wrap(self, owner, attr, label):
        fn = getattr(owner, attr)
        totals, calls = self.totals, self.calls

        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                totals[label] += time.perf_counter() - t
                calls[label] += 1
        setattr(owner, attr, timed)
        self._undo.append((owner, attr, fn))

    def __enter__(self):
        from ds4tools.engine import kernels, kv_cache, transformer, weights
        for name in ("rmsnorm", "add_bias", "add_into", "swiglu", "rope"):
            self.wrap(transformer.kernels, name, name)
        self.wrap(kv_cache.KVCache, "store", "kv store")
        self.wrap(kv_cache.KVCache, "attend", "attention")
        self.wrap(weights.Linear, "matmul", "matmul")
        self.wrap(weights.Linear, "rows", "embedding rows")
        self.wrap(transformer.Transformer, "output", "output (norm + logits)")
        del kernels
        return self

    def __exit__(self, *exc):
        for owner, attr, fn in reversed(self._undo):
            setattr(owner, attr, fn)


def kernel_breakdown(eng, steps=16) -> tuple[dict, float]:
    prompt = np.arange(3, 67) % eng.hparams.n_vocab
    eng.forward(prompt, 0, logits="last")
    with KernelTimer() as kt:
        t = time.perf_counter()
        for i in range(steps):
            eng.forward([5], 64 + i, logits="last")
        wall = (time.perf_counter() - t) / steps
    per = {k: v / steps for k, v in kt.totals.items()}
    # the output matmul is inside "output": count it once
    per["matmul"] = per.get("matmul", 0.0)
    return per, wall


def warm_start(threads, model=None) -> float | None:
    cmd = [sys.executable, "-m", "ds4tools.cli", "run", "-p", "def main(", "-n", "1", "--temp", "0",
           "--threads", str(threads)]
    if model:
        cmd += ["-m", model]
    env = dict(os.environ)
    times = []
    for _ in range(2):
        t = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, env=env)
        times.append(time.perf_counter() - t)
        if r.returncode != 0:
            return None
    return times[-1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--models", default="demo,stories,q8_0,q4_k_m,q2_k")
    ap.add_argument("--prompt-tokens", type=int, default=512, help="prefill length (and decode depth)")
    ap.add_argument("--quick", action="store_true", help="tiny synthetic models (smoke run)")
    ap.add_argument("--dir", help="where to keep the synthetic GGUFs (default: a temp dir)")
    ap.add_argument("--exact", action="store_true", help="float32 activations everywhere")
    ap.add_argument("--no-llama-cpp", action="store_true", help="skip the llama.cpp baseline")
    args = ap.parse_args(argv)

    def log(msg):
        print(msg, flush=True)

    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
        run(args, args.dir, log)
    else:
        with tempfile.TemporaryDirectory(prefix="bench-engine-") as folder:  # ~1.3 GB of GGUFs
            run(args, folder, log)
    return 0


def run(args, folder, log) -> None:
    from ds4tools.engine import Engine, set_threads
    set_threads(args.threads)
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    cfg = QUICK if args.quick else FULL
    paths = prepare_models(folder, cfg, names, log)

    bw = memcpy_bandwidth(1 << 26 if args.quick else 1 << 30)
    log(f"numpy memory copy: {bw:.1f} GB/s (bytes read per second)   threads: {args.threads}   "
        f"load average: {' '.join(f'{v:.1f}' for v in os.getloadavg())} on {os.cpu_count()} cores")
    results = {}
    for name in names:
        if name not in paths:
            continue
        eng = Engine(paths[name], threads=args.threads, exact=args.exact, n_ctx=1024)
        n_prompt = min(args.prompt_tokens, 64) if args.quick else args.prompt_tokens
        res = measure_model(eng, args.repeat, n_prompt=n_prompt)
        results[name] = res
        ref = REFERENCE_TPS.get(name)
        log(f"\n{name}: {paths[name]}")
        log(f"  formats: {eng.weights.formats_used}   int8 path: "
            f"{sorted({l.fmt.name for l in eng.weights.linears() if l.int8}) or 'none'}")
        log(f"  prefill {res['prefill_tps']:.1f} t/s   decode {res['decode_tps']:.2f} t/s "
            f"({res['decode_ms']:.2f} ms/token)"
            + (f"   llama.cpp reference {ref:.0f} t/s -> ratio {res['decode_tps'] / ref:.2f}" if ref and not args.quick else ""))
        log(f"  weights streamed: {res['weight_bytes'] / 1e6:.0f} MB/token -> {res['weight_gbps']:.2f} GB/s "
            f"= {res['weight_gbps'] / bw:.2f} x numpy copy bandwidth")
        rs = res["r"]
        log("  r(k): " + " ".join(f"{k}:{v:.2f}" for k, v in rs.items())
            + f"   (1-token forward {res['t1_ms']:.2f} ms at context {res['n_ctx_measured']})")
        base = None if args.no_llama_cpp else llama_cpp_baseline(paths[name], args.threads, args.repeat,
                                                                  n_prompt=n_prompt)
        if base:
            log(f"  llama.cpp, same file and threads (no AMX/repack buffers): prefill "
                f"{base['prefill_tps']:.1f} t/s, decode {base['decode_tps']:.2f} t/s -> ours / theirs: "
                f"prefill {res['prefill_tps'] / base['prefill_tps']:.2f}, decode "
                f"{res['decode_tps'] / base['decode_tps']:.2f}; its r(k): "
                + " ".join(f"{k}:{v:.2f}" for k, v in base["r"].items()))
        per, wall = kernel_breakdown(eng)
        inside = sum(v for k, v in per.items() if k != "output (norm + logits)")
        log(f"  one decode step {wall * 1e3:.2f} ms: " + ", ".join(
            f"{k} {v * 1e3:.2f}" for k, v in sorted(per.items(), key=lambda kv: -kv[1]))
            + f"; Python between kernels ~{max(0.0, wall - inside) * 1e3:.2f} ms")
        del eng

    if "demo" in paths:
        ws = warm_start(args.threads)
        log(f"\nwarm start (second `ds4tools run -n 1`, demo model): "
            + (f"{ws:.2f} s" if ws is not None else "failed"))


if __name__ == "__main__":
    sys.exit(main())
