"""Whole-file quantization of a synthetic ~350M-parameter F16 llama GGUF (made here).

For each target (default Q8_0, Q4_K_M, Q2_K) it runs `ds4tools quantize` in a fresh process
and prints seconds, throughput (GB/s of F16 input) and the peak RSS of that process. When
llama-cpp-python is installed it runs llama.cpp's own quantizer (llama_model_quantize) on the
same file with the same thread count, in a fresh process too, and prints the ratio
(> 1 means ds4tools is faster) and whether the two outputs hold byte-identical tensors.

    python benchmarks/bench_quantize.py                          # 2 threads, best of 1
    python benchmarks/bench_quantize.py --types Q8_0 --repeat 3 --threads 2
    python benchmarks/bench_quantize.py --quick                  # a ~20M-parameter smoke run

Reference (the issue): llama.cpp took 3.3 s, 24.4 s and 15.6 s for Q8_0, Q4_K_M and Q2_K on
this kind of machine with 2 threads.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

from gguf import GGUFValueType as V  # noqa: E402

from ds4tools.gguf_io import GGUFStreamWriter  # noqa: E402

REFERENCE_S = {"Q8_0": 3.3, "Q4_K_M": 24.4, "Q2_K": 15.6}
# ~355M parameters: 24 layers of hidden 1024 / ffn 3072 (GQA 16/4) and a 32000-token vocabulary
FULL = dict(n_layer=24, n_embd=1024, n_ff=3072, n_head=16, n_head_kv=4, n_vocab=32000)
QUICK = dict(n_layer=2, n_embd=512, n_ff=1536, n_head=8, n_head_kv=2, n_vocab=8000)


def tensor_shapes(n_layer, n_embd, n_ff, n_head, n_head_kv, n_vocab):
    hd = n_embd // n_head
    shapes = {"token_embd.weight": (n_vocab, n_embd)}
    for i in range(n_layer):
        p = f"blk.{i}."
        shapes.update({
            p + "attn_norm.weight": (n_embd,), p + "attn_q.weight": (n_embd, n_embd),
            p + "attn_k.weight": (n_head_kv * hd, n_embd), p + "attn_v.weight": (n_head_kv * hd, n_embd),
            p + "attn_output.weight": (n_embd, n_embd), p + "ffn_norm.weight": (n_embd,),
            p + "ffn_gate.weight": (n_ff, n_embd), p + "ffn_up.weight": (n_ff, n_embd),
            p + "ffn_down.weight": (n_embd, n_ff),
        })
    shapes["output_norm.weight"] = (n_embd,)
    shapes["output.weight"] = (n_vocab, n_embd)
    return shapes


def make_model(path, cfg, seed=0) -> int:
    """Write the synthetic F16 model one tensor at a time; returns its parameter count."""
    shapes = tensor_shapes(**cfg)
    rng = np.random.default_rng(seed)
    tokens = [f"<t{i}>" for i in range(cfg["n_vocab"])]
    with GGUFStreamWriter(path, "llama") as w:
        for key, value, vtype in (
                ("general.name", "bench-synthetic", V.STRING), ("llama.block_count", cfg["n_layer"], V.UINT32),
                ("llama.context_length", 2048, V.UINT32), ("llama.embedding_length", cfg["n_embd"], V.UINT32),
                ("llama.feed_forward_length", cfg["n_ff"], V.UINT32),
                ("llama.attention.head_count", cfg["n_head"], V.UINT32),
                ("llama.attention.head_count_kv", cfg["n_head_kv"], V.UINT32),
                ("llama.attention.layer_norm_rms_epsilon", 1e-5, V.FLOAT32),
                ("llama.rope.freq_base", 10000.0, V.FLOAT32), ("general.file_type", 1, V.UINT32),
                ("tokenizer.ggml.model", "llama", V.STRING)):
            w.add_key(key, value, vtype)
        w.add_key("tokenizer.ggml.tokens", tokens, V.ARRAY, V.STRING)
        w.add_key("tokenizer.ggml.scores", [0.0] * len(tokens), V.ARRAY, V.FLOAT32)
        w.add_key("tokenizer.ggml.token_type", [1] * len(tokens), V.ARRAY, V.INT32)
        for name, shape in shapes.items():
            w.add_tensor_info(name, shape, "F32" if len(shape) == 1 else "F16")
        w.begin()
        for name, shape in shapes.items():
            if len(shape) == 1:
                w.write_tensor(name, np.ones(shape, np.float32))
            else:
                x = rng.standard_normal(shape, dtype=np.float32)
                x *= np.float32(0.02)
                w.write_tensor(name, x.astype(np.float16))
    return sum(int(np.prod(s)) for s in shapes.values())


_PEAK_RSS = """
def peak_rss_mib():
    # VmHWM belongs to this address space; ru_maxrss would include the parent's peak, which
    # Linux carries across fork + exec
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
"""
_CHILD_OURS = _PEAK_RSS + """
import json, sys, time
t0 = time.perf_counter()
from ds4tools.quantize import QuantizeOptions, quantize_model
r = quantize_model(sys.argv[1], sys.argv[2], QuantizeOptions(sys.argv[3], threads=int(sys.argv[4]),
                   progress=False), report=lambda m: None)
