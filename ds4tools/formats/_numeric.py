"""Scalar helpers shared by every format's kernels.

They are plain ``@njit`` functions on scalars, so the same code serves the CPU kernels, the
CUDA kernels (numba compiles ``@njit`` callees for the device) and the CUDA simulator. Every
rounding rule matches ggml's C reference bit for bit:

* ``fp32_to_fp16``: IEEE round-to-nearest-even, like ``GGML_FP32_TO_FP16``;
* ``nearest_int``: ggml's ``nearest_int`` (the ``+ 12582912.f`` trick), which rounds half to even;
* ``round_away``: C ``roundf`` (half away from zero), used by Q8_0;
* ``fp16_to_fp32``: exact decoding of one fp16 scale.

numba has no float16 on the CPU, so fp16 -> fp32 goes through a 65536-entry table
(``FP16_TO_FP32``) that kernels take as an argument (a global array would be frozen into the
compiled code).
"""
import math

import numpy as np
from numba import njit, prange

#: fp16 bit pattern -> float32 value, for all 65536 patterns.
FP16_TO_FP32 = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)


@njit(cache=True)
def nearest_int(v):
    """ggml's nearest_int: round half to even (valid for |v| < 2**22)."""
    return round(v)


@njit(cache=True)
def round_away(v):
    """C roundf: round half away from zero. Exact for float32 inputs (done in float64)."""
    a = math.floor(abs(float(v)) + 0.5)
    return int(a) if v >= 0 else -int(a)


@njit(cache=True)
def fp32_to_fp16(v):
    """float -> fp16 bit pattern (int in 0..65535), round to nearest even, like ggml."""
    x = float(v)
    sign = 0x8000 if math.copysign(1.0, x) < 0.0 else 0
    if x != x:  # NaN keeps its sign, like ggml
        return sign | 0x7E00
    a = abs(x)
    if a >= 65520.0:
        return sign | 0x7C00
    if a < 6.103515625e-05:  # below 2**-14: subnormal fp16, a multiple of 2**-24
        return sign | round(a * 16777216.0)
    m, e = math.frexp(a)  # a = m * 2**e, m in [0.5, 1)
    frac = round((m * 2.0 - 1.0) * 1024.0)  # a carry to 1024 bumps the exponent, as it should
    return sign | (((e + 14) << 10) + frac)


@njit(cache=True)
def fp16_to_fp32(h):
    """fp16 bit pattern -> float32, exactly. Block functions use this for their few scales
    (kernels that decode whole fp16 tensors use the FP16_TO_FP32 table instead)."""
    e = (h >> 10) & 0x1F
    m = h & 0x3FF
    if e == 0:
        v = math.ldexp(float(m), -24)
    elif e == 31:
        v = math.inf if m == 0 else math.nan
    else:
        v = math.ldexp(float(1024 + m), e - 25)
    return np.float32(-v if h & 0x8000 else v)


@njit(cache=True)
def fp16_bits(raw, off):
    """Little-endian fp16 bit pattern stored at raw[off], raw[off+1]."""
    return np.int64(raw[off]) | (np.int64(raw[off + 1]) << 8)


@njit(cache=True)
def put_fp16(raw, off, bits):
    raw[off] = bits & 0xFF
    raw[off + 1] = (bits >> 8) & 0xFF


@njit(parallel=True, cache=True)
def nonfinite_rows(bits):
    """Per row of float32 data viewed as uint32, whether it holds a NaN or an Inf.

    Integer max of the exponent fields: one vectorized pass, no temporary arrays."""
    rows, n = bits.shape
    bad = np.zeros(rows, np.bool_)
    for r in prange(rows):
        top = np.uint32(0)
        for i in range(n):
            top = max(top, bits[r, i] & np.uint32(0x7F800000))
        bad[r] = top == np.uint32(0x7F800000)
    return bad
