"""IQ2_XXS: 2.06 bits per weight. 256-element super-blocks of 8-element grid points.

A super-block is fp16 ``d`` then 8 x (uint32 grid indices, uint32 signs+scale) for its eight
32-element blocks: four bytes index a 256-entry grid of 8-vectors with entries {8, 25, 43}, the
second word holds four 7-bit sign patterns (the eighth sign makes the parity even) and a
4-bit block scale in the top bits: ``x = d * (0.5 + s) * 0.25 * grid[i] * sign``.

ggml's quantizer (quantize_row_iq2_xxs_impl) needs importance weights. Per block it flips
signs to make every 8-group's parity even, gets a first scale from make_qp_quants, then
tries 13 scales; for each it rounds the 8-groups to 2-bit codes and, when a code is not a grid
point, takes the best of that code's precomputed grid neighbours. The neighbour lists are
derived data (iq2xs_init_impl): for every code, the grid points at its two smallest squared
distances, ordered by (distance, grid index). We compute them from the grid at first use.

The grid and sign tables come from the gguf package at import time.
"""
import functools
import itertools
import math

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants as _gguf_quants
from numba import njit, prange

from .base import QuantFormat, register
from . import _simd
from ._int8dot import IQ2_XXS_GRID, KIND_IQ2_XXS
from .legacy import INT8_MIN_ROW_FUSED, _matmul_q8, matmul_q8_tiles
from ._numeric import FP16_TO_FP32, fp16_bits, fp16_to_fp32, fp32_to_fp16, put_fp16
from ._search import GROUP_MAX_EPS, SCRATCH, make_qp_quants, nearest_int

QK_K = 256
BLOCK_BYTES = 66
_KMAX_Q = 3  # codes are 0..2 (grid values 1, 3, 5 in the quantizer's units)
_MAP_SIZE = 43692  # ggml's kmap_size: room for every 16-bit code with 2-bit fields


def _grid_codes() -> np.ndarray:
    """The 256 grid points as packed 2-bit codes (uint16; field i = element i)."""
    raw = _gguf_quants.IQ2_XXS.grid_hex
    codes = np.frombuffer(bytes.fromhex(raw.decode("ascii")), dtype="<u2").astype(np.int64)
    assert codes.shape == (256,) and len(set(codes.tolist())) == 256
    return codes


GRID_CODES = _grid_codes()
#: per grid point, its eight 2-bit levels (0..2)
GRID_LEVELS = ((GRID_CODES[:, None] >> (2 * np.arange(8))) & 3).astype(np.uint8)
#: the decoder's grid: levels mapped to the stored magnitudes (8, 25, 43)
GRID_VALUES = np.asarray(_gguf_quants.IQ2_XXS.grid_map, dtype=np.float32)[GRID_LEVELS]
#: sign patterns: 7 stored bits -> 8 signs with even parity
KSIGNS = np.frombuffer(_gguf_quants.IQ2_XXS.ksigns, dtype=np.uint8).copy()
assert KSIGNS.shape == (128,) and GRID_LEVELS.max() <= 2
#: the same patterns as factors +-1 (multiplying by them is exact, like ggml's sign select)
SIGN_FACTORS = np.where((KSIGNS[:, None] >> np.arange(8)) & 1, -1.0, 1.0).astype(np.float32)
_GRID_I8 = GRID_VALUES.astype(np.int8)
_SIGNS_I8 = SIGN_FACTORS.astype(np.int8)


