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

from dataclasses import dataclass, field

import numpy as np
from numba import njit, prange

from ._llvm_ir import f32_from_bits, float32_bits
from ._numeric import FP16_TO_FP32
from .floats import f32_bits_to_f16

QK8_0 = 32
QK_K = 256
#: values per Q8_K partial sum (the K-quants' sub-block size)
QK8_K_SUM = 16
KINDS = ("Q8_0", "Q8_K")


@dataclass(frozen=True)
class QuantizedActivations:
    """Rows x (k, n) as int8 blocks: x[t, j] ~= d[t, j // block] * q[t, j].

    ``sums``: per Q8_0 block the sum of its 32 quants, per Q8_K the sums of 16 (ggml's bsums),
    for the formats whose weights carry an offset (Q4_1, Q5_1, Q2_K, Q4_K, Q5_K)."""
    kind: str
    q: np.ndarray      # int8 (k, n)
    d: np.ndarray      # float32 (k, n // block)
    sums: np.ndarray   # int32 (k, n // 32) for Q8_0, (k, n // 16) for Q8_K
    #: the kernels' own layouts of these rows, made once per layout by the matmuls that read
    #: them (q, k, v and gate, up share their input) and kept here: layout key -> arrays
    layouts: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def rows(self) -> int:
        return self.q.shape[0]


_ABS_BITS = np.int32(0x7FFFFFFF)
_INF_BITS = np.int32(0x7F800000)  # |x| bit patterns at or above it: infinities and NaN
_ROUND_MAGIC = np.float32(12582912.0)  # 1.5 * 2**23
#: rows from which a call quantizes its rows in parallel (below, a parallel region costs more
#: than it saves; either way every row runs the same row function)
PARALLEL_ROWS = 8


@njit(cache=True, inline="always", error_model="numpy")
def _round_away(v):
    # C's roundf (half away from zero) in float32: the fraction v - trunc(v) is exact, so ties
    # are seen exactly; the loops around it vectorize
    t = np.trunc(v)
    f = v - t
    if f >= np.float32(0.5):
        t += np.float32(1.0)
    elif f <= np.float32(-0.5):
        t -= np.float32(1.0)
    return np.int32(t)


@njit(cache=True, inline="always", error_model="numpy")
def _nearest_int(v):
    # ggml's nearest_int (round half to even, |v| < 2**22) through the float adder, as ggml does
    return np.int32((float32_bits(v + _ROUND_MAGIC) & np.int32(0x007FFFFF)) - np.int32(0x00400000))


