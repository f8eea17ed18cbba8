"""The CUDA backend's speed on one NVIDIA GPU (an H200 for the issue), in one JSON file.

    python benchmarks/bench_cuda.py --out bench_cuda.json               # everything, < 8 min on an H200
    python benchmarks/bench_cuda.py --out b.json --sections copy,matvec,torch
    python benchmarks/bench_cuda.py --out b.json --models 8B-Q4_K_M,8B-Q8_0 --budget-s 200
    NUMBA_ENABLE_CUDASIM=1 python benchmarks/bench_cuda.py --tiny --out b.json   # smoke run

Sections, in this order. Each runs inside a guard: a failure is recorded as {"error": ...} and
the run goes on; the JSON file is rewritten (temporary file + rename) after every section and
every model, so a run cut short still leaves what it measured. Once the wall-clock budget
(--budget-s, from the start of the script) is spent, the remaining sections are recorded as
{"skipped": reason}.

  environment  device, compute capability, memory, driver and runtime versions, numba /
               numba-cuda / numpy / torch versions, whether this is numba's simulator
  copy         device-to-device copy of a 2 GiB buffer (cuMemcpyDtoD): GB/s counting the
               bytes read plus the bytes written ("gbps_rw", the figure every ratio below is
               taken against) and the read-equivalent (bytes copied per second); also a plain
               read-only kernel's GB/s, for reference
  matvec       the fused dequantize-mat-vec of every format in matmul.SUPPORTED on a
               14336 x 4096 weight (rows x row length, x of one row): GB/s of weight bytes read,
               its ratio to the copy bandwidth and to PyTorch's bf16 mat-vec. The matrix is
               copied to enough distinct device buffers (>= 512 MiB in all) that the launches
               cycle through more memory than the L2 holds. "gbps" is GPU time from CUDA events
               with the launches queued behind a spin kernel (so numba's ~10-40 us of Python
               per launch does not count); "gbps_wall" the host's time per call, launch included
  torch        PyTorch's bf16 mat-vec at the same shape (the reference point), and its copy
  models       synthetic qwen3 models of the shapes of Qwen3 0.6B, 4B and 8B, in Q4_K_M and
               Q8_0: decode tokens/s (prefill 32 tokens, then single-token greedy steps with
               logits="last"; the median step), the weight bytes a step reads / the step time
               as GB/s and its ratio to the copy bandwidth, and the verify cost
               r(k) = median time of a k-token forward (logits="all", at a fixed position, the
               cache truncated back each time) / that of a 1-token forward, k = 1..16
  demo         speculative decoding on the bundled demo model (greedy, held-out prompts of
               ds4tools/data/demo/prompts.json): plain decoding, prompt lookup, its MTP head
               (N = 2) and its DSpark draft (block 8), all on the GPU: tokens/s, the speedup over
               plain decoding, and whether each produced plain decoding's tokens

Synthetic weights are random bytes in each format's block layout (no quantizer run: an 8B model
would take too long on the CPU) with the fp16 scale fields (d, and the min / dmin of the
affine formats) overwritten so that every matrix's values have an rms of 1/sqrt(row length)
and a mean near 0; norms are ones. The Q4_K_M model's per-tensor types come from
ds4tools.mixes.TypeChooser (llama.cpp's rules: Q6_K output / tied embedding, Q6_K attn_v and
ffn_down of the "use more bits" layers, Q4_K elsewhere). Every matrix of every layer is its own
device allocation (the uploads come from overlapping windows of one random host pool per
tensor shape, shifted by one block per use: the host draws ~1 GB of random bytes per model, not
the model's size, and the GPU's L2 never sees two layers share memory).

Goals (the issue), printed as ratios and recorded, never asserted: Q4_K and Q8_0 mat-vec >= 60%
of the measured copy bandwidth (gbps_rw); 8B-shape Q4_K_M decode >= 100 t/s; r(8) <= 1.15
(8B Q4_K_M); DSpark >= 2x plain decoding on the demo target.

Sizing (an H200, fresh process, no numba cache; estimates, not yet measured there): environment +
copy ~5 s; matvec ~45-60 s (15 formats: compile ~1-3 s each, then < 1 s of timing; Q4_K, Q8_0
and Q6_K first, the others skipped once fewer than 200 s of the budget are left); torch ~10 s;
models ~10-25 s each plus ~20 s of kernel compiles on the first (host pool <= 1.4 GB, upload
<= 8.7 GB, decode steps sized from a measured step to ~5 s (16..64 steps), r(k) rounds to ~8 s
(2..7 rounds)); demo ~30-60 s (converted on first use). A model starts only while its estimated
time fits the budget less a 60 s reserve for the demo; default budget 420 s, so a run ends well
inside 8 minutes even when a section overruns its estimate.
--tiny shrinks everything (a 1-layer 32-wide model, 4 x 256 mat-vecs, KiB copies, no demo, r(k)
for k = 1..4 unless --max-k says otherwise) so that the whole script runs under
NUMBA_ENABLE_CUDASIM=1 in about a minute: the simulator runs one Python thread per CUDA thread,
and a forward there costs ~1.5 s per row (its row norms), so k = 1..16 alone would take ~4 min.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import sys
import time
import traceback
import warnings
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

try:  # kernels here name ``cuda`` as a module global: the simulator swaps such globals
    from numba import cuda
except Exception:  # noqa: BLE001 - recorded by the environment section
    cuda = None

HERE = os.path.dirname(os.path.abspath(__file__))
if os.path.join(HERE, "..") not in sys.path:
    sys.path.insert(0, os.path.join(HERE, ".."))

SECTIONS = ("environment", "copy", "matvec", "torch", "models", "demo")

#: mat-vec shape (rows of W = outputs, row length = inputs): an 8B llama's FFN up projection
MATVEC_SHAPE = (14336, 4096)
TINY_MATVEC_SHAPE = (4, 256)

#: qwen3 shapes (Qwen3-0.6B / 4B / 8B configs)
MODEL_SHAPES = {
    "0.6B": dict(n_embd=1024, n_layer=28, n_head=16, n_head_kv=8, head_dim=128, n_ff=3072,
                 n_vocab=151936, tied=True),
    "4B": dict(n_embd=2560, n_layer=36, n_head=32, n_head_kv=8, head_dim=128, n_ff=9728,
               n_vocab=151936, tied=True),
    "8B": dict(n_embd=4096, n_layer=36, n_head=32, n_head_kv=8, head_dim=128, n_ff=12288,
               n_vocab=151936, tied=False),
}
#: as small as the simulator needs (it runs one Python thread per CUDA thread, and a forward's
#: cost there is its number of thread blocks): its Q4_K_M types fall back as llama.cpp's do
#: (rows of 32: Q5_0 / Q8_0; rows of 8: F16)
TINY_SHAPE = dict(n_embd=32, n_layer=1, n_head=1, n_head_kv=1, head_dim=8, n_ff=8,
                  n_vocab=16, tied=True)

#: the order the models run in: the goal model (8B Q4_K_M) early, the largest upload last
DEFAULT_MODELS = ("0.6B-Q4_K_M", "8B-Q4_K_M", "0.6B-Q8_0", "4B-Q4_K_M", "4B-Q8_0", "8B-Q8_0")
TINY_MODELS = ("tiny-Q4_K_M",)
MIXES = ("Q4_K_M", "Q8_0")

GOAL_MATVEC_RATIO = 0.60
GOAL_DECODE_TPS = 100.0
GOAL_R8 = 1.15
GOAL_DSPARK = 2.0

#: seconds the models section leaves for the demo when deciding whether to start a model
DEMO_RESERVE_S = 60.0
#: the mat-vec launches cycle through at least this many bytes of distinct weight copies
ROTATE_BYTES = 512 << 20
#: mat-vec formats measured first (the goals', then the Q4_K_M mix's other one); the rest are
#: skipped once less than MATVEC_LEAVE_S seconds of the budget are left (models, torch, demo)
MATVEC_FIRST = ("Q4_K", "Q8_0", "Q6_K")
MATVEC_LEAVE_S = 200.0


def log(msg: str = "") -> None:
    print(msg, flush=True)


def g(v, width: int = 0) -> str:
    """v to 4 significant digits (the simulator's figures are tiny, an H200's large)."""
    return f"{v:{width}.4g}"


# --- synthetic weights --------------------------------------------------------------------------


@dataclass(frozen=True)
class BlockLayout:
    """Where a block's fp16 scale fields are, and the rms of its values when d = 1 (measured
    with ds4tools.formats.dequantize over 20000 random blocks)."""
    d: int                  # byte offset of the fp16 scale d
    m: int | None = None    # byte offset of the second fp16 field (Q4_1/Q5_1: m, K-quants: dmin)
    m_ratio: float = 0.0    # that field as a multiple of d: centres the values on 0
    unit_rms: float = 1.0   # rms of the decoded values at d = 1 (m = m_ratio)


#: the formats' block layouts (legacy.py, kquants.py, iq4_nl.py, iq2_xxs.py). Q4_1 / Q5_1 decode
#: q * d + m (q in 0..15 / 0..31): m = -7.5 d / -15.5 d centres them; Q2_K / Q4_K / Q5_K decode
#: d * sc * q - dmin * mn with sc, mn uniform (4 or 6 bits): dmin = E[q] * d centres them.
LAYOUTS = {
    "Q8_0": BlockLayout(0, unit_rms=73.87),
    "Q4_0": BlockLayout(0, unit_rms=4.636),
    "Q4_1": BlockLayout(0, 2, -7.5, 4.613),
    "Q5_0": BlockLayout(0, unit_rms=9.237),
    "Q5_1": BlockLayout(0, 2, -15.5, 9.227),
    "Q2_K": BlockLayout(80, 82, 1.5, 13.88),      # scales[16] qs[64] d dmin
    "Q3_K": BlockLayout(108, unit_rms=43.32),     # hmask[32] qs[64] scales[12] d
    "Q4_K": BlockLayout(0, 2, 7.5, 258.4),        # d dmin scales[12] qs[128]
    "Q5_K": BlockLayout(0, 2, 15.5, 527.0),       # d dmin scales[12] qh[32] qs[128]
    "Q6_K": BlockLayout(208, unit_rms=1366.0),    # ql[128] qh[64] scales[16] d
    "IQ4_NL": BlockLayout(0, unit_rms=67.37),     # d qs[16]
    "IQ2_XXS": BlockLayout(0, unit_rms=53.32),    # d qs[64]
}
FLOAT_FORMATS = {"F32": np.float32, "F16": np.float16, "BF16": None}


def target_rms(n_in: int) -> float:
    """The rms of a synthetic matrix with rows of n_in: outputs of a unit-rms input stay ~1."""
    return 1.0 / math.sqrt(n_in)


def _random_bytes(rng, n: int) -> np.ndarray:
    words = rng.bit_generator.random_raw(-(-n // 8)).astype(np.uint64, copy=False)
    return words.view(np.uint8)[:n]


def _fp16_bytes(v: float) -> np.ndarray:
    return np.frombuffer(np.float16(v).tobytes(), np.uint8)


def synthetic_blocks(fmt_name: str, n_blocks: int, rms: float, rng) -> np.ndarray:
    """n_blocks blocks of fmt_name (uint8, flat) whose values have about the given rms: random
    bytes with the scale fields set (quantized formats), or normal floats (F32, F16, BF16)."""
    from ds4tools import formats
    fmt = formats.get_format(fmt_name)
    if fmt_name in FLOAT_FORMATS:
        x = rng.standard_normal(n_blocks, dtype=np.float32) * np.float32(rms)
        if fmt_name == "BF16":
            return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        return x.astype(FLOAT_FORMATS[fmt_name]).view(np.uint8)
    lay = LAYOUTS.get(fmt_name)
    if lay is None:
        raise ValueError(f"no synthetic block layout for {fmt_name} (known: "
                         f"{', '.join(list(LAYOUTS) + list(FLOAT_FORMATS))})")
    raw = _random_bytes(rng, n_blocks * fmt.type_size)
    blocks = raw.reshape(n_blocks, fmt.type_size)
    d = rms / lay.unit_rms
    blocks[:, lay.d:lay.d + 2] = _fp16_bytes(d)
    if lay.m is not None:
        blocks[:, lay.m:lay.m + 2] = _fp16_bytes(d * lay.m_ratio)
    return raw


def synthetic_matrix(fmt_name: str, n_out: int, n_in: int, rng) -> np.ndarray:
    """A (n_out, row_bytes) uint8 matrix of fmt_name with values of rms 1/sqrt(n_in)."""
    from ds4tools import formats
    fmt = formats.get_format(fmt_name)
    raw = synthetic_blocks(fmt_name, n_out * (n_in // fmt.block_size), target_rms(n_in), rng)
    return raw.reshape(formats.byte_shape((n_out, n_in), fmt))


class BlockPools:
    """One random host pool per (format, n_out, n_in); each ``take`` returns a window shifted
    by one more block, so every matrix has its own data pointer (its own upload: place_weights
    shares an upload only between arrays at the same address)."""

    def __init__(self, uses: Counter, rng):
        from ds4tools import formats
        self.pools, self.next = {}, Counter()
        for (fmt_name, n_out, n_in), n in uses.items():
            fmt = formats.get_format(fmt_name)
            n_blocks = n_out * (n_in // fmt.block_size) + (n - 1)
            self.pools[(fmt_name, n_out, n_in)] = synthetic_blocks(fmt_name, n_blocks, target_rms(n_in), rng)

    def take(self, fmt_name: str, n_out: int, n_in: int) -> np.ndarray:
        from ds4tools import formats
        key = (fmt_name, n_out, n_in)
        fmt = formats.get_format(fmt_name)
        shape = formats.byte_shape((n_out, n_in), fmt)
        start = self.next[key] * fmt.type_size
        self.next[key] += 1
        return self.pools[key][start:start + shape[0] * shape[1]].reshape(shape)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pools.values())


def tensor_plan(shape: dict) -> dict:
    """name -> (n_out, n_in) of every matrix of a qwen3 model of ``shape`` (llama.cpp names)."""
    H, Q, KV, F = shape["n_embd"], shape["n_head"] * shape["head_dim"], \
        shape["n_head_kv"] * shape["head_dim"], shape["n_ff"]
    plan = {"token_embd.weight": (shape["n_vocab"], H)}
    for i in range(shape["n_layer"]):
        p = f"blk.{i}."
        plan.update({p + "attn_q.weight": (Q, H), p + "attn_k.weight": (KV, H),
                     p + "attn_v.weight": (KV, H), p + "attn_output.weight": (H, Q),
                     p + "ffn_gate.weight": (F, H), p + "ffn_up.weight": (F, H),
                     p + "ffn_down.weight": (H, F)})
    if not shape["tied"]:
        plan["output.weight"] = (shape["n_vocab"], H)
    return plan


def mix_types(shape: dict, mix: str) -> dict:
    """name -> format of every matrix under llama.cpp's rules for ``mix`` (Q4_K_M, Q8_0...)."""
    from ds4tools import formats
    from ds4tools.mixes import TypeChooser, llama_cpp_order, resolve_target
    plan = tensor_plan(shape)
    names = list(plan)
    for i in range(shape["n_layer"]):  # the 1-D tensors too: the chooser counts what it sees
        names += [f"blk.{i}.{t}.weight" for t in ("attn_norm", "ffn_norm", "attn_q_norm", "attn_k_norm")]
    names.append("output_norm.weight")
    chooser = TypeChooser(resolve_target(mix, list(formats.FORMATS)), "qwen3", shape["n_layer"],
                          shape["n_head"], shape["n_head_kv"], names=names)
    types = {}
    for name in llama_cpp_order(names):
        if name in plan:
            n_out, n_in = plan[name]
            choice = chooser.choose(name, (n_in, n_out))  # ggml order: row length first
            types[name] = choice.type_name if choice is not None else "F32"
    return types