@functools.lru_cache(maxsize=None)
def search_tables() -> tuple[np.ndarray, np.ndarray]:
    """(code_map, neighbours), laid out as ggml's iq2xs_init_impl lays them out.

    code_map[u] is the grid index of code u, or -(offset + 1) when u is off the grid;
    neighbours[offset, 0] is the neighbour count n, and rows offset+1 .. offset+n are the
    neighbours (ggml stores their grid indices; we store their eight levels, which the search
    reads directly). Only codes whose fields are all <= 2 can be looked up (the quantizer
    clamps to 2), so only those get lists."""
    code_map = np.full(_MAP_SIZE, -1, np.int32)
    code_map[GRID_CODES] = np.arange(256, dtype=np.int32)
    levels = np.array(list(itertools.product(range(3), repeat=8)), dtype=np.int64)[:, ::-1]
    codes = (levels << (2 * np.arange(8))).sum(axis=1)
    off = code_map[codes] < 0
    codes, levels = codes[off], levels[off]
    # squared distance (in the quantizer's units 2*l+1) from each off-grid code to each grid point
    diff = 2 * (GRID_LEVELS[None, :, :].astype(np.int64) - levels[:, None, :])
    dist2 = (diff * diff).sum(axis=2)
    order = np.argsort(dist2, axis=1, kind="stable")  # ties by grid index, as ggml's qsort key
    ranked = np.take_along_axis(dist2, order, axis=1)
    # keep the grid points at the two smallest distinct distances (ggml's nwant = 2)
    second = ranked[np.arange(len(codes)), np.argmax(ranked > ranked[:, :1], axis=1)]
    counts = (ranked <= second[:, None]).sum(axis=1)
    starts = np.concatenate(([0], np.cumsum(counts + 1)[:-1]))
    code_map[codes] = -(starts + 1)
    assert counts.max() < 256
    neighbours = np.zeros((int((counts + 1).sum()), 8), np.uint8)
    neighbours[starts, 0] = counts
    keep = np.arange(256)[None, :] < counts[:, None]
    slots = starts[:, None] + 1 + np.arange(256)[None, :]
    neighbours[slots[keep]] = GRID_LEVELS[order[keep]]
    return code_map, neighbours


# --- exact helpers --------------------------------------------------------------------------

_FLT_MAX = np.float32(3.4028234663852886e38)


@njit(cache=True)
def _best_neighbour(neighbours, offset, xval, waux, base, scale, terms):
    """ggml's iq2_find_best_neighbour: among the listed grid points, the first with the least
    sum over the 8 elements of waux * diff * diff, where diff = scale * (2l + 1) - x.
    Returns the winner's code.

    Each element contributes one of three values, so they are computed once (terms[4i + l])
    and every candidate's distance is a sum of 8 of them, in element order as in C."""
    for i in range(8):
        x = xval[base + i]
        w = waux[base + i]
        for l in range(3):
            diff = scale * np.float32(2 * l + 1) - x
            terms[4 * i + l] = w * diff * diff
    count = np.int64(neighbours[offset, 0])
    best_d2 = _FLT_MAX
    best = 1
    for j in range(1, count + 1):
        levels = neighbours[offset + j]
        d2 = np.float32(0.0)
        for i in range(8):
            d2 += terms[4 * i + levels[i]]
        better = d2 < best_d2  # a select, not a branch: the winner is unpredictable
        best_d2 = d2 if better else best_d2
        best = j if better else best
    levels = neighbours[offset + best]
    code = 0
    for i in range(8):
        code |= np.int64(levels[i]) << (2 * i)
    return code


@njit(cache=True)
def _round_groups(xval, inv, L):
    """Levels for every element at inverse scale inv (ggml: nearest_int(0.5*(inv*x - 1))
    clamped to 0..2), and the packed code of each 8-group in L[32 + k]."""
    for i in range(32):
        l = nearest_int(np.float32(0.5) * (inv * xval[i] - np.float32(1.0)))
        L[i] = max(0, min(_KMAX_Q - 1, l))
    for k in range(4):
        u = 0
        for i in range(8):
            u |= L[8 * k + i] << (2 * i)
        L[32 + k] = u