@njit(cache=True, error_model="numpy")
def _q8_0_row(x, q, d, sums, lut):
    # the largest |x| as the max of the bit patterns with the sign cleared (integer lanes;
    # NaN and infinities sort above every finite value)
    for b in range(x.shape[0] // QK8_0):
        j0 = b * QK8_0
        m = np.int32(0)
        for j in range(j0, j0 + QK8_0):
            m = max(m, np.int32(float32_bits(x[j]) & _ABS_BITS))
        if m >= _INF_BITS:  # a NaN scale: the block's products stay NaN
            d[b] = np.float32(np.nan)
            q[j0:j0 + QK8_0] = 0
            sums[b] = 0
            continue
        db = f32_from_bits(np.int32(m)) / np.float32(127.0)
        inv = np.float32(1.0) / db if db != 0 else np.float32(0.0)
        d[b] = lut[f32_bits_to_f16(np.int64(float32_bits(db)))]
        s = np.int32(0)
        for j in range(j0, j0 + QK8_0):
            v = _round_away(x[j] * inv)
            q[j] = v
            s += v
        sums[b] = s


@njit(cache=True, error_model="numpy")
def _q8_k_row(x, q, d, sums):
    n = x.shape[0]
    for b in range(n // QK_K):
        j0 = b * QK_K
        m = np.int32(0)
        for j in range(j0, j0 + QK_K):
            m = max(m, np.int32(float32_bits(x[j]) & _ABS_BITS))
        if m >= _INF_BITS or m == 0:  # NaN / Inf: a NaN scale; all zeros: a zero scale
            d[b] = np.float32(np.nan) if m else np.float32(0.0)
            q[j0:j0 + QK_K] = 0
            continue
        # ggml scales by the first value of largest magnitude: +amax or -amax, whichever
        # comes first (two vectorizable index minima instead of a branchy scan)
        neg = np.int32(m | np.int32(-2147483648))
        first_pos = QK_K
        first_neg = QK_K
        for j in range(j0, j0 + QK_K):
            bits = float32_bits(x[j])
            first_pos = min(first_pos, j - j0 if bits == m else QK_K)
            first_neg = min(first_neg, j - j0 if bits == neg else QK_K)
        amax = f32_from_bits(np.int32(m))
        iscale = np.float32(-127.0) / (amax if first_pos < first_neg else -amax)
        for j in range(j0, j0 + QK_K):
            q[j] = min(np.int32(127), _nearest_int(iscale * x[j]))
        d[b] = np.float32(1.0) / iscale
    for s in range(n // QK8_K_SUM):
        acc = np.int32(0)
        for j in range(s * QK8_K_SUM, (s + 1) * QK8_K_SUM):
            acc += q[j]
        sums[s] = acc


@njit(cache=True, error_model="numpy")
def quantize_q8_0(x, q, d, sums, lut):
    """ggml's quantize_row_q8_0 (scale stored as fp16, so d is the fp16-rounded value; quants
    from the unrounded one, rounded half away from zero) plus each block's quant sum. A block
    holding NaN or an infinity gets a NaN scale (and zero quants)."""
    for t in range(x.shape[0]):
        _q8_0_row(x[t], q[t], d[t], sums[t], lut)


@njit(cache=True, parallel=True, error_model="numpy")
def quantize_q8_0_parallel(x, q, d, sums, lut):
    """quantize_q8_0 with the rows split over the threads."""
    for t in prange(x.shape[0]):
        _q8_0_row(x[t], q[t], d[t], sums[t], lut)


@njit(cache=True, error_model="numpy")
def quantize_q8_k(x, q, d, sums):
    """ggml's quantize_row_q8_K: per 256 values iscale = -127 / (the value of largest
    magnitude), quants nearest_int(iscale * x) capped at 127, d = 1 / iscale, sums of 16. A
    super-block holding NaN or an infinity gets a NaN scale (and zero quants)."""
    for t in range(x.shape[0]):
        _q8_k_row(x[t], q[t], d[t], sums[t])


@njit(cache=True, parallel=True, error_model="numpy")
def quantize_q8_k_parallel(x, q, d, sums):
    """quantize_q8_k with the rows split over the threads."""
    for t in prange(x.shape[0]):
        _q8_k_row(x[t], q[t], d[t], sums[t])


@njit(cache=True)
def quantize_q8_k_rows(x):
    """quantize_activations(x, "Q8_K")'s arrays, for compiled callers: (q, d, sums)."""
    k, n = x.shape
    q = np.empty((k, n), np.int8)
    d = np.empty((k, n // QK_K), np.float32)
    sums = np.empty((k, n // QK8_K_SUM), np.int32)
    if k >= PARALLEL_ROWS:
        quantize_q8_k_parallel(x, q, d, sums)
    else:
        quantize_q8_k(x, q, d, sums)
    return q, d, sums


def quantize_activations(x: np.ndarray, kind: str) -> QuantizedActivations:
    """Quantize float32 rows x (k, n), C-contiguous, to ``kind`` ("Q8_0" or "Q8_K")."""
    k, n = x.shape
    if kind == "Q8_0":
        block, per_sum = QK8_0, QK8_0
    elif kind == "Q8_K":
        block, per_sum = QK_K, QK8_K_SUM
    else:
        raise ValueError(f"unknown activation type {kind!r} (use {', '.join(KINDS)})")
    if n % block:
        raise ValueError(f"row length {n} is not a multiple of {kind}'s block of {block}")
    if kind == "Q8_K":
        return QuantizedActivations(kind, *quantize_q8_k_rows(x))
    q = np.empty((k, n), np.int8)
    d = np.empty((k, n // block), np.float32)
    sums = np.empty((k, n // per_sum), np.int32)
    parallel = k >= PARALLEL_ROWS
    (quantize_q8_0_parallel if parallel else quantize_q8_0)(x, q, d, sums, FP16_TO_FP32)
    return QuantizedActivations(kind, q, d, sums)
