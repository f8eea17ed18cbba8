"""Activations quantized to int8 blocks for the integer matmuls (ggml's vec_dot_type).

ggml multiplies a quantized weight matrix by activations that it first quantizes to int8
blocks of its own: Q8_0 (32 values, one scale) for the 32-element formats and Q8_K (256 values,
one float32 scale, sums of 16) for the K-quants and IQ2_XXS. A NaN or infinity in a block makes
its scale NaN, so corrupt activations stay visible in the results (never rounded into finite
integers). A row is quantized once per matmul
input and then dotted in integers against every weight row; the engine quantizes a normed
hidden state once for all the matrices that read it (q, k, v; gate, up).

Each row is quantized by the same code whatever the number of rows, so a token's quantized
activations, and the products built on them, do not depend on the batch it came in.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from ._numeric import fp16_to_fp32, fp32_to_fp16, nearest_int, round_away

QK8_0 = 32
QK_K = 256
#: values per Q8_K partial sum (the K-quants' sub-block size)
QK8_K_SUM = 16
KINDS = ("Q8_0", "Q8_K")
FLT_MAX = np.float32(3.4028234663852886e38)


@dataclass(frozen=True)
class QuantizedActivations:
    """Rows x (k, n) as int8 blocks: x[t, j] ~= d[t, j // block] * q[t, j].

    ``sums``: per Q8_0 block the sum of its 32 quants, per Q8_K the sums of 16 (ggml's bsums),
    for the formats whose weights carry an offset (Q4_1, Q5_1, Q2_K, Q4_K, Q5_K)."""
    kind: str
    q: np.ndarray      # int8 (k, n)
    d: np.ndarray      # float32 (k, n // block)
    sums: np.ndarray   # int32 (k, n // 32) for Q8_0, (k, n // 16) for Q8_K

    @property
    def rows(self) -> int:
        return self.q.shape[0]


@njit(cache=True, error_model="numpy")
def quantize_q8_0(x, q, d, sums):
    """ggml's quantize_row_q8_0 (scale stored as fp16, so d is the fp16-rounded value; quants
    from the unrounded one, rounded half away from zero) plus each block's quant sum."""
    k, n = x.shape
    for t in range(k):
        for b in range(n // QK8_0):
            amax = np.float32(0.0)
            finite = True
            for j in range(b * QK8_0, b * QK8_0 + QK8_0):
                ax = abs(x[t, j])
                amax = max(amax, ax)
                finite &= ax <= FLT_MAX  # False for NaN and infinities
            db = amax / np.float32(127.0)
            inv = np.float32(1.0) / db if db != 0 else np.float32(0.0)
            d[t, b] = fp16_to_fp32(fp32_to_fp16(db)) if finite else np.float32(np.nan)
            s = 0
            for j in range(b * QK8_0, b * QK8_0 + QK8_0):
                v = round_away(x[t, j] * inv)
                q[t, j] = v
                s += v
            sums[t, b] = s


@njit(cache=True, error_model="numpy")
def quantize_q8_k(x, q, d, sums):
    """ggml's quantize_row_q8_K: per 256 values iscale = -127 / (the value of largest
    magnitude), quants nearest_int(iscale * x) capped at 127, d = 1 / iscale, sums of 16."""
    k, n = x.shape
    for t in range(k):
        for b in range(n // QK_K):
            amax = np.float32(0.0)
            vmax = np.float32(0.0)
            finite = True
            for j in range(b * QK_K, (b + 1) * QK_K):
                ax = abs(x[t, j])
                if ax > amax:
                    amax = ax
                    vmax = x[t, j]
                finite &= ax <= FLT_MAX
            if not finite:
                d[t, b] = np.float32(np.nan)
                for j in range(b * QK_K, (b + 1) * QK_K):
                    q[t, j] = 0
            elif amax == 0:
                d[t, b] = np.float32(0.0)
                for j in range(b * QK_K, (b + 1) * QK_K):
                    q[t, j] = 0
            else:
                iscale = np.float32(-127.0) / vmax
                for j in range(b * QK_K, (b + 1) * QK_K):
                    q[t, j] = min(127, nearest_int(iscale * x[t, j]))
                d[t, b] = np.float32(1.0) / iscale
        for s in range(n // QK8_K_SUM):
            acc = 0
            for j in range(s * QK8_K_SUM, (s + 1) * QK8_K_SUM):
                acc += q[t, j]
            sums[t, s] = acc


def quantize_activations(x: np.ndarray, kind: str) -> QuantizedActivations:
    """Quantize float32 rows x (k, n), C-contiguous, to ``kind`` ("Q8_0" or "Q8_K")."""
    k, n = x.shape
    if kind == "Q8_0":
        block, per_sum, fn = QK8_0, QK8_0, quantize_q8_0
    elif kind == "Q8_K":
        block, per_sum, fn = QK_K, QK8_K_SUM, quantize_q8_k
    else:
        raise ValueError(f"unknown activation type {kind!r} (use {', '.join(KINDS)})")
    if n % block:
        raise ValueError(f"row length {n} is not a multiple of {kind}'s block of {block}")
    q = np.empty((k, n), np.int8)
    d = np.empty((k, n // block), np.float32)
    sums = np.empty((k, n // per_sum), np.int32)
    fn(x, q, d, sums)
    return QuantizedActivations(kind, q, d, sums)