def model_metadata(shape: dict, n_ctx: int) -> dict:
    a = "qwen3"
    return {"general.architecture": a, f"{a}.context_length": max(n_ctx, 4096),
            f"{a}.embedding_length": shape["n_embd"], f"{a}.block_count": shape["n_layer"],
            f"{a}.feed_forward_length": shape["n_ff"], f"{a}.attention.head_count": shape["n_head"],
            f"{a}.attention.head_count_kv": shape["n_head_kv"],
            f"{a}.attention.key_length": shape["head_dim"],
            f"{a}.attention.value_length": shape["head_dim"],
            f"{a}.attention.layer_norm_rms_epsilon": 1e-6, f"{a}.rope.freq_base": 1000000.0,
            f"{a}.rope.dimension_count": shape["head_dim"], f"{a}.vocab_size": shape["n_vocab"]}


def synthetic_model(shape: dict, mix: str, rng, n_ctx: int):
    """(HParams, ModelWeights, types, host pool bytes) of a random qwen3 model in ``mix``."""
    from ds4tools.engine.hparams import hparams_from_metadata
    from ds4tools.engine.weights import LayerWeights, Linear, ModelWeights
    hp = hparams_from_metadata(model_metadata(shape, n_ctx), n_vocab_tensor=shape["n_vocab"])
    plan, types = tensor_plan(shape), mix_types(shape, mix)
    pools = BlockPools(Counter((types[n], *plan[n]) for n in plan), rng)

    def lin(name):
        return Linear(name, pools.take(types[name], *plan[name]), types[name], plan[name])

    def ones(n):
        return np.ones(n, np.float32)  # a fresh array each: no two vectors share an upload

    H, D = shape["n_embd"], shape["head_dim"]
    layers = []
    for i in range(shape["n_layer"]):
        p = f"blk.{i}."
        layers.append(LayerWeights(
            attn_norm=ones(H), wq=lin(p + "attn_q.weight"), wk=lin(p + "attn_k.weight"),
            wv=lin(p + "attn_v.weight"), wo=lin(p + "attn_output.weight"), ffn_norm=ones(H),
            w_gate=lin(p + "ffn_gate.weight"), w_up=lin(p + "ffn_up.weight"),
            w_down=lin(p + "ffn_down.weight"), q_norm=ones(D), k_norm=ones(D)))
    embd = lin("token_embd.weight")
    if shape["tied"]:  # as load_weights: the same bytes (one upload), a separate Linear
        output = Linear(embd.name, embd.raw, embd.fmt, embd.shape)
    else:
        output = lin("output.weight")
    used = Counter(types.values())
    weights = ModelWeights(embd, layers, ones(H), output, None, shape["tied"], dict(used))
    return hp, weights, types, pools.nbytes


