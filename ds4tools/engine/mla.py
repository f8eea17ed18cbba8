"""Multi-head latent attention (MLA, DeepSeek V2/V3), in llama.cpp's "absorbed" form, and the
latent cache it reads.

    q      = h Wq                     or  rmsnorm(h Wq_a) Wq_b          (the low-rank q path)
    q      = [q_nope | q_pe] per head  (n_nope + n_rot dimensions)
    kv     = h Wkv_a                  = [c | k_pe]   (kv_lora_rank + n_rot, shared by all heads)
    c      = rmsnorm(c) ; k_pe = rope(k_pe) ; q_pe = rope(q_pe)
    cache[pos] = [c | k_pe]           the latent: one row of kv_lora_rank + n_rot per position
    q_abs  = Wk_b[h] q_nope           (per head: n_nope -> kv_lora_rank)
    a      = softmax(scale * [q_abs | q_pe] . cache rows) @ c rows        per head
    out    = (Wv_b[h] a for each head) Wo                                   (kv_lora_rank -> n_v)

The cache holds the latent, never expanded keys and values, so a position costs
kv_lora_rank + n_rot floats per layer whatever the head count. Attention is MQA over it: every
head reads the same rows (keys: the whole row; values: its first kv_lora_rank entries), so one
job takes 8 heads of a token and reads each row once for all of them (on the 1B deepseek2 of
benchmarks/bench_moe.py, 16 heads over 512 positions: 210 -> 136 us a layer).

The per-head projections Wk_b and Wv_b are 3-D tensors (n_head, n_out, n_in); they multiply
through the grouped matmul of the mixture-of-experts block with the head as the "expert", one
(row, head) pair per input row, so a row's bits never depend on the batch; one compiled call
for all heads (Wk_b's rows of n_nope are Q5_0 / Q8_0 in llama.cpp's mixes and take the float32
path: its grouped kernel replaced a Python loop over the heads that cost a third of a step).

Shared by the architectures with MLA attention (deepseek2; glm-dsa adds its indexer on top).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit, prange

from .. import formats
from ..formats._numeric import FP16_TO_FP32
from ..formats.floats import f32_bits_to_f16
from . import kernels
from .kv_cache import CACHE_TYPES
from .moe import ExpertMatrices
from .weights import Linear, SharedInput, WeightsError, _linear, _tensor, _vector, int8_for


@dataclass(frozen=True)
class MLAShape:
    n_head: int
    n_lora_q: int       # 0: q comes from one matrix (DeepSeek V2-Lite)
    n_lora_kv: int      # the latent width (kv_lora_rank)
    n_nope: int         # per-head query/key dimensions without rope
    n_rot: int          # per-head rope dimensions (and the shared k_pe's)
    n_v: int            # per-head value width after Wv_b

    @property
    def n_k(self) -> int:
        """A head's query/key length as the model defines it (n_nope + n_rot)."""
        return self.n_nope + self.n_rot

    @property
    def n_latent(self) -> int:
        """A cache row: the compressed vector and the rope key part."""
        return self.n_lora_kv + self.n_rot


# --- weights ------------------------------------------------------------------------------------


@dataclass
class MLAWeights:
    attn_norm: np.ndarray
    wkv_a: Linear                     # attn_kv_a_mqa (n_lora_kv + n_rot, n_embd)
    kv_a_norm: np.ndarray             # (n_lora_kv,)
    wk_b: ExpertMatrices              # attn_k_b (n_head, n_lora_kv, n_nope)
    wv_b: ExpertMatrices              # attn_v_b (n_head, n_v, n_lora_kv)
    wo: Linear                        # attn_output (n_embd, n_head * n_v)
    wq: Linear | None = None          # attn_q, or
    wq_a: Linear | None = None        # attn_q_a (n_lora_q, n_embd)
    q_a_norm: np.ndarray | None = None
    wq_b: Linear | None = None        # attn_q_b (n_head * n_k, n_lora_q)

    def linears(self) -> list:
        q = [self.wq] if self.wq is not None else [self.wq_a, self.wq_b]
        return q + [self.wkv_a, self.wk_b, self.wv_b, self.wo]


def _per_head(tensors: dict, name: str, n_head: int, n_out: int, n_in: int, int8: str) -> ExpertMatrices:
    t = _tensor(tensors, name, (n_head, n_out, n_in))
    fmt = formats.format_for_type(t.ggml_type)
    if n_in % fmt.block_size:
        raise WeightsError(f"tensor {name}: row length {n_in} is not a multiple of "
                           f"{fmt.name}'s block size {fmt.block_size}")
    return ExpertMatrices(name, np.asarray(t.raw()), fmt, n_head, n_out, n_in,
                          int8=int8_for(fmt, int8, n_in))


