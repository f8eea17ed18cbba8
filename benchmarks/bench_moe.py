"""Mixture-of-experts decoding speed: a synthetic ~1B model of each MoE family, ours against
llama.cpp.

The model (made here, random weights, never committed; default folder /tmp/ds4tools-bench-moe):
a GGUF of ~1.04B parameters of which ~0.22B are read per token, as llama.cpp's Q4_K_M mix
written by ds4tools' own writer and quantizer. ``--arch`` picks the family (default glm4moe):

    all: 19 layers, hidden 1024, 16 query heads, layer 0 dense (ffn 2816), layers 1-18: 64
    routed experts of width 256, top-8 by sigmoid with the selection bias (normalised, scaled
    2.5), one shared expert; vocab 32000
    glm4moe: 4 kv heads of 64, rope over half the head, q / k / v biases
    deepseek2: multi-head latent attention (q rank 512, kv rank 256, 64 + 32 rope dims per
    head, values of 64), 8 expert groups of which 4 are used
    glm-dsa: deepseek2's attention and experts (no groups) plus the DSA indexer (8 heads of 64,
    top-256 positions, on every layer)

Measured, each in its own child process (so each has its own peak RSS): prefill t/s of a
512-token prompt, decode t/s (greedy steps after it), r(k) = time(forward of k tokens) /
time(forward of 1 token) for k = 1..8 at the prompt's context, and the peak resident memory
(``ru_maxrss``) of the process. Ours also reports the GB/s of weights a decode step reads,
counting only the experts it used. llama.cpp (llama-cpp-python, when installed) runs the same
file with the same threads in the same run: both children stay loaded and the parent alternates
their measurements (``--rounds N``, default 5), printing the medians of the per-round ratios
(benchmarks/paired.py, which measures any GGUF this way).

    python benchmarks/bench_moe.py                   # make the model if missing, 2 threads
    python benchmarks/bench_moe.py --rounds 3 --repeat 3
    python benchmarks/bench_moe.py --quick           # a tiny model (smoke run)
    python benchmarks/bench_moe.py --arch deepseek2  # the same for DeepSeek V2/V3's layout

``--nextn`` adds one NextN (MTP) layer after the 19 blocks, as GLM-4.5's files carry it (a MoE
layer plus eh_proj and its norms; llama.cpp loads it and does not run it), in a file of its
own; with it the comparison is followed by ``ds4tools bench --glm-mtp`` on that file: the MTP
sweep's verify cost r, draft cost c and measured speedup. The head's weights are random, so it
almost never agrees with the target: the measured speedup is the cost of drafting when nothing
is accepted. ``--alpha A`` prints, from each setting's measured verify cost r (at k = N + 1)
and draft cost c (the N chained head steps), the speedup a head accepting each draft with
probability A would give: tau / (r + c), tau = 1 + A + ... + A^N (say where A comes from: a
trained head on another target).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

from gguf import GGUFValueType as V  # noqa: E402

from ds4tools.gguf_io import GGUFStreamWriter  # noqa: E402

sys.path.insert(0, HERE)
from paired import compare  # noqa: E402

#: ~1.04B parameters, ~0.22B read per token (the output matrix included, the embedding row not)
FULL = dict(arch="glm4moe", n_layer=19, n_embd=1024, n_head=16, n_head_kv=4, head_dim=64, n_rot=32,
            n_ff=2816, n_expert=64, n_expert_used=8, n_ff_exp=256, n_expert_shared=1,
            n_dense_lead=1, n_vocab=32000, n_nextn=0)
QUICK = dict(arch="glm4moe", n_layer=3, n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_rot=32,
             n_ff=512, n_expert=16, n_expert_used=4, n_ff_exp=256, n_expert_shared=1,
             n_dense_lead=1, n_vocab=2048, n_nextn=0)
#: latent attention (deepseek2, glm-dsa): ranks and head dims (rope dims: n_rot)
MLA = dict(n_lora_q=512, n_lora_kv=256, n_nope=64, n_v=64, n_group=8, n_group_used=4)
MLA_QUICK = dict(n_lora_q=256, n_lora_kv=256, n_nope=64, n_v=64, n_group=4, n_group_used=2)
#: the DSA indexer (glm-dsa): heads, head dim (twice n_rot, as llama.cpp needs), top-k positions
DSA = dict(n_group=0, n_group_used=0, idx_head=8, idx_dim=64, idx_top_k=256)
ARCHS = ("glm4moe", "deepseek2", "glm-dsa")


def config(arch: str, quick: bool = False, nextn: bool = False) -> dict:
    """The benchmark model of ``arch`` (one of ARCHS), full size or the smoke run's."""
    cfg = dict(QUICK if quick else FULL, arch=arch, n_nextn=1 if nextn else 0)
    if arch != "glm4moe":
        cfg.update(MLA_QUICK if quick else MLA)
    if arch == "glm-dsa":
        cfg.update(DSA, idx_top_k=32 if quick else DSA["idx_top_k"])
    return cfg


