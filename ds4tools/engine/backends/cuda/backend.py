"""The CUDA backend: weights resident on the GPU in their GGUF block formats (uploaded once, no
dequantized copies), activations, rope tables and the KV cache on the device.

Per forward, token ids, positions and limits go up; logits (and hidden rows a drafter asks
for) come back. Matmuls are the fused float32 kernels of ``matmul.py`` (the CPU's exact path,
not ggml's int8-activation path), the rest the kernels of ``ops.py``.
"""
from __future__ import annotations

from dataclasses import fields, is_dataclass, replace

import numpy as np
from numba import cuda

from ....formats._numeric import FP16_TO_FP32
from ...kv_cache import KVCache, KVSnapshot
from ...latent_cache import DSACache, DSASnapshot, LatentCache, LatentSnapshot
from ...moe import ExpertMatrices
from ...weights import Linear, SharedInput
from .. import BackendUnavailable
from . import matmul, ops


@cuda.jit
def _concat_columns_kernel(a, b, out):
    t, j = cuda.grid(2)
    if t < out.shape[0] and j < out.shape[1]:
        na = a.shape[1]
        out[t, j] = a[t, j] if j < na else b[t, j - na]


def _concat_columns(a, b, out) -> None:
    """out (k, n_a + n_b) = [a | b] for a (k, n_a), b (k, n_b) (a plain copy: exact)."""
    threads = (1, 64)
    blocks = (out.shape[0], (out.shape[1] + threads[1] - 1) // threads[1])
    _concat_columns_kernel[blocks, threads](a, b, out)


class DeviceLinear:
    """A Linear (y = x @ W.T) whose raw GGUF blocks live on the GPU."""

    __slots__ = ("name", "fmt", "n_out", "n_in", "raw", "int8")

    def __init__(self, lin: Linear, raw):
        self.name = lin.name
        self.fmt = lin.fmt
        self.n_out, self.n_in = lin.n_out, lin.n_in
        self.raw = raw
        self.int8 = False  # the float32 path: the only one on this device

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n_out, self.n_in)

    @property
    def nbytes(self) -> int:
        return int(self.raw.nbytes)

    def matmul(self, x, out, int8: bool | None = None):
        """out (k, n_out) = x (k, n_in) @ W.T, device arrays (x may be a SharedInput)."""
        rows = x.x if isinstance(x, SharedInput) else x
        matmul.matmul(self.fmt.name, self.raw, rows, out)
        return out

    def rows(self, ids):
        """Rows ``ids`` of W decoded to float32 (k, n_in), on the device."""
        ids = cuda.to_device(np.ascontiguousarray(np.asarray(ids, np.int64).reshape(-1)))
        out = cuda.device_array((ids.shape[0], self.n_in), np.float32)
        matmul.dequantize_rows(self.fmt.name, self.raw, ids, out)
        return out

    def __repr__(self) -> str:
        return f"<DeviceLinear {self.name} {self.fmt.name} {self.n_out}x{self.n_in}>"


class DeviceExpertMatrices:
    """ExpertMatrices (a mixture of experts' 3-D tensor of one projection) on the GPU: the
    routed (row, slot) pairs each read their expert's matrix (``matmul.expert_matmul``)."""

    __slots__ = ("name", "fmt", "n_expert", "n_out", "n_in", "raw", "int8", "n_used", "reads",
                 "last_read", "kq_kind")

    def __init__(self, m: ExpertMatrices, raw):
        self.name, self.fmt = m.name, m.fmt
        self.n_expert, self.n_out, self.n_in, self.n_used = m.n_expert, m.n_out, m.n_in, m.n_used
        self.raw = raw
        self.int8 = False
        self.kq_kind = None  # the CPU's one-call int8 path does not run here
        self.reads: dict[int, list[int]] = {}
        self.last_read = 0

    # the read counts a benchmark reads (as ExpertMatrices)
    nbytes = ExpertMatrices.nbytes
    expert_nbytes = ExpertMatrices.expert_nbytes
    record = ExpertMatrices.record
    reset_reads = ExpertMatrices.reset_reads
    bytes_per_call = ExpertMatrices.bytes_per_call

    def matmul(self, x, expert_ids: np.ndarray, out, *, record: bool = True, device_ids=None):
        """out[t, j] = x[t] @ W[expert_ids[t, j]].T; x (k, n_in) on the device (or a
        SharedInput), expert_ids numpy (k, n_used), out (k, n_used, n_out) on the device.
        ``device_ids``: the same ids (flat, int64) already on the device: nothing is uploaded."""
        rows = x.x if isinstance(x, SharedInput) else x
        ids = np.ascontiguousarray(expert_ids, np.int64)
        if record:
            self.record(ids.shape[0], int(np.unique(ids).size))
        n_pairs = ids.size
        if device_ids is None:
            device_ids = cuda.to_device(ids.reshape(-1))
        matmul.expert_matmul(self.fmt.name, self.raw, rows, device_ids, ids.shape[1],
                             out.reshape(n_pairs, self.n_out))
        return out