def count_params(shape: dict) -> int:
    plan = tensor_plan(shape)
    n = sum(a * b for a, b in plan.values())
    return n + shape["n_layer"] * (2 * shape["n_embd"] + 2 * shape["head_dim"]) + shape["n_embd"]


# --- the JSON file ------------------------------------------------------------------------------


def _plain(v):
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, (np.integer,)):
        return int(v)
    if isinstance(v, (np.floating, float)):
        v = float(v)
        return v if math.isfinite(v) else None
    if isinstance(v, np.bool_):
        return bool(v)
    if isinstance(v, np.ndarray):
        return _plain(v.tolist())
    return v


class Report:
    """The results document, rewritten atomically (temporary file + rename) on every save."""

    def __init__(self, path: Path, args, t0: float):
        self.path = path
        self.t0 = t0
        self.budget_s = args.budget_s
        self.doc = {"benchmark": "benchmarks/bench_cuda.py", "version": 1,
                    "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    "argv": sys.argv[1:], "tiny": args.tiny, "budget_s": args.budget_s,
                    "sections": {}}

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def left(self) -> float:
        return self.budget_s - self.elapsed()

    def save(self) -> None:
        self.doc["elapsed_s"] = round(self.elapsed(), 2)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(_plain(self.doc), indent=2))
        os.replace(tmp, self.path)


def _error(e: BaseException) -> dict:
    tb = traceback.format_exception(type(e), e, e.__traceback__)
    return {"error": f"{type(e).__name__}: {e}", "traceback": "".join(tb)[-3000:]}


def run_section(report: Report, name: str, fn, min_left_s: float = 5.0) -> None:
    """Run one section: its result (or {"error"}, or {"skipped"} once the budget is spent) goes
    into the document under ``name``, which is saved."""
    doc = report.doc
    if report.left() < min_left_s:
        doc[name] = {"skipped": f"the budget of {report.budget_s:.0f} s is spent "
                                f"({report.elapsed():.0f} s elapsed)"}
        report.doc["sections"][name] = {"status": "skipped", "seconds": 0.0}
        log(f"\n== {name}: skipped (budget spent)")
        report.save()
        return
    log(f"\n== {name}")
    t = time.perf_counter()
    doc[name] = {}
    try:
        result = fn(doc[name])
        if result is not None:
            doc[name] = result
        status = "skipped" if "skipped" in doc[name] else "ok"
        if status == "skipped":
            log(f"  skipped: {doc[name]['skipped']}")
    except Exception as e:  # noqa: BLE001 - one section's failure must not end the run
        doc[name] = {**doc[name], **_error(e)}
        status = "error"
        log(f"  {name} failed: {doc[name]['error']}")
    report.doc["sections"][name] = {"status": status, "seconds": round(time.perf_counter() - t, 2)}
    report.save()


# --- GPU timing ---------------------------------------------------------------------------------


def _cuda():
    if cuda is None:
        from numba import cuda as missing  # noqa: F401 - raises the ImportError
    return cuda


