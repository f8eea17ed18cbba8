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

The indexer cache is part of ``DSACache`` (latent_cache.py: a LatentCache with one more array),
so truncate, snapshot and restore move both together and speculative rollback restores the
selection too. Every step is per row in a fixed order: a row's choice never depends on its
batch. The steps are a backend's operations (backends/), the choice of the top_k on the host.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
from numba import njit, prange

from . import kernels
from .backends.cpu import CPU
from .latent_cache import DSACache, DSASnapshot  # noqa: F401  (the cache of this block)
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


# --- the choice of positions ---------------------------------------------------------------------


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
    """indexer_select's choice on numpy arrays (the CPU's scores, then _select_top): per row t,
    the top_k positions in [0, limits[t]) by indexer score, ascending, into
    selected[t, :counts[t]]."""
    scores = np.empty((q.shape[0], int(limits.max())), np.float32)
    kernels.dsa_scores(q, keys, w, limits, top_k, scores)
    _select_top(scores, limits, top_k, selected, counts)


def indexer_scores(q, keys, w, limit):
    """The scores of one query row (n_head, d) over keys [0, limit): for tests."""
    scores = np.empty(limit, np.float32)
    kernels._row_scores(np.ascontiguousarray(q), keys, np.ascontiguousarray(w), limit, scores)
    return scores


# --- the indexer --------------------------------------------------------------------------------


class IndexerWorkspace:
    """The indexer's buffers for up to ``rows`` rows on the device of backend ``ops`` (the
    selection's on the host too: the top-k is chosen there, as the router's experts)."""

    def __init__(self, s: IndexerShape, rows: int, ops=CPU):
        self.ops = ops
        self.q = ops.empty((rows, s.n_head, s.head_dim))
        self.k = ops.empty((rows, s.head_dim))
        self.k_raw = ops.empty((rows, s.head_dim))
        self.w = ops.empty((rows, s.n_head))
        self.selected = np.zeros((rows, s.top_k), np.int64)
        self.counts = np.zeros(rows, np.int64)
        self.hadamard = ops.asarray(hadamard(s.head_dim))


def indexer_select(hs, qa, w: IndexerWeights, s: IndexerShape, cache: DSACache, layer: int,
                   positions, limits, rope: tuple, ws: IndexerWorkspace):
    """A full layer's indexer: stores the rows' indexer keys at ``positions`` and returns
    (selected, counts) for LatentCache.attend, on the device of ``ws.ops``. ``hs``: the layer's
    normed input (a SharedInput); ``qa``: its normed low-rank query (k, n_lora_q).

    Per row t: the top_k positions in [0, limits[t]) by indexer score, ascending (every
    position when limits[t] <= top_k); equal scores keep the lower position. The scores are
    made on the device (across threads by blocks of positions on the CPU); the choice is made
    on the host by one function whatever the device, as the router's (moe.py)."""
    ops = ws.ops
    k = qa.shape[0]
    cos, sin = rope
    q = ws.q[:k]
    w.wq_b.matmul(qa, q.reshape(k, s.n_head * s.head_dim))
    ops.rope(q, positions, cos, sin, False)
    raw = ws.k_raw[:k]
    w.wk.matmul(hs, raw)
    key = ws.k[:k]
    ops.layer_norm(raw, w.k_norm, w.k_norm_b, 0.0, key)
    ops.rope(key.reshape(k, 1, s.head_dim), positions, cos, sin, False)
    ops.rotate_rows(q.reshape(k * s.n_head, s.head_dim), ws.hadamard)
    ops.rotate_rows(key, ws.hadamard)
    cache.store_index(layer, key, positions)
    wts = ws.w[:k]
    w.proj.matmul(hs, wts)
    ops.scale(wts, s.weight_scale)
    host_limits = ops.to_host(limits)
    n = int(host_limits.max())
    scores = ops.empty((k, n))
    ops.dsa_scores(q, cache.index_keys(layer, n), wts, limits, s.top_k, scores)
    selected, counts = ws.selected[:k], ws.counts[:k]
    _select_top(ops.to_host(scores), host_limits, s.top_k, selected, counts)
    return ops.asarray(selected), ops.asarray(counts)