class DeviceKVCache(KVCache):
    """KVCache's interface (length, truncate, snapshot, store, attend) over device arrays."""

    def __init__(self, n_layer: int, n_kv_head: int, n_ctx: int, head_dim: int,
                 cache_type: str = "f32"):
        host = KVCache(1, 1, 1, 1, cache_type)  # validates the type; gives the dtype
        if min(n_layer, n_kv_head, n_ctx, head_dim) <= 0:
            raise ValueError("KV cache dimensions must be positive")
        shape = (n_layer, n_kv_head, n_ctx, head_dim)
        self.k = _zeros(shape, host.k.dtype)
        self.v = _zeros(shape, host.k.dtype)
        self.cache_type = cache_type
        self.n_ctx = n_ctx
        self.length = 0

    def snapshot(self) -> KVSnapshot:
        """A device copy of the cache (all rows: a device array has no strided copies) and
        the length."""
        return KVSnapshot(self.length, _device_copy(self.k), _device_copy(self.v))

    def restore(self, snap: KVSnapshot) -> None:
        if snap.k.shape != self.k.shape or snap.k.dtype != self.k.dtype:
            raise ValueError("snapshot does not fit this cache")
        self.k.copy_to_device(snap.k)
        self.v.copy_to_device(snap.v)
        self.length = snap.length

    def store(self, layer: int, k_rows, v_rows, positions) -> None:
        store = ops.store_kv_f32 if self.cache_type == "f32" else ops.store_kv_f16
        store(self.k[layer], self.v[layer], k_rows, v_rows, positions)

    def attend(self, layer: int, q, limits, scale: float, out) -> None:
        lut = None if self.cache_type == "f32" else CUDA.fp16_table()
        ops.attention(q, self.k[layer], self.v[layer], limits, np.float32(scale), out, lut)


class DeviceLatentCache(LatentCache):
    """LatentCache's interface (MLA's cache: one latent row per layer and position) over a
    device array; attention reads the rows as keys and their first kv_lora_rank columns as
    values (ops.attention on two views of the same rows)."""

    def __init__(self, n_layer: int, n_ctx: int, n_lora_kv: int, n_rot: int,
                 cache_type: str = "f32"):
        super().__init__(n_layer, n_ctx, n_lora_kv, n_rot, cache_type, zeros=_zeros)

    def snapshot(self) -> LatentSnapshot:
        """A device copy of the rows (all of them, as DeviceKVCache) and the length."""
        return LatentSnapshot(self.length, _device_copy(self.rows))

    def restore(self, snap: LatentSnapshot) -> None:
        if snap.rows.shape != self.rows.shape or snap.rows.dtype != self.rows.dtype:
            raise ValueError("snapshot does not fit this cache")
        self.rows.copy_to_device(snap.rows)
        self.length = snap.length

    def store(self, layer: int, latent, positions) -> None:
        ops.store_rows(self.rows[layer], latent, positions)

    def attend(self, layer: int, q, limits, scale: float, out, selected=None) -> None:
        """As LatentCache.attend; ``selected``: None, or (positions, counts) on the device."""
        rows = self.rows[layer]
        keys = rows.reshape(1, *rows.shape)
        lut = None if self.cache_type == "f32" else CUDA.fp16_table()
        positions, counts = (None, limits) if selected is None else selected
        ops.attention(q, keys, keys[:, :, :self.n_lora_kv], counts, np.float32(scale), out, lut,
                      positions)


class DeviceDSACache(DSACache):
    """DSACache's interface (the latent rows plus the DSA indexer's keys, one length) over
    device arrays: DeviceLatentCache's rows and attention, and the keys beside them."""

    def __init__(self, n_layer: int, n_ctx: int, n_lora_kv: int, n_rot: int, index_layers,
                 index_dim: int, cache_type: str = "f32"):
        super().__init__(n_layer, n_ctx, n_lora_kv, n_rot, index_layers, index_dim, cache_type,
                         zeros=_zeros)

    store = DeviceLatentCache.store
    attend = DeviceLatentCache.attend

    def snapshot(self) -> DSASnapshot:
        return DSASnapshot(self.length, _device_copy(self.rows), _device_copy(self.index_rows))

    def restore(self, snap: DSASnapshot) -> None:
        if (not isinstance(snap, DSASnapshot) or snap.rows.shape != self.rows.shape
                or snap.index_rows.shape != self.index_rows.shape
                or snap.rows.dtype != self.rows.dtype):
            raise ValueError("snapshot does not fit this cache")
        self.rows.copy_to_device(snap.rows)
        self.index_rows.copy_to_device(snap.index_rows)
        self.length = snap.length

    def store_index(self, layer: int, keys, positions) -> None:
        ops.store_rows(self.index_rows[self.index_slot[layer]], keys, positions)

    def index_keys(self, layer: int, n: int):
        """The layer's indexer keys of positions [0, n) as float32, on the device."""
        rows = self.index_rows[self.index_slot[layer]]
        if self.cache_type == "f32":
            return rows
        out = cuda.device_array((n, rows.shape[1]), np.float32)
        ops.decode_f16(rows, CUDA.fp16_table(), out)
        return out