def simulated() -> bool:
    from numba import config
    return bool(config.ENABLE_CUDASIM)


def median(xs) -> float:
    return float(np.median(np.asarray(xs, np.float64)))


class GpuTimer:
    """Times a loop of launches two ways: the host's wall time per call (synchronize, launch n
    times, synchronize; numba's per-launch Python included) and, on a real GPU, the GPU's time
    per call from CUDA events with the launches queued behind a spin kernel, so that the GPU
    runs them back to back whatever the host's launch overhead."""

    def __init__(self):
        self.cuda = _cuda()
        self.events = not simulated() and hasattr(self.cuda, "event")
        self._spin_kernel = None
        self._spin_ns_per_iter = None
        self._spin_out = None

    def _spin(self):
        if self._spin_kernel is None:
            @cuda.jit
            def spin(out, n):  # one thread: a dependent float chain of n steps
                acc = np.float32(1.0)
                for _ in range(n):
                    acc = acc * np.float32(0.999999) + np.float32(1e-6)
                out[0] = acc

            self._spin_kernel = spin
            self._spin_out = cuda.device_array(1, np.float32)
            spin[1, 1](self._spin_out, 10)
            cuda.synchronize()
            n = 200_000
            ms = self._event_ms(lambda: spin[1, 1](self._spin_out, n))
            self._spin_ns_per_iter = max(ms * 1e6 / n, 0.05)
        return self._spin_kernel

    def _event_ms(self, work) -> float:
        cuda = self.cuda
        e0, e1 = cuda.event(timing=True), cuda.event(timing=True)
        cuda.synchronize()
        e0.record()
        work()
        e1.record()
        e1.synchronize()
        return cuda.event_elapsed_time(e0, e1)

    def time(self, launch, n_calls: int, repeats: int) -> dict:
        """{"wall_s": median wall seconds per call, "gpu_s": median GPU seconds per call (None
        on the simulator), "queue_ahead": whether the host finished queueing before the spin
        ended on every repeat}. ``launch(i)`` enqueues call i; warm it up first."""
        cuda = self.cuda
        walls = []
        for _ in range(repeats):
            cuda.synchronize()
            t = time.perf_counter()
            for i in range(n_calls):
                launch(i)
            cuda.synchronize()
            walls.append((time.perf_counter() - t) / n_calls)
        res = {"wall_s": median(walls), "gpu_s": None, "queue_ahead": None}
        if not self.events:
            return res
        try:
            spin = self._spin()
            # the spin lasts 1.5 x the whole wall loop (+1 ms): the host is done queueing before it
            spin_ms = 1.5 * res["wall_s"] * n_calls * 1e3 + 1.0
            iters = int(spin_ms * 1e6 / self._spin_ns_per_iter)
            gpus, ahead = [], True
            e0, e1 = cuda.event(timing=True), cuda.event(timing=True)
            for _ in range(repeats):
                cuda.synchronize()
                t = time.perf_counter()
                spin[1, 1](self._spin_out, iters)
                e0.record()
                for i in range(n_calls):
                    launch(i)
                e1.record()
                queued_ms = (time.perf_counter() - t) * 1e3
                e1.synchronize()
                ahead = ahead and queued_ms < spin_ms
                gpus.append(cuda.event_elapsed_time(e0, e1) * 1e-3 / n_calls)
            res["gpu_s"], res["queue_ahead"] = median(gpus), ahead
        except Exception as e:  # noqa: BLE001 - the wall figure stands without events
            res["gpu_error"] = f"{type(e).__name__}: {e}"
        return res


def free_device_memory() -> None:
    """Drop numba's deferred frees (after the last reference to a device array has gone)."""
    gc.collect()
    cuda = _cuda()
    try:
        ctx = cuda.current_context()
        dealloc = getattr(ctx, "deallocations", None) or getattr(getattr(ctx, "memory_manager", None),
                                                                 "deallocations", None)
        if dealloc is not None:
            dealloc.clear()
    except Exception:  # noqa: BLE001 - best effort
        pass


def device_memory() -> dict | None:
    try:
        free, total = _cuda().current_context().get_memory_info()
        return {"free_bytes": int(free), "total_bytes": int(total)}
    except Exception:  # noqa: BLE001 - the simulator may not say
        return None


# --- sections -----------------------------------------------------------------------------------


