"""deepseek4 (DeepSeek V4 Flash) engine figures: decode t/s ours vs llama.cpp in the same run,
peak RSS, the verify cost r(k), and the compressed cache's bytes.

The model: a synthetic DSV4-shaped GGUF (random weights, llama.cpp's keys and tensor names)
scaled to about 1.4B parameters: 24 blocks with DSV4 Flash's layer pattern (ratio 0 on
blocks 0-1, ratio 4 with the indexer on the even blocks from 2, ratio 128 on the odd ones
from 3; hash-routed experts on blocks 0-2), 4 hyper-connection streams with 20 Sinkhorn
rounds, 16 query heads of 128 over one shared KV head, a 128-row sliding window, q / output
low-rank paths, 64 experts of 256 (top 6) plus a shared one. Routed experts are Q4_K (quantized
here with ds4tools' quantizer; two distinct expert sets alternate over the blocks, which
keeps the generation short and changes nothing in the timing), the other matrices Q8_0, the
router, hyper-connection and position-embedding matrices F16 (ds4's q4 mix). The file is
written under --dir (default: a temporary folder) and never kept in the repository.

Each engine runs in its own child process with the same threads, one after the other, and
reports its peak resident set size; the figures are ours / llama.cpp's, repeated --rounds
times, medians printed.

    python benchmarks/bench_deepseek4.py                    # 2 threads, 3 rounds
    python benchmarks/bench_deepseek4.py --dir /tmp/ds4b --rounds 5
    python benchmarks/bench_deepseek4.py --quick            # a tiny model (smoke run)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

from gguf import GGUFValueType as V  # noqa: E402
from paired import llama_cpp_context  # noqa: E402


@dataclass(frozen=True)
class Shape:
    n_layer: int = 24
    n_embd: int = 1024
    n_vocab: int = 32000
    n_head: int = 16
    head_dim: int = 128
    n_rot: int = 64
    n_lora_q: int = 256
    o_groups: int = 4
    o_lora_rank: int = 256
    n_swa: int = 128
    idx_head: int = 16
    idx_dim: int = 128
    idx_top_k: int = 64
    hc: int = 4
    sinkhorn_iters: int = 20
    n_hash_layers: int = 3
    n_expert: int = 64
    n_expert_used: int = 6
    n_ff_exp: int = 256
    n_ctx: int = 4096


FULL = Shape()
QUICK = Shape(n_layer=4, n_embd=256, n_vocab=2048, n_head=4, head_dim=64, n_lora_q=64,
              o_groups=2, o_lora_rank=64, idx_head=4, idx_dim=64, idx_top_k=8, n_expert=8,
              n_expert_used=2, n_ff_exp=256, n_swa=32)
#: DeepSeek V4 Flash itself (ds4's constants): for the cache-size table only
DSV4_FLASH = Shape(n_layer=43, n_embd=4096, n_vocab=129280, n_head=64, head_dim=512, n_rot=64,
                   n_lora_q=1024, o_groups=8, o_lora_rank=1024, n_swa=128, idx_head=64,
                   idx_dim=128, idx_top_k=512, n_expert=256, n_expert_used=6, n_ff_exp=2048,
                   n_ctx=65536)


def ratios(s: Shape) -> list:
    """DSV4 Flash's pattern: 0 on blocks 0-1, then 4 on even blocks and 128 on odd ones."""
    return [0 if i < 2 else (4 if i % 2 == 0 else 128) for i in range(s.n_layer)]