# --- the synthetic model ----------------------------------------------------------------------


def tensor_shapes(cfg) -> dict:
    """name -> numpy shape (rows last), llama.cpp's names for cfg["arch"]."""
    H, E, F = cfg["n_embd"], cfg["n_expert"], cfg["n_ff_exp"]
    s = {"token_embd.weight": (cfg["n_vocab"], H)}
    for il in range(cfg["n_layer"] + cfg["n_nextn"]):
        p = f"blk.{il}."
        s[p + "attn_norm.weight"] = (H,)
        s.update(_attention_shapes(cfg, p))
        if il < cfg["n_dense_lead"]:
            s.update({p + "ffn_gate.weight": (cfg["n_ff"], H), p + "ffn_up.weight": (cfg["n_ff"], H),
                      p + "ffn_down.weight": (H, cfg["n_ff"])})
        else:
            S = F * cfg["n_expert_shared"]
            s.update({p + "ffn_gate_inp.weight": (E, H), p + "exp_probs_b.bias": (E,),
                      p + "ffn_gate_exps.weight": (E, F, H), p + "ffn_up_exps.weight": (E, F, H),
                      p + "ffn_down_exps.weight": (E, H, F),
                      p + "ffn_gate_shexp.weight": (S, H), p + "ffn_up_shexp.weight": (S, H),
                      p + "ffn_down_shexp.weight": (H, S)})
        if il >= cfg["n_layer"]:  # a NextN layer: the layer above plus its input projection
            s.update({p + "nextn.eh_proj.weight": (H, 2 * H), p + "nextn.enorm.weight": (H,),
                      p + "nextn.hnorm.weight": (H,), p + "nextn.shared_head_norm.weight": (H,)})
    s["output_norm.weight"] = (H,)
    s["output.weight"] = (cfg["n_vocab"], H)
    return s


def _attention_shapes(cfg, p: str) -> dict:
    H, NH = cfg["n_embd"], cfg["n_head"]
    if cfg["arch"] == "glm4moe":  # grouped-query attention with biases
        Q, KV = NH * cfg["head_dim"], cfg["n_head_kv"] * cfg["head_dim"]
        return {p + "attn_q.weight": (Q, H), p + "attn_q.bias": (Q,),
                p + "attn_k.weight": (KV, H), p + "attn_k.bias": (KV,),
                p + "attn_v.weight": (KV, H), p + "attn_v.bias": (KV,),
                p + "attn_output.weight": (H, Q), p + "post_attention_norm.weight": (H,)}
    RQ, RKV, NK = cfg["n_lora_q"], cfg["n_lora_kv"], cfg["n_nope"] + cfg["n_rot"]
    s = {p + "attn_q_a.weight": (RQ, H), p + "attn_q_a_norm.weight": (RQ,),
         p + "attn_q_b.weight": (NH * NK, RQ),
         p + "attn_kv_a_mqa.weight": (RKV + cfg["n_rot"], H), p + "attn_kv_a_norm.weight": (RKV,),
         p + "attn_k_b.weight": (NH, RKV, cfg["n_nope"]),
         p + "attn_v_b.weight": (NH, cfg["n_v"], RKV),
         p + "attn_output.weight": (H, NH * cfg["n_v"]), p + "ffn_norm.weight": (H,)}
    if cfg["arch"] == "glm-dsa":  # the lightning indexer, on every layer
        D, IH = cfg["idx_dim"], cfg["idx_head"]
        s.update({p + "indexer.attn_q_b.weight": (IH * D, RQ), p + "indexer.attn_k.weight": (D, H),
                  p + "indexer.k_norm.weight": (D,), p + "indexer.k_norm.bias": (D,),
                  p + "indexer.proj.weight": (IH, H)})
    return s