class CudaBackend:
    name = "cuda"

    def __init__(self):
        self._fp16_table = None

    def fp16_table(self):
        """fp16 bits -> float32, on the device (uploaded on first use)."""
        if self._fp16_table is None:
            self._fp16_table = cuda.to_device(FP16_TO_FP32)
        return self._fp16_table

    # --- buffers ----------------------------------------------------------------------------------

    @staticmethod
    def empty(shape, dtype=np.float32):
        return cuda.device_array(shape, dtype)

    @staticmethod
    def asarray(a):
        """a numpy array a on the device (a device array is returned as it is)."""
        if not isinstance(a, np.ndarray):
            return a
        return cuda.to_device(np.ascontiguousarray(a))

    @staticmethod
    def copy_into(dst, src) -> None:
        """dst[...] = src, both on the device, of one shape (either may be a strided view)."""
        if dst.is_c_contiguous() and src.is_c_contiguous():
            dst.copy_to_device(src)
        else:
            ops.copy_strided(dst, src)

    concat_columns = staticmethod(_concat_columns)

    @staticmethod
    def to_host(a) -> np.ndarray:
        return a.copy_to_host()

    host_copy = to_host

    @staticmethod
    def is_c_contiguous(a) -> bool:
        return bool(a.is_c_contiguous())

    # --- weights ----------------------------------------------------------------------------------

    def place_weights(self, weights):
        """A copy of ``weights`` (a dataclass of Linears, vectors and lists of layers) with
        every matrix's blocks and every vector on the GPU; matrices sharing their bytes (a
        tied output) share one upload."""
        uploaded: dict = {}

        def place(value):
            if isinstance(value, Linear):
                if value.fmt.name not in matmul.SUPPORTED:
                    raise BackendUnavailable(f"tensor {value.name}: {value.fmt.name} has no CUDA "
                                             f"matmul (CUDA runs {', '.join(matmul.SUPPORTED)})")
                key = (value.raw.__array_interface__["data"][0], value.raw.nbytes)
                if key not in uploaded:
                    uploaded[key] = cuda.to_device(value.raw)
                return DeviceLinear(value, uploaded[key])
            if isinstance(value, ExpertMatrices):
                if value.fmt.name not in matmul.SUPPORTED or value.raw.ndim != 3:
                    raise BackendUnavailable(f"tensor {value.name}: {value.fmt.name} experts have "
                                             f"no CUDA matmul")
                return DeviceExpertMatrices(value, cuda.to_device(value.raw))
            if isinstance(value, np.ndarray):
                return cuda.to_device(np.ascontiguousarray(value))
            if isinstance(value, list):
                return [place(v) for v in value]
            if is_dataclass(value) and not isinstance(value, type):
                return replace(value, **{f.name: place(getattr(value, f.name))
                                         for f in fields(value) if f.init})
            return value

        return place(weights)

    # --- row operations ---------------------------------------------------------------------------

    rmsnorm = staticmethod(ops.rmsnorm)
    add_bias = staticmethod(ops.add_bias)
    add_into = staticmethod(ops.add_into)
    swiglu = staticmethod(ops.swiglu)
    rope = staticmethod(ops.rope)
    weighted_sum = staticmethod(ops.weighted_sum)
    layer_norm = staticmethod(ops.layer_norm)
    rotate_rows = staticmethod(ops.rotate_rows)
    scale = staticmethod(ops.scale)
    dsa_scores = staticmethod(ops.dsa_scores)

    # --- attention --------------------------------------------------------------------------------

    @staticmethod
    def kv_cache(n_layer: int, n_kv_head: int, n_ctx: int, head_dim: int,
                 cache_type: str = "f32") -> DeviceKVCache:
        return DeviceKVCache(n_layer, n_kv_head, n_ctx, head_dim, cache_type)

    @staticmethod
    def latent_cache(n_layer: int, n_ctx: int, n_lora_kv: int, n_rot: int,
                     cache_type: str = "f32", index_layers=(), index_dim: int = 0):
        """A DeviceLatentCache; with ``index_layers`` a DeviceDSACache."""
        if index_layers:
            return DeviceDSACache(n_layer, n_ctx, n_lora_kv, n_rot, index_layers, index_dim,
                                  cache_type)
        return DeviceLatentCache(n_layer, n_ctx, n_lora_kv, n_rot, cache_type)


def _zeros(shape, dtype):
    a = cuda.device_array(shape, dtype)
    a.copy_to_device(np.zeros(shape, dtype))
    return a


def _device_copy(a):
    b = cuda.device_array(a.shape, a.dtype)
    b.copy_to_device(a)
    return b


CUDA = CudaBackend()
