"""ggml's 32-element block formats: Q8_0 (and, beside it, Q4_0, Q4_1, Q5_0, Q5_1).

Block-level functions (``*_block``) are plain ``@njit`` functions on one block's floats and
bytes; the CPU kernels call them from ``prange`` loops and the CUDA kernels
(``ds4tools.formats.cuda.legacy``) call the very same functions per thread.
"""
import numpy as np
from gguf import GGMLQuantizationType as T
from numba import njit, prange

from .base import QuantFormat, register
from ._numeric import FP16_TO_FP32, fp16_bits, fp16_to_fp32, fp32_to_fp16, put_fp16, round_away

QK = 32

# --- Q8_0: fp16 d, then 32 x int8; x = d * q --------------------------------------------------


@njit(cache=True)
def q8_0_quantize_block(xb, ob):
    amax = np.float32(0.0)
    for j in range(QK):
        v = abs(xb[j])
        if v > amax:
            amax = v
    d = amax / np.float32(127.0)
    inv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
    put_fp16(ob, 0, fp32_to_fp16(d))
    for j in range(QK):
        ob[2 + j] = np.uint8(round_away(xb[j] * inv) & 0xFF)


@njit(cache=True)
def q8_0_dequantize_block(ib, yb):
    d = fp16_to_fp32(fp16_bits(ib, 0))
    for j in range(QK):
        yb[j] = d * np.float32(np.int8(ib[2 + j]))


@njit(parallel=True, cache=True)
def _q8_0_quantize(x, out):
    # The CPU path restates q8_0_quantize_block in a shape LLVM vectorizes: a 32-trip inner
    # loop gets unrolled into scalar code, a flat loop over the row does not (3x faster).
    # Per-row scratch comes from malloc, not fresh pages. tests/cuda checks both paths agree.
    rows, n = x.shape
    nb = n // QK
    for r in prange(rows):
        xr = x[r]
        inv = np.empty(n, np.float32)
        q = np.empty(n, np.int8)
        for b in range(nb):
            amax = np.float32(0.0)
            for j in range(b * QK, b * QK + QK):
                amax = max(amax, abs(xr[j]))
            d = amax / np.float32(127.0)
            put_fp16(out[r], b * 34, fp32_to_fp16(d))
            inv[b * QK:(b + 1) * QK] = np.float32(1.0) / d if d != 0 else np.float32(0.0)
        for i in range(n):
            v = xr[i] * inv[i]
            t = np.trunc(v)  # C roundf: half away from zero, exact in float32
            q[i] = np.int8(t + np.copysign(np.float32(1.0), v) if abs(v - t) >= np.float32(0.5) else t)
        qb = q.view(np.uint8)
        for b in range(nb):
            out[r, b * 34 + 2:b * 34 + 34] = qb[b * QK:(b + 1) * QK]


@njit(parallel=True, cache=True)
def _q8_0_dequantize(raw, out):
    rows, n = out.shape
    nb = n // QK
    for r in prange(rows):
        for b in range(nb):
            q8_0_dequantize_block(raw[r, b * 34:(b + 1) * 34], out[r, b * QK:(b + 1) * QK])


@njit(parallel=True, fastmath=True, cache=True)
def _q8_0_matmul(raw, lut, x, out):
    n_out = raw.shape[0]
    k, n_in = x.shape
    nb = n_in // QK
    for r in prange(n_out):
        q = np.empty(n_in, np.float32)
        d = np.empty(nb, np.float32)
        for b in range(nb):
            d[b] = lut[np.int64(raw[r, b * 34]) | (np.int64(raw[r, b * 34 + 1]) << 8)]
            for j in range(QK):
                q[b * QK + j] = np.float32(np.int8(raw[r, b * 34 + 2 + j]))
        for t in range(k):
            acc = np.float32(0.0)
            for b in range(nb):
                s = np.float32(0.0)
                for j in range(QK):
                    s += q[b * QK + j] * x[t, b * QK + j]
                acc += d[b] * s
            out[t, r] = acc


@register
class Q8_0(QuantFormat):
    name, ggml_type, block_size, type_size = "Q8_0", T.Q8_0, 32, 34
    uses_imatrix = False  # ggml's quantize_q8_0 ignores importance weights

    def _cpu_quantize(self, x, imatrix):
        out = np.empty((x.shape[0], self.row_bytes(x.shape[1])), np.uint8)
        _q8_0_quantize(x, out)
        return out

    def _cpu_dequantize(self, raw, n_per_row):
        out = np.empty((raw.shape[0], n_per_row), np.float32)
        _q8_0_dequantize(raw, out)
        return out

    def _cpu_matmul(self, raw, x, out):
        _q8_0_matmul(raw, FP16_TO_FP32, x, out)

    def _cuda_quantize(self, x, imatrix):
        from .cuda import legacy as k
        return k.quantize(self, x, imatrix)

    def _cuda_dequantize(self, raw, n_per_row):
        from .cuda import legacy as k
        return k.dequantize(self, raw, n_per_row)