@njit(cache=True)
def iq2_xxs_quantize_block(xbl, qwl, code_map, neighbours, ob, scratch, ints):
    """One super-block of 256 floats and its 256 importance weights -> 66 bytes.

    scratch: float32 (6, SCRATCH) (weight, waux, xval, scales, terms: 32 values each; the
    make_qp_quants scratch); ints: int64 (4, 36)
    (L, Laux + the four group codes, signs, q2)."""
    weight = scratch[0]
    waux = scratch[1]
    xval = scratch[2]
    scales = scratch[3]
    terms = scratch[4]
    search = scratch[5]
    L = ints[0]
    Laux = ints[1]
    signs = ints[2]
    q2 = ints[3]
    for i in range(16):
        q2[i] = 0
    put_fp16(ob, 0, 0)
    max_scale = np.float32(0.0)
    sumx2 = np.float32(0.0)
    for i in range(QK_K):
        sumx2 += xbl[i] * xbl[i]
    sigma2 = sumx2 / np.float32(QK_K)

    for ib in range(8):
        xb = xbl[32 * ib:32 * ib + 32]
        qw = qwl[32 * ib:32 * ib + 32]
        for i in range(32):
            weight[i] = qw[i] * np.float32(math.sqrt(sigma2 + xb[i] * xb[i]))
        for i in range(32):
            waux[i] = np.float32(math.sqrt(weight[i]))
        for k in range(4):
            nflip = 0
            s = 0
            for i in range(8):
                v = xb[8 * k + i]
                if v >= 0:
                    xval[8 * k + i] = v
                else:
                    xval[8 * k + i] = -v
                    nflip += 1
                    s |= 1 << i
            if nflip % 2:
                # odd parity: flip the element that costs least, so the 8th sign is implied
                imin = 0
                vmin = weight[8 * k] * xb[8 * k] * xb[8 * k]
                for i in range(1, 8):
                    ax = weight[8 * k + i] * xb[8 * k + i] * xb[8 * k + i]
                    if ax < vmin:
                        vmin = ax
                        imin = i
                xval[8 * k + imin] = -xval[8 * k + imin]
                s ^= 1 << imin
            signs[k] = s & 127
        vmax = xval[0]
        for i in range(1, 32):
            vmax = vmax if vmax > xval[i] else xval[i]
        if vmax < GROUP_MAX_EPS:
            scales[ib] = 0
            continue
        scale = make_qp_quants(32, _KMAX_Q + 1, xval, L, weight, search)
        eff_max = scale * np.float32(_KMAX_Q)
        if eff_max <= 0:
            scales[ib] = 0
            continue
        best = np.float32(0.0)
        for step in range(-6, 7):
            inv = (np.float32(2 * _KMAX_Q - 1) + np.float32(step) * np.float32(0.1)) / eff_max
            this_scale = np.float32(1.0) / inv
            _round_groups(xval, inv, Laux)
            for k in range(4):
                g = code_map[Laux[32 + k]]
                if g < 0:
                    u = _best_neighbour(neighbours, -g - 1, xval, waux, 8 * k, this_scale, terms)
                    for i in range(8):
                        Laux[8 * k + i] = (u >> (2 * i)) & 3
            sumqx = np.float32(0.0)
            sumq2 = np.float32(0.0)
            for i in range(32):
                w = weight[i]
                q = np.float32(2 * Laux[i] + 1)
                sumqx += w * xval[i] * q
                sumq2 += w * q * q
            if sumq2 > 0 and sumqx * sumqx > best * sumq2:
                scale = sumqx / sumq2
                best = scale * sumqx
                for i in range(32):
                    L[i] = Laux[i]
        if scale > 0:
            inv = np.float32(1.0) / scale
            _round_groups(xval, inv, Laux)
            for k in range(4):
                u = Laux[32 + k]
                if code_map[u] < 0:
                    u = _best_neighbour(neighbours, -code_map[u] - 1, xval, waux, 8 * k, scale, terms)
                for i in range(8):
                    L[8 * k + i] = (u >> (2 * i)) & 3
            sumqx = np.float32(0.0)
            sumq2 = np.float32(0.0)
            for i in range(32):
                w = weight[i]
                q = np.float32(2 * L[i] + 1)
                sumqx += w * xval[i] * q
                sumq2 += w * q * q
            if sumq2 > 0:
                scale = sumqx / sumq2
        if scale < 0:
            # ggml: cannot happen, but if it does, store a positive scale and flip the signs
            scale = -scale
            for k in range(4):
                signs[k] = (~signs[k]) & 127
        for k in range(4):
            u = 0
            for i in range(8):
                u |= (L[8 * k + i] & 0xFF) << (2 * i)
            g = code_map[u] if u < _MAP_SIZE else -1
            # ggml aborts on an off-grid code here; unreachable for finite input
            g = max(g, 0)
            q2[2 * ib] |= g << (8 * k)
            q2[2 * ib + 1] |= signs[k] << (7 * k)
        scales[ib] = scale
        max_scale = max_scale if max_scale > scale else scale

    if max_scale == 0:
        for i in range(64):
            ob[2 + i] = 0
        return
    d = max_scale / np.float32(31.0)
    put_fp16(ob, 0, fp32_to_fp16(d))
    inv_d = np.float32(1.0) / d
    for ib in range(8):
        l = nearest_int(np.float32(0.5) * (inv_d * scales[ib] - np.float32(1.0)))
        l = max(0, min(15, l))
        q2[2 * ib + 1] |= l << 28
    for w in range(16):
        v = q2[w]
        for b in range(4):
            ob[2 + 4 * w + b] = (v >> (8 * b)) & 0xFF