def section_environment(out: dict, args) -> dict:
    from importlib import metadata
    import numba
    import ds4tools
    cuda = _cuda()
    out.update({"simulator": simulated(), "python": platform.python_version(),
                "platform": platform.platform(), "host_cpus": os.cpu_count(),
                "numpy": np.__version__, "numba": numba.__version__, "ds4tools": ds4tools.__version__})
    for pkg in ("numba-cuda", "torch", "cuda-python", "cuda-bindings"):
        try:
            out[pkg] = metadata.version(pkg)
        except Exception:  # noqa: BLE001
            out[pkg] = None
    out["cuda_available"] = bool(cuda.is_available())
    if not out["cuda_available"]:
        raise RuntimeError("numba sees no CUDA device (NUMBA_ENABLE_CUDASIM=1 runs the simulator)")
    dev = cuda.get_current_device()
    name = getattr(dev, "name", None)
    out["device"] = name.decode() if isinstance(name, bytes) else (name or "numba CUDA simulator")
    out["compute_capability"] = list(getattr(dev, "compute_capability", ()) or ())
    for attr in ("MULTIPROCESSOR_COUNT", "L2_CACHE_SIZE", "CLOCK_RATE", "MEMORY_CLOCK_RATE",
                 "GLOBAL_MEMORY_BUS_WIDTH"):
        try:
            out[attr.lower()] = int(getattr(dev, attr))
        except Exception:  # noqa: BLE001 - the simulator has none of these
            pass
    out["memory"] = device_memory()
    try:
        out["driver_version"] = ".".join(map(str, cuda.cudadrv.driver.driver.get_version()))
    except Exception as e:  # noqa: BLE001
        out["driver_version"] = f"unknown ({type(e).__name__})"
    try:
        out["runtime_version"] = ".".join(map(str, cuda.runtime.get_version()))
    except Exception as e:  # noqa: BLE001
        out["runtime_version"] = f"unknown ({type(e).__name__})"
    if not out["simulator"]:
        try:
            import subprocess
            smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm,"
                                  "clocks.max.mem,power.limit", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=10)
            out["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
        except Exception as e:  # noqa: BLE001
            out["nvidia_smi"] = f"unavailable ({type(e).__name__})"
    log(f"  {out['device']} (cc {'.'.join(map(str, out['compute_capability'])) or '?'}), driver "
        f"{out['driver_version']}, runtime {out['runtime_version']}, numba {out['numba']}, numba-cuda "
        f"{out['numba-cuda']}, torch {out['torch']}{'  [SIMULATOR]' if out['simulator'] else ''}")
    return out


def _read_kernel():
    @cuda.jit
    def read_all(words, out):
        i = cuda.grid(1)
        stride = cuda.gridsize(1)
        acc = np.uint64(0)
        for j in range(i, words.shape[0], stride):
            acc ^= words[j]
        if acc == np.uint64(0x9E3779B97F4A7C15):  # (practically) never: keeps the loads alive
            out[0] = acc
    return read_all


def section_copy(out: dict, args, timer: GpuTimer) -> dict:
    cuda = _cuda()
    nbytes = (64 << 10) if args.tiny else (args.copy_mib << 20)
    repeats = 2 if args.tiny else 10
    src = cuda.device_array(nbytes, np.uint8)
    dst = cuda.device_array(nbytes, np.uint8)
    dst.copy_to_device(src)  # warm-up (the contents do not matter: left uninitialized)
    t = timer.time(lambda i: dst.copy_to_device(src), 1, repeats)
    sec = t["gpu_s"] or t["wall_s"]
    out.update({"bytes": nbytes, "seconds": sec, "timing": "cuda events" if t["gpu_s"] else "wall",
                "wall_seconds": t["wall_s"],
                "gbps_rw": 2 * nbytes / sec / 1e9, "gbps_read_equivalent": nbytes / sec / 1e9,
                "reference_for_ratios": "gbps_rw (bytes read + bytes written per second): the DRAM "
                                        "traffic a copy sustains; a mat-vec's weight bytes read per "
                                        "second are compared against it (against the read-equivalent "
                                        "the ratios would double)"})
    # a read-only kernel over the same buffer, for reference (not used for the ratios)
    try:
        read_all = _read_kernel()
        words = src.view(np.uint64) if hasattr(src, "view") else src
        sink = cuda.device_array(1, np.uint64)
        sms = getattr(args, "_sms", None) or 132
        grid = (2, 32) if args.tiny else (sms * 8, 256)
        read_all[grid](words, sink)
        cuda.synchronize()
        r = timer.time(lambda i: read_all[grid](words, sink), 1, repeats)
        rs = r["gpu_s"] or r["wall_s"]
        out["read_kernel_gbps"] = nbytes / rs / 1e9
    except Exception as e:  # noqa: BLE001
        out["read_kernel_error"] = f"{type(e).__name__}: {e}"
    del src, dst
    free_device_memory()
    log(f"  device-to-device copy of {g(nbytes / 2**20)} MiB: {g(out['gbps_rw'])} GB/s read+write "
        f"({g(out['gbps_read_equivalent'])} GB/s read-equivalent; {out['timing']})"
        + (f"; read-only kernel {g(out['read_kernel_gbps'])} GB/s" if "read_kernel_gbps" in out else ""))
    return out


def section_matvec(out: dict, args, timer: GpuTimer, copy_gbps: float | None, report: Report) -> dict:
    from ds4tools import formats
    from ds4tools.engine.backends.cuda import matmul
    cuda = _cuda()
    n_out, n_in = TINY_MATVEC_SHAPE if args.tiny else MATVEC_SHAPE
    names = [f.strip() for f in (args.formats.split(",") if args.formats else matmul.SUPPORTED) if f.strip()]
    # the goals' formats first, then Q4_K_M's Q6_K: if compiling runs slow, the others give way
    names = [f for f in MATVEC_FIRST if f in names] + [f for f in names if f not in MATVEC_FIRST]
    rng = np.random.default_rng(1)
    out.update({"shape": [n_out, n_in], "k": 1, "supported": list(matmul.SUPPORTED),
                "reference": "copy.gbps_rw", "formats": {}})
    read_gbps = (report.doc.get("copy") or {}).get("read_kernel_gbps")
    x = cuda.to_device(rng.standard_normal((1, n_in), dtype=np.float32))
    y = cuda.device_array((1, n_out), np.float32)
    per_format_s = max(2.0, (args.budget_s * 0.15) / max(1, len(names)))
    for name in names:
        res = out["formats"][name] = {}
        if name not in MATVEC_FIRST[:2] and report.left() < MATVEC_LEAVE_S:
            res["skipped"] = (f"budget: {report.left():.0f} s left, {MATVEC_LEAVE_S:.0f} s are kept "
                              f"for the later sections")
            log(f"  {name:<8} skipped ({res['skipped']})")
            continue
        t_start = time.perf_counter()
        try:
            host = synthetic_matrix(name, n_out, n_in, rng)
            nbytes = host.nbytes
            copies = 1 if args.tiny else int(min(64, max(2, math.ceil(ROTATE_BYTES / nbytes))))
            first = cuda.to_device(host)
            bufs = [first]
            for _ in range(copies - 1):
                b = cuda.device_array(host.shape, np.uint8)
                b.copy_to_device(first)
                bufs.append(b)
            del host
            t = time.perf_counter()
            matmul.matmul(name, first, x, y)  # compiles
            cuda.synchronize()
            compile_s = time.perf_counter() - t
            got = y.copy_to_host()
            finite = bool(np.isfinite(got).all())
            if args.tiny:
                n_calls, repeats = copies, 1
            else:
                n_calls = max(copies, 16)
                t = time.perf_counter()
                for i in range(n_calls):
                    matmul.matmul(name, bufs[i % copies], x, y)
                cuda.synchronize()
                one = (time.perf_counter() - t) / n_calls
                repeats = int(min(9, max(3, (per_format_s - (time.perf_counter() - t_start)) / 3
                                         / max(one * n_calls, 1e-6))))
            tm = timer.time(lambda i: matmul.matmul(name, bufs[i % copies], x, y), n_calls, repeats)
            sec = tm["gpu_s"] or tm["wall_s"]
            res.update({"bytes": nbytes, "bits_per_weight": 8.0 * nbytes / (n_out * n_in),
                        "copies": copies, "calls_per_repeat": n_calls, "repeats": repeats,
                        "compile_s": compile_s, "finite": finite,
                        "us": sec * 1e6, "timing": "cuda events" if tm["gpu_s"] else "wall",
                        "gbps": nbytes / sec / 1e9, "wall_us": tm["wall_s"] * 1e6,
                        "gbps_wall": nbytes / tm["wall_s"] / 1e9, "queue_ahead": tm["queue_ahead"]})
            if "gpu_error" in tm:
                res["gpu_error"] = tm["gpu_error"]
            if copy_gbps:
                res["ratio_to_copy"] = res["gbps"] / copy_gbps
                res["ratio_to_copy_wall"] = res["gbps_wall"] / copy_gbps
                res["ratio_to_copy_read_equivalent"] = 2 * res["gbps"] / copy_gbps
            if read_gbps:
                res["ratio_to_read_kernel"] = res["gbps"] / read_gbps
            log(f"  {name:<8} {res['bits_per_weight']:5.2f} b/w {g(nbytes / 1e6, 7)} MB  "
                f"{g(res['us'], 8)} us  {g(res['gbps'], 8)} GB/s"
                + (f"  = {g(res['ratio_to_copy'], 5)} x copy" if copy_gbps else "")
                + f"   (wall {g(res['wall_us'])} us/call = {g(res['gbps_wall'])} GB/s; compile "
                  f"{compile_s:.1f} s){'' if finite else '  NON-FINITE OUTPUT'}")
            del bufs, first
        except Exception as e:  # noqa: BLE001 - one format's failure leaves the others
            res.update(_error(e))
            log(f"  {name:<8} failed: {res['error']}")
        res["seconds"] = time.perf_counter() - t_start
        free_device_memory()
    return out


def section_torch(out: dict, args) -> dict:
    try:
        import torch
    except Exception as e:  # noqa: BLE001
        return {"skipped": f"PyTorch is not installed ({type(e).__name__}: {e})"}
    if not torch.cuda.is_available():
        return {"skipped": f"PyTorch {torch.__version__} sees no CUDA device"}
    n_out, n_in = TINY_MATVEC_SHAPE if args.tiny else MATVEC_SHAPE
    out.update({"torch": torch.__version__, "device": torch.cuda.get_device_name(0),
                "shape": [n_out, n_in], "dtype": "bfloat16", "k": 1})
    nbytes = n_out * n_in * 2
    copies = 2 if args.tiny else int(min(64, max(2, math.ceil(ROTATE_BYTES / nbytes))))
    ws = [torch.randn(n_out, n_in, dtype=torch.bfloat16, device="cuda") for _ in range(copies)]
    x = torch.randn(n_in, 1, dtype=torch.bfloat16, device="cuda")
    n_calls, repeats = max(copies, 16), 2 if args.tiny else 9
    for i in range(n_calls):
        ws[i % copies] @ x
    torch.cuda.synchronize()

    def loop():
        for i in range(n_calls):
            ws[i % copies] @ x

    walls, gpus = [], []
    sleep = getattr(torch.cuda, "_sleep", None)
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        loop()
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - t) / n_calls)
    for _ in range(repeats):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        if sleep is not None:  # queue the launches behind ~2x their host time of GPU sleep
            sleep(int(2 * median(walls) * n_calls * 2e9) + 1_000_000)
        e0.record()
        loop()
        e1.record()
        e1.synchronize()
        gpus.append(e0.elapsed_time(e1) * 1e-3 / n_calls)
    sec = median(gpus)
    out.update({"bytes": nbytes, "copies": copies, "us": sec * 1e6, "timing": "cuda events",
                "queued_behind_sleep": sleep is not None, "gbps": nbytes / sec / 1e9,
                "wall_us": median(walls) * 1e6, "gbps_wall": nbytes / median(walls) / 1e9})
    # torch's own device-to-device copy, to cross-check the copy section
    n = (64 << 10) if args.tiny else (1 << 30)
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    ts = []
    for _ in range(2 if args.tiny else 7):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        b.copy_(a)
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e-3)
    out["copy_gbps_rw"] = 2 * n / median(ts) / 1e9
    del ws, x, a, b
    torch.cuda.empty_cache()
    log(f"  torch bf16 mat-vec {n_out}x{n_in}: {g(out['us'])} us = {g(out['gbps'])} GB/s (wall "
        f"{g(out['wall_us'])} us/call); torch copy {g(out['copy_gbps_rw'])} GB/s read+write")
    return out


