"""IQ4_NL: 32-element blocks of 4-bit indices into a fixed non-linear table, one fp16 scale.

A block is fp16 ``d`` then 16 bytes: index ``j`` (low nibble) and ``j + 16`` (high nibble)
share a byte; ``x = d * KVALUES[index]``. ggml's quantizer searches 15 candidate scales per
block, choosing each element's table entry by binary search, and keeps the scale with the
best weighted fit (weights: ``x**2``, or the imatrix times ``sqrt(sigma2 + x**2)``).

Block functions (``*_block``) are plain ``@njit`` functions on one block's arrays, shared by
the CPU kernels and the CUDA kernels in ``ds4tools.formats.cuda.iq``.
"""
import math

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants as _gguf_quants
from numba import njit, prange

from .base import QuantFormat, register
from . import _simd
from ._int8dot import IQ4_NL_LEVELS
from .legacy import (INT8_MIN_ROW_FUSED, INT8_MIN_WEIGHTS_FUSED, KIND_IQ4_NL, _matmul_q8,
                     matmul_q8_tiles)
from ._numeric import FP16_TO_FP32, fp16_bits, fp16_to_fp32, fp32_to_fp16, put_fp16

QK = 32
BLOCK_BYTES = 18
#: the 16 non-linear levels, taken from the gguf package (the format's defining table)
KVALUES = np.array(_gguf_quants.IQ4_NL.kvalues, dtype=np.float32)
assert KVALUES.shape == (16,) and (np.diff(KVALUES) > 0).all()
assert tuple(KVALUES) == IQ4_NL_LEVELS  # the int8 path's table

#: decision points between neighbouring levels, and the step from one level to the next
MIDPOINTS = ((KVALUES[:-1].astype(np.float64) + KVALUES[1:]) / 2).astype(np.float32)
STEPS = np.diff(KVALUES).astype(np.float32)
_KVALUES_I8 = KVALUES.astype(np.int8)

_GROUP_MAX_EPS = np.float32(1e-15)
_NTRY = 7
#: candidate scales per block: ggml's first guess, then itry = -7..7
N_CANDIDATES = 2 * _NTRY + 2


@njit(cache=True)
def best_index(mids, x):
    """The level nearest to x, as ggml's best_index_int8 chooses it (a tie goes up).

    ggml binary-searches, then compares the float32 distances to the two neighbours. Counting
    the midpoints at or below x gives the same index for every float32 x: near a midpoint
    (a half-integer of magnitude >= 4.5) both distances are exact, and elsewhere rounding
    cannot reorder them. tests/test_formats_iq.py checks this against a literal binary
    search. Counting has no branches, so it vectorizes."""
    if x != x:
        return 15  # ggml's search: every comparison with a NaN is false, so it ends at the top
    i = 0
    for k in range(15):
        i += 1 if x >= mids[k] else 0
    return i


