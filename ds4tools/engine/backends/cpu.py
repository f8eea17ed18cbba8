"""The CPU backend: the engine's numba kernels on numpy arrays, weights memory-mapped in place."""
from __future__ import annotations

import numpy as np

from .. import kernels
from ..kv_cache import KVCache
from ..latent_cache import DSACache, LatentCache


class CpuBackend:
    name = "cpu"

    # --- buffers: numpy arrays ------------------------------------------------------------------

    @staticmethod
    def empty(shape, dtype=np.float32) -> np.ndarray:
        return np.empty(shape, dtype)

    @staticmethod
    def asarray(a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(a)

    @staticmethod
    def copy_into(dst: np.ndarray, src: np.ndarray) -> None:
        dst[...] = src

    @staticmethod
    def concat_columns(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
        """out (k, n_a + n_b) = [a | b]."""
        out[:, :a.shape[1]] = a
        out[:, a.shape[1]:] = b

    @staticmethod
    def to_host(a: np.ndarray) -> np.ndarray:
        """a as numpy (here: a itself)."""
        return a

    @staticmethod
    def host_copy(a: np.ndarray) -> np.ndarray:
        """A numpy copy of a, which later kernels may overwrite."""
        return a.copy()

    @staticmethod
    def is_c_contiguous(a: np.ndarray) -> bool:
        return a.flags.c_contiguous

    # --- weights: the memory map itself ---------------------------------------------------------

    @staticmethod
    def place_weights(weights):
        return weights

    # --- row operations -------------------------------------------------------------------------

    rmsnorm = staticmethod(kernels.rmsnorm)
    add_bias = staticmethod(kernels.add_bias)
    add_into = staticmethod(kernels.add_into)
    swiglu = staticmethod(kernels.swiglu)
    rope = staticmethod(kernels.rope)
    weighted_sum = staticmethod(kernels.weighted_sum)
    layer_norm = staticmethod(kernels.layer_norm)
    dsa_scores = staticmethod(kernels.dsa_scores)

    @staticmethod
    def rotate_rows(x: np.ndarray, h: np.ndarray) -> None:
        """x (m, d) <- x @ h in place, h symmetric (d x d)."""
        kernels.rotate_rows(x, h, np.empty(x.shape[1], np.float32))

    @staticmethod
    def scale(x: np.ndarray, factor) -> None:
        """x *= factor (a float32), in place."""
        np.multiply(x, factor, out=x)

    # --- attention ------------------------------------------------------------------------------

    @staticmethod
    def kv_cache(n_layer: int, n_kv_head: int, n_ctx: int, head_dim: int,
                 cache_type: str = "f32") -> KVCache:
        return KVCache(n_layer, n_kv_head, n_ctx, head_dim, cache_type)

    @staticmethod
    def latent_cache(n_layer: int, n_ctx: int, n_lora_kv: int, n_rot: int,
                     cache_type: str = "f32", index_layers=(), index_dim: int = 0) -> LatentCache:
        """MLA's latent cache; with ``index_layers`` a DSACache (the DSA indexer's keys too)."""
        if index_layers:
            return DSACache(n_layer, n_ctx, n_lora_kv, n_rot, index_layers, index_dim, cache_type)
        return LatentCache(n_layer, n_ctx, n_lora_kv, n_rot, cache_type)


CPU = CpuBackend()
