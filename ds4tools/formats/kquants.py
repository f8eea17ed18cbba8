"""ggml's K-quants: Q2_K, Q3_K, Q4_K, Q5_K and Q6_K (256-element super-blocks).

Each super-block holds 16 sub-blocks of 16 (Q2_K, Q3_K, Q6_K) or 8 of 32 (Q4_K, Q5_K) with
their own quantized scales (and mins). Without an imatrix ggml runs quantize_row_q*_K_ref; with
one, quantize_row_q*_K_impl (Q6_K's impl uses the weights as they are, the others scale them
by sqrt(sigma2 + x^2) with sigma2 from the super-block). The per-super-block functions below
are plain ``@njit`` functions shared by the CPU kernels (``prange`` over rows) and the CUDA
kernels (``ds4tools.formats.cuda.kquants``, one thread per super-block); the scale searches
live in ``_search``.

``quantize_row`` is the entry point for both: the CPU hands it a whole row, a CUDA thread one
super-block. It searches all sub-blocks of what it is given at once (one SIMD lane per
sub-block, see ``_search``), then finishes super-block by super-block (sub-scales, fp16
scales, final quants, packing). Scratch sizes depend on the row length: ``int_scratch(n)``,
``float_scratch(n)``. Decoding: the CUDA kernels call ``dequantize_block``; the CPU runs flat
loop nests (``_decode_*``) that vectorize; tests check both against each other and gguf-py.

Where ggml re-reads its rounded fp16 scales before computing the final quants, so do we
(``_f16(ob, off)``): Q2_K and Q3_K..Q6_K all requantize from the stored fp16 d (and dmin).
"""
import math

import numpy as np
from gguf import GGMLQuantizationType as T
from numba import njit, prange

from .base import QuantFormat, register
from ._int8dot import (DOT_K_4x1_AFF, DOT_K_4x1_PAIR, DOT_K_4x1_SYM, DOT_K_4x2_AFF, DOT_K_4x2_PAIR,
                       DOT_K_4x2_SYM, FUSED_K1S_Q2_K, FUSED_K1S_Q3_K, FUSED_K1S_Q4_K,
                       FUSED_K1S_Q5_K, FUSED_K1S_Q6_K, FUSED_K1_Q2_K,
                       FUSED_K1_Q3_K, FUSED_K1_Q4_K, FUSED_K1_Q5_K, FUSED_K1_Q6_K, FUSED_K2_Q2_K,
                       FUSED_K2_Q3_K, FUSED_K2_Q4_K, FUSED_K2_Q5_K, FUSED_K2_Q6_K, FUSED_K3_Q2_K,
                       FUSED_K3_Q3_K, FUSED_K3_Q4_K, FUSED_K3_Q5_K, FUSED_K3_Q6_K, FUSED_K4_Q2_K,
                       FUSED_K4_Q3_K, FUSED_K4_Q4_K, FUSED_K4_Q5_K, FUSED_K4_Q6_K, FUSED_K8_Q2_K,
                       FUSED_K8_Q3_K, FUSED_K8_Q4_K, FUSED_K8_Q5_K, FUSED_K8_Q6_K, K_AFFINE,
                       K_PAIRED,
                       KPAIR_BYTES, K_FUSED_ROWS, K_SHORT_ROW_BYTES, K_SHORT_ROWS, K_TILE_ROWS,
                       KSUM, KSUM_STORE_4x4, UNPACK_K_Q2_K, UNPACK_K_Q3_K, UNPACK_K_Q4_K,
                       UNPACK_K_Q5_K, UNPACK_K_Q6_K)
from ._kquant_avx2 import (NATURAL_K1_Q2_K, NATURAL_K1_Q3_K, NATURAL_K1_Q4_K, NATURAL_K1_Q5_K,
                           NATURAL_K1_Q6_K, NATURAL_K2_Q2_K, NATURAL_K2_Q3_K, NATURAL_K2_Q4_K,
                           NATURAL_K2_Q5_K, NATURAL_K2_Q6_K)
from ._llvm_ir import avx2_without_vnni
from .activations import quantize_q8_k_rows
from ._numeric import FP16_TO_FP32, fp16_bits, fp16_to_fp32, put_fp16
from ._search import (GROUP_MAX_EPS, LANE_WORK, SCRATCH, affine_search_groups, as_int8,
                      from_lanes, make_qp_quants, make_qx_quants, nearest_int, q3_search_lanes,
                      symmetric_search_groups, to_fp16, to_lanes)

QK_K = 256
KIND = {"Q2_K": 0, "Q3_K": 1, "Q4_K": 2, "Q5_K": 3, "Q6_K": 4}
TYPE_SIZE = (84, 110, 144, 176, 210)


@njit(cache=True)
def int_scratch(n):
    """int32 scratch values quantize_row needs for a row of n values."""
    return 2 * n + 32


