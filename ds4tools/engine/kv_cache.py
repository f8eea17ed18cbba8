"""The key/value cache: preallocated per layer, with a length that moves.

Rows [0, length) are the committed positions. Rolling back (speculative decoding rejecting a
draft) is ``truncate(n)``: only the length moves, the stale rows are overwritten by the next
forward. ``snapshot()`` / ``restore()`` save and bring back the committed rows themselves, for
callers that overwrite positions below the length and may want them back.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..formats._numeric import FP16_TO_FP32
from . import kernels

CACHE_TYPES = ("f32", "f16")


@dataclass(frozen=True)
class KVSnapshot:
    length: int
    k: np.ndarray
    v: np.ndarray


class KVCache:
    """K and V for ``n_layer`` layers: arrays (n_layer, n_kv_head, n_ctx, head_dim), float32 or
    fp16 bit patterns (uint16; numba has no float16 on the CPU)."""

    def __init__(self, n_layer: int, n_kv_head: int, n_ctx: int, head_dim: int,
                 cache_type: str = "f32"):
        if cache_type not in CACHE_TYPES:
            raise ValueError(f"unknown cache type {cache_type!r} (use {' or '.join(CACHE_TYPES)})")
        if min(n_layer, n_kv_head, n_ctx, head_dim) <= 0:
            raise ValueError("KV cache dimensions must be positive")
        dtype = np.float32 if cache_type == "f32" else np.uint16
        shape = (n_layer, n_kv_head, n_ctx, head_dim)
        # np.zeros maps fresh pages lazily: a long context costs memory only once it is used.
        self.k = np.zeros(shape, dtype)
        self.v = np.zeros(shape, dtype)
        self.cache_type = cache_type
        self.n_ctx = n_ctx
        self.length = 0

    @property
    def n_layer(self) -> int:
        return self.k.shape[0]

    def truncate(self, n: int) -> None:
        """Forget positions n and above (O(1): the length moves, nothing is cleared)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {n}")
        self.length = n

    def clear(self) -> None:
        self.length = 0

    def snapshot(self) -> KVSnapshot:
        """A copy of the committed rows and the length."""
        n = self.length
        return KVSnapshot(n, self.k[:, :, :n].copy(), self.v[:, :, :n].copy())

    def restore(self, snap: KVSnapshot) -> None:
        n = snap.length
        if n > self.n_ctx or snap.k.shape[:2] != self.k.shape[:2] or snap.k.dtype != self.k.dtype:
            raise ValueError("snapshot does not fit this cache")
        self.k[:, :, :n] = snap.k
        self.v[:, :, :n] = snap.v
        self.length = n

    def store(self, layer: int, k_rows: np.ndarray, v_rows: np.ndarray, positions: np.ndarray) -> None:
        """Write float32 rows (k, n_kv_head, head_dim) of one layer at ``positions``."""
        store = kernels.store_kv_f32 if self.cache_type == "f32" else kernels.store_kv_f16
        store(self.k[layer], self.v[layer], k_rows, v_rows, positions)

    def attend(self, layer: int, q: np.ndarray, limits: np.ndarray, scale: float, out: np.ndarray) -> None:
        """Attention of q (k, n_head, head_dim) over this layer's rows; row t sees [0, limits[t])."""
        if self.cache_type == "f32":
            kernels.attention_f32(q, self.k[layer], self.v[layer], limits, np.float32(scale), out)
        else:
            kernels.attention_f16(q, self.k[layer], self.v[layer], limits, np.float32(scale), out,
                                  FP16_TO_FP32)
