"""DeepSeek sparse attention (DSA): the "lightning indexer" that picks, for every query row, the
cached positions its MLA attention reads, as llama.cpp's glm-dsa graph computes it.

Per decoder layer that runs its own indexer (a "full" layer):

    q_i   = (rmsnorm(h Wq_a) Wq_b_idx)      (k, n_idx_head, d): from the normed low-rank query
    k_i   = layernorm(h Wk_idx) * g + b     (k, d): one key per position, shared by every head
            (llama.cpp passes its plain-norm epsilon, which glm-dsa files never set: 0)
    q_i, k_i = rope over their first n_rot dimensions ("norm" pairs, the model's rope tables)
    q_i, k_i = q_i H, k_i H                 H: the d x d orthonormal Walsh-Hadamard matrix
    cache_i[pos] = k_i                      the indexer's own key cache, one row per position
    w     = (h W_proj) / sqrt(d * n_idx_head)        (k, n_idx_head): per-head weights
    score[t, j] = sum_h relu(q_i[t, h] . cache_i[j]) * w[t, h]     for j < limit[t]
    row t attends to the top_k positions by score (all of [0, limit[t]) when limit[t] <= top_k)

A "shared" layer (GLM-5.2's ``attention.indexer.types``) has no indexer and reuses the
positions of the last full layer before it. Ties in the score keep the lower position (an
exact tie happens when every head's dot product is <= 0: the score is then exactly 0).

The indexer cache is part of ``DSACache`` (a LatentCache with one more array), so truncate,
snapshot and restore move both together and speculative rollback restores the selection too.
Every step is per row in a fixed order: a row's choice never depends on its batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
from numba import njit, prange

from ..formats._numeric import FP16_TO_FP32
from . import kernels
from .latent_cache import LatentCache, LatentSnapshot, _decode_f16, _store_f16, _store_f32
from .weights import Linear, _linear, _vector

#: the indexer's tensors under ``blk.N.`` (llama.cpp's names)
INDEXER_TENSORS = ("indexer.attn_q_b.weight", "indexer.attn_k.weight", "indexer.k_norm.weight",
                   "indexer.k_norm.bias", "indexer.proj.weight")


@dataclass(frozen=True)
class IndexerShape:
    n_head: int         # attention.indexer.head_count
    head_dim: int       # attention.indexer.key_length (a power of two: the Hadamard rotation's size)
    top_k: int          # attention.indexer.top_k
    n_rot: int          # the rotated dimensions at the start of each indexer head

    @cached_property  # (read by every indexer call)
    def weight_scale(self) -> np.float32:
        """The per-head weights' factor, 1 / sqrt(d * n_head), as llama.cpp rounds it."""
        return np.float32(1.0) / np.sqrt(np.float32(self.head_dim * self.n_head))


# --- weights ------------------------------------------------------------------------------------


@dataclass
class IndexerWeights:
    wq_b: Linear                  # indexer.attn_q_b (n_head * d, n_lora_q)
    wk: Linear                    # indexer.attn_k (d, n_embd)
    k_norm: np.ndarray            # (d,) (ones when the file has none)
    k_norm_b: np.ndarray          # (d,) (zeros when the file has none)
    proj: Linear                  # indexer.proj (n_head, n_embd)

    def linears(self) -> list:
        return [self.wq_b, self.wk, self.proj]


def load_indexer(tensors: dict, prefix: str, s: IndexerShape, n_lora_q: int, n_embd: int,
                 int8: str) -> IndexerWeights:
    """One layer's indexer from llama.cpp's names under ``prefix`` (``blk.N.``); the k norm's
    scale and bias are optional, as in llama.cpp's loader."""
    p, d = prefix, s.head_dim
    g = _vector(tensors, p + "indexer.k_norm.weight", d, required=False)
    b = _vector(tensors, p + "indexer.k_norm.bias", d, required=False)
    return IndexerWeights(
        wq_b=_linear(tensors, p + "indexer.attn_q_b.weight", s.n_head * d, n_lora_q, int8),
        wk=_linear(tensors, p + "indexer.attn_k.weight", d, n_embd, int8),
        k_norm=np.ones(d, np.float32) if g is None else g,
        k_norm_b=np.zeros(d, np.float32) if b is None else b,
        proj=_linear(tensors, p + "indexer.proj.weight", s.n_head, n_embd, int8))