def _metadata(cfg) -> list:
    """(key, value, type) of cfg["arch"]'s hyper-parameters, as llama.cpp's converter writes
    them."""
    a = cfg["arch"]
    u32 = lambda k, v: (f"{a}.{k}", int(v), V.UINT32)  # noqa: E731
    keys = [u32("block_count", cfg["n_layer"] + cfg["n_nextn"]), u32("context_length", 4096),
            u32("embedding_length", cfg["n_embd"]), u32("feed_forward_length", cfg["n_ff"]),
            u32("attention.head_count", cfg["n_head"]),
            (f"{a}.attention.layer_norm_rms_epsilon", 1e-5, V.FLOAT32),
            u32("rope.dimension_count", cfg["n_rot"]), u32("vocab_size", cfg["n_vocab"]),
            u32("expert_count", cfg["n_expert"]), u32("expert_used_count", cfg["n_expert_used"]),
            u32("expert_shared_count", cfg["n_expert_shared"]),
            u32("expert_feed_forward_length", cfg["n_ff_exp"]),
            u32("leading_dense_block_count", cfg["n_dense_lead"]), u32("expert_gating_func", 2),
            (f"{a}.expert_weights_norm", True, V.BOOL), (f"{a}.expert_weights_scale", 2.5, V.FLOAT32),
            u32("nextn_predict_layers", cfg["n_nextn"])]
    if a == "glm4moe":
        return keys + [u32("attention.head_count_kv", cfg["n_head_kv"]),
                       u32("attention.key_length", cfg["head_dim"]),
                       u32("attention.value_length", cfg["head_dim"]),
                       (f"{a}.rope.freq_base", 1000000.0, V.FLOAT32)]
    keys += [u32("attention.head_count_kv", 1),  # the absorbed layout: one latent row
             u32("attention.key_length", cfg["n_lora_kv"] + cfg["n_rot"]),
             u32("attention.value_length", cfg["n_lora_kv"]),
             u32("attention.key_length_mla", cfg["n_nope"] + cfg["n_rot"]),
             u32("attention.value_length_mla", cfg["n_v"]),
             u32("attention.q_lora_rank", cfg["n_lora_q"]), u32("attention.kv_lora_rank", cfg["n_lora_kv"]),
             (f"{a}.rope.freq_base", 10000.0, V.FLOAT32)]
    if cfg["n_group"]:
        keys += [u32("expert_group_count", cfg["n_group"]),
                 u32("expert_group_used_count", cfg["n_group_used"])]
    if a == "glm-dsa":
        keys += [u32("attention.indexer.head_count", cfg["idx_head"]),
                 u32("attention.indexer.key_length", cfg["idx_dim"]),
                 u32("attention.indexer.top_k", cfg["idx_top_k"])]
    return keys