@njit(cache=True)
def iq4_nl_quantize_block(xb, qw, use_qw, values, mids, steps, ob, weight, cand):
    """One block of 32 floats -> 18 bytes, as ggml's quantize_row_iq4_nl_impl (ntry = 7).

    qw: the block's 32 importance weights (read only when use_qw). Scratch: weight (32,)
    and cand (3, N_CANDIDATES): per candidate scale its inverse, sum w*q*x and sum w*q*q."""
    sigma2 = np.float32(0.0)
    for j in range(QK):
        sigma2 += xb[j] * xb[j]
    sigma2 *= np.float32(0.0625)  # 2 / 32
    if use_qw:
        for j in range(QK):
            weight[j] = qw[j] * np.float32(math.sqrt(sigma2 + xb[j] * xb[j]))
    else:
        for j in range(QK):
            weight[j] = xb[j] * xb[j]
    amax = np.float32(0.0)
    vmax = np.float32(0.0)
    for j in range(QK):
        ax = abs(xb[j])
        if ax > amax:
            amax = ax
            vmax = xb[j]
    d = np.float32(0.0)
    if amax >= _GROUP_MAX_EPS:
        # All candidates at once: lane c accumulates in ggml's order (j = 0..31), and the
        # lanes are independent, so the loop over c vectorizes without reordering any sum.
        nc = cand.shape[1]
        inv = cand[0]
        sqx = cand[1]
        sq2 = cand[2]
        inv[0] = np.float32(1.0) / (-vmax / values[0])
        for c in range(1, nc):
            inv[c] = (np.float32(c - 1 - _NTRY) + values[0]) / vmax
        for c in range(nc):
            sqx[c] = np.float32(0.0)
            sq2[c] = np.float32(0.0)
        for j in range(QK):
            xj = xb[j]
            wj = weight[j]
            for c in range(nc):
                al = inv[c] * xj
                q = values[0]
                for k in range(15):
                    q += steps[k] if al >= mids[k] else np.float32(0.0)
                sqx[c] += wj * q * xj
                sq2[c] += wj * q * q
        d = sqx[0] / sq2[0] if sq2[0] > 0 else np.float32(0.0)
        best = d * sqx[0]
        for c in range(1, nc):
            if sq2[c] > 0 and sqx[c] * sqx[c] > best * sq2[c]:
                d = sqx[c] / sq2[c]
                best = d * sqx[c]
    put_fp16(ob, 0, fp32_to_fp16(d))
    inv_d = np.float32(1.0) / d if d != 0 else np.float32(0.0)
    for j in range(16):
        lo = best_index(mids, inv_d * xb[j])
        hi = best_index(mids, inv_d * xb[j + 16])
        ob[2 + j] = np.uint8(lo | (hi << 4))


@njit(cache=True)
def iq4_nl_dequantize_block(ib, values, yb):
    d = fp16_to_fp32(fp16_bits(ib, 0))
    for j in range(16):
        yb[j] = d * values[ib[2 + j] & 0xF]
        yb[j + 16] = d * values[ib[2 + j] >> 4]


@njit(parallel=True, cache=True)
def _iq4_nl_quantize(x, imatrix, use_qw, values, mids, steps, out):
    rows, n = x.shape
    nb = n // QK
    for r in prange(rows):
        weight = np.empty(QK, np.float32)
        cand = np.empty((3, N_CANDIDATES), np.float32)
        for b in range(nb):
            iq4_nl_quantize_block(x[r, b * QK:(b + 1) * QK], imatrix[b * QK:(b + 1) * QK],
                                  use_qw, values, mids, steps,
                                  out[r, b * BLOCK_BYTES:(b + 1) * BLOCK_BYTES], weight, cand)


@njit(parallel=True, cache=True)
def _iq4_nl_dequantize(raw, lut, values, out):
    rows, n = out.shape
    nb = n // QK
    for r in prange(rows):
        for b in range(nb):
            o = b * BLOCK_BYTES
            d = lut[np.int64(raw[r, o]) | (np.int64(raw[r, o + 1]) << 8)]
            for j in range(16):
                byte = raw[r, o + 2 + j]
                out[r, b * QK + j] = d * values[byte & 0xF]
                out[r, b * QK + 16 + j] = d * values[byte >> 4]


@njit(cache=True)
def _unpack_row(rr, lut, values, q, d):
    """One row of blocks -> its block scales d and its levels q (values[nibble]: float32 for
    the float path, int8 for the int8 path), for the matmuls to reuse across tokens."""
    for b in range(d.shape[0]):
        o = b * BLOCK_BYTES
        d[b] = lut[np.int64(rr[o]) | (np.int64(rr[o + 1]) << 8)]
        for j in range(16):
            byte = rr[o + 2 + j]
            q[b * QK + j] = values[byte & 0xF]
            q[b * QK + 16 + j] = values[byte >> 4]