def _model_names(args) -> list[str]:
    if args.models:
        return [m.strip() for m in args.models.split(",") if m.strip()]
    return list(TINY_MODELS if args.tiny else DEFAULT_MODELS)


def _parse_model(name: str):
    size, _, mix = name.partition("-")
    shapes = {"tiny": TINY_SHAPE, **MODEL_SHAPES}
    if size not in shapes or mix not in MIXES:
        raise ValueError(f"unknown model {name!r} (sizes {', '.join(shapes)}; mixes {', '.join(MIXES)})")
    return shapes[size], mix


def measure_model(name: str, args, copy_gbps, report: Report, res: dict) -> dict:
    from ds4tools.engine.transformer import Transformer
    cuda = _cuda()
    shape, mix = _parse_model(name)
    tiny = args.tiny or shape is TINY_SHAPE
    n_prompt = 4 if tiny else 32
    ks = list(range(1, args.max_k + 1))
    n_ctx = 8 + args.max_k if tiny else 256
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    t0 = time.perf_counter()
    hp, weights, types, pool_bytes = synthetic_model(shape, mix, rng, n_ctx)
    t_gen = time.perf_counter() - t0
    step_bytes = sum(lin.nbytes for lin in weights.linears())  # every matrix but the embedding
    upload_bytes = sum(l.nbytes for l in weights.linears()) + (0 if shape["tied"] else weights.token_embd.nbytes)
    fmt_counts = Counter(types.values())
    res.update({"shape": {k: v for k, v in shape.items()}, "params": count_params(shape), "mix": mix,
                "types": dict(fmt_counts),
                "types_source": "ds4tools.mixes.TypeChooser (llama.cpp's per-tensor rules for the "
                                "mix, for these tensor names and shapes)",
                "types_not_default": {n: t for n, t in types.items() if t != max(fmt_counts, key=fmt_counts.get)},
                "weight_bytes_per_token": step_bytes, "weight_bytes_uploaded": upload_bytes,
                "host_pool_bytes": pool_bytes, "synthesis_s": t_gen, "n_ctx": n_ctx,
                "prefill_tokens": n_prompt})
    t0 = time.perf_counter()
    model = Transformer(hp, weights, n_ctx=n_ctx, device="cuda")
    cuda.synchronize()
    res["upload_s"] = time.perf_counter() - t0
    del weights
    gc.collect()
    log(f"  {name}: {g(res['params'] / 1e9)}B params, {dict(fmt_counts)}, {g(step_bytes / 1e9)} GB read "
        f"per token; host synthesis {t_gen:.1f} s, upload {res['upload_s']:.1f} s")
    prompt = rng.integers(0, hp.n_vocab, n_prompt)
    feed = rng.integers(0, hp.n_vocab, max(ks))

    if not tiny:  # (the simulator compiles nothing: every forward there costs seconds)
        t0 = time.perf_counter()
        model.forward(prompt, 0, logits="last")  # compiles / loads every kernel this model uses
        model.forward(feed[:2], n_prompt, logits="all")
        res["warmup_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    model.forward(prompt, 0, logits="last")
    res["prefill_s"] = time.perf_counter() - t0
    res["prefill_tps"] = n_prompt / res["prefill_s"]

    # decode: single-token greedy steps after the prompt
    if tiny:
        n_decode = 2
    else:
        model.cache.truncate(n_prompt)
        t0 = time.perf_counter()
        model.forward([int(prompt[-1])], n_prompt, logits="last")
        t_step = time.perf_counter() - t0
        n_decode = int(min(64, max(16, args.decode_s / max(t_step, 1e-4))))
    model.cache.truncate(n_prompt)
    tok = int(prompt[-1])
    steps = []
    for i in range(n_decode):
        t = time.perf_counter()
        lg = model.forward([tok], n_prompt + i, logits="last").logits
        steps.append(time.perf_counter() - t)
        tok = int(np.argmax(lg[-1]))
    med = median(steps)
    res.update({"decode_steps": n_decode, "decode_step_ms_median": med * 1e3,
                "decode_step_ms_min": min(steps) * 1e3, "decode_step_ms_mean": float(np.mean(steps)) * 1e3,
                "decode_tps": 1.0 / med, "decode_tps_mean": n_decode / sum(steps),
                "weight_gbps": step_bytes / med / 1e9})
    if copy_gbps:
        res["weight_gbps_ratio_to_copy"] = res["weight_gbps"] / copy_gbps
    log(f"  {name}: decode {g(res['decode_tps'])} t/s (median of {n_decode} steps, "
        f"{g(med * 1e3)} ms) -> {g(res['weight_gbps'])} GB/s of weights"
        + (f" = {g(res['weight_gbps_ratio_to_copy'])} x copy" if copy_gbps else "")
        + f"; prefill {g(res['prefill_tps'])} t/s")
    report.save()

    # verify cost r(k): k-token forwards at position n_prompt, interleaved within each round
    if tiny:
        rounds = 1
    else:
        est = med * sum(1.0 + 0.1 * k for k in ks)
        rounds = int(min(7, max(2, args.verify_s / max(est, 1e-4))))
    times = {k: [] for k in ks}
    for _ in range(rounds):
        for k in ks:
            model.cache.truncate(n_prompt)
            cuda.synchronize()
            t = time.perf_counter()
            model.forward(feed[:k], n_prompt, logits="all")
            cuda.synchronize()
            times[k].append(time.perf_counter() - t)
    model.cache.truncate(n_prompt)
    t1 = median(times[1])
    res.update({"verify_rounds": rounds, "verify_position": n_prompt,
                "verify_ms": {k: median(v) * 1e3 for k, v in times.items()},
                "ks": ks, "r": {k: (median(v) / t1 if k != 1 else 1.0) for k, v in times.items()},
                "verify_logits": "all (every row's logits come back to the host, as a verify step)"})
    log(f"  {name}: r(k) " + " ".join(f"{k}:{v:.2f}" for k, v in res["r"].items())
        + f"  (1-token forward {t1 * 1e3:.2f} ms, {rounds} rounds)")
    del model
    free_device_memory()
    return res


def section_models(out: dict, args, report: Report) -> dict:
    names = _model_names(args)
    copy_gbps = (report.doc.get("copy") or {}).get("gbps_rw")
    reserve = 0.0 if (args.tiny or "demo" not in args.sections) else DEMO_RESERVE_S
    out.update({"order": names, "models": {}})
    rate = None  # seconds per GB of uploaded weights, from the models so far
    for name in names:
        res = out["models"][name] = {}
        try:
            shape, mix = _parse_model(name)
        except ValueError as e:
            res["error"] = str(e)
            continue
        gb = count_params(shape) * (0.6 if mix == "Q4_K_M" else 1.07) / 1e9
        est = 15.0 + (rate * gb if rate else 10.0 * gb)
        if not args.tiny and report.left() - reserve < est:
            res["skipped"] = (f"budget: {report.left():.0f} s left, this model needs ~{est:.0f} s "
                              f"(+{reserve:.0f} s kept for the demo)")
            log(f"  {name}: skipped ({res['skipped']})")
            report.save()
            continue
        t = time.perf_counter()
        try:
            measure_model(name, args, copy_gbps, report, res)
        except Exception as e:  # noqa: BLE001 - the next model may still run
            res.update(_error(e))
            log(f"  {name} failed: {res['error']}")
            free_device_memory()
        res["seconds"] = time.perf_counter() - t
        if "error" not in res and gb > 0.5:
            rate = max(rate or 0.0, (res["seconds"] - 5.0) / gb)
        report.save()
    return out


def _demo_prompts(n: int) -> list[str]:
    import ds4tools
    from ds4tools.demo import demo_source
    f = demo_source().parent / "prompts.json"
    if not f.is_file():
        f = Path(ds4tools.__file__).parent / "data" / "demo" / "prompts.json"
    return [p["text"] for p in json.loads(f.read_text())][:n]


def section_demo(out: dict, args, report: Report) -> dict:
    if args.tiny:
        return {"skipped": "--tiny: the demo model is too slow under the simulator"}
    from ds4tools.demo import demo_model_path, demo_support_path
    from ds4tools.engine import Engine
    from ds4tools.engine.sampling import Sampler
    from ds4tools.engine.speculative.config import SpecConfig
    from ds4tools.engine.speculative.stats import SpecStats
    t = time.perf_counter()
    path = demo_model_path(progress=False)
    out["prepare_s"] = time.perf_counter() - t
    prompts = _demo_prompts(args.demo_prompts)
    n_tokens = args.demo_tokens
    eng = Engine(str(path), device="cuda")
    out.update({"model": Path(path).name, "prompts": len(prompts), "tokens_per_prompt": n_tokens,
                "sampling": "greedy", "methods": {}})
    sampler = Sampler(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0)

    def run(label):
        list(eng.generate(prompts[0], 16, sampler=sampler, seed=0, stop_at_eog=False))  # warm-up
        toks = secs = 0.0
        outputs, spec = [], SpecStats(method=label)
        for i, p in enumerate(prompts):
            ids = [tok.id for tok in eng.generate(p, n_tokens, sampler=sampler, seed=i, stop_at_eog=False)]
            outputs.append(ids)
            toks += eng.last_stats.decode_tokens
            secs += eng.last_stats.decode_seconds
            if eng.drafter is not None and eng.last_spec_stats is not None:
                spec.merge(eng.last_spec_stats)
        return {"tokens_per_second": toks / secs if secs else 0.0, "decode_tokens": toks,
                "decode_seconds": secs}, outputs, (spec if eng.drafter is not None else None)

    plain, plain_out, _ = run("plain")
    out["methods"]["plain"] = plain
    log(f"  demo plain: {plain['tokens_per_second']:.1f} t/s ({len(prompts)} prompts x {n_tokens} tokens)")
    report.save()

    # the demo's MTP head and DSpark draft are prepared on first use (converted on the CPU)
    methods = [("lookup", lambda: SpecConfig(lookup=8)),
               ("mtp-n2", lambda: SpecConfig(mtp_file=str(demo_support_path("mtp", progress=False)),
                                             mtp_draft=2)),
               ("dspark-b8-c0", lambda: SpecConfig(
                   dspark=True, mtp_file=str(demo_support_path("dspark", progress=False)),
                   dspark_block_size=8, dspark_confidence=0.0))]
    for label, make in methods:
        if report.left() < 20:
            out["methods"][label] = {"skipped": "budget spent"}
            continue
        entry = out["methods"][label] = {}
        try:
            eng.set_spec(make())
            res, outs, spec = run(label)
            entry.update(res)
            entry["speedup"] = res["tokens_per_second"] / plain["tokens_per_second"]
            entry["same_tokens_as_plain"] = outs == plain_out
            if spec is not None:
                entry["spec"] = spec.as_dict()
            log(f"  demo {label}: {res['tokens_per_second']:.1f} t/s = {entry['speedup']:.2f} x plain"
                f"{'' if entry['same_tokens_as_plain'] else '  (tokens differ from plain!)'}")
        except Exception as e:  # noqa: BLE001
            entry.update({"available": False, "error": f"{type(e).__name__}: {e}"})
            log(f"  demo {label}: unavailable ({entry['error']})")
        finally:
            eng.spec, eng.drafter = None, None
        report.save()
    eng.close()
    free_device_memory()
    return out


# --- goals --------------------------------------------------------------------------------------


def goals(doc: dict) -> dict:
    def get(*path):
        v = doc
        for p in path:
            if not isinstance(v, dict) or p not in v:
                return None
            v = v[p]
        return v

    def goal(desc, value, target, higher=True, note=None):
        met = None if value is None else (value >= target if higher else value <= target)
        entry = {"goal": desc, "value": value, "target": target, "met": met}
        if note:
            entry["note"] = note
        return entry

    out = {}
    for f in ("Q4_K", "Q8_0"):
        out[f"matvec_{f}"] = goal(f"{f} mat-vec GB/s >= {GOAL_MATVEC_RATIO:.0%} of the copy bandwidth "
                                  f"(gbps_rw)", get("matvec", "formats", f, "ratio_to_copy"), GOAL_MATVEC_RATIO)
    out["decode_8B_Q4_K_M"] = goal(f"8B-shape Q4_K_M decode >= {GOAL_DECODE_TPS:.0f} t/s",
                                   get("models", "models", "8B-Q4_K_M", "decode_tps"), GOAL_DECODE_TPS)
    r8 = get("models", "models", "8B-Q4_K_M", "r", 8)
    if r8 is None:
        r8 = get("models", "models", "8B-Q4_K_M", "r", "8")
    out["r8_8B_Q4_K_M"] = goal(f"r(8) <= {GOAL_R8} (8B Q4_K_M)", r8, GOAL_R8, higher=False)
    ds = get("demo", "methods", "dspark-b8-c0")
    out["dspark_demo"] = goal(f"DSpark >= {GOAL_DSPARK:.0f}x plain decoding on the demo target (greedy)",
                              (ds or {}).get("speedup"), GOAL_DSPARK,
                              note=(ds or {}).get("error") or (ds or {}).get("skipped"))
    return out


def summary(doc: dict) -> None:
    log("\n== summary")
    copy = (doc.get("copy") or {}).get("gbps_rw")
    torch_gbps = (doc.get("torch") or {}).get("gbps")
    log(f"  copy bandwidth {g(copy)} GB/s (read+write)" if copy else "  copy bandwidth: not measured")
    for f, r in ((doc.get("matvec") or {}).get("formats") or {}).items():
        if "gbps" in r:
            log(f"  mat-vec {f:<8} {g(r['gbps'], 8)} GB/s"
                + (f"  {g(r['gbps'] / copy, 6)} x copy" if copy else "")
                + (f"  {g(r['gbps'] / torch_gbps, 6)} x torch bf16" if torch_gbps else ""))
    for n, m in ((doc.get("models") or {}).get("models") or {}).items():
        if "decode_tps" in m:
            rs = m.get("r") or {}
            log(f"  {n:<12} decode {g(m['decode_tps'], 8)} t/s  {g(m['weight_gbps'], 8)} GB/s"
                + (f" ({g(m['weight_gbps'] / copy)} x copy)" if copy else "")
                + "  " + " ".join(f"r({k}) {rs[k]:.2f}" for k in (2, 4, 8, 16) if k in rs))
    for label, m in ((doc.get("demo") or {}).get("methods") or {}).items():
        if "speedup" in m:
            log(f"  demo {label:<13} {m['tokens_per_second']:8.1f} t/s  {m['speedup']:.2f} x plain")
    log("  goals:")
    for gl in doc.get("goals", {}).values():
        v = gl["value"]
        state = "not measured" if gl["met"] is None else ("MET" if gl["met"] else "not met")
        log(f"    {gl['goal']}: {g(v) if v is not None else '-'} -> {state}"
            + (f" ({gl['note']})" if gl.get("note") and gl["met"] is None else ""))


# --- main ---------------------------------------------------------------------------------------


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_cuda.json", help="the JSON file to write (default %(default)s)")
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="wall-clock budget from the start; later sections are skipped once spent")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes everywhere (runs under the simulator)")
    ap.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated, of: " + ", ".join(SECTIONS))
    ap.add_argument("--models", default=None,
                    help="comma-separated SIZE-MIX (sizes 0.6B, 4B, 8B, tiny; mixes Q4_K_M, Q8_0); "
                         f"default {','.join(DEFAULT_MODELS)}")
    ap.add_argument("--formats", default=None, help="mat-vec formats (default: all of matmul.SUPPORTED)")
    ap.add_argument("--copy-mib", type=int, default=2048, help="copy buffer size (default %(default)s MiB)")
    ap.add_argument("--decode-s", type=float, default=5.0, help="target seconds of decode steps per model")
    ap.add_argument("--verify-s", type=float, default=8.0, help="target seconds of r(k) rounds per model")
    ap.add_argument("--max-k", type=int, default=None,
                    help="r(k) for k = 1..MAX_K (default 16; 4 with --tiny: under the simulator a "
                         "forward costs ~1.5 s per row, so k = 1..16 alone takes ~4 min)")
    ap.add_argument("--demo-prompts", type=int, default=8)
    ap.add_argument("--demo-tokens", type=int, default=128)
    args = ap.parse_args(argv)
    if args.max_k is None:
        args.max_k = 4 if args.tiny else 16
    if not 1 <= args.max_k <= 64:
        ap.error(f"--max-k {args.max_k}: must be in 1..64")
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in args.sections if s not in SECTIONS]
    if unknown:
        ap.error(f"unknown sections {unknown} (known: {', '.join(SECTIONS)})")
    return args


