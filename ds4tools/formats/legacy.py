"""ggml's 32-element block formats: Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1.

Block-level functions (``*_block``) are plain ``@njit`` functions on one block's floats and
bytes; the CUDA kernels (``ds4tools.formats.cuda.legacy``) call them per thread, and so do the
CPU kernels where speed does not matter. The hot CPU paths (quantizing without an imatrix,
decoding) restate the block functions as flat loops over a row, a shape LLVM vectorizes, or
(Q4_0..Q5_1's quantizer) as one block's vector IR (``_block32``); tests/cuda checks that both
give the same bytes.

Layouts (little endian): Q4_0 = fp16 d, 16 bytes of nibbles (element j low, j+16 high);
Q4_1 = fp16 d, fp16 m, nibbles; Q5_0 = fp16 d, uint32 qh (bit 4 of element j), nibbles;
Q5_1 = fp16 d, fp16 m, qh, nibbles. Decoding: x = d * (q - 8 or 16), or x = d * q + m.
"""
import math

import numpy as np
from gguf import GGMLQuantizationType as T
from numba import njit, prange

from .base import QuantFormat, register
from ._block32 import QUANT_Q4_0, QUANT_Q4_1, QUANT_Q5_0, QUANT_Q5_1, block_key_extrema
from ._llvm_ir import avx2_without_vnni, f32_from_bits, store_le
from ._numeric import FP16_TO_FP32, fp16_bits, fp16_to_fp32, fp32_to_fp16, put_fp16, round_away
from ._search import LANE_WORK, affine_search_groups, symmetric_search_groups, to_fp16
from ._int8dot import (DECODE_F32_Q4_0, DECODE_F32_Q4_1, DECODE_F32_Q5_0, DECODE_F32_Q5_1,
                       DECODE_F32_Q8_0,
                       DOT_2x1_AFF, DOT_2x1_Q8, DOT_2x1_SYM, DOT_2x2_AFF, DOT_2x2_Q8, DOT_2x2_SYM,
                       FUSED1_IQ2_XXS, FUSED1_IQ4_NL, FUSED1_Q4_0, FUSED1_Q4_1, FUSED1_Q5_0,
                       FUSED1_Q5_1, FUSED1_Q8_0, FUSED2_IQ2_XXS, FUSED2_IQ4_NL, FUSED2_Q4_0,
                       FUSED2_Q4_1, FUSED2_Q5_0, FUSED2_Q5_1, FUSED2_Q8_0, FUSED3_IQ2_XXS,
                       FUSED3_IQ4_NL, FUSED3_Q4_0, FUSED3_Q4_1, FUSED3_Q5_0, FUSED3_Q5_1,
                       FUSED3_Q8_0, FUSED4_IQ2_XXS, FUSED4_IQ4_NL, FUSED4_Q4_0, FUSED4_Q4_1,
                       FUSED4_Q5_0, FUSED4_Q5_1, FUSED4_Q8_0, FUSED8_IQ2_XXS, FUSED8_IQ4_NL,
                       FUSED8_Q4_0, FUSED8_Q4_1, FUSED8_Q5_0, FUSED8_Q5_1, FUSED8_Q8_0,
                       FUSED_NATURAL, FUSED_QUAD, FUSED_ROWS, FUSED_SLOTS,
                       GROUP_BLOCKS, GROUP_BYTES, GROUP_RAW_BYTES, KIND_IQ2_XXS, UNPACK_IQ2_XXS,
                       UNPACK_IQ4_NL, UNPACK_Q4_0, UNPACK_Q4_1, UNPACK_Q5_0, UNPACK_Q5_1,
                       UNPACK_Q8_0, WEIGHT_OFFSET, iq2_xxs_natural,
                       iq2_xxs_slot_order)

QK = 32
FLT_MAX = np.float32(3.4028234663852886e38)

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
            put_fp16(out[r], b * 34, to_fp16(d))  # integer ops on the bits: 30% faster
            inv[b * QK:(b + 1) * QK] = np.float32(1.0) / d if d != 0 else np.float32(0.0)
        for i in range(n):
            v = xr[i] * inv[i]
            t = np.trunc(v)  # C roundf: half away from zero, exact in float32
            q[i] = np.int8(t + np.copysign(np.float32(1.0), v) if abs(v - t) >= np.float32(0.5) else t)
        qb = q.view(np.uint8)
        for b in range(nb):
            out[r, b * 34 + 2:b * 34 + 34] = qb[b * QK:(b + 1) * QK]