def make_f16_model(path, cfg, seed=0) -> int:
    """The cfg["arch"] GGUF with random F16 matrices (F32 norms, biases and router), written one
    tensor at a time; a plain SentencePiece-style token list (the benchmark feeds token ids)."""
    shapes = tensor_shapes(cfg)
    rng = np.random.default_rng(seed)
    n_vocab = cfg["n_vocab"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"t{i}" for i in range(n_vocab - len(tokens))]
    types = [2, 3, 3] + [6] * 256 + [1] * (n_vocab - 259)
    with GGUFStreamWriter(path, cfg["arch"]) as w:
        for key, value, vtype in [("general.name", f"bench-synthetic-{cfg['arch']}", V.STRING)] + \
                _metadata(cfg) + [("general.file_type", 1, V.UINT32),
                                  ("tokenizer.ggml.model", "llama", V.STRING)]:
            w.add_key(key, value, vtype)
        w.add_key("tokenizer.ggml.tokens", tokens, V.ARRAY, V.STRING)
        w.add_key("tokenizer.ggml.scores", [0.0] * len(tokens), V.ARRAY, V.FLOAT32)
        w.add_key("tokenizer.ggml.token_type", types, V.ARRAY, V.INT32)
        for name, shape in shapes.items():
            f32 = len(shape) == 1 or "ffn_gate_inp" in name  # llama.cpp keeps the router F32
            w.add_tensor_info(name, shape, "F32" if f32 else "F16")
        w.begin()
        n_params = 0
        for name, shape in shapes.items():
            if len(shape) == 1:
                if name.endswith(".bias"):
                    data = (0.05 * rng.standard_normal(shape)).astype(np.float32)
                else:
                    data = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
            else:
                scale = np.float32((2.0 if "ffn_gate_inp" in name else 1.0) / np.sqrt(shape[-1]))
                data = rng.standard_normal(shape, dtype=np.float32) * scale
                if "ffn_gate_inp" not in name:
                    data = data.astype(np.float16)
            n_params += data.size
            w.write_tensor(name, data)
        w.commit()
    return n_params


def model_params(cfg) -> tuple[int, int]:
    """(total parameters, parameters read per decoded token: every matrix but the embedding
    and the NextN layers, the experts counted top-k + shared)."""
    total = active = 0
    nextn_blocks = tuple(f"blk.{il}." for il in range(cfg["n_layer"], cfg["n_layer"] + cfg["n_nextn"]))
    for name, shape in tensor_shapes(cfg).items():
        n = int(np.prod(shape))
        total += n
        if name == "token_embd.weight" or name.startswith(nextn_blocks):
            continue
        if "_exps" in name:
            n = n // cfg["n_expert"] * cfg["n_expert_used"]
        active += n
    return total, active