@njit(cache=True)
def _decode_superblock(raw, o0, d, grid_values, signs, y, y0):
    """Super-block at raw[o0:o0+66] with scale d -> y[y0:y0+256], as ggml's
    dequantize_row_iq2_xxs: db * grid * sign, db = d * (0.5 + s) * 0.25."""
    for ib in range(8):
        o = o0 + 2 + 8 * ib
        aux1 = (np.uint32(raw[o + 4]) | (np.uint32(raw[o + 5]) << np.uint32(8))
                | (np.uint32(raw[o + 6]) << np.uint32(16)) | (np.uint32(raw[o + 7]) << np.uint32(24)))
        db = d * (np.float32(0.5) + np.float32(aux1 >> np.uint32(28))) * np.float32(0.25)
        base = y0 + 32 * ib
        for l in range(4):
            g = raw[o + l]
            sg = (aux1 >> np.uint32(7 * l)) & np.uint32(127)
            for j in range(8):
                y[base + 8 * l + j] = db * grid_values[g, j] * signs[sg, j]


@njit(cache=True)
def iq2_xxs_dequantize_block(ib, grid_values, signs, yb):
    _decode_superblock(ib, 0, fp16_to_fp32(fp16_bits(ib, 0)), grid_values, signs, yb, 0)


@njit(parallel=True, cache=True)
def _iq2_xxs_quantize(x, imatrix, code_map, neighbours, out):
    rows, n = x.shape
    nbl = n // QK_K
    for r in prange(rows):
        scratch = np.empty((6, SCRATCH), np.float32)
        ints = np.empty((4, 36), np.int64)
        for b in range(nbl):
            iq2_xxs_quantize_block(x[r, b * QK_K:(b + 1) * QK_K], imatrix[b * QK_K:(b + 1) * QK_K],
                                   code_map, neighbours,
                                   out[r, b * BLOCK_BYTES:(b + 1) * BLOCK_BYTES], scratch, ints)