def main(argv=None) -> int:
    t0 = time.perf_counter()
    args = parse_args(argv)
    # numba warns on every small grid (the spin kernel, a decode step's short matmuls): noise here
    warnings.filterwarnings("ignore", message=".*under-utilization.*")
    report = Report(Path(args.out), args, t0)
    report.doc["argv"] = list(sys.argv[1:] if argv is None else argv)
    report.doc["options"] = {k: v for k, v in vars(args).items() if not k.startswith("_")}
    log(f"bench_cuda: writing {args.out}; budget {args.budget_s:.0f} s{'; --tiny' if args.tiny else ''}")
    report.save()

    timer_box = {}

    def timer():
        if "t" not in timer_box:
            timer_box["t"] = GpuTimer()
        return timer_box["t"]

    def env(o):
        r = section_environment(o, args)
        args._sms = r.get("multiprocessor_count")
        return r

    steps = {
        "environment": env,
        "copy": lambda o: section_copy(o, args, timer()),
        "matvec": lambda o: section_matvec(o, args, timer(), (report.doc.get("copy") or {}).get("gbps_rw"),
                                           report),
        "torch": lambda o: section_torch(o, args),
        "models": lambda o: section_models(o, args, report),
        "demo": lambda o: section_demo(o, args, report),
    }
    for name in SECTIONS:
        if name in args.sections:
            run_section(report, name, steps[name])
            if name == "environment" and "error" in report.doc[name]:
                log("  no usable CUDA device: the other sections are skipped")
                for rest in SECTIONS[1:]:
                    if rest in args.sections:
                        report.doc[rest] = {"skipped": "no usable CUDA device (see environment)"}
                        report.doc["sections"][rest] = {"status": "skipped", "seconds": 0.0}
                break

    # ratios against torch, once both are measured
    torch_gbps = (report.doc.get("torch") or {}).get("gbps")
    for r in ((report.doc.get("matvec") or {}).get("formats") or {}).values():
        if torch_gbps and "gbps" in r:
            r["ratio_to_torch_bf16"] = r["gbps"] / torch_gbps
    report.doc["goals"] = goals(report.doc)
    report.save()
    summary(report.doc)
    log(f"\nwrote {args.out} in {report.elapsed():.0f} s")
    return 1 if "error" in report.doc.get("environment", {}) else 0


if __name__ == "__main__":
    sys.exit(main())
