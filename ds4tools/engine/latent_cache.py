"""MLA's latent cache (DeepSeek V2/V3, GLM-5): one row of kv_lora_rank + n_rot floats per layer
and position, never expanded keys and values, and the attention that reads it.

Attention over the latent is MQA: every head reads the same rows (keys: the whole row; values:
its first kv_lora_rank entries), so one job takes 8 heads of a token and reads each row once for
all of them (on the 1B deepseek2 of benchmarks/bench_moe.py, 16 heads over 512 positions: 210 ->
136 us a layer). DSACache adds the DSA indexer's keys (glm-dsa, dsa.py) under the same length.
The CUDA backend's caches (backends/cuda) keep the same rows on the device.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit, prange

from ..formats._numeric import FP16_TO_FP32
from ..formats.floats import f32_bits_to_f16
from . import kernels
from .kv_cache import CACHE_TYPES


@dataclass(frozen=True)
class LatentSnapshot:
    length: int
    rows: np.ndarray


class LatentCache:
    """The MLA cache: one latent row (n_lora_kv + n_rot) per layer and position, float32 or
    fp16 bit patterns (uint16). Same length / truncate / snapshot semantics as KVCache:
    truncating moves the length only, the next forward overwrites the stale rows."""

    def __init__(self, n_layer: int, n_ctx: int, n_lora_kv: int, n_rot: int, cache_type: str = "f32",
                 zeros=np.zeros):
        """``zeros(shape, dtype)`` allocates the rows (a device backend passes its own)."""
        if cache_type not in CACHE_TYPES:
            raise ValueError(f"unknown cache type {cache_type!r} (use {' or '.join(CACHE_TYPES)})")
        if min(n_layer, n_ctx, n_lora_kv, n_rot) <= 0:
            raise ValueError("latent cache dimensions must be positive")
        dtype = np.float32 if cache_type == "f32" else np.uint16
        # np.zeros maps fresh pages lazily: a long context costs memory only once it is used.
        self.rows = zeros((n_layer, n_ctx, n_lora_kv + n_rot), dtype)
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


# --- DSA (glm-dsa): the latent cache plus the indexer's keys ------------------------------------


@dataclass(frozen=True)
class DSASnapshot(LatentSnapshot):
    index_rows: np.ndarray | None = None


class DSACache(LatentCache):
    """The MLA latent cache plus the indexer's key cache: one row of ``index_dim`` values per
    full-indexer layer and position (f32, or fp16 bits like the latent rows). One length for
    both: truncate, snapshot and restore keep them in step."""

    def __init__(self, n_layer: int, n_ctx: int, n_lora_kv: int, n_rot: int, index_layers,
                 index_dim: int, cache_type: str = "f32", zeros=np.zeros):
        super().__init__(n_layer, n_ctx, n_lora_kv, n_rot, cache_type, zeros)
        self.index_layers = tuple(int(i) for i in index_layers)
        if not self.index_layers or index_dim <= 0:
            raise ValueError("a DSA cache needs indexer layers and a positive key length")
        self.index_slot = {il: slot for slot, il in enumerate(self.index_layers)}
        self.index_rows = zeros((len(self.index_layers), n_ctx, index_dim), self.rows.dtype)

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