@njit(cache=True)
def float_scratch(n):
    """float32 scratch values quantize_row needs for a row of n values."""
    return 3 * n + (3 + LANE_WORK) * (n // 16) + SCRATCH


@njit(cache=True)
def _f16(ob, off):
    """The fp16 value stored at ob[off] as float32 (ggml's GGML_FP16_TO_FP32(y->d))."""
    return fp16_to_fp32(fp16_bits(ob, off))


@njit(cache=True)
def _sum_squares(xb, n):
    s = np.float32(0.0)
    for i in range(n):
        s += xb[i] * xb[i]
    return s


@njit(cache=True)
def _importance(x, qw, sigma2, wts, n):
    for i in range(n):
        wts[i] = qw[i] * np.float32(math.sqrt(sigma2 + x[i] * x[i]))


@njit(cache=True)
def _pack_2bit(L, ob, off):
    # 4 quants of 2 bits per byte: elements l, l+32, l+64, l+96 of each half
    for h in range(2):
        for l in range(32):
            j = 128 * h + l
            ob[off + 32 * h + l] = (L[j] | (L[j + 32] << 2) | (L[j + 64] << 4) | (L[j + 96] << 6)) & 0xFF


@njit(cache=True)
def _put_scale_min_k4(ob, off, j, ls, lm):
    # 8 six-bit scales and mins in 12 bytes (ggml's get_scale_min_k4 reads them back)
    if j < 4:
        ob[off + j] = ls & 0xFF
        ob[off + j + 4] = lm & 0xFF
    else:
        ob[off + j + 4] = ((ls & 0xF) | ((lm & 0xF) << 4)) & 0xFF
        ob[off + j - 4] = (ob[off + j - 4] | ((ls >> 4) << 6)) & 0xFF
        ob[off + j] = (ob[off + j] | ((lm >> 4) << 6)) & 0xFF


@njit(cache=True)
def get_scale_min_k4(j, q, off):
    if j < 4:
        return np.int64(q[off + j]) & 63, np.int64(q[off + j + 4]) & 63
    d = (np.int64(q[off + j + 4]) & 0xF) | ((np.int64(q[off + j - 4]) >> 6) << 4)
    m = (np.int64(q[off + j + 4]) >> 4) | ((np.int64(q[off + j]) >> 6) << 4)
    return d, m


@njit(cache=True)
def _q3_scale(ob, off, j):
    # sub-block j's signed 6-bit scale from Q3_K's 12 packed bytes
    lo = (np.int64(ob[off + j]) & 0xF) if j < 8 else (np.int64(ob[off + j - 8]) >> 4)
    return (lo | (((np.int64(ob[off + 8 + j % 4]) >> (2 * (j // 4))) & 3) << 4)) - 32


@njit(cache=True)
def _requantize_affine(xb, ob, L, nsub, size, nmax, d_all, m_all, scales_off):
    # Final quants from the stored fp16 d, dmin and 6-bit scales/mins (Q4_K, Q5_K)
    for j in range(nsub):
        sc, m = get_scale_min_k4(j, ob, scales_off)
        d = d_all * np.float32(sc)
        if d == 0:
            continue
        dm = m_all * np.float32(m)
        for ii in range(size):
            L[size * j + ii] = max(0, min(nmax, nearest_int((xb[size * j + ii] + dm) / d)))


# --- Q2_K: scales[16] (4-bit scale | 4-bit min << 4), qs[64], fp16 d, fp16 dmin ------------


@njit(cache=True, error_model="numpy")
def _q2_k_finish(xb, scales, mins, sw, weighted, L, ob, Ls, Lm, search):
    # One super-block from its 16 sub-block scales and mins (and quants L, kept where a
    # sub-block's stored scale is zero): 4-bit sub-scales, fp16 d and dmin, final quants.
    if weighted:
        dm = make_qp_quants(16, 15, scales, Ls, sw, search)
        mm = make_qp_quants(16, 15, mins, Lm, sw, search)
        put_fp16(ob, 80, to_fp16(dm))
        put_fp16(ob, 82, to_fp16(mm))
        for j in range(16):
            ob[j] = (Ls[j] | (Lm[j] << 4)) & 0xFF
    else:
        max_scale = np.float32(0.0)
        max_min = np.float32(0.0)
        for j in range(16):
            if scales[j] > max_scale:
                max_scale = scales[j]
            if mins[j] > max_min:
                max_min = mins[j]
        q4scale = np.float32(15.0)
        if max_scale > 0:
            iscale = q4scale / max_scale
            for j in range(16):
                ob[j] = nearest_int(iscale * scales[j]) & 0xFF
            put_fp16(ob, 80, to_fp16(max_scale / q4scale))
        else:
            for j in range(16):
                ob[j] = 0
            put_fp16(ob, 80, 0)
        if max_min > 0:
            iscale = q4scale / max_min
            for j in range(16):
                ob[j] = (ob[j] | (nearest_int(iscale * mins[j]) << 4)) & 0xFF
            put_fp16(ob, 82, to_fp16(max_min / q4scale))
        else:
            put_fp16(ob, 82, 0)
    d_all = _f16(ob, 80)
    m_all = _f16(ob, 82)
    for j in range(16):
        d = d_all * np.float32(ob[j] & 0xF)
        if d == 0:
            continue
        m = m_all * np.float32(ob[j] >> 4)
        for ii in range(16):
            L[16 * j + ii] = max(0, min(3, nearest_int((xb[16 * j + ii] + m) / d)))
    _pack_2bit(L, ob, 16)


@njit(cache=True, error_model="numpy")
def _affine_row(kind, x, qw, weighted, o, iw, fw):
    # Q2_K (kind 0), Q4_K (2), Q5_K (3) for a row of super-blocks: weights, then one search
    # over all sub-blocks of the row (lanes), then each super-block's scales and quants.
    n = x.shape[0]
    size = 16 if kind == 0 else 32
    ng = n // size
    per = QK_K // size
    ts = TYPE_SIZE[kind]
    L = iw[0:n]
    tL = iw[n:2 * n]
    Ls = iw[2 * n:2 * n + 16]
    Lm = iw[2 * n + 16:2 * n + 32]
    w = fw[0:n]
    tx = fw[n:2 * n]
    tw = fw[2 * n:3 * n]
    f = 3 * n
    scales = fw[f:f + ng]
    mins = fw[f + ng:f + 2 * ng]
    sw = fw[f + 2 * ng:f + 3 * ng]
    work = fw[f + 3 * ng:f + (3 + LANE_WORK) * ng]
    f += (3 + LANE_WORK) * (n // 16)
    search = fw[f:f + SCRATCH]
    for sb in range(n // QK_K):
        lo = sb * QK_K
        xs = x[lo:lo + QK_K]
        ws = w[lo:lo + QK_K]
        if weighted:
            if kind == 0:
                sigma2 = _sum_squares(xs, QK_K) / np.float32(QK_K)
            else:
                sigma2 = np.float32(2.0) * _sum_squares(xs, QK_K) / np.float32(QK_K)
            _importance(xs, qw[lo:lo + QK_K], sigma2, ws, QK_K)
            for j in range(per):
                s = np.float32(0.0)
                for l in range(size):
                    s += ws[size * j + l]
                sw[sb * per + j] = s
        elif kind == 0:
            for i in range(QK_K):
                ws[i] = abs(xs[i])
        else:
            for j in range(per):
                av_x = np.float32(math.sqrt(_sum_squares(xs[32 * j:32 * j + 32], 32) / np.float32(32.0)))
                for l in range(32):
                    ws[32 * j + l] = av_x + abs(xs[32 * j + l])
    nmax = 3 if kind == 0 else (15 if kind == 2 else 31)
    if weighted:
        affine_search_groups(ng, size, nmax, x, w, L, np.float32(-0.9), np.float32(0.05), 36, False,
                             True, scales, mins, tx, tw, tL, work)
    elif kind == 0:
        affine_search_groups(ng, 16, 3, x, w, L, np.float32(-0.5), np.float32(0.1), 15, True,
                             False, scales, mins, tx, tw, tL, work)
    elif kind == 2:
        affine_search_groups(ng, 32, 15, x, w, L, np.float32(-1.0), np.float32(0.1), 20, False,
                             False, scales, mins, tx, tw, tL, work)
    else:
        affine_search_groups(ng, 32, 31, x, w, L, np.float32(-0.5), np.float32(0.1), 15, False,
                             False, scales, mins, tx, tw, tL, work)
    for sb in range(n // QK_K):
        lo = sb * QK_K
        g = sb * per
        if kind == 0:
            _q2_k_finish(x[lo:lo + QK_K], scales[g:g + per], mins[g:g + per], sw[g:g + per], weighted,
                         L[lo:lo + QK_K], o[sb * ts:(sb + 1) * ts], Ls, Lm, search)
        else:
            _q45_k_finish(nmax, x[lo:lo + QK_K], scales[g:g + per], mins[g:g + per], sw[g:g + per],
                          weighted, L[lo:lo + QK_K], o[sb * ts:(sb + 1) * ts], Ls, Lm, search)


@njit(cache=True)
def q2_k_dequantize_block(ib, yb):
    d = _f16(ib, 80)
    dmin = _f16(ib, 82)
    for e in range(QK_K):
        sc = np.int64(ib[e // 16])
        q = (np.int64(ib[16 + 32 * (e // 128) + e % 32]) >> (2 * ((e % 128) // 32))) & 3
        yb[e] = d * np.float32(sc & 0xF) * np.float32(q) - dmin * np.float32(sc >> 4)


# --- Q3_K: hmask[32], qs[64], scales[12] (16 x 6 bits, offset 32), fp16 d ------------------


@njit(cache=True)
def _put_q3_scale(ob, off, j, l):
    # sub-block j's 6-bit scale code l (0..63) into Q3_K's 12 bytes (zeroed beforehand)
    if j < 8:
        ob[off + j] = l & 0xF
    else:
        ob[off + j - 8] |= (l & 0xF) << 4
    ob[off + j % 4 + 8] |= (l >> 4) << (2 * (j // 4))


@njit(cache=True, error_model="numpy")
def _q3_k_finish(xb, scales, sw, weighted, L, ob, Ls, search):
    # One super-block from its 16 sub-block scales (and quants L, kept where a sub-block's
    # stored scale is zero): 6-bit sub-scales, fp16 d, final quants, high-bit mask.
    for k in range(12):
        ob[96 + k] = 0
    if weighted:
        d_block = make_qx_quants(16, 32, scales, Ls, sw, search)
        for j in range(16):
            _put_q3_scale(ob, 96, j, Ls[j])
        put_fp16(ob, 108, to_fp16(d_block))
    else:
        max_scale = np.float32(0.0)
        amax = np.float32(0.0)
        for j in range(16):
            if abs(scales[j]) > amax:
                amax = abs(scales[j])
                max_scale = scales[j]
        if max_scale != 0:
            iscale = np.float32(-32.0) / max_scale
            for j in range(16):
                _put_q3_scale(ob, 96, j, max(-32, min(31, as_int8(nearest_int(iscale * scales[j])))) + 32)
            put_fp16(ob, 108, to_fp16(np.float32(1.0) / iscale))
        else:
            put_fp16(ob, 108, 0)
    d_all = _f16(ob, 108)
    for j in range(16):
        d = d_all * np.float32(_q3_scale(ob, 96, j))
        if d == 0:
            continue
        for ii in range(16):
            L[16 * j + ii] = max(-4, min(3, nearest_int(xb[16 * j + ii] / d))) + 4
    for m in range(32):  # the high bit of element j goes to bit j // 32 of hmask[j % 32]
        bits = 0
        for k in range(8):
            bits |= (L[32 * k + m] >> 2) << k
            L[32 * k + m] &= 3
        ob[m] = bits
    _pack_2bit(L, ob, 32)


@njit(cache=True, error_model="numpy")
def _q3_q6_row(kind, x, qw, weighted, o, iw, fw):
    # Q3_K (kind 1) and Q6_K (4) for a row: one search over all 16-value sub-blocks (lanes),
    # then each super-block's scales and quants.
    n = x.shape[0]
    ng = n // 16
    ts = TYPE_SIZE[kind]
    L = iw[0:n]
    tL = iw[n:2 * n]
    Ls = iw[2 * n:2 * n + 16]
    w = fw[0:n]
    tx = fw[n:2 * n]
    tw = fw[2 * n:3 * n]
    f = 3 * n
    scales = fw[f:f + ng]
    sw = fw[f + ng:f + 2 * ng]
    work = fw[f + 3 * ng:f + (3 + LANE_WORK) * ng]
    f += (3 + LANE_WORK) * ng
    search = fw[f:f + SCRATCH]
    if kind == 4:
        for i in range(n):
            w[i] = qw[i] if weighted else x[i] * x[i]
        symmetric_search_groups(ng, 16, 32, x, w, L, scales, tx, tw, tL, work)
    elif weighted:
        for sb in range(n // QK_K):
            lo = sb * QK_K
            xs = x[lo:lo + QK_K]
            sigma2 = np.float32(2.0) * _sum_squares(xs, QK_K) / np.float32(QK_K)
            _importance(xs, qw[lo:lo + QK_K], sigma2, w[lo:lo + QK_K], QK_K)
            for j in range(16):
                s = np.float32(0.0)
                for l in range(16):
                    s += w[lo + 16 * j + l]
                sw[sb * 16 + j] = s
        symmetric_search_groups(ng, 16, 4, x, w, L, scales, tx, tw, tL, work)
    else:
        to_lanes(ng, 16, x, tx)
        q3_search_lanes(ng, 16, 4, tx, tL, scales, work)
        from_lanes(ng, 16, tL, L)
    for sb in range(n // QK_K):
        lo = sb * QK_K
        if kind == 1:
            _q3_k_finish(x[lo:lo + QK_K], scales[16 * sb:16 * sb + 16], sw[16 * sb:16 * sb + 16],
                         weighted, L[lo:lo + QK_K], o[sb * ts:(sb + 1) * ts], Ls, search)
        else:
            _q6_k_finish(x[lo:lo + QK_K], scales[16 * sb:16 * sb + 16], L[lo:lo + QK_K],
                         o[sb * ts:(sb + 1) * ts])


@njit(cache=True)
def q3_k_dequantize_block(ib, yb):
    d_all = _f16(ib, 108)
    for e in range(QK_K):
        dl = d_all * np.float32(_q3_scale(ib, 96, e // 16))
        q = (np.int64(ib[32 + 32 * (e // 128) + e % 32]) >> (2 * ((e % 128) // 32))) & 3
        if not (np.int64(ib[e % 32]) >> (e // 32)) & 1:
            q -= 4
        yb[e] = dl * np.float32(q)


# --- Q4_K / Q5_K: fp16 d, fp16 dmin, scales[12] (8 x 6-bit scale and min), [qh[32]], qs[128] --


@njit(cache=True, error_model="numpy")
def _q45_k_finish(nmax, xb, scales, mins, sw, weighted, L, ob, Ls, Lm, search):
    # One Q4_K (nmax 15) or Q5_K (nmax 31) super-block from its 8 sub-block scales and mins.
    if weighted:
        d_block = make_qp_quants(8, 63, scales, Ls, sw, search)
        m_block = make_qp_quants(8, 63, mins, Lm, sw, search)
        for j in range(8):
            ls = Ls[j]
            lm = Lm[j]
            if nmax == 31:  # Q5_K's impl clamps, Q4_K's does not
                ls = min(63, ls)
                lm = min(63, lm)
            _put_scale_min_k4(ob, 4, j, ls, lm)
        put_fp16(ob, 0, to_fp16(d_block))
        put_fp16(ob, 2, to_fp16(m_block))
    else:
        max_scale = np.float32(0.0)
        max_min = np.float32(0.0)
        for j in range(8):
            if scales[j] > max_scale:
                max_scale = scales[j]
            if mins[j] > max_min:
                max_min = mins[j]
        inv_scale = np.float32(63.0) / max_scale if max_scale > 0 else np.float32(0.0)
        inv_min = np.float32(63.0) / max_min if max_min > 0 else np.float32(0.0)
        for j in range(8):
            ls = min(63, nearest_int(inv_scale * scales[j]) & 0xFF)
            lm = min(63, nearest_int(inv_min * mins[j]) & 0xFF)
            _put_scale_min_k4(ob, 4, j, ls, lm)
        put_fp16(ob, 0, to_fp16(max_scale / np.float32(63.0)))
        put_fp16(ob, 2, to_fp16(max_min / np.float32(63.0)))
    _requantize_affine(xb, ob, L, 8, 32, nmax, _f16(ob, 0), _f16(ob, 2), 4)
    if nmax == 15:
        for h in range(4):
            for l in range(32):
                ob[16 + 32 * h + l] = (L[64 * h + l] | (L[64 * h + l + 32] << 4)) & 0xFF
    else:
        for k in range(32):
            ob[16 + k] = 0
        for h in range(4):
            for l in range(32):
                l1 = L[64 * h + l]
                l2 = L[64 * h + l + 32]
                if l1 > 15:
                    l1 -= 16
                    ob[16 + l] |= 1 << (2 * h)
                if l2 > 15:
                    l2 -= 16
                    ob[16 + l] |= 2 << (2 * h)
                ob[48 + 32 * h + l] = (l1 | (l2 << 4)) & 0xFF


@njit(cache=True)
def _q45_k_dequantize_block(five, ib, yb):
    d = _f16(ib, 0)
    dmin = _f16(ib, 2)
    qs = 48 if five else 16
    for j in range(8):
        sc, m = get_scale_min_k4(j, ib, 4)
        d1 = d * np.float32(sc)
        m1 = dmin * np.float32(m)
        shift = 4 * (j % 2)
        for l in range(32):
            q = (np.int64(ib[qs + 32 * (j // 2) + l]) >> shift) & 0xF
            if five and (np.int64(ib[16 + l]) >> j) & 1:
                q += 16
            yb[32 * j + l] = d1 * np.float32(q) - m1


@njit(cache=True)
def q4_k_dequantize_block(ib, yb):
    _q45_k_dequantize_block(False, ib, yb)


@njit(cache=True)
def q5_k_dequantize_block(ib, yb):
    _q45_k_dequantize_block(True, ib, yb)


# --- Q6_K: ql[128], qh[64], int8 scales[16], fp16 d -----------------------------------------


@njit(cache=True, error_model="numpy")
def _q6_k_finish(xb, scales, L, ob):
    # One super-block from its 16 sub-block scales: int8 sub-scales, fp16 d, final quants.
    max_scale = np.float32(0.0)
    max_abs = np.float32(0.0)
    for j in range(16):
        if abs(scales[j]) > max_abs:
            max_abs = abs(scales[j])
            max_scale = scales[j]
    if max_abs < GROUP_MAX_EPS:
        for k in range(210):
            ob[k] = 0
        return
    iscale = np.float32(-128.0) / max_scale
    put_fp16(ob, 208, to_fp16(np.float32(1.0) / iscale))
    for j in range(16):
        ob[192 + j] = min(127, nearest_int(iscale * scales[j])) & 0xFF
    d_all = _f16(ob, 208)
    for j in range(16):
        d = d_all * np.float32(as_int8(np.int64(ob[192 + j])))
        if d == 0:
            continue
        for ii in range(16):
            L[16 * j + ii] = max(-32, min(31, nearest_int(xb[16 * j + ii] / d))) + 32
    for h in range(2):
        for l in range(32):
            j = 128 * h + l
            ob[64 * h + l] = ((L[j] & 0xF) | ((L[j + 64] & 0xF) << 4)) & 0xFF
            ob[64 * h + l + 32] = ((L[j + 32] & 0xF) | ((L[j + 96] & 0xF) << 4)) & 0xFF
            ob[128 + 32 * h + l] = ((L[j] >> 4) | ((L[j + 32] >> 4) << 2) | ((L[j + 64] >> 4) << 4)
                                    | ((L[j + 96] >> 4) << 6)) & 0xFF


@njit(cache=True)
def q6_k_dequantize_block(ib, yb):
    d = _f16(ib, 208)
    for e in range(QK_K):
        h = e // 128
        quarter = (e % 128) // 32
        l = e % 32
        ql = np.int64(ib[64 * h + l + 32 * (quarter & 1)])
        lo = (ql >> (4 * (quarter >> 1))) & 0xF
        hi = (np.int64(ib[128 + 32 * h + l]) >> (2 * quarter)) & 3
        q = (lo | (hi << 4)) - 32
        yb[e] = d * np.float32(as_int8(np.int64(ib[192 + e // 16]))) * np.float32(q)


# --- dispatch by kind ------------------------------------------------------------------------


@njit(cache=True, error_model="numpy")
def quantize_row(kind, x, qw, weighted, o, iw, fw):
    """A row of super-blocks (x: float32[n], n a multiple of 256) of the K-quant ``kind`` (see
    KIND) into ``o`` (uint8[n / 256 * type_size]); ``weighted`` selects ggml's imatrix path
    with importance weights ``qw`` (float32[n], ignored otherwise). ``iw``, ``fw``: scratch
    of int_scratch(n) int32 and float_scratch(n) float32 values."""
    if kind == 1 or kind == 4:
        _q3_q6_row(kind, x, qw, weighted, o, iw, fw)
    else:
        _affine_row(kind, x, qw, weighted, o, iw, fw)


@njit(cache=True)
def dequantize_block(kind, ib, yb):
    """One super-block of the K-quant ``kind`` to 256 floats, as ggml's dequantize_row_*."""
    if kind == 0:
        q2_k_dequantize_block(ib, yb)
    elif kind == 1:
        q3_k_dequantize_block(ib, yb)
    elif kind == 2:
        q4_k_dequantize_block(ib, yb)
    elif kind == 3:
        q5_k_dequantize_block(ib, yb)
    else:
        q6_k_dequantize_block(ib, yb)


# --- CPU kernels -------------------------------------------------------------------------------


@njit(parallel=True, cache=True, error_model="numpy")
def _quantize(kind, x, qw, weighted, out):
    rows, n = x.shape
    for r in prange(rows):
        iw = np.empty(int_scratch(n), np.int32)
        fw = np.empty(float_scratch(n), np.float32)
        quantize_row(kind, x[r], qw, weighted, out[r], iw, fw)


@njit(cache=True)
def _lut16(lut, rr, off):
    return lut[np.int64(rr[off]) | (np.int64(rr[off + 1]) << 8)]


@njit(cache=True)
def _decode_q2_k(rr, lut, y):
    for sb in range(y.shape[0] // QK_K):
        o = sb * 84
        d = _lut16(lut, rr, o + 80)
        dmin = _lut16(lut, rr, o + 82)
        for h in range(2):
            for half in range(2):
                # byte qs[32h + 16half + l] holds values 128h + 32jj + 16half + l, jj = 0..3
                s = o + 8 * h + half
                c0, c1, c2, c3 = np.int32(rr[s]), np.int32(rr[s + 2]), np.int32(rr[s + 4]), np.int32(rr[s + 6])
                d0, d1, d2, d3 = (d * np.float32(c0 & 0xF), d * np.float32(c1 & 0xF),
                                  d * np.float32(c2 & 0xF), d * np.float32(c3 & 0xF))
                m0, m1, m2, m3 = (dmin * np.float32(c0 >> 4), dmin * np.float32(c1 >> 4),
                                  dmin * np.float32(c2 >> 4), dmin * np.float32(c3 >> 4))
                qo = o + 16 + 32 * h + 16 * half
                yo = sb * QK_K + 128 * h + 16 * half
                for l in range(16):
                    v = np.int32(rr[qo + l])
                    y[yo + l] = d0 * np.float32(v & 3) - m0
                    y[yo + 32 + l] = d1 * np.float32((v >> 2) & 3) - m1
                    y[yo + 64 + l] = d2 * np.float32((v >> 4) & 3) - m2
                    y[yo + 96 + l] = d3 * np.float32(v >> 6) - m3


@njit(cache=True)
def _decode_q3_k(rr, lut, y):
    for sb in range(y.shape[0] // QK_K):
        o = sb * 110
        d_all = _lut16(lut, rr, o + 108)
        for h in range(2):
            for half in range(2):
                j = 8 * h + half  # scale of values 128h + 32jj + 16half + l is j + 2jj
                d0 = d_all * np.float32(_q3_scale(rr, o + 96, j))
                d1 = d_all * np.float32(_q3_scale(rr, o + 96, j + 2))
                d2 = d_all * np.float32(_q3_scale(rr, o + 96, j + 4))
                d3 = d_all * np.float32(_q3_scale(rr, o + 96, j + 6))
                qo = o + 32 + 32 * h + 16 * half
                mo = o + 16 * half
                yo = sb * QK_K + 128 * h + 16 * half
                for l in range(16):
                    v = np.int32(rr[qo + l])
                    hm = np.int32(rr[mo + l]) >> (4 * h)  # high bits: bit 4h + jj of hmask
                    y[yo + l] = d0 * np.float32((v & 3) - 4 + 4 * (hm & 1))
                    y[yo + 32 + l] = d1 * np.float32(((v >> 2) & 3) - 4 + 2 * (hm & 2))
                    y[yo + 64 + l] = d2 * np.float32(((v >> 4) & 3) - 4 + (hm & 4))
                    y[yo + 96 + l] = d3 * np.float32((v >> 6) - 4 + ((hm & 8) >> 1))


@njit(cache=True)
def _decode_q45_k(five, rr, lut, y):
    ts = 176 if five else 144
    qs = 48 if five else 16
    for sb in range(y.shape[0] // QK_K):
        o = sb * ts
        d = _lut16(lut, rr, o)
        dmin = _lut16(lut, rr, o + 2)
        for h in range(4):
            sc, m = get_scale_min_k4(2 * h, rr, o + 4)
            d1 = d * np.float32(sc)
            m1 = dmin * np.float32(m)
            sc, m = get_scale_min_k4(2 * h + 1, rr, o + 4)
            d2 = d * np.float32(sc)
            m2 = dmin * np.float32(m)
            qo = o + qs + 32 * h
            yo = sb * QK_K + 64 * h
            if five:
                for l in range(32):
                    v = np.int32(rr[qo + l])
                    hb = np.int32(rr[o + 16 + l]) >> (2 * h)
                    y[yo + l] = d1 * np.float32((v & 0xF) | ((hb & 1) << 4)) - m1
                    y[yo + 32 + l] = d2 * np.float32((v >> 4) | ((hb & 2) << 3)) - m2
            else:
                for l in range(32):
                    v = np.int32(rr[qo + l])
                    y[yo + l] = d1 * np.float32(v & 0xF) - m1
                    y[yo + 32 + l] = d2 * np.float32(v >> 4) - m2


@njit(cache=True)
def _decode_q6_k(rr, lut, y):
    for sb in range(y.shape[0] // QK_K):
        o = sb * 210
        d = _lut16(lut, rr, o + 208)
        for h in range(2):
            for half in range(2):
                # scales of the four 32-value quarters for this 16-value half
                s0 = d * np.float32(as_int8(np.int64(rr[o + 192 + 8 * h + half])))
                s1 = d * np.float32(as_int8(np.int64(rr[o + 192 + 8 * h + 2 + half])))
                s2 = d * np.float32(as_int8(np.int64(rr[o + 192 + 8 * h + 4 + half])))
                s3 = d * np.float32(as_int8(np.int64(rr[o + 192 + 8 * h + 6 + half])))
                yo = sb * QK_K + 128 * h + 16 * half
                for l in range(16 * half, 16 * half + 16):
                    a = np.int32(rr[o + 64 * h + l])
                    b = np.int32(rr[o + 64 * h + 32 + l])
                    c = np.int32(rr[o + 128 + 32 * h + l])
                    k = l - 16 * half
                    y[yo + k] = s0 * np.float32(((a & 0xF) | ((c & 3) << 4)) - 32)
                    y[yo + 32 + k] = s1 * np.float32(((b & 0xF) | (((c >> 2) & 3) << 4)) - 32)
                    y[yo + 64 + k] = s2 * np.float32(((a >> 4) | (((c >> 4) & 3) << 4)) - 32)
                    y[yo + 96 + k] = s3 * np.float32(((b >> 4) | (((c >> 6) & 3) << 4)) - 32)


@njit(cache=True)
def _decode_row(kind, rr, lut, y):
    # One row of super-blocks to floats, bit-identical to dequantize_block but in plain loop
    # nests LLVM vectorizes (several times faster than the block functions on the CPU). Each
    # inner loop writes four outputs per step: with less work per step, LLVM unrolls 16-step
    # loops into scalar code instead of vectorizing them (2.5-4x slower).
    if kind == 0:
        _decode_q2_k(rr, lut, y)
    elif kind == 1:
        _decode_q3_k(rr, lut, y)
    elif kind == 2:
        _decode_q45_k(False, rr, lut, y)
    elif kind == 3:
        _decode_q45_k(True, rr, lut, y)
    else:
        _decode_q6_k(rr, lut, y)


@njit(parallel=True, cache=True)
def _dequantize(kind, raw, lut, out):
    for r in prange(raw.shape[0]):
        _decode_row(kind, raw[r], lut, out[r])


@njit(parallel=True, fastmath=True, cache=True)
def _matmul(kind, raw, lut, x, out):
    n_out = raw.shape[0]
    k, n_in = x.shape
    for r in prange(n_out):
        w = np.empty(n_in, np.float32)
        _decode_row(kind, raw[r], lut, w)
        for t in range(k):
            acc = np.float32(0.0)
            for i in range(n_in):
                acc += w[i] * x[t, i]
            out[t, r] = acc


# --- int8 activations (ggml's vec_dot_type for the K-quants is Q8_K) -------------------------
# As ggml's vec_dot_q*_K_q8_K: per sub-block an exact integer dot of the weights' quants with the
# activations' int8, then the scales; here the scales are applied in float per sub-block of 16,
# lane-wise (16 sub-blocks = one super-block = one vector operation), not in int32 per
# super-block. _int8dot's K section has the layout and the IR: a weight row's super-block is
# unpacked (UNPACK_K_* / _emit_unpack_sb: per 64 quants a word permutation, a per-lane shift or
# rotate and a mask) into 4 chunks of bytes, lane i = sub-block i, with per lane the float scale
# dw = d * sc and the offset m = -dmin * min (Q2_K, Q4_K, Q5_K) or corr = -128 * sum(q) (Q3_K,
# Q6_K, whose activations come as x + 128); the activations are put in the same layout once per
# call with dx per super-block and dx * bsum per sub-block (_prep_act_k). Then per (row, token)
# and super-block: 4 vpdpbusd into 16 int32 lanes (starting at 0, or at corr), acc =
# fma(float(isum), dw * dx, acc) [, acc = fma(m, dx * bsum, acc)], and a fixed tree over the
# lanes at the end: the same float sequence whatever the path below, k or the thread split
# (bit-identical results).
# Q4_K and Q5_K scale sub-blocks of 32, so a group is two super-blocks (K_PAIRED: the K pair
# layout, lane i = sub-block i % 8 of super-block i // 8, 8 chunks; _emit_unpack_pair,
# _prep_act_k_pair): 8 vpdpbusd, then the same 3 float operations for 512 values instead of 256
# (the tiles measured 20% faster). An odd last super-block leaves the pair's second half zero.
# * k <= 8 (decode, short drafts and verifies): FUSED_K{k}_* unpack K_FUSED_ROWS rows (one:
#   one ascending stream per thread) super-block by super-block in registers and dot them with
#   up to 4 tokens at once, no scratch (5 to 8 tokens: the 8-token kernels).
# * k >= 9: 4 rows at a time are unpacked whole into a task's scratch (once for all the tokens),
#   then the tokens go in blocks of _QK_TOKEN_BLOCK (their 16-lane accumulators stay in L1) and
#   the K tiles (4 rows x 2 tokens, 4 x 1 for an odd last token; 4 x 1 for every token where
#   TWO_TOKEN_TILES is off) run over each block one run of
#   _QK_RUN_GROUPS super-blocks at a time (the run's unpacked weights stay in L1; half as many
#   pair groups).
# Rows go in fours (the last row repeated to fill a tile; its copies are not written).
_QK_ROWS_PER_TASK = 16  # weight rows per prange task (scratch allocated once per task)
#: tokens per block and super-blocks per run (measured on 1024x2816 and 2816x1024 at k = 32,
#: 128 and 512, 1 thread: blocks of 16-64 tokens and runs of 4-64 are within 5%; without token
#: blocks, runs sized so all the tokens' activations fit 64 KiB lost 10-25% at k >= 128)
_QK_TOKEN_BLOCK = 32
#: up to this many tokens the fused kernels run (see above): 5 to 8 in one pass of the 8-token
#: kernels (on the AVX-512 VNNI host 1.25-1.8x faster than two passes, 4 tokens and the rest,
#: over blocks of 4 rows in L1; with AVX2 code 1.2-1.4x)
_QK_FUSED_TOKENS = 8
_QK_RUN_GROUPS = 16
#: more tokens (up to TILES_FROM) in passes of _QK_FUSED_TOKENS through the fused kernels
#: instead of the tiles, where the CPU has AVX2 but not AVX-512 VNNI: there the 8-token kernels
#: cost less per token than the tiles for batches of a few blocks (AVX2 code on the Xeon of
#: docs/engine.md, 2816x1024 from L3, 2 threads, k = 16 / 32: Q4_K 0.83 / 0.94x the 4 x 2
#: tiles' time, Q6_K 0.84 / 0.94x). Each task's rows stay in L1 / L2 for its passes.
FUSED_PASSES = avx2_without_vnni()
#: up to this many tokens (a prefill's batches take more): from there the tiles, unpacked once
#: for all the tokens, cost less per token than the 8-token kernels' unpacking per pass (AVX2
#: code, 2816x1024 from L3, 2 threads, the 4 x 1 tiles' time over the passes' at k = 32 / 64 /
#: 256: Q4_K 0.96 / 0.84 / 0.80, Q5_K 0.91 / 0.80 / 0.70, Q6_K 0.96 / 0.87 / 0.83, Q3_K
#: 1.06 / 0.97 / 0.89, Q2_K 1.07 / 0.95 / 0.94)
TILES_FROM = 64
#: whether the K tiles take two tokens at once (4 rows x 2 tokens): not where FUSED_PASSES
#: holds, as 8 accumulators of 16 lanes fill AVX2's 16 registers and spill (4 x 1 tiles at
#: k = 256: 0.84-0.91x the time of 4 x 2 over the five K-quants)
TWO_TOKEN_TILES = not FUSED_PASSES


def _fused(k: int) -> bool:
    """Whether k tokens go through the fused kernels (up to _QK_FUSED_TOKENS; more in passes
    of that many where FUSED_PASSES holds, below TILES_FROM), else through the tiles."""
    return k <= _QK_FUSED_TOKENS or (FUSED_PASSES and k < TILES_FROM)


@njit(cache=True)
def _unpack_row_k(kind, rr, lut, w, dw, m, corr, nsb):
    if kind == 0:
        UNPACK_K_Q2_K(rr, lut, w, dw, m, corr, nsb)
    elif kind == 1:
        UNPACK_K_Q3_K(rr, lut, w, dw, m, corr, nsb)
    elif kind == 2:
        UNPACK_K_Q4_K(rr, lut, w, dw, m, corr, nsb)
    elif kind == 3:
        UNPACK_K_Q5_K(rr, lut, w, dw, m, corr, nsb)
    else:
        UNPACK_K_Q6_K(rr, lut, w, dw, m, corr, nsb)


@njit(cache=True, error_model="numpy")
def _prep_act_k(q, d, sums, shift, xq, dx, dxs):
    # Q8_K activations into the K group layout (value 16i + 4c + e of super-block g at byte
    # 256g + 64c + 4i + e) as bytes q + shift (0 or 128), d per super-block, d * bsum per
    # sub-block of 16 (affine formats: dxs has n / 16 columns, else it is not written).
    k, n = q.shape
    for t in range(k):
        for g in range(n // QK_K):
            dx[t, g] = d[t, g]
            for i in range(16):
                for c in range(4):
                    for e in range(4):
                        xq[t, QK_K * g + 64 * c + 4 * i + e] = (np.int32(q[t, QK_K * g + 16 * i + 4 * c + e])
                                                                + shift) & 0xFF
                if dxs.shape[1] > 1:
                    dxs[t, 16 * g + i] = d[t, g] * np.float32(sums[t, 16 * g + i])


@njit(cache=True, error_model="numpy")
def _prep_scales_k_pair(d, sums, dx, dxs):
    # Q8_K scales for the Q4_K / Q5_K kernels: d on its super-block's 8 lanes of the pair group
    # in dx and d * (the sub-block of 32's sum) in dxs, an odd last super-block's half zeros
    k, nsb = d.shape
    for t in range(k):
        if nsb % 2:
            dx[t, 16 * (nsb // 2) + 8:] = 0
            dxs[t, 16 * (nsb // 2) + 8:] = 0
        for g in range(nsb):
            lane = 16 * (g // 2) + 8 * (g % 2)
            for j in range(8):
                dx[t, lane + j] = d[t, g]
                dxs[t, lane + j] = d[t, g] * np.float32(np.int32(sums[t, 16 * g + 2 * j])
                                                        + np.int32(sums[t, 16 * g + 2 * j + 1]))


@njit(cache=True, error_model="numpy")
def _prep_dxs(d, sums, dxs):
    # d * bsum per sub-block of 16 (the affine formats' offsets), as _prep_act_k writes it
    k, nsb = d.shape
    for t in range(k):
        for g in range(nsb):
            for i in range(16):
                dxs[t, 16 * g + i] = d[t, g] * np.float32(sums[t, 16 * g + i])


@njit(cache=True, error_model="numpy")
def _prep_act_k_pair(q, d, sums, xq, dx, dxs, grouped):
    # Q8_K activations for Q4_K / Q5_K: dx, dxs as _prep_scales_k_pair; xq in the K pair layout
    # (value 32j + 4c + e of super-block 2p + s at byte 512p + 64c + 4(8s + j) + e) for the
    # tiles, or with ``grouped`` in the K group layout of _prep_act_k (the fused kernels of few
    # tokens add a pair's sums from it).
    k, n = q.shape
    nsb = n // QK_K
    _prep_scales_k_pair(d, sums, dx, dxs)
    for t in range(k):
        if nsb % 2 and not grouped:
            xq[t, KPAIR_BYTES * (nsb // 2):] = 0
        for g in range(nsb):
            if grouped:
                for i in range(16):
                    for c in range(4):
                        for e in range(4):
                            xq[t, QK_K * g + 64 * c + 4 * i + e] = np.uint8(
                                q[t, QK_K * g + 16 * i + 4 * c + e] & 0xFF)
            else:
                o = KPAIR_BYTES * (g // 2) + 32 * (g % 2)
                for j in range(8):
                    for c in range(8):
                        for e in range(4):
                            xq[t, o + 64 * c + 4 * j + e] = np.uint8(q[t, QK_K * g + 32 * j + 4 * c + e]
                                                                     & 0xFF)


@njit(cache=True, inline="always")
def _put_k(v, k, R, s, r, r1, out):
    # a fused call's R * k values (rows outer) into out[s:s + k, r..], rows before r1 only
    for i in range(min(R, r1 - r)):
        for t in range(k):
            out[s + t, r + i] = v[k * i + t]


@njit(cache=True)
def _fused_k_span1(kind, raw, lut, xq, dx, dxs, s, r0, r1, out):
    n = raw.shape[0]
    if kind == 0:
        for r in range(r0, r1, K_FUSED_ROWS):
            _put_k(FUSED_K1_Q2_K(raw, lut, xq, dx, dxs, s, r, n), 1, K_FUSED_ROWS, s, r, r1, out)
    elif kind == 1:
        for r in range(r0, r1, K_FUSED_ROWS):
            _put_k(FUSED_K1_Q3_K(raw, lut, xq, dx, dxs, s, r, n), 1, K_FUSED_ROWS, s, r, r1, out)
    elif kind == 2:
        for r in range(r0, r1, K_FUSED_ROWS):
            _put_k(FUSED_K1_Q4_K(raw, lut, xq, dx, dxs, s, r, n), 1, K_FUSED_ROWS, s, r, r1, out)
    elif kind == 3:
        for r in range(r0, r1, K_FUSED_ROWS):
            _put_k(FUSED_K1_Q5_K(raw, lut, xq, dx, dxs, s, r, n), 1, K_FUSED_ROWS, s, r, r1, out)
    else:
        for r in range(r0, r1, K_FUSED_ROWS):
            _put_k(FUSED_K1_Q6_K(raw, lut, xq, dx, dxs, s, r, n), 1, K_FUSED_ROWS, s, r, r1, out)


@njit(cache=True)
def _fused_k_span1s(kind, raw, lut, xq, dx, dxs, s, r0, r1, out):
    n = raw.shape[0]
    if kind == 0:
        for r in range(r0, r1, K_SHORT_ROWS):
            _put_k(FUSED_K1S_Q2_K(raw, lut, xq, dx, dxs, s, r, n), 1, K_SHORT_ROWS, s, r, r1, out)
    elif kind == 1:
        for r in range(r0, r1, K_SHORT_ROWS):
            _put_k(FUSED_K1S_Q3_K(raw, lut, xq, dx, dxs, s, r, n), 1, K_SHORT_ROWS, s, r, r1, out)
    elif kind == 2:
        for r in range(r0, r1, K_SHORT_ROWS):
            _put_k(FUSED_K1S_Q4_K(raw, lut, xq, dx, dxs, s, r, n), 1, K_SHORT_ROWS, s, r, r1, out)
    elif kind == 3:
        for r in range(r0, r1, K_SHORT_ROWS):
            _put_k(FUSED_K1S_Q5_K(raw, lut, xq, dx, dxs, s, r, n), 1, K_SHORT_ROWS, s, r, r1, out)
    else:
        for r in range(r0, r1, K_SHORT_ROWS):
            _put_k(FUSED_K1S_Q6_K(raw, lut, xq, dx, dxs, s, r, n), 1, K_SHORT_ROWS, s, r, r1, out)


@njit(cache=True)
def _fused_k_span2(kind, raw, lut, xq, dx, dxs, s, r0, r1, out):
    n = raw.shape[0]
    if kind == 0:
        for r in range(r0, r1, K_FUSED_ROWS):
            _put_k(FUSED_K2_Q2_K(raw, lut, xq, dx, dxs, s, r, n), 2, K_FUSED_ROWS, s, r, r1, out)
    elif kind == 1:
        for r in range(r0, r1, K_FUSED_ROWS):
            _put_k(FUSED_K2_Q3_K(raw, lut, xq, dx, dxs, s, r, n), 2, K_FUSED_ROWS, s, r, r1, out)
    elif kind == 2:
        for r in range(r0, r1, K_FUSED_ROWS):
            _put_k(FUSED_K2_Q4_K(raw, lut, xq, dx, dxs, s, r, n), 2, K_FUSED_ROWS, s, r, r1, out)
    elif kind == 3:
        for r in range(r0, r1, K_FUSED_ROWS):
            _put_k(FUSED_K2_Q5_K(raw, lut, xq, dx, dxs, s, r, n), 2, K_FUSED_ROWS, s, r, r1, out)
    else:
        for r in range(r0, r1, K_FUSED_ROWS):
            _put_k(FUSED_K2_Q6_K(raw, lut, xq, dx, dxs, s, r, n), 2, K_FUSED_ROWS, s, r, r1, out)


@njit(cache=True)
def _fused_k_span3(kind, raw, lut, xq, dx, dxs, s, r0, r1, out):
    n = raw.shape[0]
    if kind == 0:
        for r in range(r0, r1, K_FUSED_ROWS):
            _put_k(FUSED_K3_Q2_K(raw, lut, xq, dx, dxs, s, r, n), 3, K_FUSED_ROWS, s, r, r1, out)
    elif kind == 1:
        for r in range(r0, r1, K_FUSED_ROWS):
            _put_k(FUSED_K3_Q3_K(raw, lut, xq, dx, dxs, s, r, n), 3, K_FUSED_ROWS, s, r, r1, out)
    elif kind == 2:
        for r in range(r0, r1, K_FUSED_ROWS):
            _put_k(FUSED_K3_Q4_K(raw, lut, xq, dx, dxs, s, r, n), 3, K_FUSED_ROWS, s, r, r1, out)
    elif kind == 3:
        for r in range(r0, r1, K_FUSED_ROWS):
            _put_k(FUSED_K3_Q5_K(raw, lut, xq, dx, dxs, s, r, n), 3, K_FUSED_ROWS, s, r, r1, out)
    else:
        for r in range(r0, r1, K_FUSED_ROWS):
            _put_k(FUSED_K3_Q6_K(raw, lut, xq, dx, dxs, s, r, n), 3, K_FUSED_ROWS, s, r, r1, out)


@njit(cache=True)
def _fused_k_span4(kind, raw, lut, xq, dx, dxs, s, r0, r1, out):
    n = raw.shape[0]
    if kind == 0:
        for r in range(r0, r1, K_FUSED_ROWS):
            _put_k(FUSED_K4_Q2_K(raw, lut, xq, dx, dxs, s, r, n), 4, K_FUSED_ROWS, s, r, r1, out)
    elif kind == 1:
        for r in range(r0, r1, K_FUSED_ROWS):
            _put_k(FUSED_K4_Q3_K(raw, lut, xq, dx, dxs, s, r, n), 4, K_FUSED_ROWS, s, r, r1, out)
    elif kind == 2:
        for r in range(r0, r1, K_FUSED_ROWS):
            _put_k(FUSED_K4_Q4_K(raw, lut, xq, dx, dxs, s, r, n), 4, K_FUSED_ROWS, s, r, r1, out)
    elif kind == 3:
        for r in range(r0, r1, K_FUSED_ROWS):
            _put_k(FUSED_K4_Q5_K(raw, lut, xq, dx, dxs, s, r, n), 4, K_FUSED_ROWS, s, r, r1, out)
    else:
        for r in range(r0, r1, K_FUSED_ROWS):
            _put_k(FUSED_K4_Q6_K(raw, lut, xq, dx, dxs, s, r, n), 4, K_FUSED_ROWS, s, r, r1, out)


@njit(cache=True)
def _put_k8(v, k, s, r, out):
    # the first k of a FUSED_K8 call's 8 values (one row) into out[s:s + k, r]
    for t in range(k):
        out[s + t, r] = v[t]


@njit(cache=True)
def _fused_k_span8(kind, raw, lut, xq, dx, dxs, s, k, r0, r1, out):
    # tokens s..s+k-1 (5 <= k <= 8) of _fused_k_span, one row per call
    n = raw.shape[0]
    if kind == 0:
        for r in range(r0, r1):
            _put_k8(FUSED_K8_Q2_K(raw, lut, xq, dx, dxs, s, r, n), k, s, r, out)
    elif kind == 1:
        for r in range(r0, r1):
            _put_k8(FUSED_K8_Q3_K(raw, lut, xq, dx, dxs, s, r, n), k, s, r, out)
    elif kind == 2:
        for r in range(r0, r1):
            _put_k8(FUSED_K8_Q4_K(raw, lut, xq, dx, dxs, s, r, n), k, s, r, out)
    elif kind == 3:
        for r in range(r0, r1):
            _put_k8(FUSED_K8_Q5_K(raw, lut, xq, dx, dxs, s, r, n), k, s, r, out)
    else:
        for r in range(r0, r1):
            _put_k8(FUSED_K8_Q6_K(raw, lut, xq, dx, dxs, s, r, n), k, s, r, out)


@njit(cache=True)
def _fused_k_span_few(kind, raw, lut, xq, dx, dxs, s, k, r0, r1, out):
    # tokens s..s+k-1 (k <= 4) of _fused_k_span
    if k == 1 and raw.shape[1] < K_SHORT_ROW_BYTES:
        _fused_k_span1s(kind, raw, lut, xq, dx, dxs, s, r0, r1, out)
    elif k == 1:
        _fused_k_span1(kind, raw, lut, xq, dx, dxs, s, r0, r1, out)
    elif k == 2:
        _fused_k_span2(kind, raw, lut, xq, dx, dxs, s, r0, r1, out)
    elif k == 3:
        _fused_k_span3(kind, raw, lut, xq, dx, dxs, s, r0, r1, out)
    else:
        _fused_k_span4(kind, raw, lut, xq, dx, dxs, s, r0, r1, out)


@njit(cache=True)
def _fused_k_span(kind, raw, lut, xq, dx, dxs, s, k, r0, r1, out):
    """out[s + t, r] for tokens s..s+k-1 (k <= 8) and rows r0..r1-1: one fused call per
    K_FUSED_ROWS rows, each row unpacked once for up to 4 tokens; one token over short rows
    (under K_SHORT_ROW_BYTES) K_SHORT_ROWS rows per call. The kind and k are chosen once per
    span, so each loop runs one kernel, whose setup LLVM hoists out of it (as legacy's
    _fused_span). 5 to 8 tokens take the 8-token kernels (FUSED_K8_*), the tokens past the
    last read as the last and dropped."""
    if k <= 4:
        _fused_k_span_few(kind, raw, lut, xq, dx, dxs, s, k, r0, r1, out)
    else:
        _fused_k_span8(kind, raw, lut, xq, dx, dxs, s, k, r0, r1, out)


@njit(cache=True)
def _natural_span(kind, raw, lut, x, sums, dx, dxs, r0, r1, out):
    """out[:, r] for rows r0..r1-1 with _kquant_avx2's kernels, K_FUSED_ROWS rows x 2 tokens per
    call (1 for an odd last token), the kind chosen once per span (see _fused_k_span)."""
    n = raw.shape[0]
    k = x.shape[0]
    R = K_FUSED_ROWS
    if kind == 0:
        for r in range(r0, r1, R):
            for t in range(0, k - 1, 2):
                _put_k(NATURAL_K2_Q2_K(raw, lut, x, sums, dx, dxs, t, r, n), 2, R, t, r, r1, out)
            if k % 2:
                _put_k(NATURAL_K1_Q2_K(raw, lut, x, sums, dx, dxs, k - 1, r, n), 1, R, k - 1, r,
                       r1, out)
    elif kind == 1:
        for r in range(r0, r1, R):
            for t in range(0, k - 1, 2):
                _put_k(NATURAL_K2_Q3_K(raw, lut, x, sums, dx, dxs, t, r, n), 2, R, t, r, r1, out)
            if k % 2:
                _put_k(NATURAL_K1_Q3_K(raw, lut, x, sums, dx, dxs, k - 1, r, n), 1, R, k - 1, r,
                       r1, out)
    elif kind == 2:
        for r in range(r0, r1, R):
            for t in range(0, k - 1, 2):
                _put_k(NATURAL_K2_Q4_K(raw, lut, x, sums, dx, dxs, t, r, n), 2, R, t, r, r1, out)
            if k % 2:
                _put_k(NATURAL_K1_Q4_K(raw, lut, x, sums, dx, dxs, k - 1, r, n), 1, R, k - 1, r,
                       r1, out)
    elif kind == 3:
        for r in range(r0, r1, R):
            for t in range(0, k - 1, 2):
                _put_k(NATURAL_K2_Q5_K(raw, lut, x, sums, dx, dxs, t, r, n), 2, R, t, r, r1, out)
            if k % 2:
                _put_k(NATURAL_K1_Q5_K(raw, lut, x, sums, dx, dxs, k - 1, r, n), 1, R, k - 1, r,
                       r1, out)
    else:
        for r in range(r0, r1, R):
            for t in range(0, k - 1, 2):
                _put_k(NATURAL_K2_Q6_K(raw, lut, x, sums, dx, dxs, t, r, n), 2, R, t, r, r1, out)
            if k % 2:
                _put_k(NATURAL_K1_Q6_K(raw, lut, x, sums, dx, dxs, k - 1, r, n), 1, R, k - 1, r,
                       r1, out)


@njit(parallel=True, cache=True, error_model="numpy")
def _matmul_q8_k_natural(kind, raw, lut, x, d, sums, out):
    """out[t, r] for a few tokens (k <= NATURAL_TOKENS[kind]) with _kquant_avx2's kernels
    (quants in their stored order; the same bits as _matmul_q8_kg): K_FUSED_ROWS rows x 2
    tokens per call (1 for an odd last token), the rows in L1 for the next pair,
    _QK_ROWS_PER_TASK rows per task."""
    n_out = raw.shape[0]
    k, n = x.shape
    # dx, dxs as the group kernels take them (one call: a decoding step makes hundreds)
    if K_PAIRED[kind]:
        n_pairs = (n // QK_K + 1) // 2
        dx = np.empty((k, 16 * n_pairs), np.float32)
        dxs = np.empty((k, 16 * n_pairs), np.float32)
        _prep_scales_k_pair(d, sums, dx, dxs)
    else:
        dx = d
        dxs = np.empty((k, n // 16 if K_AFFINE[kind] else 1), np.float32)
        if K_AFFINE[kind]:
            _prep_dxs(d, sums, dxs)
    per = _QK_ROWS_PER_TASK  # a multiple of K_FUSED_ROWS
    for c in prange((n_out + per - 1) // per):
        _natural_span(kind, raw, lut, x, sums, dx, dxs, c * per, min(n_out, c * per + per), out)


#: a few tokens take _kquant_avx2's kernels where the CPU has AVX2 but not AVX-512 VNNI (with
#: VNNI the group layout costs one word permutation per chunk and one vpdpbusd per 64 bytes, and
#: stays faster); tests switch it to compare both
NATURAL_FEW = avx2_without_vnni()
#: up to how many tokens, per kind (Zen 3, 1 and 2 threads, 2816x1024 / 1024x2816 from L3:
#: 1.1-2.3x the group-layout kernels at k = 1; at k = 2 and 4 Q4_K's 0.86-0.92x, where its
#: sums of 32 cost one reduction network per token, the others 1.0-1.6x). Since the group
#: kernels add int16 sums on AVX2 (_int8dot._dot_chunks) they win from 3 tokens on for Q2_K,
#: Q3_K and Q6_K too (AVX2 code on the Xeon of docs/engine.md, 900M-parameter models streamed
#: from memory, 2 threads, the natural kernels' time over theirs at k = 3 / 4: Q2_K 1.3 / 1.4,
#: Q3_K 1.3 / 1.35, Q6_K 1.1-1.15 / 1.15-1.25; at k = 2 within 5% either way)
NATURAL_TOKENS = (2, 2, 1, 1, 2)


@njit(parallel=True, cache=True, error_model="numpy")
def _matmul_q8_kg(kind, raw, lut, xq, dx, dxs, out, run, tb, fused, two):
    """out[t, r] = the int8-activation dot of K-quant weight row r and activation row t (from
    _layout_k): with ``fused`` (_fused(k)) by the fused kernels, in passes of _QK_FUSED_TOKENS
    tokens, else by _int8dot's K tiles on blocks of ``tb`` tokens, ``run`` super-blocks at a
    time (see above), of two tokens at once if ``two``."""
    n_out = raw.shape[0]
    k, n_in = xq.shape  # the activation layout: pairs for Q4_K, Q5_K tiles (fused: groups)
    ts = TYPE_SIZE[kind]
    nsb = raw.shape[1] // ts
    affine = kind == 0 or kind == 2 or kind == 3
    paired = kind == 2 or kind == 3
    n_groups = (nsb + 1) // 2 if paired else nsb
    if paired:  # a group is twice the bytes: half the super-block groups per run
        run = max(1, run // 2)
    R = K_TILE_ROWS
    n_tiles = (n_out + R - 1) // R
    per_task = _QK_ROWS_PER_TASK // R
    if k == 0:
        return
    if fused:  # rows unpacked in registers, no scratch (same bits)
        per = _QK_ROWS_PER_TASK  # a multiple of K_FUSED_ROWS and K_SHORT_ROWS
        for c in prange((n_out + per - 1) // per):
            for s in range(0, k, _QK_FUSED_TOKENS):
                _fused_k_span(kind, raw, lut, xq, dx, dxs, s, min(_QK_FUSED_TOKENS, k - s),
                              c * per, min(n_out, c * per + per), out)
        return
    for c in prange((n_tiles + per_task - 1) // per_task):
        w = np.empty((R, n_in), np.uint8)
        dw = np.empty((R, 16 * n_groups), np.float32)
        m = np.empty((R, 16 * n_groups), np.float32)
        corr = np.empty((R, 16 * n_groups), np.int32)
        acc = np.empty((R * tb, 16), np.float32)
        for tile in range(c * per_task, min(n_tiles, (c + 1) * per_task)):
            r0 = R * tile
            for i in range(R):  # the 4 rows, unpacked once for all the tokens
                _unpack_row_k(kind, raw[min(r0 + i, n_out - 1)], lut, w[i], dw[i], m[i],
                              corr[i], nsb)
            for t0 in range(0, k, tb):
                t1 = min(k, t0 + tb)
                xb, dxb, dxsb = xq[t0:t1], dx[t0:t1], dxs[t0:t1]
                kb = t1 - t0
                acc[:R * kb, :] = 0
                for g0 in range(0, n_groups, run):
                    g1 = min(n_groups, g0 + run)
                    n_two = kb // 2 if two else 0
                    for t in range(0, 2 * n_two, 2):
                        if paired:
                            DOT_K_4x2_PAIR(w, dw, m, corr, xb, dxb, dxsb, acc, g0, g1, t)
                        elif affine:
                            DOT_K_4x2_AFF(w, dw, m, corr, xb, dxb, dxsb, acc, g0, g1, t)
                        else:
                            DOT_K_4x2_SYM(w, dw, m, corr, xb, dxb, dxsb, acc, g0, g1, t)
                    for t in range(2 * n_two, kb):
                        if paired:
                            DOT_K_4x1_PAIR(w, dw, m, corr, xb, dxb, dxsb, acc, g0, g1, t)
                        elif affine:
                            DOT_K_4x1_AFF(w, dw, m, corr, xb, dxb, dxsb, acc, g0, g1, t)
                        else:
                            DOT_K_4x1_SYM(w, dw, m, corr, xb, dxb, dxsb, acc, g0, g1, t)
                t = 0
                if r0 + R <= n_out:  # whole tiles: 4 tokens x 4 rows reduced at once
                    for t in range(0, kb - 3, 4):
                        KSUM_STORE_4x4(acc, t * R, out, t0 + t, r0)
                    t = kb - kb % 4
                for i in range(min(R, n_out - r0)):
                    for tt in range(t, kb):
                        out[t0 + tt, r0 + i] = KSUM(acc, tt * R + i)


def _act_layout_k(kind, act):
    """(xq, dx, dxs): the Q8_K activations ``act`` as _matmul_q8_kg takes them for ``kind``,
    made once per layout and kept on act (see QuantizedActivations)."""
    k = act.q.shape[0]
    if K_PAIRED[kind]:
        key = ("k-pair", _fused(k))  # the fused kernels read x in the group layout
    else:
        key = ("k", bool(K_AFFINE[kind]))
    got = act.layouts.get(key)
    if got is None:
        got = act.layouts[key] = _layout_k(kind, act.q, act.d, act.sums, _fused(k))
    return got


@njit(cache=True)
def _layout_k(kind, q, d, sums, fused):
    # (xq, dx, dxs): Q8_K activations in the layout _matmul_q8_kg takes for ``kind`` (for Q4_K /
    # Q5_K the group layout if ``fused``, which the fused kernels read, else the pair layout)
    k, n = q.shape
    if K_PAIRED[kind]:
        grouped = fused
        n_pairs = (n // QK_K + 1) // 2
        xq = np.empty((k, n if grouped else KPAIR_BYTES * n_pairs), np.uint8)
        dx = np.empty((k, 16 * n_pairs), np.float32)
        dxs = np.empty((k, 16 * n_pairs), np.float32)
        _prep_act_k_pair(q, d, sums, xq, dx, dxs, grouped)
    else:
        xq = np.empty((k, n), np.uint8)
        dx = np.empty((k, n // QK_K), np.float32)
        dxs = np.empty((k, n // 16 if K_AFFINE[kind] else 1), np.float32)
        _prep_act_k(q, d, sums, 0 if K_AFFINE[kind] else 128, xq, dx, dxs)
    return xq, dx, dxs


@njit(cache=True)
def _matmul_f32_via_q8_k(kind, raw, lut, x, out, run, tb, fused, two):
    # _cpu_matmul_q8_k(kind, raw, quantize_activations(x, "Q8_K"), out) in one compiled call
    # (a decode step's matmul: one dispatch instead of four): the same kernels, the same bits
    q, d, sums = quantize_q8_k_rows(x)
    xq, dx, dxs = _layout_k(kind, q, d, sums, fused)
    _matmul_q8_kg(kind, raw, lut, xq, dx, dxs, out, run, tb, fused, two)


def _cpu_matmul_q8_k(kind, raw, act, out):
    k, n = act.q.shape
    if 0 < k <= NATURAL_TOKENS[kind] and NATURAL_FEW:
        _matmul_q8_k_natural(kind, raw, FP16_TO_FP32, act.q, act.d, act.sums, out)
        return
    xq, dx, dxs = _act_layout_k(kind, act)
    _matmul_q8_kg(kind, raw, FP16_TO_FP32, xq, dx, dxs, out, _QK_RUN_GROUPS, _QK_TOKEN_BLOCK,
                  _fused(k), TWO_TOKEN_TILES)


class _KQuant(QuantFormat):
    block_size = QK_K
    uses_imatrix = True

    @property
    def kind(self) -> int:
        return KIND[self.name]

    def _cpu_quantize(self, x, imatrix):
        out = np.empty((x.shape[0], self.row_bytes(x.shape[1])), np.uint8)
        weighted = imatrix is not None
        qw = imatrix if weighted else np.zeros(x.shape[1], np.float32)
        _quantize(self.kind, x, qw, weighted, out)
        return out

    def _cpu_dequantize(self, raw, n_per_row):
        out = np.empty((raw.shape[0], n_per_row), np.float32)
        _dequantize(self.kind, raw, FP16_TO_FP32, out)
        return out

    def _cpu_matmul(self, raw, x, out):
        _matmul(self.kind, raw, FP16_TO_FP32, x, out)

    #: ggml's vec_dot_type for the K-quants
    act_type = "Q8_K"
    #: the int8 path's numba kernel (for the assembly checks)
    q8_kernel = _matmul_q8_kg
    #: the kernel of a few tokens on AVX2 hosts without VNNI (NATURAL_FEW)
    q8_kernel_few = _matmul_q8_k_natural

    def _cpu_matmul_q8(self, raw, act, out):
        _cpu_matmul_q8_k(self.kind, raw, act, out)

    def _cpu_matmul_int8(self, raw, x, out):
        kind = KIND[self.name]
        k = x.shape[0]
        if NATURAL_FEW and 0 < k <= NATURAL_TOKENS[kind]:
            super()._cpu_matmul_int8(raw, x, out)
        elif k:
            if x.shape[1] % QK_K:
                raise ValueError(f"row length {x.shape[1]} is not a multiple of Q8_K's block of {QK_K}")
            _matmul_f32_via_q8_k(kind, raw, FP16_TO_FP32, x, out, _QK_RUN_GROUPS, _QK_TOKEN_BLOCK,
                                 _fused(k), TWO_TOKEN_TILES)

    def _cuda_quantize(self, x, imatrix):
        from .cuda import kquants as k
        return k.quantize(self, x, imatrix)

    def _cuda_dequantize(self, raw, n_per_row):
        from .cuda import kquants as k
        return k.dequantize(self, raw, n_per_row)


@register
class Q2_K(_KQuant):
    name, ggml_type, type_size = "Q2_K", T.Q2_K, 84


@register
class Q3_K(_KQuant):
    name, ggml_type, type_size = "Q3_K", T.Q3_K, 110


@register
class Q4_K(_KQuant):
    name, ggml_type, type_size = "Q4_K", T.Q4_K, 144


@register
class Q5_K(_KQuant):
    name, ggml_type, type_size = "Q5_K", T.Q5_K, 176


@register
class Q6_K(_KQuant):
    name, ggml_type, type_size = "Q6_K", T.Q6_K, 210