def prepare_model(folder, cfg, log, mix="Q4_K_M") -> str:
    from ds4tools.quantize import QuantizeOptions, quantize_model
    os.makedirs(folder, exist_ok=True)
    tag = cfg["arch"] + ("-quick" if cfg["n_layer"] == QUICK["n_layer"] else "-1b") + \
        ("-nextn" if cfg["n_nextn"] else "")
    out = os.path.join(folder, f"{tag}-{mix.lower()}.gguf")
    if os.path.exists(out):
        return out
    src = os.path.join(folder, f"{tag}-f16.gguf")
    if not os.path.exists(src):
        t = time.perf_counter()
        n = make_f16_model(src + ".part", cfg)
        os.replace(src + ".part", src)
        log(f"made {src}: {n / 1e6:.0f}M parameters in {time.perf_counter() - t:.0f} s")
    t = time.perf_counter()
    quantize_model(src, out + ".part", QuantizeOptions(mix, progress=False), report=lambda m: None)
    os.replace(out + ".part", out)
    log(f"quantized {out} ({os.path.getsize(out) / 1e6:.0f} MB) in {time.perf_counter() - t:.0f} s")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3, help="best of N inside each measurement")
    ap.add_argument("--rounds", type=int, default=5, help="ours / llama.cpp alternated N times")
    ap.add_argument("--n-prompt", type=int, default=512)
    ap.add_argument("--n-decode", type=int, default=32)
    ap.add_argument("--quick", action="store_true", help="a tiny model (smoke run)")
    ap.add_argument("--dir", default="/tmp/ds4tools-bench-moe", help="where the GGUFs are kept")
    ap.add_argument("--make-only", action="store_true", help="make the model and stop")
    ap.add_argument("--no-llama-cpp", action="store_true")
    ap.add_argument("--nextn", action="store_true",
                    help="the model with a NextN layer, then the --glm-mtp sweep on it")
    ap.add_argument("--mtp-draft", default="1,2,3", help="the sweep's draft depths")
    ap.add_argument("--alpha", type=float, default=None,
                    help="also print the speedup a head accepting each draft with this "
                         "probability would give, from the measured r and c")
    ap.add_argument("--arch", choices=ARCHS, default="glm4moe", help="the model's family")
    args = ap.parse_args(argv)
    cfg = config(args.arch, args.quick, args.nextn)
    log = lambda m: print(m, flush=True)  # noqa: E731
    path = prepare_model(args.dir, cfg, log)
    total, active = model_params(cfg)
    log(f"model {path}: {total / 1e6:.0f}M parameters, {active / 1e6:.0f}M read per token")
    if args.make_only:
        return 0
    n_prompt = min(args.n_prompt, 64) if args.quick else args.n_prompt
    summary = compare(path, threads=args.threads, repeat=args.repeat, rounds=args.rounds,
                      n_prompt=n_prompt, n_decode=args.n_decode,
                      llama_cpp=not args.no_llama_cpp, log=log)
    log("SUMMARY " + json.dumps(summary))
    if args.nextn:
        mtp_sweep(path, args, n_prompt, log)
    return 0


def predicted_speedup(alpha: float, n_draft: int, r_verify: float, c_draft: float) -> float:
    """tau / (r + c): tau = 1 + alpha + ... + alpha^N tokens committed per verify forward when
    each draft is accepted with probability alpha (once the one before it was); r and c per
    step, in one-token forwards."""
    tau = float(sum(alpha ** i for i in range(n_draft + 1)))
    return tau / (r_verify + c_draft)


def mtp_sweep(path, args, n_prompt, log) -> None:
    """``ds4tools bench --glm-mtp`` on the NextN file (same threads, greedy), its table, and
    with --alpha the predicted speedups from the measured r and c."""
    from ds4tools.bench import BenchOptions, run_bench
    from ds4tools.bench.report import render_table
    opts = BenchOptions.from_cli(
        model=path, n_prompt=str(n_prompt), n_gen=str(args.n_decode * 2), rk="1,2,3,4,5,6,7,8",
        threads=args.threads, repeat=args.repeat, prompt=None, prompt_file=None, exact=False,
        cache_type="f32", temp="0", seed=1234, mtp_file=None, glm_mtp=True, dspark=False,
        mtp_draft=args.mtp_draft, mtp_margin=None, dspark_block_size=None,
        dspark_confidence=None, dspark_strict=False, lookup=None)
    doc = run_bench(opts)
    log(render_table(doc))
    for row in doc["spec"]:
        n, st = row["params"]["mtp_draft"] or 1, row["stats"]
        r, c = st["verify_cost_ratio"], st["draft_cost_ratio"]
        line = (f"MTP N={n}: alpha {row['alpha']:.2f}, measured speedup {row['speedup']:.2f}, "
                f"r {r:.2f}, c {c:.3f}, greedy tokens "
                f"{'identical to' if row['matches_plain'] else 'DIFFERENT from'} plain decoding's")
        if args.alpha is not None:
            line += (f"; with alpha {args.alpha:.2f}: predicted speedup "
                     f"{predicted_speedup(args.alpha, n, r, c):.2f}")
        log(line)


if __name__ == "__main__":
    sys.exit(main())