def metadata(s: Shape) -> dict:
    a = "deepseek4"
    return {
        f"{a}.context_length": (s.n_ctx, V.UINT32), f"{a}.embedding_length": (s.n_embd, V.UINT32),
        f"{a}.block_count": (s.n_layer, V.UINT32), f"{a}.feed_forward_length": (s.n_ff_exp, V.UINT32),
        f"{a}.attention.head_count": (s.n_head, V.UINT32), f"{a}.attention.head_count_kv": (1, V.UINT32),
        f"{a}.attention.key_length": (s.head_dim, V.UINT32),
        f"{a}.attention.value_length": (s.head_dim, V.UINT32),
        f"{a}.attention.q_lora_rank": (s.n_lora_q, V.UINT32),
        f"{a}.attention.layer_norm_rms_epsilon": (1e-6, V.FLOAT32),
        f"{a}.attention.sliding_window": (s.n_swa, V.UINT32),
        f"{a}.attention.output_group_count": (s.o_groups, V.UINT32),
        f"{a}.attention.output_lora_rank": (s.o_lora_rank, V.UINT32),
        f"{a}.attention.compress_rope_freq_base": (160000.0, V.FLOAT32),
        f"{a}.attention.compress_ratios": (ratios(s), V.ARRAY, V.INT32),
        f"{a}.attention.indexer.head_count": (s.idx_head, V.UINT32),
        f"{a}.attention.indexer.key_length": (s.idx_dim, V.UINT32),
        f"{a}.attention.indexer.top_k": (s.idx_top_k, V.UINT32),
        f"{a}.rope.freq_base": (10000.0, V.FLOAT32), f"{a}.rope.dimension_count": (s.n_rot, V.UINT32),
        f"{a}.rope.scaling.type": ("yarn", V.STRING), f"{a}.rope.scaling.factor": (16.0, V.FLOAT32),
        f"{a}.rope.scaling.original_context_length": (1024, V.UINT32),
        f"{a}.vocab_size": (s.n_vocab, V.UINT32),
        f"{a}.expert_count": (s.n_expert, V.UINT32), f"{a}.expert_used_count": (s.n_expert_used, V.UINT32),
        f"{a}.expert_shared_count": (1, V.UINT32),
        f"{a}.expert_feed_forward_length": (s.n_ff_exp, V.UINT32),
        f"{a}.expert_gating_func": (4, V.UINT32),
        f"{a}.expert_weights_norm": (True, V.BOOL), f"{a}.expert_weights_scale": (1.5, V.FLOAT32),
        f"{a}.swiglu_clamp_exp": ([10.0] * s.n_layer, V.ARRAY, V.FLOAT32),
        f"{a}.hyper_connection.count": (s.hc, V.UINT32),
        f"{a}.hyper_connection.sinkhorn_iterations": (s.sinkhorn_iters, V.UINT32),
        f"{a}.hyper_connection.epsilon": (1e-6, V.FLOAT32),
        f"{a}.hash_layer_count": (s.n_hash_layers, V.UINT32),
        "general.file_type": (15, V.UINT32),  # Q4_K_M-like
    }