print(json.dumps({"seconds": time.perf_counter() - t0, "rss_mib": peak_rss_mib()}))
"""
_CHILD_LLAMA_CPP = _PEAK_RSS + """
import ctypes, json, sys, time
import llama_cpp
from gguf import LlamaFileType
p = llama_cpp.llama_model_quantize_default_params()
p.ftype = int(LlamaFileType["MOSTLY_" + sys.argv[3]])
p.nthread = int(sys.argv[4])
t0 = time.perf_counter()
rc = llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(p))
assert rc == 0, rc
print(json.dumps({"seconds": time.perf_counter() - t0, "rss_mib": peak_rss_mib()}))
"""


def run_child(code, src, dst, type_name, threads) -> dict:
    env = dict(os.environ, NUMBA_NUM_THREADS=str(threads), PYTHONPATH=os.path.join(HERE, ".."))
    if os.path.exists(dst):
        os.remove(dst)
    out = subprocess.run([sys.executable, "-c", code, str(src), str(dst), type_name, str(threads)],
                         capture_output=True, text=True, env=env)
    if out.returncode:
        raise SystemExit(f"child failed ({type_name}):\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def same_tensors(a, b) -> bool:
    from gguf import GGUFReader
    ta = {t.name: t for t in GGUFReader(a).tensors}
    tb = {t.name: t for t in GGUFReader(b).tensors}
    return set(ta) == set(tb) and all(
        ta[n].tensor_type == tb[n].tensor_type and np.array_equal(
            np.asarray(ta[n].data).view(np.uint8), np.asarray(tb[n].data).view(np.uint8)) for n in ta)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default="Q8_0,Q4_K_M,Q2_K")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=1, help="best of N runs")
    ap.add_argument("--quick", action="store_true", help="a ~20M-parameter model instead")
    ap.add_argument("--workdir", help="where the model and outputs go (default: a temp dir)")
    ap.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp's quantizer")
    args = ap.parse_args()
    types = [t.strip().upper() for t in args.types.split(",") if t.strip()]
    try:
        import llama_cpp  # noqa: F401
        have_llama_cpp = not args.no_llama_cpp
    except ImportError:
        have_llama_cpp = False

    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        src = os.path.join(tmp, "synthetic-f16.gguf")
        t0 = time.perf_counter()
        n_params = make_model(src, QUICK if args.quick else FULL)
        size = os.path.getsize(src)
        print(f"model: {n_params / 1e6:.1f}M parameters, F16, {size / 2**20:.0f} MiB "
              f"(written in {time.perf_counter() - t0:.1f} s); {args.threads} threads, "
              f"best of {args.repeat}")
        # a first tiny run fills numba's cache, as any installed copy has it after first use
        warm = os.path.join(tmp, "warm.gguf")
        small = os.path.join(tmp, "small.gguf")
        make_model(small, dict(n_layer=1, n_embd=256, n_ff=512, n_head=4, n_head_kv=1, n_vocab=256))
        for t in types:
            run_child(_CHILD_OURS, small, warm, t, args.threads)
        header = f"{'type':8} {'ds4tools s':>10} {'GB/s':>6} {'RSS MiB':>8}"
        if have_llama_cpp:
            header += f" {'llama.cpp s':>11} {'RSS MiB':>8} {'speed-up':>8} {'same bytes':>10}"
        header += f" {'issue ref s':>11}"
        print(header)
        for t in types:
            dst = os.path.join(tmp, f"ours-{t}.gguf")
            ours = min((run_child(_CHILD_OURS, src, dst, t, args.threads) for _ in range(args.repeat)),
                       key=lambda r: r["seconds"])
            line = f"{t:8} {ours['seconds']:10.2f} {size / ours['seconds'] / 1e9:6.2f} {ours['rss_mib']:8.0f}"
            if have_llama_cpp:
                ref_path = os.path.join(tmp, f"llama-cpp-{t}.gguf")
                ref = min((run_child(_CHILD_LLAMA_CPP, src, ref_path, t, args.threads)
                           for _ in range(args.repeat)), key=lambda r: r["seconds"])
                same = same_tensors(dst, ref_path)
                line += (f" {ref['seconds']:11.2f} {ref['rss_mib']:8.0f} "
                         f"{ref['seconds'] / ours['seconds']:8.2f} {str(same):>10}")
                os.remove(ref_path)
            ref_s = REFERENCE_S.get(t)
            line += f" {ref_s:11.1f}" if ref_s and not args.quick else f" {'-':>11}"
            print(line, flush=True)
            os.remove(dst)


if __name__ == "__main__":
    main()