@njit(parallel=True, cache=True)
def _iq2_xxs_dequantize(raw, lut, grid_values, signs, out):
    rows, n = out.shape
    for r in prange(rows):
        for b in range(n // QK_K):
            o = b * BLOCK_BYTES
            d = lut[np.int64(raw[r, o]) | (np.int64(raw[r, o + 1]) << 8)]
            _decode_superblock(raw[r], o, d, grid_values, signs, out[r], b * QK_K)


@njit(parallel=True, fastmath=True, cache=True)
def _iq2_xxs_matmul(raw, lut, grid_u64, sign_mask_u64, x, out, chunk):
    # A row decodes to db * level * sign with db = d * (0.5 + s) * 0.25, as ggml's dequantizer:
    # the signed int8 levels come from _simd.unpack_iq2_xxs_blocks (sign * level is exact, so
    # db * (sign * level) equals (db * level) * sign bit for bit).
    n_out = raw.shape[0]
    k, n_in = x.shape
    nbl = n_in // QK_K
    for c in prange((n_out + chunk - 1) // chunk):
        q = np.empty(n_in, np.int8)
        ls = np.empty(n_in // 32, np.int32)
        w = np.empty(n_in, np.float32)
        for r in range(c * chunk, min(n_out, (c + 1) * chunk)):
            row = raw[r]
            _simd.unpack_iq2_xxs_blocks(row, grid_u64, sign_mask_u64, q, ls, nbl)
            for b in range(nbl):
                o = b * BLOCK_BYTES
                d = lut[np.int64(row[o]) | (np.int64(row[o + 1]) << 8)]
                for ib in range(8):
                    # ls = 2s + 1: d * (0.5 + s) * 0.25 with 0.5 + s = ls / 2 exactly
                    db = d * (np.float32(0.5) + np.float32((ls[8 * b + ib] - 1) >> 1)) * np.float32(0.25)
                    lo = b * QK_K + 32 * ib
                    for j in range(32):
                        w[lo + j] = db * np.float32(q[lo + j])
            for t in range(k):
                acc = np.float32(0.0)
                for i in range(n_in):
                    acc += w[i] * x[t, i]
                out[t, r] = acc


# --- int8 activations (ggml's vec_dot_type for IQ2_XXS is Q8_K: int8 per 256, float scale) ---


# The int8 path is Q8_0's driver (legacy.matmul_q8_tiles, kind KIND_IQ2_XXS): a row unpacked by
# _int8dot.UNPACK_IQ2_XXS to signed levels + 128 (unsigned bytes, as Q8_0's) with per 32-block
# float scales d * (2s + 1) / 8, dotted with the Q8_K activations handed over per 32-block
# (the scale per 256 repeated, the sums of 16 paired) by the tiles; one or two tokens take
# _int8dot's fused kernels (FUSED1_IQ2_XXS, FUSED2_IQ2_XXS: a row unpacked in registers with
# byte-table lookups, the activations in the slot order), same bits. ggml sums the block dots
# times 2s + 1 in int32 per super-block first; here each block's exact dot is scaled in float:
# the same product, rounded per block.

#: the grid points' eight int8 levels as one uint64 each, and per 7-bit sign pattern a uint64
#: with 0xFF in the bytes to negate (the float path builds 32 signed levels from 4 + 4 loads)
_GRID_U64 = np.ascontiguousarray(_GRID_I8).view(np.uint64).reshape(256)
_SIGN_MASK_U64 = np.where(_SIGNS_I8 < 0, 0xFF, 0).astype(np.uint8).view(np.uint64).reshape(128)
assert tuple(int(v) for v in np.abs(_GRID_I8).view(np.uint64).reshape(256)) == IQ2_XXS_GRID
#: output rows per parallel chunk of the float matmul (scratch is allocated once per chunk)
_Q8_CHUNK = 32


@register
class IQ2_XXS(QuantFormat):
    name, ggml_type, block_size, type_size = "IQ2_XXS", T.IQ2_XXS, QK_K, BLOCK_BYTES
    uses_imatrix = True
    requires_imatrix = True  # ggml_quantize_requires_imatrix
    act_type = "Q8_K"
    int8_min_row = INT8_MIN_ROW_FUSED  # the smallest row (one super-block): see legacy.py
    #: the int8 path's numba kernel (for the assembly checks)
    q8_kernel = _matmul_q8

    def _cpu_quantize(self, x, imatrix):
        code_map, neighbours = search_tables()
        out = np.empty((x.shape[0], self.row_bytes(x.shape[1])), np.uint8)
        _iq2_xxs_quantize(x, imatrix, code_map, neighbours, out)
        return out

    def _cpu_dequantize(self, raw, n_per_row):
        out = np.empty((raw.shape[0], n_per_row), np.float32)
        _iq2_xxs_dequantize(raw, FP16_TO_FP32, GRID_VALUES, SIGN_FACTORS, out)
        return out

    def _cpu_matmul(self, raw, x, out):
        _iq2_xxs_matmul(raw, FP16_TO_FP32, _GRID_U64, _SIGN_MASK_U64, x, out, _Q8_CHUNK)

    def _cpu_matmul_q8(self, raw, act, out):
        matmul_q8_tiles(KIND_IQ2_XXS, raw, act, out)

    def _cuda_quantize(self, x, imatrix):
        from .cuda import iq as k
        return k.quantize_iq2_xxs(x, imatrix)

    def _cuda_dequantize(self, raw, n_per_row):
        from .cuda import iq as k
        return k.dequantize_iq2_xxs(raw, n_per_row)