def tensors(s: Shape) -> list:
    """[(name, numpy shape, type, init)] in file order; init: 'norm', 'small', 'ids' or a
    matrix scale."""
    H, NH, D, HC = s.n_embd, s.n_head, s.head_dim, s.hc
    mix = (2 + HC) * HC
    E, F = s.n_expert, s.n_ff_exp
    out = [("token_embd.weight", (s.n_vocab, H), "Q8_0", 1.0)]
    for il, r in enumerate(ratios(s)):
        p = f"blk.{il}."
        out += [(p + "attn_norm.weight", (H,), "F32", "norm"), (p + "attn_sinks.weight", (NH,), "F32", "small"),
                (p + "attn_q_a.weight", (s.n_lora_q, H), "Q8_0", 1.0),
                (p + "attn_q_a_norm.weight", (s.n_lora_q,), "F32", "norm"),
                (p + "attn_q_b.weight", (NH * D, s.n_lora_q), "Q8_0", 1.0),
                (p + "attn_kv.weight", (D, H), "Q8_0", 1.0), (p + "attn_kv_a_norm.weight", (D,), "F32", "norm"),
                (p + "attn_output_a.weight", (s.o_groups * s.o_lora_rank, NH * D // s.o_groups), "Q8_0", 1.0),
                (p + "attn_output_b.weight", (H, s.o_groups * s.o_lora_rank), "Q8_0", 0.5)]
        for kind in ("attn", "ffn"):
            out += [(p + f"hc_{kind}_fn.weight", (mix, HC * H), "F16", 1.0),
                    (p + f"hc_{kind}_base.weight", (mix,), "F32", "small"),
                    (p + f"hc_{kind}_scale.weight", (3,), "F32", "norm")]
        if r:
            coff = 2 if r == 4 else 1
            out += [(p + "attn_compressor_kv.weight", (coff * D, H), "Q8_0", 1.0),
                    (p + "attn_compressor_gate.weight", (coff * D, H), "Q8_0", 2.0),
                    (p + "attn_compressor_ape.weight", (r, coff * D), "F16", "small"),
                    (p + "attn_compressor_norm.weight", (D,), "F32", "norm")]
            if r == 4:
                I, IH = s.idx_dim, s.idx_head
                out += [(p + "indexer.proj.weight", (IH, H), "Q8_0", 1.0),
                        (p + "indexer.attn_q_b.weight", (IH * I, s.n_lora_q), "Q8_0", 1.0),
                        (p + "indexer_compressor_kv.weight", (2 * I, H), "Q8_0", 1.0),
                        (p + "indexer_compressor_gate.weight", (2 * I, H), "Q8_0", 2.0),
                        (p + "indexer_compressor_ape.weight", (r, 2 * I), "F16", "small"),
                        (p + "indexer_compressor_norm.weight", (I,), "F32", "norm")]
        out += [(p + "ffn_norm.weight", (H,), "F32", "norm"), (p + "ffn_gate_inp.weight", (E, H), "F16", 2.0)]
        if il < s.n_hash_layers:
            out.append((p + "ffn_gate_tid2eid.weight", (s.n_vocab, s.n_expert_used), "I32", "ids"))
        else:
            out.append((p + "exp_probs_b.bias", (E,), "F32", "bias"))
        out += [(p + "ffn_gate_exps.weight", (E, F, H), "Q4_K", 1.0),
                (p + "ffn_up_exps.weight", (E, F, H), "Q4_K", 1.0),
                (p + "ffn_down_exps.weight", (E, H, F), "Q4_K", 0.5),
                (p + "ffn_gate_shexp.weight", (F, H), "Q8_0", 1.0),
                (p + "ffn_up_shexp.weight", (F, H), "Q8_0", 1.0),
                (p + "ffn_down_shexp.weight", (H, F), "Q8_0", 0.5)]
    out += [("output_hc_fn.weight", (HC, HC * H), "F16", 1.0), ("output_hc_base.weight", (HC,), "F32", "small"),
            ("output_hc_scale.weight", (1,), "F32", "norm"), ("output_norm.weight", (H,), "F32", "norm"),
            ("output.weight", (s.n_vocab, H), "Q8_0", 4.0)]
    return out


def make_model(path: str, s: Shape, seed: int = 0) -> int:
    """Write the synthetic model; returns its parameter count."""
    from ds4tools import formats
    from ds4tools.gguf_io import GGUFStreamWriter
    rng = np.random.default_rng(seed)
    specs = tensors(s)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"t{i}" for i in range(s.n_vocab - len(tokens))]
    types = [2, 3, 3] + [6] * 256 + [1] * (s.n_vocab - 259)
    experts = {}  # (kind, set) -> quantized bytes: two distinct sets alternate over the blocks
    n_params = 0
    with GGUFStreamWriter(path, "deepseek4", overwrite=True) as w:
        for key, val in metadata(s).items():
            w.add_key(key, *val)
        w.add_key("general.name", "bench-synthetic-deepseek4", V.STRING)
        w.add_key("tokenizer.ggml.model", "llama", V.STRING)
        w.add_key("tokenizer.ggml.tokens", tokens, V.ARRAY, V.STRING)
        w.add_key("tokenizer.ggml.scores", [0.0] * len(tokens), V.ARRAY, V.FLOAT32)
        w.add_key("tokenizer.ggml.token_type", types, V.ARRAY, V.INT32)
        for name, shape, t, _ in specs:
            w.add_tensor_info(name, shape, t)
        w.begin()
        for name, shape, t, init in specs:
            n_params += int(np.prod(shape))
            if t == "I32":
                data = np.stack([rng.permutation(s.n_expert)[:s.n_expert_used]
                                 for _ in range(shape[0])]).astype(np.int32)
            elif init == "norm":
                data = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
            elif init in ("small", "bias"):
                data = ((0.05 if init == "bias" else 0.3) * rng.standard_normal(shape)).astype(
                    np.float16 if t == "F16" else np.float32)
            elif "_exps." in name:
                il = int(name.split(".")[1])
                key = (name.split(".")[2], il % 2)
                if key not in experts:
                    a = rng.standard_normal(shape, dtype=np.float32) * np.float32(init / np.sqrt(shape[-1]))
                    experts[key] = formats.quantize(a, formats.get_format(t))
                data = experts[key]
            else:
                data = rng.standard_normal(shape, dtype=np.float32) * np.float32(init / np.sqrt(shape[-1]))
                if t == "F16":
                    data = data.astype(np.float16)
                elif t != "F32":
                    data = formats.quantize(data, formats.get_format(t))
            w.write_tensor(name, data)
        w.commit()
    return n_params


# --- the cache's size ---------------------------------------------------------------------------


def cache_bytes(s: Shape, n_ctx: int) -> tuple:
    """(before, after) bytes of the deepseek4 cache at n_ctx positions: before, every array
    per position (raw rows, both compressors' inputs, the entries); after, the engine's
    CompressedCache (the bounded rings and the entries)."""
    from ds4tools.engine.compressed_attention import CacheLayout, CompressedCache
    D, I = s.head_dim, s.idx_dim
    before = 0
    for r in ratios(s):
        before += n_ctx * D * 4
        if r:
            coff = 2 if r == 4 else 1
            before += (n_ctx * 2 * coff * D + (n_ctx // r + 1) * D) * 4
        if r == 4:
            before += (n_ctx * 2 * 2 * I + (n_ctx // r + 1) * I) * 4
    after = CompressedCache.nbytes_for(CacheLayout(tuple(ratios(s)), D, I, s.n_swa), n_ctx)
    return before, after


# --- the runs (each in its own process) ---------------------------------------------------------

OURS_CHILD = r"""
import json, resource, sys, time
import numpy as np
sys.path.insert(0, sys.argv[6])
from ds4tools.engine import Engine, set_threads
from ds4tools.bench.measure import verify_seconds
path, threads, n_prompt, n_decode, repeat = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
set_threads(threads)
eng = Engine(path, threads=threads, n_ctx=1024)
n_vocab = eng.hparams.n_vocab
prompt = np.random.default_rng(0).integers(3, n_vocab, n_prompt)
eng.forward(prompt[:8], 0, logits="last")  # compile / load once
t = time.perf_counter(); eng.cache.clear(); eng.forward(prompt, 0, logits="last")
t_prefill = time.perf_counter() - t

def decode():
    eng.cache.truncate(n_prompt)
    tok = int(prompt[-1]); out = []
    t = time.perf_counter()
    for i in range(n_decode):
        tok = int(np.argmax(eng.forward([tok], n_prompt + i, logits="last").logits[0])); out.append(tok)
    return (time.perf_counter() - t) / n_decode, out
runs = [decode() for _ in range(repeat)]
t_decode = min(r[0] for r in runs)
times = verify_seconds(eng, n_prompt, (1, 2, 4, 8), max(repeat, 3), prompt)
print("RESULT " + json.dumps({"prefill_tps": n_prompt / t_prefill, "decode_tps": 1 / t_decode,
      "r": {k: v / times[1] for k, v in times.items()}, "greedy": runs[0][1],
      "cache_bytes": eng.cache.nbytes, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""

LLAMA_CPP_CHILD = r"""
import json, resource, sys, time
import numpy as np
path, threads, n_prompt, n_decode, repeat = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
""" + llama_cpp_context("""
cp.type_k = cp.type_v = L.GGML_TYPE_F32  # as the fixtures' captures run deepseek4
cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED
""") + r"""
prompt = np.random.default_rng(0).integers(3, n_vocab, n_prompt)
forward(prompt[:8], 0, False)
L.llama_memory_clear(mem, True)
t = time.perf_counter(); forward(prompt, 0, False); t_prefill = time.perf_counter() - t

def back_to_prompt():
    # llama.cpp's deepseek4 memory cannot drop a tail (seq_rm fails): prefill again
    if not L.llama_memory_seq_rm(mem, 0, n_prompt, -1):
        L.llama_memory_clear(mem, True)
        forward(prompt, 0, False)

def decode():
    back_to_prompt()
    tok = int(prompt[-1]); out = []
    t = time.perf_counter()
    for i in range(n_decode):
        forward([tok], n_prompt + i, False)
        tok = int(np.argmax(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, -1), shape=(n_vocab,)))); out.append(tok)
    return (time.perf_counter() - t) / n_decode, out
runs = [decode() for _ in range(repeat)]
t_decode = min(r[0] for r in runs)
times = {k: float("inf") for k in (1, 2, 4, 8)}
for _ in range(max(repeat, 3)):
    for k in times:
        back_to_prompt()
        t = time.perf_counter(); forward(prompt[:k], n_prompt, True)
        times[k] = min(times[k], time.perf_counter() - t)
print("RESULT " + json.dumps({"prefill_tps": n_prompt / t_prefill, "decode_tps": 1 / t_decode,
      "r": {k: v / times[1] for k, v in times.items()}, "greedy": runs[0][1],
      "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def child(code: str, path: str, threads: int, n_prompt: int, n_decode: int, repeat: int) -> dict | None:
    r = subprocess.run([sys.executable, "-c", code, path, str(threads), str(n_prompt), str(n_decode),
                        str(repeat), os.path.join(HERE, "..")], capture_output=True, text=True,
                       timeout=3600)
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    if r.returncode != 0 or not lines:
        print(f"  (child failed, rc {r.returncode}: {r.stderr.strip()[-600:]})", flush=True)
        return None
    return json.loads(lines[-1][len("RESULT "):])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="ours / llama.cpp pairs (medians printed)")
    ap.add_argument("--repeat", type=int, default=2, help="decode runs per child (best taken)")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="prefill length (and decode depth)")
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--quick", action="store_true", help="a tiny model (smoke run)")
    ap.add_argument("--dir", help="where to keep the synthetic GGUF (default: a temp dir)")
    ap.add_argument("--no-llama-cpp", action="store_true")
    args = ap.parse_args(argv)
    s = QUICK if args.quick else FULL

    print("cache bytes per position (before: every array per position / after: the bounded "
          "rings amortised plus the entries)")
    for name, shape in (("DSV4 Flash", DSV4_FLASH), ("this benchmark's model", s)):
        for n in (4096, 65536):
            b, a = cache_bytes(shape, n)
            print(f"  {name:24s} n_ctx {n:6d}: {b / n:9.0f} -> {a / n:7.0f} B/position   "
                  f"({b / 2**20:8.1f} MiB -> {a / 2**20:6.1f} MiB, {b / a:5.1f}x)")

    folder = args.dir or tempfile.mkdtemp(prefix="bench-deepseek4-")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "synthetic-deepseek4-q4k.gguf" if not args.quick else "quick-deepseek4.gguf")
    if not os.path.exists(path):
        t = time.perf_counter()
        n = make_model(path, s)
        print(f"made {path}: {n / 1e9:.2f}B parameters, {os.path.getsize(path) / 1e9:.2f} GB, "
              f"in {time.perf_counter() - t:.0f} s", flush=True)
    print(f"model: {path}  shape: {asdict(s)}")
    print(f"threads {args.threads}, prompt {args.prompt_tokens}, decode {args.decode_tokens} tokens, "
          f"load average {' '.join(f'{v:.1f}' for v in os.getloadavg())} on {os.cpu_count()} cores", flush=True)
    rows = []
    for rnd in range(args.rounds):
        ours = child(OURS_CHILD, path, args.threads, args.prompt_tokens, args.decode_tokens, args.repeat)
        theirs = None if args.no_llama_cpp else child(LLAMA_CPP_CHILD, path, args.threads, args.prompt_tokens,
                                                      args.decode_tokens, args.repeat)
        if ours is None:
            continue
        line = (f"round {rnd + 1}: ours decode {ours['decode_tps']:.2f} t/s, prefill {ours['prefill_tps']:.1f} t/s, "
                f"peak RSS {ours['peak_rss'] / 2**20:.0f} MiB (cache {ours['cache_bytes'] / 2**20:.1f} MiB), "
                f"r(k) " + " ".join(f"{k}:{v:.2f}" for k, v in ours["r"].items()))
        if theirs:
            same = next((i for i, (a, b) in enumerate(zip(ours["greedy"], theirs["greedy"])) if a != b),
                        len(ours["greedy"]))
            line += (f"\n         llama.cpp decode {theirs['decode_tps']:.2f} t/s, prefill "
                     f"{theirs['prefill_tps']:.1f} t/s, peak RSS {theirs['peak_rss'] / 2**20:.0f} MiB, r(k) "
                     + " ".join(f"{k}:{v:.2f}" for k, v in theirs["r"].items())
                     + f"\n         ours / llama.cpp: decode {ours['decode_tps'] / theirs['decode_tps']:.2f}, "
                     f"prefill {ours['prefill_tps'] / theirs['prefill_tps']:.2f}, peak RSS "
                     f"{ours['peak_rss'] / theirs['peak_rss']:.2f}; greedy tokens alike: the first {same} of "
                     f"{len(ours['greedy'])}")
        print(line, flush=True)
        rows.append((ours, theirs))
    if rows:
        med = lambda v: float(np.median(v))  # noqa: E731
        o = [r[0] for r in rows]
        print(f"\nmedian of {len(rows)}: ours decode {med([x['decode_tps'] for x in o]):.2f} t/s, peak RSS "
              f"{med([x['peak_rss'] for x in o]) / 2**20:.0f} MiB, r(k) "
              + " ".join(f"{k}:{med([x['r'][k] for x in o]):.2f}" for k in o[0]["r"]))
        both = [r for r in rows if r[1]]
        if both:
            t = [r[1] for r in both]
            print(f"              llama.cpp decode {med([x['decode_tps'] for x in t]):.2f} t/s, peak RSS "
                  f"{med([x['peak_rss'] for x in t]) / 2**20:.0f} MiB, r(k) "
                  + " ".join(f"{k}:{med([x['r'][k] for x in t]):.2f}" for k in t[0]["r"]))
            print(f"              ratio ours / llama.cpp: decode "
                  f"{med([a['decode_tps'] / b['decode_tps'] for a, b in both]):.2f}, peak RSS "
                  f"{med([a['peak_rss'] / b['peak_rss'] for a, b in both]):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