def hadamard(n: int) -> np.ndarray:
    """The n x n orthonormal Walsh-Hadamard matrix (Sylvester's order, entries +-1/sqrt(n) in
    float32, as llama.cpp builds it); n a power of two. Symmetric, and its square is I."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Hadamard matrix needs a power of two, not {n}")
    i = np.arange(n)
    parity = np.zeros((n, n), np.int64)
    both = i[:, None] & i[None, :]
    while both.any():
        parity ^= both & 1
        both = both >> 1
    v = np.float32(1.0 / np.float32(np.sqrt(np.float32(n))))
    return np.where(parity == 1, -v, v).astype(np.float32)


# --- the cache ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class DSASnapshot(LatentSnapshot):
    index_rows: np.ndarray | None = None


class DSACache(LatentCache):
    """The MLA latent cache plus the indexer's key cache: one row of ``index_dim`` values per
    full-indexer layer and position (f32, or fp16 bits like the latent rows). One length for
    both: truncate, snapshot and restore keep them in step."""

    def __init__(self, n_layer: int, n_ctx: int, n_lora_kv: int, n_rot: int, index_layers,
                 index_dim: int, cache_type: str = "f32"):
        super().__init__(n_layer, n_ctx, n_lora_kv, n_rot, cache_type)
        self.index_layers = tuple(int(i) for i in index_layers)
        if not self.index_layers or index_dim <= 0:
            raise ValueError("a DSA cache needs indexer layers and a positive key length")
        self.index_slot = {il: slot for slot, il in enumerate(self.index_layers)}
        self.index_rows = np.zeros((len(self.index_layers), n_ctx, index_dim), self.rows.dtype)

    def snapshot(self) -> DSASnapshot:
        n = self.length
        return DSASnapshot(n, self.rows[:, :n].copy(), self.index_rows[:, :n].copy())

    def restore(self, snap: DSASnapshot) -> None:
        if (not isinstance(snap, DSASnapshot) or snap.index_rows.shape[0] != self.index_rows.shape[0]
                or snap.index_rows.shape[2:] != self.index_rows.shape[2:]
                or snap.index_rows.dtype != self.index_rows.dtype):
            raise ValueError("snapshot does not fit this cache")
        super().restore(snap)
        self.index_rows[:, :snap.length] = snap.index_rows

    def store_index(self, layer: int, keys: np.ndarray, positions: np.ndarray) -> None:
        """Write float32 indexer keys (k, index_dim) of a full-indexer layer at ``positions``."""
        rows = self.index_rows[self.index_slot[layer]]
        if self.cache_type == "f32":
            _store_f32(rows, keys, positions)
        else:
            _store_f16(rows, keys, positions)

    def index_keys(self, layer: int, n: int) -> np.ndarray:
        """The layer's indexer keys of positions [0, n) as float32."""
        rows = self.index_rows[self.index_slot[layer]]
        if self.cache_type == "f32":
            return rows
        decoded = np.empty((n, rows.shape[1]), np.float32)
        _decode_f16(rows, FP16_TO_FP32, decoded)
        return decoded


# --- kernels ------------------------------------------------------------------------------------


@njit(cache=True, error_model="numpy")
def layer_norm(x, weight, bias, eps, out):
    """out = (x - mean) / sqrt(var + eps) * weight + bias per row, as ggml_norm then the scale and
    the bias: sums in float64, everything else float32."""
    n = x.shape[1]
    for t in range(x.shape[0]):
        total = 0.0
        for i in range(n):
            total += np.float64(x[t, i])
        mean = np.float32(total) / np.float32(n)
        sq = 0.0
        for i in range(n):
            y = x[t, i] - mean
            out[t, i] = y
            sq += np.float64(y * y)
        var = np.float32(sq / n)
        scale = np.float32(1.0) / np.float32(np.sqrt(var + np.float32(eps)))
        for i in range(n):
            out[t, i] = out[t, i] * scale * weight[i] + bias[i]


@njit(cache=True, fastmath=True, error_model="numpy")
def rotate_rows(x, h, tmp):
    """x (m, d) <- x @ h in place (h symmetric, d x d), one row at a time in a fixed order."""
    d = x.shape[1]
    for t in range(x.shape[0]):
        for i in range(d):
            s = np.float32(0.0)
            for j in range(d):
                s += h[i, j] * x[t, j]
            tmp[i] = s
        for i in range(d):
            x[t, i] = tmp[i]


@njit(cache=True, fastmath=True, error_model="numpy")
def _row_scores(q, keys, w, n_visible, scores):
    """scores[j] = sum_h relu(q[h] . keys[j]) * w[h] for j < n_visible (heads in order)."""
    n_head, d = q.shape
    for j in range(n_visible):
        s = np.float32(0.0)
        for h in range(n_head):
            dot = np.float32(0.0)
            for i in range(d):
                dot += q[h, i] * keys[j, i]
            if dot > 0:
                s += dot * w[h]
        scores[j] = s


#: positions per scoring task: a decode step's one row is scored by every thread
SCORE_BLOCK = 64