def load_mla(tensors: dict, prefix: str, s: MLAShape, n_embd: int, int8: str) -> MLAWeights:
    """One layer's attention from llama.cpp's tensor names under ``prefix`` (``blk.N.``)."""
    p, H = prefix, n_embd
    q = {}
    if s.n_lora_q:
        q = dict(wq_a=_linear(tensors, p + "attn_q_a.weight", s.n_lora_q, H, int8),
                 q_a_norm=_vector(tensors, p + "attn_q_a_norm.weight", s.n_lora_q),
                 wq_b=_linear(tensors, p + "attn_q_b.weight", s.n_head * s.n_k, s.n_lora_q, int8))
    else:
        q = dict(wq=_linear(tensors, p + "attn_q.weight", s.n_head * s.n_k, H, int8))
    return MLAWeights(
        attn_norm=_vector(tensors, p + "attn_norm.weight", H),
        wkv_a=_linear(tensors, p + "attn_kv_a_mqa.weight", s.n_latent, H, int8),
        kv_a_norm=_vector(tensors, p + "attn_kv_a_norm.weight", s.n_lora_kv),
        wk_b=_per_head(tensors, p + "attn_k_b.weight", s.n_head, s.n_lora_kv, s.n_nope, int8),
        wv_b=_per_head(tensors, p + "attn_v_b.weight", s.n_head, s.n_v, s.n_lora_kv, int8),
        wo=_linear(tensors, p + "attn_output.weight", H, s.n_head * s.n_v, int8),
        **q)


MLA_TENSORS = ("attn_norm.weight", "attn_q.weight", "attn_q_a.weight", "attn_q_a_norm.weight",
               "attn_q_b.weight", "attn_kv_a_mqa.weight", "attn_kv_a_norm.weight",
               "attn_k_b.weight", "attn_v_b.weight", "attn_output.weight")


# --- the latent cache ---------------------------------------------------------------------------


@dataclass(frozen=True)
class LatentSnapshot:
    length: int
    rows: np.ndarray