@njit(parallel=True, fastmath=True, cache=True)
def _iq4_nl_matmul(raw, lut, values_i8, x, out, qk, chunk):
    # qk (= 32) arrives at run time: LLVM then vectorizes the block dot products instead of
    # unrolling them into scalar code. The order of every sum is fixed by the compiled code,
    # the same for each token t, so results do not depend on the batch size. A row's levels
    # are looked up as int8 (_unpack_row_i8: a byte shuffle where the host has one), then
    # widened to float32: the same values as a float table lookup.
    n_out = raw.shape[0]
    k, n_in = x.shape
    nb = n_in // qk
    for c in prange((n_out + chunk - 1) // chunk):
        qi = np.empty(n_in, np.int8)
        q = np.empty(n_in, np.float32)
        d = np.empty(nb, np.float32)
        for r in range(c * chunk, min(n_out, (c + 1) * chunk)):
            _unpack_row_i8(raw[r], lut, values_i8, qi, d)
            for j in range(n_in):
                q[j] = np.float32(qi[j])
            for t in range(k):
                xt = x[t]
                acc = np.float32(0.0)
                for b in range(nb):
                    qb = q[b * qk:(b + 1) * qk]
                    xb = xt[b * qk:(b + 1) * qk]
                    s = np.float32(0.0)
                    for j in range(qk):
                        s += qb[j] * xb[j]
                    acc += d[b] * s
                out[t, r] = acc


# --- int8 activations (ggml's vec_dot_type for IQ4_NL is Q8_0: int8 per 32, fp16 scale) -------
# The levels + 128 are unsigned bytes, as Q8_0's quants + 128 are: the int8 path is Q8_0's
# (legacy.matmul_q8_tiles, kind IQ4_NL), the row unpacked by _int8dot.UNPACK_IQ4_NL (Q4_0's
# nibble unpack, then one byte shuffle per 64 values looking the levels up).


@njit(cache=True)
def _unpack_row_i8(rr, lut, values_i8, q, d):
    """_unpack_row for the float path's levels (int8): one byte shuffle per 16 bytes where the
    host has one (_simd.unpack_nibbles_lut16), then the scales."""
    nb = d.shape[0]
    _simd.unpack_nibbles_lut16(rr, values_i8, q, nb, BLOCK_BYTES, 2)
    for b in range(nb):
        o = b * BLOCK_BYTES
        d[b] = lut[np.int64(rr[o]) | (np.int64(rr[o + 1]) << 8)]


#: output rows per parallel chunk of the float matmul (scratch is allocated once per chunk)
_Q8_CHUNK = 32


@register
class IQ4_NL(QuantFormat):
    name, ggml_type, block_size, type_size = "IQ4_NL", T.IQ4_NL, QK, BLOCK_BYTES
    uses_imatrix = True
    act_type = "Q8_0"
    int8_min_row = INT8_MIN_ROW_FUSED
    int8_min_weights = INT8_MIN_WEIGHTS_FUSED
    #: the int8 path's numba kernel (for the assembly checks)
    q8_kernel = _matmul_q8

    def _cpu_quantize(self, x, imatrix):
        out = np.empty((x.shape[0], self.row_bytes(x.shape[1])), np.uint8)
        use_qw = imatrix is not None
        w = imatrix if use_qw else np.zeros(x.shape[1], np.float32)
        _iq4_nl_quantize(x, w, use_qw, KVALUES, MIDPOINTS, STEPS, out)
        return out

    def _cpu_dequantize(self, raw, n_per_row):
        out = np.empty((raw.shape[0], n_per_row), np.float32)
        _iq4_nl_dequantize(raw, FP16_TO_FP32, KVALUES, out)
        return out

    def _cpu_matmul(self, raw, x, out):
        _iq4_nl_matmul(raw, FP16_TO_FP32, _KVALUES_I8, x, out, QK, _Q8_CHUNK)

    def _cpu_matmul_q8(self, raw, act, out):
        matmul_q8_tiles(KIND_IQ4_NL, raw, act, out)

    def _cuda_quantize(self, x, imatrix):
        from .cuda import iq as k
        return k.quantize_iq4_nl(x, imatrix)

    def _cuda_dequantize(self, raw, n_per_row):
        from .cuda import iq as k
        return k.dequantize_iq4_nl(raw, n_per_row)