@njit(parallel=True, cache=True, error_model="numpy")
def _all_scores(q, keys, w, limits, top_k, scores):
    # scores[t, :limits[t]] for the rows that select (limits[t] > top_k), in tasks of
    # (row, SCORE_BLOCK positions); a position's score is _row_scores' whatever the split
    per = (scores.shape[1] + SCORE_BLOCK - 1) // SCORE_BLOCK
    for task in prange(q.shape[0] * per):
        t = task // per
        j0 = (task - t * per) * SCORE_BLOCK
        n = limits[t]
        if n <= top_k or j0 >= n:
            continue
        j1 = min(n, j0 + SCORE_BLOCK)
        _row_scores(q[t], keys[j0:j1], w[t], j1 - j0, scores[t, j0:j1])


@njit(parallel=True, cache=True, error_model="numpy")
def _select_top(scores, limits, top_k, selected, counts):
    for t in prange(scores.shape[0]):
        n = limits[t]
        if n <= top_k:
            for j in range(n):
                selected[t, j] = j
            counts[t] = n
            continue
        row = scores[t, :n]
        # the top_k-th largest score; positions above it all go in, equal ones by position
        threshold = np.partition(row, n - top_k)[n - top_k]  # a sorted-around copy
        above = 0
        for j in range(n):
            if row[j] > threshold:
                above += 1
        ties = top_k - above
        m = 0
        for j in range(n):
            s = row[j]
            if s > threshold or (s == threshold and ties > 0):
                if s == threshold:
                    ties -= 1
                selected[t, m] = j
                m += 1
        counts[t] = m


def select_positions(q, keys, w, limits, top_k, selected, counts):
    """Per row t: the top_k positions in [0, limits[t]) by indexer score, ascending, into
    selected[t, :counts[t]] (every position when limits[t] <= top_k). Equal scores keep the
    lower position. The scores are made across threads by blocks of positions, then each row
    selects."""
    scores = np.empty((q.shape[0], int(limits.max())), np.float32)
    _all_scores(q, keys, w, limits, top_k, scores)
    _select_top(scores, limits, top_k, selected, counts)


def indexer_scores(q, keys, w, limit):
    """The scores of one query row (n_head, d) over keys [0, limit): for tests."""
    scores = np.empty(limit, np.float32)
    _row_scores(np.ascontiguousarray(q), keys, np.ascontiguousarray(w), limit, scores)
    return scores


# --- the indexer --------------------------------------------------------------------------------


class IndexerWorkspace:
    """The indexer's buffers for up to ``rows`` rows."""

    def __init__(self, s: IndexerShape, rows: int):
        f = np.float32
        self.q = np.empty((rows, s.n_head, s.head_dim), f)
        self.k = np.empty((rows, s.head_dim), f)
        self.k_raw = np.empty((rows, s.head_dim), f)
        self.w = np.empty((rows, s.n_head), f)
        self.tmp = np.empty(s.head_dim, f)
        self.selected = np.zeros((rows, s.top_k), np.int64)
        self.counts = np.zeros(rows, np.int64)
        self.hadamard = hadamard(s.head_dim)


def indexer_select(hs, qa: np.ndarray, w: IndexerWeights, s: IndexerShape, cache: DSACache,
                   layer: int, positions: np.ndarray, limits: np.ndarray, rope: tuple,
                   ws: IndexerWorkspace):
    """A full layer's indexer: stores the rows' indexer keys at ``positions`` and returns
    (selected, counts) for LatentCache.attend. ``hs``: the layer's normed input (a
    SharedInput); ``qa``: its normed low-rank query (k, n_lora_q)."""
    k = qa.shape[0]
    cos, sin = rope
    q = ws.q[:k]
    w.wq_b.matmul(qa, q.reshape(k, s.n_head * s.head_dim))
    kernels.rope(q, positions, cos, sin, False)
    raw = ws.k_raw[:k]
    w.wk.matmul(hs, raw)
    key = ws.k[:k]
    layer_norm(raw, w.k_norm, w.k_norm_b, 0.0, key)
    kernels.rope(key[:, None, :], positions, cos, sin, False)
    rotate_rows(q.reshape(k * s.n_head, s.head_dim), ws.hadamard, ws.tmp)
    rotate_rows(key, ws.hadamard, ws.tmp)
    cache.store_index(layer, key, positions)
    wts = ws.w[:k]
    w.proj.matmul(hs, wts)
    np.multiply(wts, s.weight_scale, out=wts)
    keys = cache.index_keys(layer, int(limits.max()))
    selected, counts = ws.selected[:k], ws.counts[:k]
    select_positions(q, keys, wts, limits, s.top_k, selected, counts)
    return selected, counts