@njit(cache=True)
def _q8_0_decode_row(rr, lut, w, qk):
    # d * q for one row, as q8_0_dequantize_block. qk (= QK) comes in at run time: with a
    # constant trip count LLVM unrolls the loop into scalar code, 2.5x slower.
    for b in range(w.shape[0] // QK):
        d = lut[np.int64(rr[b * 34]) | (np.int64(rr[b * 34 + 1]) << 8)]
        for j in range(qk):
            w[b * QK + j] = d * np.float32(np.int8(rr[b * 34 + 2 + j]))


@njit(parallel=True, cache=True)
def _q8_0_dequantize(raw, lut, out, qk):
    for r in prange(raw.shape[0]):
        _q8_0_decode_row(raw[r], lut, out[r], qk)


@njit(cache=True, inline="always")
def dot_two_rows(w0, w1, x, t):
    """(w0 . x[t], w1 . x[t]) for two decoded weight rows, in one pass: the x loads are shared
    and two reductions are in flight. The float32 paths' one dot loop (inlined, it takes the
    caller's fastmath), so every caller reduces a row in the same order."""
    a0 = np.float32(0.0)
    a1 = np.float32(0.0)
    for i in range(x.shape[1]):
        xi = x[t, i]
        a0 += w0[i] * xi
        a1 += w1[i] * xi
    return a0, a1


@njit(parallel=True, fastmath=True, cache=True)
def _q8_0_matmul(raw, lut, x, out):
    # Decode two rows to floats (d * q, exactly the dequantized weights: DECODE_F32_Q8_0), then
    # for each activation row one pass computing both flat dots: the x loads are shared and two
    # reductions are in flight. Every row goes through this same two-row code (an odd last row
    # is paired with itself), so a row's result never depends on its neighbour, on k or on
    # where a thread's chunk starts: batched verification depends on that.
    n_out = raw.shape[0]
    k, n_in = x.shape
    n_pairs = (n_out + 1) // 2
    chunk = 4  # pairs per task: scratch is allocated once per task, not per row
    for c in prange((n_pairs + chunk - 1) // chunk):
        w0 = np.empty(n_in, np.float32)
        w1 = np.empty(n_in, np.float32)
        for pair in range(c * chunk, min(n_pairs, c * chunk + chunk)):
            r0 = 2 * pair
            r1 = min(r0 + 1, n_out - 1)
            DECODE_F32_Q8_0(raw[r0], lut, w0, n_in // QK)
            DECODE_F32_Q8_0(raw[r1], lut, w1, n_in // QK)
            for t in range(k):
                out[t, r0], out[t, r1] = dot_two_rows(w0, w1, x, t)


# --- int8-activation matmuls on 32-blocks: the five formats here, IQ4_NL and IQ2_XXS -----------
# Each weight row is unpacked once (_int8dot's group layout: unsigned bytes, per-block scales d
# and offsets m), then dotted with the activation rows by _int8dot's tiles: exact integer block
# dots, then per lane acc += float(isum_b) * (d_w * d_x) (+ m_b * (d_x * sum(q_x)) for Q4_1 and
# Q5_1) in a fixed order. Rows are padded with zero blocks to a multiple of GROUP_BLOCKS.
# Kind numbers: KIND below for Q4_0..Q5_1, 4 for Q8_0, 5 for IQ4_NL, 6 for IQ2_XXS (whose Q8_K
# activations are handed over per 32-block: see matmul_q8_tiles). Kinds 4..6 have signed
# weights + 128 (any u <= 255) and share the Q8 tiles.
_Q8_KIND_Q8_0 = 4
KIND_IQ4_NL = 5
#: with the fused k <= 2 kernels (no scratch, no padded work) int8 wins at k=1 from rows of
#: 256 (1024-row matrices, 1 thread, int8 / f32 time at k=1, n_in 64 128 256 384 512 768 1024
#: 1536 2048: Q8_0 1.44 1.10 0.55 0.39 0.30 0.36 0.29 0.29 0.37; Q4_0 1.35 1.08 0.62 0.42 0.32
#: 0.40 0.31 0.32 0.35): the formats of this file, IQ4_NL and IQ2_XXS use it (IQ2_XXS, whose
#: rows are multiples of 256: 0.33 0.18 0.16 0.12 at n_in 256 512 768 1024; k=8 1.04 0.45 0.44
#: 0.29)
INT8_MIN_ROW_FUSED = 8 * QK
#: ... and from this many weights: below it the float32 path wins at k = 1 on 2 threads, by the
#: int8 path's fixed cost per call (int8 / f32 time including the activations' quantization,
#: AVX2 code, n_out 192 / 384 / 768: n_in 576 Q8_0 1.71 / 1.22 / 0.92; n_in 1024 Q8_0 1.13 /
#: 0.76 / 0.59, Q4_0 1.19 / 0.80 / 0.56, IQ4_NL 1.06 / 0.74 / 0.58, Q5_1 1.06 / 0.82 / 0.69; the
#: native AVX-512 code within 0.15 of these). The demo model's 192 x 576 ffn_down is one: its
#: decoding step 521-548 -> 465-478 us in float32 (AVX2 code, 2 threads)
INT8_MIN_WEIGHTS_FUSED = 1 << 18
_Q8_ROWS_PER_TASK = 16  # weight rows per prange task (scratch allocated once per task)
#: up to this many tokens (decoding, a drafter's step, a verify) take the fused kernels, each
#: row unpacked once for all of them (Zen 4, Q8_0 2816x1024 from DRAM, 2 threads, k = 4:
#: 200 us against 250-450 us for the tiles, 140-150 us at k = 1); 5 to 8 the 8-token kernels
#: (AVX-512 VNNI host, 2816x1024 / 1024x2816 x 24 from DRAM, 2 threads, k = 8 against the
#: tiles: Q8_0 1.1-1.3x, Q4_0 1.25-1.7x, IQ4_NL 1.3-1.6x); the tiles from 9 on
Q8_FUSED_TOKENS = 8
#: more tokens in passes of Q8_FUSED_TOKENS through the fused kernels instead of the tiles, where
#: the CPU has AVX2 but not AVX-512 VNNI: there the tiles' 2 x 2 blocks cost more per token than
#: the fused kernels' one row of 8 tokens (AVX2 code on the Xeon of docs/engine.md, 2816x1024
#: from L3, 2 threads, k = 16 / 32, the passes' time over the tiles': Q8_0 0.69 / 0.68, Q4_0,
#: Q4_1, Q5_0, Q5_1 0.76-0.84), but for IQ4_NL and IQ2_XXS (1.18 / 1.26 and 1.17 / 1.48: their
#: fused kernels look their levels up per row), which keep the tiles
FUSED_PASSES = avx2_without_vnni()
_Q8_RUN_GROUPS = 8  # groups (128 blocks, 4 KiB of a row) per run: see _matmul_q8
_Q8_TOKEN_BLOCK = 32  # tokens per block: see _matmul_q8


@njit(cache=True)
def _unpack_groups(kind, rr, lut, u, dw, m, ng):
    if kind == KIND_IQ2_XXS:
        UNPACK_IQ2_XXS(rr, lut, u, dw, m, ng)
    elif kind == KIND_IQ4_NL:
        UNPACK_IQ4_NL(rr, lut, u, dw, m, ng)
    elif kind == 0:
        UNPACK_Q4_0(rr, lut, u, dw, m, ng)
    elif kind == 1:
        UNPACK_Q4_1(rr, lut, u, dw, m, ng)
    elif kind == 2:
        UNPACK_Q5_0(rr, lut, u, dw, m, ng)
    elif kind == 3:
        UNPACK_Q5_1(rr, lut, u, dw, m, ng)
    else:
        UNPACK_Q8_0(rr, lut, u, dw, m, ng)


@njit(cache=True)
def _unpack_row_q8(kind, rr, lut, u, dw, m, tail):
    # One row's blocks -> _int8dot's group layout: unsigned quants u, scales dw, offsets m
    # (Q4_1/Q5_1; untouched otherwise). A last partial group is unpacked from tail: its
    # blocks, then zero bytes (scale 0: they add exact zeros).
    gr = GROUP_RAW_BYTES[kind]
    ng = rr.shape[0] // gr
    _unpack_groups(kind, rr, lut, u, dw, m, ng)
    if rr.shape[0] > ng * gr:
        tail[:] = 0
        tail[:rr.shape[0] - ng * gr] = rr[ng * gr:]
        _unpack_groups(kind, tail, lut, u[ng * GROUP_BYTES:], dw[ng * GROUP_BLOCKS:],
                       m[ng * GROUP_BLOCKS:], 1)


@njit(cache=True)
def _prep_scales_q8(d, sums, offset, xcorr, dx, dxs):
    # per block the weight offset times sum(q), d and d * sum(q), zero-padded to xcorr's width
    k, nb = d.shape
    xcorr[:, :] = 0
    dx[:, :] = 0
    dxs[:, :] = 0
    for t in range(k):
        for b in range(nb):
            xcorr[t, b] = offset * sums[t, b]
            dx[t, b] = d[t, b]
            dxs[t, b] = d[t, b] * np.float32(sums[t, b])


@njit(cache=True)
def _prep_act_q8(q, d, sums, offset, xq, xcorr, dx, dxs):
    """Activations once per call, zero-padded to xq's width: quants in _int8dot's group layout
    (value 4c + e of block 16g + i at byte 512g + 64c + 4i + e), and _prep_scales_q8's."""
    k, n = q.shape
    nb = n // QK
    xq[:, :] = 0
    for t in range(k):
        for b in range(nb):
            base = (b // GROUP_BLOCKS) * GROUP_BYTES + 4 * (b % GROUP_BLOCKS)
            for j in range(QK):
                xq[t, base + 64 * (j >> 2) + (j & 3)] = q[t, b * QK + j]
    _prep_scales_q8(d, sums, offset, xcorr, dx, dxs)


@njit(cache=True)
def _slot_order_q8(q, xq):
    # the quants of _prep_act_q8's xq moved to IQ2_XXS's slot order (_int8dot.FUSED_SLOTS):
    # value 8b + v of block 16g + i at byte 512g + 64v + 4i + b (the same bytes of xq)
    k, n = q.shape
    for t in range(k):
        for b in range(n // QK):
            base = (b // GROUP_BLOCKS) * GROUP_BYTES + 4 * (b % GROUP_BLOCKS)
            for j in range(QK):
                xq[t, base + 64 * (j & 7) + (j >> 3)] = q[t, b * QK + j]


@njit(cache=True, inline="always")
def _put(v, k, r, r1, out):
    # a fused call's R * k values (rows outer) into out[:, r..], rows before r1 only
    for i in range(min(FUSED_ROWS, r1 - r)):
        for t in range(k):
            out[t, r + i] = v[k * i + t]


@njit(cache=True)
def _fused_span1(kind, raw, lut, xq, xcorr, dx, dxs, r0, r1, out):
    n = raw.shape[0]
    if kind == _Q8_KIND_Q8_0:
        for r in range(r0, r1, FUSED_ROWS):
            _put(FUSED1_Q8_0(raw, lut, xq, xcorr, dx, dxs, 0, r, n), 1, r, r1, out)
    elif kind == 0:
        for r in range(r0, r1, FUSED_ROWS):
            _put(FUSED1_Q4_0(raw, lut, xq, xcorr, dx, dxs, 0, r, n), 1, r, r1, out)
    elif kind == 1:
        for r in range(r0, r1, FUSED_ROWS):
            _put(FUSED1_Q4_1(raw, lut, xq, xcorr, dx, dxs, 0, r, n), 1, r, r1, out)
    elif kind == 2:
        for r in range(r0, r1, FUSED_ROWS):
            _put(FUSED1_Q5_0(raw, lut, xq, xcorr, dx, dxs, 0, r, n), 1, r, r1, out)
    elif kind == 3:
        for r in range(r0, r1, FUSED_ROWS):
            _put(FUSED1_Q5_1(raw, lut, xq, xcorr, dx, dxs, 0, r, n), 1, r, r1, out)
    elif kind == KIND_IQ2_XXS:
        for r in range(r0, r1, FUSED_ROWS):
            _put(FUSED1_IQ2_XXS(raw, lut, xq, xcorr, dx, dxs, 0, r, n), 1, r, r1, out)
    else:
        for r in range(r0, r1, FUSED_ROWS):
            _put(FUSED1_IQ4_NL(raw, lut, xq, xcorr, dx, dxs, 0, r, n), 1, r, r1, out)


@njit(cache=True)
def _fused_span2(kind, raw, lut, xq, xcorr, dx, dxs, r0, r1, out):
    n = raw.shape[0]
    if kind == _Q8_KIND_Q8_0:
        for r in range(r0, r1, FUSED_ROWS):
            _put(FUSED2_Q8_0(raw, lut, xq, xcorr, dx, dxs, 0, r, n), 2, r, r1, out)
    elif kind == 0:
        for r in range(r0, r1, FUSED_ROWS):
            _put(FUSED2_Q4_0(raw, lut, xq, xcorr, dx, dxs, 0, r, n), 2, r, r1, out)
    elif kind == 1:
        for r in range(r0, r1, FUSED_ROWS):
            _put(FUSED2_Q4_1(raw, lut, xq, xcorr, dx, dxs, 0, r, n), 2, r, r1, out)
    elif kind == 2:
        for r in range(r0, r1, FUSED_ROWS):
            _put(FUSED2_Q5_0(raw, lut, xq, xcorr, dx, dxs, 0, r, n), 2, r, r1, out)
    elif kind == 3:
        for r in range(r0, r1, FUSED_ROWS):
            _put(FUSED2_Q5_1(raw, lut, xq, xcorr, dx, dxs, 0, r, n), 2, r, r1, out)
    elif kind == KIND_IQ2_XXS:
        for r in range(r0, r1, FUSED_ROWS):
            _put(FUSED2_IQ2_XXS(raw, lut, xq, xcorr, dx, dxs, 0, r, n), 2, r, r1, out)
    else:
        for r in range(r0, r1, FUSED_ROWS):
            _put(FUSED2_IQ4_NL(raw, lut, xq, xcorr, dx, dxs, 0, r, n), 2, r, r1, out)


@njit(cache=True)
def _fused_span3(kind, raw, lut, xq, xcorr, dx, dxs, r0, r1, out):
    n = raw.shape[0]
    if kind == _Q8_KIND_Q8_0:
        for r in range(r0, r1, FUSED_ROWS):
            _put(FUSED3_Q8_0(raw, lut, xq, xcorr, dx, dxs, 0, r, n), 3, r, r1, out)
    elif kind == 0:
        for r in range(r0, r1, FUSED_ROWS):
            _put(FUSED3_Q4_0(raw, lut, xq, xcorr, dx, dxs, 0, r, n), 3, r, r1, out)
    elif kind == 1:
        for r in range(r0, r1, FUSED_ROWS):
            _put(FUSED3_Q4_1(raw, lut, xq, xcorr, dx, dxs, 0, r, n), 3, r, r1, out)
    elif kind == 2:
        for r in range(r0, r1, FUSED_ROWS):
            _put(FUSED3_Q5_0(raw, lut, xq, xcorr, dx, dxs, 0, r, n), 3, r, r1, out)
    elif kind == 3:
        for r in range(r0, r1, FUSED_ROWS):
            _put(FUSED3_Q5_1(raw, lut, xq, xcorr, dx, dxs, 0, r, n), 3, r, r1, out)
    elif kind == KIND_IQ2_XXS:
        for r in range(r0, r1, FUSED_ROWS):
            _put(FUSED3_IQ2_XXS(raw, lut, xq, xcorr, dx, dxs, 0, r, n), 3, r, r1, out)
    else:
        for r in range(r0, r1, FUSED_ROWS):
            _put(FUSED3_IQ4_NL(raw, lut, xq, xcorr, dx, dxs, 0, r, n), 3, r, r1, out)


@njit(cache=True)
def _fused_span4(kind, raw, lut, xq, xcorr, dx, dxs, r0, r1, out):
    n = raw.shape[0]
    if kind == _Q8_KIND_Q8_0:
        for r in range(r0, r1, FUSED_ROWS):
            _put(FUSED4_Q8_0(raw, lut, xq, xcorr, dx, dxs, 0, r, n), 4, r, r1, out)
    elif kind == 0:
        for r in range(r0, r1, FUSED_ROWS):
            _put(FUSED4_Q4_0(raw, lut, xq, xcorr, dx, dxs, 0, r, n), 4, r, r1, out)
    elif kind == 1:
        for r in range(r0, r1, FUSED_ROWS):
            _put(FUSED4_Q4_1(raw, lut, xq, xcorr, dx, dxs, 0, r, n), 4, r, r1, out)
    elif kind == 2:
        for r in range(r0, r1, FUSED_ROWS):
            _put(FUSED4_Q5_0(raw, lut, xq, xcorr, dx, dxs, 0, r, n), 4, r, r1, out)
    elif kind == 3:
        for r in range(r0, r1, FUSED_ROWS):
            _put(FUSED4_Q5_1(raw, lut, xq, xcorr, dx, dxs, 0, r, n), 4, r, r1, out)
    elif kind == KIND_IQ2_XXS:
        for r in range(r0, r1, FUSED_ROWS):
            _put(FUSED4_IQ2_XXS(raw, lut, xq, xcorr, dx, dxs, 0, r, n), 4, r, r1, out)
    else:
        for r in range(r0, r1, FUSED_ROWS):
            _put(FUSED4_IQ4_NL(raw, lut, xq, xcorr, dx, dxs, 0, r, n), 4, r, r1, out)


@njit(cache=True)
def _put8(v, k, r, out):
    # the first k of a FUSED8 call's 8 values (one row) into out[:k, r]
    for t in range(k):
        out[t, r] = v[t]


@njit(cache=True)
def _fused_span8(kind, raw, lut, xq, xcorr, dx, dxs, r0, r1, out):
    # 5 to 8 tokens: one row per call, the tokens past the last read as the last and dropped
    n = raw.shape[0]
    k = out.shape[0]
    if kind == _Q8_KIND_Q8_0:
        for r in range(r0, r1):
            _put8(FUSED8_Q8_0(raw, lut, xq, xcorr, dx, dxs, 0, r, n), k, r, out)
    elif kind == 0:
        for r in range(r0, r1):
            _put8(FUSED8_Q4_0(raw, lut, xq, xcorr, dx, dxs, 0, r, n), k, r, out)
    elif kind == 1:
        for r in range(r0, r1):
            _put8(FUSED8_Q4_1(raw, lut, xq, xcorr, dx, dxs, 0, r, n), k, r, out)
    elif kind == 2:
        for r in range(r0, r1):
            _put8(FUSED8_Q5_0(raw, lut, xq, xcorr, dx, dxs, 0, r, n), k, r, out)
    elif kind == 3:
        for r in range(r0, r1):
            _put8(FUSED8_Q5_1(raw, lut, xq, xcorr, dx, dxs, 0, r, n), k, r, out)
    elif kind == KIND_IQ2_XXS:
        for r in range(r0, r1):
            _put8(FUSED8_IQ2_XXS(raw, lut, xq, xcorr, dx, dxs, 0, r, n), k, r, out)
    else:
        for r in range(r0, r1):
            _put8(FUSED8_IQ4_NL(raw, lut, xq, xcorr, dx, dxs, 0, r, n), k, r, out)


@njit(cache=True)
def _fused_span(kind, raw, lut, xq, xcorr, dx, dxs, r0, r1, out):
    """out[t, r] for all k <= 8 tokens and rows r0..r1-1: one fused call per FUSED_ROWS rows,
    each row unpacked once for all k tokens. The kind and k are chosen once per span, so each
    loop runs one kernel, whose setup LLVM hoists out of it (chosen per row, the setup ran per
    row: 1024-wide Q8_0 rows went 2.5x slower)."""
    k = out.shape[0]
    if k == 1:
        _fused_span1(kind, raw, lut, xq, xcorr, dx, dxs, r0, r1, out)
    elif k == 2:
        _fused_span2(kind, raw, lut, xq, xcorr, dx, dxs, r0, r1, out)
    elif k == 3:
        _fused_span3(kind, raw, lut, xq, xcorr, dx, dxs, r0, r1, out)
    elif k == 4:
        _fused_span4(kind, raw, lut, xq, xcorr, dx, dxs, r0, r1, out)
    else:
        _fused_span8(kind, raw, lut, xq, xcorr, dx, dxs, r0, r1, out)


@njit(parallel=True, cache=True, error_model="numpy")
def _matmul_q8(kind, raw, lut, xq, xcorr, dx, dxs, out, passes):
    """out[t, r] = the int8-activation dot of weight row r (raw blocks of ``kind``) and
    activation row t (from _prep_act_q8). Weight rows go in pairs (an odd last row paired with
    itself), each pair unpacked once, then dotted with the tokens two at a time (an odd last
    token alone) by _int8dot's tiles, which give bit-identical results for a (row, token)
    whatever tile computes it. The tokens go in blocks of _Q8_TOKEN_BLOCK (their accumulators
    stay in L1) and long rows in runs of _Q8_RUN_GROUPS groups, all the block's tokens per run,
    so a run of weights and activations stays in L1 (the float accumulators carry over).
    Up to Q8_FUSED_TOKENS tokens (any number with ``passes``, in passes of that many:
    FUSED_PASSES) take _int8dot's fused kernels instead: FUSED_ROWS rows at a
    time unpacked in registers and dotted with all the tokens, no scratch; for Q8_0 those read
    xq in the natural order (value j of block b at byte 32b + j), for Q4_0, Q4_1 and IQ4_NL in
    _int8dot's quad order (matmul_q8_tiles prepares them), not the group layout. IQ2_XXS's
    weights and activations are in _int8dot's slot order for every k where the host has
    AVX-512 VBMI and GFNI; its fused kernels read the natural order on AVX2."""
    n_out = raw.shape[0]
    k, n_pad = xq.shape
    nb_pad = n_pad // QK
    ng = nb_pad // GROUP_BLOCKS
    if k == 0:
        return
    if k <= Q8_FUSED_TOKENS or passes:  # rows unpacked in registers, no scratch (same bits)
        per = _Q8_ROWS_PER_TASK  # a multiple of FUSED_ROWS
        for c in prange((n_out + per - 1) // per):
            for s in range(0, k, Q8_FUSED_TOKENS):  # (passes: FUSED_PASSES)
                e = min(k, s + Q8_FUSED_TOKENS)
                _fused_span(kind, raw, lut, xq[s:e], xcorr[s:e], dx[s:e], dxs[s:e], c * per,
                            min(n_out, c * per + per), out[s:e])
        return
    n_pairs = (n_out + 1) // 2
    pairs = _Q8_ROWS_PER_TASK // 2
    tb = _Q8_TOKEN_BLOCK
    for c in prange((n_pairs + pairs - 1) // pairs):
        u = np.zeros((2, n_pad), np.uint8)
        dw = np.zeros((2, nb_pad), np.float32)
        m = np.zeros((2, nb_pad), np.float32)
        tail = np.zeros(GROUP_RAW_BYTES[kind], np.uint8)
        acc = np.empty((2 * tb, 16), np.float32)
        for pair in range(c * pairs, min(n_pairs, c * pairs + pairs)):
            r0 = 2 * pair
            r1 = min(r0 + 1, n_out - 1)
            _unpack_row_q8(kind, raw[r0], lut, u[0], dw[0], m[0], tail)
            _unpack_row_q8(kind, raw[r1], lut, u[1], dw[1], m[1], tail)
            for t0 in range(0, k, tb):
                t1 = min(k, t0 + tb)
                kb = t1 - t0
                xb, xcb, dxb, dxsb = xq[t0:t1], xcorr[t0:t1], dx[t0:t1], dxs[t0:t1]
                acc[:2 * kb, :] = 0
                for g0 in range(0, ng, _Q8_RUN_GROUPS):
                    g1 = min(ng, g0 + _Q8_RUN_GROUPS)
                    for t in range(0, kb - 1, 2):
                        if kind >= _Q8_KIND_Q8_0:
                            v00, v01, v10, v11 = DOT_2x2_Q8(u, dw, m, xb, xcb, dxb, dxsb, acc,
                                                            g0, g1, 0, t)
                        elif kind == 0 or kind == 2:
                            v00, v01, v10, v11 = DOT_2x2_SYM(u, dw, m, xb, xcb, dxb, dxsb, acc,
                                                             g0, g1, 0, t)
                        else:
                            v00, v01, v10, v11 = DOT_2x2_AFF(u, dw, m, xb, xcb, dxb, dxsb, acc,
                                                             g0, g1, 0, t)
                        out[t0 + t, r0] = v00
                        out[t0 + t + 1, r0] = v01
                        out[t0 + t, r1] = v10
                        out[t0 + t + 1, r1] = v11
                    if kb % 2:
                        t = kb - 1
                        if kind >= _Q8_KIND_Q8_0:
                            v0, v1 = DOT_2x1_Q8(u, dw, m, xb, xcb, dxb, dxsb, acc, g0, g1, 0, t)
                        elif kind == 0 or kind == 2:
                            v0, v1 = DOT_2x1_SYM(u, dw, m, xb, xcb, dxb, dxsb, acc, g0, g1, 0, t)
                        else:
                            v0, v1 = DOT_2x1_AFF(u, dw, m, xb, xcb, dxb, dxsb, acc, g0, g1, 0, t)
                        out[t0 + t, r0] = v0
                        out[t0 + t, r1] = v1


def _passes(kind):
    """Whether ``kind`` runs any number of tokens through its fused kernels (FUSED_PASSES)."""
    return FUSED_PASSES and kind < KIND_IQ4_NL  # (not IQ4_NL, IQ2_XXS)


def _act_layout_q8(kind, act):
    """(xq, xcorr, dx, dxs): the activations ``act`` as _matmul_q8 takes them for ``kind``,
    made once per layout and weight offset and kept on act (see QuantizedActivations)."""
    k, n = act.q.shape
    fused = k <= Q8_FUSED_TOKENS or _passes(kind)
    natural = kind in FUSED_NATURAL or (kind == KIND_IQ2_XXS and iq2_xxs_natural())
    layout = ("natural" if fused and natural else
              "quad" if fused and kind in FUSED_QUAD else
              "slots" if kind in FUSED_SLOTS and iq2_xxs_slot_order() else "group")
    key = ("q8", layout, WEIGHT_OFFSET[kind])
    got = act.layouts.get(key)
    if got is not None:
        return got
    d, sums = act.d, act.sums
    if act.kind == "Q8_K":
        d = np.repeat(d, n // d.shape[1] // QK, axis=1)
        sums = sums.reshape(k, n // QK, 2).sum(axis=2, dtype=np.int32)
    nb_pad = -(-(n // QK) // GROUP_BLOCKS) * GROUP_BLOCKS
    xcorr = np.empty((k, nb_pad), np.int32)
    dx = np.empty((k, nb_pad), np.float32)
    dxs = np.empty((k, nb_pad), np.float32)
    if layout in ("natural", "quad"):  # the fused kernels read the natural or the quad order
        _prep_scales_q8(d, sums, WEIGHT_OFFSET[kind], xcorr, dx, dxs)
        if n == nb_pad * QK and layout == "natural":
            xq = act.q  # whole groups: as it is
        else:
            xq = np.zeros((k, nb_pad * QK), np.int8)
            xq[:, :n] = act.q
            if layout == "quad":  # (see _int8dot)
                xq = np.ascontiguousarray(
                    xq.reshape(k, -1, 4, 4, 2, 16).transpose(0, 1, 2, 4, 3, 5).reshape(k, -1))
    else:
        xq = np.empty((k, nb_pad * QK), np.int8)
        _prep_act_q8(act.q, d, sums, WEIGHT_OFFSET[kind], xq, xcorr, dx, dxs)
        if layout == "slots":  # the slot order (IQ2_XXS, for its tiles too)
            _slot_order_q8(act.q, xq)
    got = act.layouts[key] = (xq, xcorr, dx, dxs)
    return got


def matmul_q8_tiles(kind, raw, act, out):
    """out (k, n_out) = the int8-activation product of raw weight rows of ``kind`` (see above)
    and the quantized activations act (Q8_0; Q8_K for IQ2_XXS, whose scale per 256 and sums
    of 16 are handed to the tiles per 32-block)."""
    xq, xcorr, dx, dxs = _act_layout_q8(kind, act)
    _matmul_q8(kind, raw, FP16_TO_FP32, xq, xcorr, dx, dxs, out, _passes(kind))


@register
class Q8_0(QuantFormat):
    name, ggml_type, block_size, type_size = "Q8_0", T.Q8_0, 32, 34
    uses_imatrix = False  # ggml's quantize_q8_0 ignores importance weights
    act_type = "Q8_0"
    int8_min_row = INT8_MIN_ROW_FUSED
    int8_min_weights = INT8_MIN_WEIGHTS_FUSED
    q8_kernel = _matmul_q8

    def _cpu_quantize(self, x, imatrix):
        out = np.empty((x.shape[0], self.row_bytes(x.shape[1])), np.uint8)
        _q8_0_quantize(x, out)
        return out

    def _cpu_dequantize(self, raw, n_per_row):
        out = np.empty((raw.shape[0], n_per_row), np.float32)
        _q8_0_dequantize(raw, FP16_TO_FP32, out, QK)
        return out

    def _cpu_matmul(self, raw, x, out):
        _q8_0_matmul(raw, FP16_TO_FP32, x, out)

    def _cpu_matmul_q8(self, raw, act, out):
        matmul_q8_tiles(_Q8_KIND_Q8_0, raw, act, out)

    def _cuda_quantize(self, x, imatrix):
        from .cuda import legacy as k
        return k.quantize(self, x, imatrix)

    def _cuda_dequantize(self, raw, n_per_row):
        from .cuda import legacy as k
        return k.dequantize(self, raw, n_per_row)


# === Q4_0, Q4_1, Q5_0, Q5_1 ===================================================================
# Kind numbers select a format inside the kernels shared by the four (one compiled kernel each).
KIND = {"Q4_0": 0, "Q4_1": 1, "Q5_0": 2, "Q5_1": 3}
TYPE_SIZE = (18, 20, 22, 24)


@njit(cache=True)
def _put_u32(ob, off, v):
    for k in range(4):
        ob[off + k] = (v >> (8 * k)) & 0xFF


@njit(cache=True)
def _get_u32(ib, off):
    return (np.int64(ib[off]) | (np.int64(ib[off + 1]) << 8) | (np.int64(ib[off + 2]) << 16)
            | (np.int64(ib[off + 3]) << 24))


@njit(cache=True)
def _pack4(L, ob, off):
    for j in range(16):
        ob[off + j] = (L[j] | (L[j + 16] << 4)) & 0xFF


@njit(cache=True)
def _pack5(L, ob, off_qh, off_qs):
    qh = 0
    for j in range(16):
        ob[off_qs + j] = ((L[j] & 0x0F) | ((L[j + 16] & 0x0F) << 4)) & 0xFF
        qh |= ((L[j] & 0x10) >> 4) << j
        qh |= ((L[j + 16] & 0x10) >> 4) << (j + 16)
    _put_u32(ob, off_qh, qh)


# --- reference quantizers (no imatrix): ggml's quantize_row_q*_ref ---------------------------


@njit(cache=True, error_model="numpy")
def _symmetric_scale(xb, divisor):
    # d = (the value of largest magnitude, first one on ties) / divisor
    amax = np.float32(0.0)
    vmax = np.float32(0.0)
    for j in range(QK):
        if amax < abs(xb[j]):
            amax = abs(xb[j])
            vmax = xb[j]
    return vmax / divisor


@njit(cache=True)
def _min_max(xb):
    vmin = FLT_MAX
    vmax = -FLT_MAX
    for j in range(QK):
        if xb[j] < vmin:
            vmin = xb[j]
        if xb[j] > vmax:
            vmax = xb[j]
    return vmin, vmax


@njit(cache=True, error_model="numpy")
def q4_0_quantize_block(xb, ob, L):
    d = _symmetric_scale(xb, np.float32(-8.0))
    inv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
    put_fp16(ob, 0, fp32_to_fp16(d))
    for j in range(QK):
        L[j] = min(15, np.int32(xb[j] * inv + np.float32(8.5)))
    _pack4(L, ob, 2)


@njit(cache=True, error_model="numpy")
def q4_1_quantize_block(xb, ob, L):
    vmin, vmax = _min_max(xb)
    d = (vmax - vmin) / np.float32(15.0)
    inv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
    put_fp16(ob, 0, fp32_to_fp16(d))
    put_fp16(ob, 2, fp32_to_fp16(vmin))
    for j in range(QK):
        L[j] = min(15, np.int32((xb[j] - vmin) * inv + np.float32(0.5)))
    _pack4(L, ob, 4)


@njit(cache=True, error_model="numpy")
def q5_0_quantize_block(xb, ob, L):
    d = _symmetric_scale(xb, np.float32(-16.0))
    inv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
    put_fp16(ob, 0, fp32_to_fp16(d))
    for j in range(QK):
        L[j] = min(31, np.int32(xb[j] * inv + np.float32(16.5)))
    _pack5(L, ob, 2, 6)


@njit(cache=True, error_model="numpy")
def q5_1_quantize_block(xb, ob, L):
    vmin, vmax = _min_max(xb)
    d = (vmax - vmin) / np.float32(31.0)
    inv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
    put_fp16(ob, 0, fp32_to_fp16(d))
    put_fp16(ob, 2, fp32_to_fp16(vmin))
    for j in range(QK):
        L[j] = np.int32((xb[j] - vmin) * inv + np.float32(0.5)) & 0xFF  # (uint8_t), no clamp
    _pack5(L, ob, 4, 8)


# --- imatrix quantizers: ggml's quantize_row_q*_impl ----------------------------------------


@njit(cache=True)
def sum_squares_from(s, xs):
    """s + sum(x*x), added in order (a row's sum can be built from consecutive pieces)."""
    for i in range(xs.shape[0]):
        s += xs[i] * xs[i]
    return s


@njit(cache=True)
def mean_from_sum(s, n):
    return s / np.float32(n)


@njit(cache=True)
def row_sigma2(xr):
    """sum(x*x) / n_per_row over the whole row, summed in order as ggml does."""
    return mean_from_sum(sum_squares_from(np.float32(0.0), xr), xr.shape[0])


@njit(cache=True)
def weighted_int_scratch(n):
    """int32 scratch values quantize_row_weighted needs for n values."""
    return 2 * n


@njit(cache=True)
def weighted_float_scratch(n):
    """float32 scratch values quantize_row_weighted needs for n values."""
    return 3 * n + (2 + LANE_WORK) * (n // QK)


@njit(cache=True, error_model="numpy")
def quantize_row_weighted(kind, x, qw, sigma2, o, iw, fw):
    """Blocks of Q4_0/Q4_1/Q5_0/Q5_1 (by ``kind``) with importance weights ``qw`` and the
    whole row's ``sigma2`` (see row_sigma2), as ggml's quantize_row_q*_impl. x may be a whole
    row (CPU) or any run of its blocks (a CUDA thread's one block); all its blocks are searched
    at once (_search's lanes). iw, fw: weighted_int_scratch / weighted_float_scratch values."""
    n = x.shape[0]
    ng = n // QK
    ts = TYPE_SIZE[kind]
    L = iw[0:n]
    tL = iw[n:2 * n]
    w = fw[0:n]
    tx = fw[n:2 * n]
    tw = fw[2 * n:3 * n]
    scales = fw[3 * n:3 * n + ng]
    mins = fw[3 * n + ng:3 * n + 2 * ng]
    work = fw[3 * n + 2 * ng:3 * n + (2 + LANE_WORK) * ng]
    for i in range(n):
        w[i] = qw[i] * np.float32(math.sqrt(sigma2 + x[i] * x[i]))
    if kind == 0 or kind == 2:
        symmetric_search_groups(ng, QK, 8 if kind == 0 else 16, x, w, L, scales, tx, tw, tL, work)
    else:
        affine_search_groups(ng, QK, 15 if kind == 1 else 31, x, w, L, np.float32(-0.9),
                             np.float32(0.05), 36, False, True, scales, mins, tx, tw, tL, work)
    for b in range(ng):
        ob = o[b * ts:(b + 1) * ts]
        Lb = L[b * QK:(b + 1) * QK]
        put_fp16(ob, 0, to_fp16(scales[b]))
        if kind == 1 or kind == 3:
            put_fp16(ob, 2, to_fp16(-mins[b]))
        if kind == 0:
            _pack4(Lb, ob, 2)
        elif kind == 1:
            _pack4(Lb, ob, 4)
        elif kind == 2:
            _pack5(Lb, ob, 2, 6)
        else:
            _pack5(Lb, ob, 4, 8)


@njit(cache=True, error_model="numpy")
def quantize_block(kind, xb, ob, L):
    """One block of Q4_0/Q4_1/Q5_0/Q5_1 (by ``kind``) without importance weights."""
    if kind == 0:
        q4_0_quantize_block(xb, ob, L)
    elif kind == 1:
        q4_1_quantize_block(xb, ob, L)
    elif kind == 2:
        q5_0_quantize_block(xb, ob, L)
    else:
        q5_1_quantize_block(xb, ob, L)


@njit(cache=True)
def dequantize_block(kind, ib, yb):
    """One block of Q4_0/Q4_1/Q5_0/Q5_1 (by ``kind``) to 32 floats, as ggml's dequantize_row_*."""
    d = fp16_to_fp32(fp16_bits(ib, 0))
    if kind == 1 or kind == 3:
        m = fp16_to_fp32(fp16_bits(ib, 2))
        off = 4
    else:
        m = np.float32(0.0)
        off = 2
    qh = 0
    if kind >= 2:
        qh = _get_u32(ib, off)
        off += 4
    bias = (8, 0, 16, 0)[kind]
    for j in range(16):
        v = np.int64(ib[off + j])
        q0 = (v & 0x0F) | (((qh >> j) << 4) & 0x10)
        q1 = (v >> 4) | ((qh >> (j + 12)) & 0x10)
        if kind == 1 or kind == 3:
            yb[j] = np.float32(q0) * d + m
            yb[j + 16] = np.float32(q1) * d + m
        else:
            yb[j] = np.float32(q0 - bias) * d
            yb[j + 16] = np.float32(q1 - bias) * d


# --- CPU kernels -------------------------------------------------------------------------------


@njit(parallel=True, cache=True, error_model="numpy")
def _quantize_weighted(kind, x, qw, out):
    rows, n = x.shape
    for r in prange(rows):
        iw = np.empty(weighted_int_scratch(n), np.int32)
        fw = np.empty(weighted_float_scratch(n), np.float32)
        quantize_row_weighted(kind, x[r], qw, row_sigma2(x[r]), out[r], iw, fw)


@njit(cache=True)
def _quantize_block_ir(kind, xr, lo, vmin, inv, o, qs_off):
    if kind == 0:
        return QUANT_Q4_0(xr, lo, vmin, inv, o, qs_off)
    if kind == 1:
        return QUANT_Q4_1(xr, lo, vmin, inv, o, qs_off)
    if kind == 2:
        return QUANT_Q5_0(xr, lo, vmin, inv, o, qs_off)
    return QUANT_Q5_1(xr, lo, vmin, inv, o, qs_off)


@njit(cache=True)
def _key_bits(k):
    # a block_key_extrema sort key back to the float's bits (the map is its own inverse)
    return np.int32(k ^ ((k >> 31) & 0x7FFFFFFF))


@njit(parallel=True, cache=True, error_model="numpy")
def _quantize_ref(kind, x, out):
    # quantize_block restated for speed, one block at a time with _block32's vector IR: the
    # block's extrema, its scale(s) in scalar float32 exactly as ggml, then values, packing and
    # stores in vector code. No scratch. tests/cuda checks it agrees with quantize_block.
    rows, n = x.shape
    nb = n // QK
    ts = TYPE_SIZE[kind]
    affine = kind == 1 or kind == 3
    qs = 2 if kind == 0 else (4 if kind == 1 else (6 if kind == 2 else 8))
    for r in prange(rows):
        xr = x[r]
        o = out[r]
        for b in range(nb):
            lo = b * QK
            kmin, kmax = block_key_extrema(xr, lo)
            bmin = _key_bits(kmin)
            bmax = _key_bits(kmax)
            vmin = f32_from_bits(bmin)
            vmax = f32_from_bits(bmax)
            if affine:
                if vmin == 0 or vmax == 0:  # the sign of a zero matters: ggml's exact scan
                    vmin, vmax = _min_max(xr[lo:lo + QK])
                d = (vmax - vmin) / (np.float32(15.0) if kind == 1 else np.float32(31.0))
                store_le(o, b * ts + 2, np.uint16(to_fp16(vmin)))
            else:
                # the first value of largest magnitude; only a +m/-m tie (or all zeros) needs
                # ggml's scan. Which of max and min wins is a coin flip: chosen without a branch.
                if vmax == -vmin:
                    vmax = _symmetric_scale(xr[lo:lo + QK], np.float32(1.0))
                else:
                    pick_max = -np.int32(vmax > -vmin)
                    vmax = f32_from_bits(np.int32((bmin & ~pick_max) | (bmax & pick_max)))
                d = vmax / (np.float32(-8.0) if kind == 0 else np.float32(-16.0))
            store_le(o, b * ts, np.uint16(to_fp16(d)))  # integer ops on the bits, as Q8_0
            inv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
            qh = _quantize_block_ir(kind, xr, lo, vmin, inv, o, b * ts + qs)
            if kind >= 2:
                store_le(o, b * ts + qs - 4, qh)


#: 16, passed to the decoders at run time: with a constant trip count LLVM unrolls their
#: 16-step loops into scalar code, 2.5x slower than the loop it vectorizes otherwise
HALF = QK // 2


@njit(cache=True)
def _decode_row(kind, rr, lut, y, half):
    # One row of blocks to floats, bit-identical to dequantize_block; one plain loop nest per
    # format (a shape LLVM vectorizes, unlike the block function's per-element branches).
    # half: HALF (see there).
    ts = TYPE_SIZE[kind]
    for b in range(y.shape[0] // QK):
        o = b * ts
        yo = b * QK
        d = lut[np.int64(rr[o]) | (np.int64(rr[o + 1]) << 8)]
        if kind == 0:
            for j in range(half):
                v = np.int32(rr[o + 2 + j])
                y[yo + j] = np.float32((v & 0x0F) - 8) * d
                y[yo + 16 + j] = np.float32((v >> 4) - 8) * d
        elif kind == 1:
            m = lut[np.int64(rr[o + 2]) | (np.int64(rr[o + 3]) << 8)]
            for j in range(half):
                v = np.int32(rr[o + 4 + j])
                y[yo + j] = np.float32(v & 0x0F) * d + m
                y[yo + 16 + j] = np.float32(v >> 4) * d + m
        elif kind == 2:
            qh = np.int32(_get_u32(rr, o + 2))
            for j in range(half):
                v = np.int32(rr[o + 6 + j])
                y[yo + j] = np.float32(((v & 0x0F) | (((qh >> j) << 4) & 0x10)) - 16) * d
                y[yo + 16 + j] = np.float32(((v >> 4) | ((qh >> (j + 12)) & 0x10)) - 16) * d
        else:
            m = lut[np.int64(rr[o + 2]) | (np.int64(rr[o + 3]) << 8)]
            qh = np.int32(_get_u32(rr, o + 4))
            for j in range(half):
                v = np.int32(rr[o + 8 + j])
                y[yo + j] = np.float32((v & 0x0F) | (((qh >> j) << 4) & 0x10)) * d + m
                y[yo + 16 + j] = np.float32((v >> 4) | ((qh >> (j + 12)) & 0x10)) * d + m


@njit(parallel=True, cache=True)
def _dequantize(kind, raw, lut, out, half):
    for r in prange(raw.shape[0]):
        _decode_row(kind, raw[r], lut, out[r], half)


@njit(cache=True)
def _decode_row_f32(kind, rr, lut, w):
    # bit-identical to _decode_row (kinds 0..3) and _q8_0_decode_row (4: Q8_0)
    # (tests/test_formats_int8_legacy.py), as vector IR: 3x faster
    nb = w.shape[0] // QK
    if kind == 0:
        DECODE_F32_Q4_0(rr, lut, w, nb)
    elif kind == 1:
        DECODE_F32_Q4_1(rr, lut, w, nb)
    elif kind == 2:
        DECODE_F32_Q5_0(rr, lut, w, nb)
    elif kind == 3:
        DECODE_F32_Q5_1(rr, lut, w, nb)
    else:
        DECODE_F32_Q8_0(rr, lut, w, nb)


@njit(parallel=True, fastmath=True, cache=True)
def _matmul(kind, raw, lut, x, out, half):
    # Decode two rows to floats (exactly the dequantized weights), then for each activation
    # row one pass computing both flat dots: the x loads are shared and two reductions are in
    # flight. Every row goes through this same two-row code (an odd last row is paired with
    # itself), so a row's result never depends on its neighbour, on k or on where a thread's
    # chunk starts (as _q8_0_matmul). half: unused, kept for the signature.
    n_out = raw.shape[0]
    k, n_in = x.shape
    n_pairs = (n_out + 1) // 2
    chunk = 4  # pairs per task: scratch is allocated once per task, not per row
    for c in prange((n_pairs + chunk - 1) // chunk):
        w0 = np.empty(n_in, np.float32)
        w1 = np.empty(n_in, np.float32)
        for pair in range(c * chunk, min(n_pairs, c * chunk + chunk)):
            r0 = 2 * pair
            r1 = min(r0 + 1, n_out - 1)
            _decode_row_f32(kind, raw[r0], lut, w0)
            _decode_row_f32(kind, raw[r1], lut, w1)
            for t in range(k):
                out[t, r0], out[t, r1] = dot_two_rows(w0, w1, x, t)


class _Legacy32(QuantFormat):
    """Q4_0, Q4_1, Q5_0, Q5_1: the kernels above, selected by the format's kind number."""
    block_size = QK
    uses_imatrix = True
    act_type = "Q8_0"
    int8_min_row = INT8_MIN_ROW_FUSED
    int8_min_weights = INT8_MIN_WEIGHTS_FUSED
    q8_kernel = _matmul_q8

    @property
    def kind(self) -> int:
        return KIND[self.name]

    def _cpu_quantize(self, x, imatrix):
        out = np.empty((x.shape[0], self.row_bytes(x.shape[1])), np.uint8)
        if imatrix is None:
            _quantize_ref(self.kind, x, out)
        else:
            _quantize_weighted(self.kind, x, imatrix, out)
        return out

    def _cpu_dequantize(self, raw, n_per_row):
        out = np.empty((raw.shape[0], n_per_row), np.float32)
        _dequantize(self.kind, raw, FP16_TO_FP32, out, HALF)
        return out

    def _cpu_matmul(self, raw, x, out):
        _matmul(self.kind, raw, FP16_TO_FP32, x, out, HALF)

    def _cpu_matmul_q8(self, raw, act, out):
        matmul_q8_tiles(self.kind, raw, act, out)

    def _cuda_quantize(self, x, imatrix):
        from .cuda import legacy as k
        return k.quantize(self, x, imatrix)

    def _cuda_dequantize(self, raw, n_per_row):
        from .cuda import legacy as k
        return k.dequantize(self, raw, n_per_row)


@register
class Q4_0(_Legacy32):
    name, ggml_type, type_size = "Q4_0", T.Q4_0, 18


@register
class Q4_1(_Legacy32):
    name, ggml_type, type_size = "Q4_1", T.Q4_1, 20


@register
class Q5_0(_Legacy32):
    name, ggml_type, type_size = "Q5_0", T.Q5_0, 22


@register
class Q5_1(_Legacy32):
    name, ggml_type, type_size = "Q5_1", T.Q5_1, 24