class LatentCache:
    """The MLA cache: one latent row (n_lora_kv + n_rot) per layer and position, float32 or
    fp16 bit patterns (uint16). Same length / truncate / snapshot semantics as KVCache:
    truncating moves the length only, the next forward overwrites the stale rows."""

    def __init__(self, n_layer: int, n_ctx: int, n_lora_kv: int, n_rot: int, cache_type: str = "f32"):
        if cache_type not in CACHE_TYPES:
            raise ValueError(f"unknown cache type {cache_type!r} (use {' or '.join(CACHE_TYPES)})")
        if min(n_layer, n_ctx, n_lora_kv, n_rot) <= 0:
            raise ValueError("latent cache dimensions must be positive")
        dtype = np.float32 if cache_type == "f32" else np.uint16
        # np.zeros maps fresh pages lazily: a long context costs memory only once it is used.
        self.rows = np.zeros((n_layer, n_ctx, n_lora_kv + n_rot), dtype)
        self.n_lora_kv = n_lora_kv
        self.cache_type = cache_type
        self.n_ctx = n_ctx
        self.length = 0

    @property
    def n_layer(self) -> int:
        return self.rows.shape[0]

    def truncate(self, n: int) -> None:
        """Forget positions n and above (O(1): the length moves, nothing is cleared)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {n}")
        self.length = n

    def clear(self) -> None:
        self.length = 0

    def snapshot(self) -> LatentSnapshot:
        n = self.length
        return LatentSnapshot(n, self.rows[:, :n].copy())

    def restore(self, snap: LatentSnapshot) -> None:
        n = snap.length
        if (n > self.n_ctx or snap.rows.shape[0] != self.rows.shape[0]
                or snap.rows.shape[2:] != self.rows.shape[2:] or snap.rows.dtype != self.rows.dtype):
            raise ValueError("snapshot does not fit this cache")
        self.rows[:, :n] = snap.rows
        self.length = n

    def store(self, layer: int, latent: np.ndarray, positions: np.ndarray) -> None:
        """Write float32 latent rows (k, n_lora_kv + n_rot) of one layer at ``positions``."""
        if self.cache_type == "f32":
            _store_f32(self.rows[layer], latent, positions)
        else:
            _store_f16(self.rows[layer], latent, positions)

    def attend(self, layer: int, q: np.ndarray, limits: np.ndarray, scale: float, out: np.ndarray,
               selected=None) -> None:
        """q (k, n_head, n_lora_kv + n_rot) against this layer's rows; row t sees [0, limits[t]);
        out (k, n_head, n_lora_kv): the softmax-weighted latent vectors. ``selected``: None, or
        (positions (k, m) int64 ascending, counts (k,) int64): row t then sees only the first
        counts[t] positions of its list (all below limits[t]; a sparse attention's choice)."""
        rows = self.rows[layer]
        if self.cache_type == "f16":
            decoded = np.empty((int(limits.max()), rows.shape[1]), np.float32)
            _decode_f16(rows, FP16_TO_FP32, decoded)
            rows = decoded
        if selected is None:
            latent_attention(q, rows, limits, np.float32(scale), out)
        else:
            latent_attention_selected(q, rows, selected[0], selected[1], np.float32(scale), out)


@njit(cache=True, error_model="numpy")
def _store_f32(cache, latent, positions):
    for t in range(latent.shape[0]):
        p = positions[t]
        for i in range(latent.shape[1]):
            cache[p, i] = latent[t, i]


@njit(cache=True, error_model="numpy")
def _store_f16(cache, latent, positions):
    bits = latent.view(np.uint32)
    for t in range(latent.shape[0]):
        p = positions[t]
        for i in range(latent.shape[1]):
            cache[p, i] = f32_bits_to_f16(np.int64(bits[t, i]))


@njit(parallel=True, cache=True, error_model="numpy")
def _decode_f16(cache, lut, out):
    for j in prange(out.shape[0]):
        for i in range(out.shape[1]):
            out[j, i] = lut[cache[j, i]]


#: heads per attention job: a job reads each visible latent row once for all its heads (the
#: rows are shared by every head), instead of once per head; fixed, so that a row's
#: result does not depend on the batch
HEADS_PER_JOB = 8


@njit(cache=True, fastmath=True, error_model="numpy")
def _attend_latent(q, rows, index, n_visible, scale, scores, m, acc, out):
    """Query rows q (heads, n_latent) of one token over the latent rows index[0..n_visible)
    (ascending; index None: rows 0..n_visible-1): out (heads, n_lora) = softmax(scale * rows @
    q[h]) @ rows[:, :n_lora] per head h. Each head reduces over the rows in their order."""
    n_h, d = q.shape
    n_lora = out.shape[1]
    for h in range(n_h):
        m[h] = kernels.NEG_INF
    for j in range(n_visible):
        r = j if index is None else index[j]
        for h in range(n_h):
            s = np.float32(0.0)
            for i in range(d):
                s += q[h, i] * rows[r, i]
            s *= scale
            scores[h, j] = s
            m[h] = max(m[h], s)
    for h in range(n_h):
        total = np.float32(0.0)
        for j in range(n_visible):
            e = kernels.exp_f32(scores[h, j] - m[h])
            scores[h, j] = e
            total += e
        m[h] = np.float32(1.0) / total  # m now holds 1 / total
        for i in range(n_lora):
            acc[h, i] = np.float32(0.0)
    for j in range(n_visible):
        r = j if index is None else index[j]
        for h in range(n_h):
            w = scores[h, j]
            for i in range(n_lora):
                acc[h, i] += w * rows[r, i]
    for h in range(n_h):
        for i in range(n_lora):
            out[h, i] = acc[h, i] * m[h]


@njit(parallel=True, cache=True, error_model="numpy")
def latent_attention(q, rows, limits, scale, out):
    """q (k, n_head, n_latent) float32; rows (>= max limit, n_latent) float32; out (k, n_head,
    n_lora). Jobs are (row, HEADS_PER_JOB heads), each head reducing in a fixed order: a
    result does not depend on the batch."""
    k, n_head, _ = q.shape
    n_lora = out.shape[2]
    per = (n_head + HEADS_PER_JOB - 1) // HEADS_PER_JOB
    for job in prange(k * per):
        t = job // per
        h0 = (job - t * per) * HEADS_PER_JOB
        h1 = min(n_head, h0 + HEADS_PER_JOB)
        n_visible = limits[t]
        scores = np.empty((h1 - h0, n_visible), np.float32)
        m = np.empty(h1 - h0, np.float32)
        acc = np.empty((h1 - h0, n_lora), np.float32)
        _attend_latent(q[t, h0:h1], rows, None, n_visible, scale, scores, m, acc, out[t, h0:h1])


@njit(parallel=True, cache=True, error_model="numpy")
def latent_attention_selected(q, rows, selected, counts, scale, out):
    """latent_attention where row t sees the cache rows selected[t, :counts[t]] only."""
    k, n_head, _ = q.shape
    n_lora = out.shape[2]
    per = (n_head + HEADS_PER_JOB - 1) // HEADS_PER_JOB
    for job in prange(k * per):
        t = job // per
        h0 = (job - t * per) * HEADS_PER_JOB
        h1 = min(n_head, h0 + HEADS_PER_JOB)
        n_visible = counts[t]
        scores = np.empty((h1 - h0, n_visible), np.float32)
        m = np.empty(h1 - h0, np.float32)
        acc = np.empty((h1 - h0, n_lora), np.float32)
        _attend_latent(q[t, h0:h1], rows, selected[t], n_visible, scale, scores, m, acc,
                       out[t, h0:h1])


# --- the attention block ------------------------------------------------------------------------


class MLAWorkspace:
    """The block's activation buffers for up to ``rows`` rows (see transformer.Workspace)."""

    def __init__(self, s: MLAShape, n_embd: int, rows: int):
        f = np.float32
        self.norm = np.empty((rows, n_embd), f)
        self.q_a = np.empty((rows, max(s.n_lora_q, 1)), f)
        self.q = np.empty((rows, s.n_head, s.n_k), f)
        self.q_nope = np.empty((rows, s.n_head, s.n_nope), f)
        self.q_abs = np.empty((rows, s.n_head, s.n_lora_kv), f)
        self.q_cat = np.empty((rows, s.n_head, s.n_latent), f)
        self.latent = np.empty((rows, s.n_latent), f)
        self.ctx = np.empty((rows, s.n_head, s.n_lora_kv), f)
        self.v = np.empty((rows, s.n_head, s.n_v), f)
        self.proj = np.empty((rows, n_embd), f)
        #: row t * n_head + h multiplies with head h's matrix
        self.head_ids = np.tile(np.arange(s.n_head, dtype=np.int64), rows).reshape(rows * s.n_head, 1)


def mla_attention_block(x: np.ndarray, w: MLAWeights, s: MLAShape, rms_eps: float, kq_scale: float,
                        cache: LatentCache, layer: int, positions: np.ndarray, limits: np.ndarray,
                        rope: tuple, ws: MLAWorkspace, select=None) -> None:
    """x (k, n_embd) += the attention half of an MLA decoder layer, in place. Writes the layer's
    latent rows at ``positions``; query row t attends to cache rows [0, limits[t]). ``rope``:
    (cos, sin) tables over n_rot ("norm" pairs, as llama.cpp's deepseek2). ``select``: None, or
    a sparse attention's chooser (glm-dsa's indexer), called as select(h, q_a) with the normed
    input (a SharedInput) and the normed low-rank query; it returns the positions each row
    attends to (see LatentCache.attend)."""
    k = x.shape[0]
    kh = k * s.n_head
    h = ws.norm[:k]
    kernels.rmsnorm(x, w.attn_norm, rms_eps, h)
    hs = SharedInput(h)  # quantized once for the q and kv projections
    q = ws.q[:k]
    if w.wq is not None:
        w.wq.matmul(hs, q.reshape(k, s.n_head * s.n_k))
    else:
        qa = ws.q_a[:k]
        w.wq_a.matmul(hs, qa)
        kernels.rmsnorm(qa, w.q_a_norm, rms_eps, qa)
        w.wq_b.matmul(qa, q.reshape(k, s.n_head * s.n_k))
    if select is not None:
        if w.wq is not None:
            raise ValueError("a sparse attention's chooser needs the low-rank query path")
        selected = select(hs, qa)
    latent = ws.latent[:k]
    w.wkv_a.matmul(hs, latent)
    c = latent[:, :s.n_lora_kv]
    kernels.rmsnorm(c, w.kv_a_norm, rms_eps, c)
    cos, sin = rope
    kernels.rope(latent[:, None, s.n_lora_kv:], positions, cos, sin, False)  # a view: in place
    cache.store(layer, latent, positions)

    # the query in latent space: [Wk_b q_nope | rope(q_pe)]
    q_nope = ws.q_nope[:k]
    np.copyto(q_nope, q[:, :, :s.n_nope])
    q_abs = ws.q_abs[:k]
    ids = ws.head_ids[:kh]
    w.wk_b.matmul(q_nope.reshape(kh, s.n_nope), ids, q_abs.reshape(kh, 1, s.n_lora_kv))
    q_cat = ws.q_cat[:k]
    np.copyto(q_cat[:, :, :s.n_lora_kv], q_abs)
    np.copyto(q_cat[:, :, s.n_lora_kv:], q[:, :, s.n_nope:])
    kernels.rope(q_cat[:, :, s.n_lora_kv:], positions, cos, sin, False)

    ctx = ws.ctx[:k]
    if select is None:
        cache.attend(layer, q_cat, limits, kq_scale, ctx)
    else:
        cache.attend(layer, q_cat, limits, kq_scale, ctx, selected)
    v = ws.v[:k]
    w.wv_b.matmul(ctx.reshape(kh, s.n_lora_kv), ids, v.reshape(kh, 1, s.n_v))
    o = ws.proj[:k]
    w.wo.matmul(v.reshape(k, s.n_head * s.n_v), o)
    kernels.add_into(x, o)
