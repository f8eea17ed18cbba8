"""Fused dequantize-matmul kernels: ``out = x @ W.T`` with W read from its raw GGUF blocks.

The weights stay on the GPU as the uint8 block bytes of their format (``raw``: one row of W per
row of bytes); each kernel decodes them in registers as it goes, never writing a float copy.

Thread layout (matmul)
----------------------
* One warp (32 threads) per output row ``j`` of W at a time; a block holds WARPS_PER_BLOCK
  warps, so ``blockIdx.x`` picks WARPS_PER_BLOCK consecutive rows of W; past MAX_WARPS rows
  a warp goes on to its row plus the grid's warp count.
* The activation rows ``t`` go in groups of up to ROWS_PER_GROUP (the smallest of 1, 2, 4, 8
  that holds the batch: a kernel per group size, so one-token decoding does no spare work);
  ``blockIdx.y`` picks the group. A lane keeps one float32 accumulator per row of its group, so
  every weight byte it decodes is read once per group and multiplied into all of the group's
  rows.
* A row of W is cut into fixed 32-element *items*: a block of Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 or
  IQ4_NL, one eighth of a 256-element super-block of the K-quants or IQ2_XXS. Lane ``l`` takes
  items l, l + 32, l + 64, ... in that order; within an item the elements are visited in one
  fixed order per format. Float formats (F32, F16, BF16) use single elements as items, so a
  warp reads 32 consecutive weights at a time (coalesced) and any row length works.
* The 32 lane sums then go to shared memory, and one lane per output adds them in lane
  order and writes the total. (Under numba's simulator a warp takes up to 32 // group rows of
  W per round, so that one barrier serves them all: scheduling only, the same operations.)

Why the results are batch-invariant
-----------------------------------
Nothing in the sequence of float operations that makes ``out[t, j]`` depends on how many rows
``x`` has or which rows share its group: the item split, the lane order, the per-item element
order and the reduction tree are fixed by ``n_in`` alone, and each accumulator only ever sees
its own row (a row's sequence of operations is the same in a group of any size). A group that
runs past the last row of ``x`` repeats the last row into its spare accumulators (clamped
index, no branch) and does not write them. There are no atomics.
So a token alone and the same token inside any batch give bit-identical outputs.

The reduction goes through shared memory and ``syncthreads`` rather than warp shuffles: numba's
CUDA simulator, which runs the tests, has no shuffles, and a tree of the same shape would give
the same bits anyway.

Decoding is written once per format, as a factory taking a *sink*: the matmul kernels pass a
sink that multiplies the weight into the group's rows, ``dequantize_rows`` one that stores it.
Both therefore see exactly the floats of ``ds4tools.formats.dequantize`` (the same operations
in the same order; ``ds4tools.formats.cuda`` makes NVVM keep ``a * b + c`` as two roundings).
"""
from __future__ import annotations

import numpy as np
from numba import config, cuda, float32

from ....formats import byte_shape
from ....formats import cuda as _formats_cuda  # noqa: F401  (installs the no-FMA NVVM option)
from ....formats._numeric import FP16_TO_FP32
from ....formats.iq2_xxs import GRID_VALUES as IQ2_XXS_GRID_VALUES, KSIGNS as IQ2_XXS_KSIGNS
from ....formats.iq4_nl import KVALUES as IQ4_NL_VALUES

SUPPORTED: tuple[str, ...] = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                              "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ2_XXS")

WARP = 32
#: warps (= rows of W) per block of the matmul kernels
WARPS_PER_BLOCK = 4
#: activation rows whose accumulators a lane holds at once (one pass over the weights each)
ROWS_PER_GROUP = 8
#: the group sizes compiled: a batch of k rows takes the smallest that holds min(k, 8) rows
GROUP_SIZES = (1, 2, 4, 8)
#: most warps a launch starts (each takes every MAX_WARPS-th row of W): plenty to fill a GPU
#: (an H200 holds 132 x 64 warps). Under numba's simulator, which runs a Python thread per CUDA
#: thread, one block's worth. Which warp computes a row never changes its bits.
MAX_WARPS = WARPS_PER_BLOCK if config.ENABLE_CUDASIM else 1 << 14
#: threads per block of the dequantize_rows kernels (one item each)
DEQUANT_THREADS = 128

_MATMUL_THREADS = WARP * WARPS_PER_BLOCK


# --- sinks: what a decoder does with each weight it decodes -----------------------------------


def _accumulate_into_group(rows_per_group):
    @cuda.jit(device=True)
    def sink(weight, column, x, first_row, acc):
        # acc[r] += weight * x[first_row + r, column]; rows past the end of x repeat the last
        # one (their accumulators are never written out): no data-dependent branch.
        last_row = x.shape[0] - 1
        for r in range(rows_per_group):
            acc[r] += weight * x[min(first_row + r, last_row), column]
    return sink


@cuda.jit(device=True)
def _store_weight(weight, column, out, out_row, unused_acc):
    out[out_row, column] = weight


# --- shared bit helpers -----------------------------------------------------------------------


@cuda.jit(device=True)
def _fp16_scale(raw, row, offset, fp16_table):
    # little-endian fp16 bit pattern at raw[row, offset:offset + 2], decoded through the table
    return fp16_table[np.int32(raw[row, offset]) | (np.int32(raw[row, offset + 1]) << 8)]


@cuda.jit(device=True)
def _signed_byte(byte):
    v = np.int32(byte)
    return v - ((v & 0x80) << 1)


@cuda.jit(device=True)
def _u32_at(raw, row, offset):
    return (np.int64(raw[row, offset]) | (np.int64(raw[row, offset + 1]) << 8)
            | (np.int64(raw[row, offset + 2]) << 16) | (np.int64(raw[row, offset + 3]) << 24))


@cuda.jit(device=True)
def _q3_k_scale(raw, row, offset, j):
    # sub-block j's signed 6-bit scale from Q3_K's 12 packed scale bytes at raw[row, offset]
    if j < 8:
        low = np.int32(raw[row, offset + j]) & 0xF
    else:
        low = np.int32(raw[row, offset + j - 8]) >> 4
    high = (np.int32(raw[row, offset + 8 + j % 4]) >> (2 * (j // 4))) & 3
    return (low | (high << 4)) - 32


@cuda.jit(device=True)
def _k4_scale(raw, row, offset, j):
    # Q4_K/Q5_K: the 6-bit scale of 32-element sub-block j (ggml's get_scale_min_k4)
    if j < 4:
        return np.int32(raw[row, offset + j]) & 63
    low = np.int32(raw[row, offset + j + 4]) & 0xF
    return low | ((np.int32(raw[row, offset + j - 4]) >> 6) << 4)


@cuda.jit(device=True)
def _k4_min(raw, row, offset, j):
    # Q4_K/Q5_K: the 6-bit min of 32-element sub-block j (ggml's get_scale_min_k4)
    if j < 4:
        return np.int32(raw[row, offset + j + 4]) & 63
    low = np.int32(raw[row, offset + j + 4]) >> 4
    return low | ((np.int32(raw[row, offset + j]) >> 6) << 4)


# --- decoders: one 32-element item (one element for float formats) -> sink -------------------
# Every decoder has the signature (raw, row, item, fp16_table, table_a, table_b, buf, t, acc)
# and calls sink(weight, column, buf, t, acc) for each of its elements in a fixed order. The
# arithmetic is that of ds4tools.formats' dequantizers, operation for operation.


def _f32_decoder(sink):
    @cuda.jit(device=True)
    def decode(raw, row, item, fp16_table, table_a, table_b, buf, t, acc):
        sink(raw[row, item], item, buf, t, acc)  # raw viewed as float32
    return decode


def _f16_decoder(sink):
    @cuda.jit(device=True)
    def decode(raw, row, item, fp16_table, table_a, table_b, buf, t, acc):
        sink(fp16_table[raw[row, item]], item, buf, t, acc)  # raw viewed as uint16
    return decode


def _bf16_decoder(sink):
    @cuda.jit(device=True)
    def decode(raw, row, item, fp16_table, table_a, table_b, buf, t, acc):
        # table_a: bf16 bit pattern -> float32 (numba has no bit cast; the table is exact, NaNs too)
        sink(table_a[raw[row, item]], item, buf, t, acc)  # raw viewed as uint16
    return decode


def _q8_0_decoder(sink):
    @cuda.jit(device=True)
    def decode(raw, row, item, fp16_table, table_a, table_b, buf, t, acc):
        offset = item * 34
        d = _fp16_scale(raw, row, offset, fp16_table)
        for l in range(32):
            sink(d * np.float32(_signed_byte(raw[row, offset + 2 + l])), item * 32 + l, buf, t, acc)
    return decode


def _q4_0_decoder(sink):
    @cuda.jit(device=True)
    def decode(raw, row, item, fp16_table, table_a, table_b, buf, t, acc):
        offset = item * 18
        d = _fp16_scale(raw, row, offset, fp16_table)
        for l in range(16):
            v = np.int32(raw[row, offset + 2 + l])
            sink(np.float32((v & 0xF) - 8) * d, item * 32 + l, buf, t, acc)
            sink(np.float32((v >> 4) - 8) * d, item * 32 + 16 + l, buf, t, acc)
    return decode


def _q4_1_decoder(sink):
    @cuda.jit(device=True)
    def decode(raw, row, item, fp16_table, table_a, table_b, buf, t, acc):
        offset = item * 20
        d = _fp16_scale(raw, row, offset, fp16_table)
        m = _fp16_scale(raw, row, offset + 2, fp16_table)
        for l in range(16):
            v = np.int32(raw[row, offset + 4 + l])
            sink(np.float32(v & 0xF) * d + m, item * 32 + l, buf, t, acc)
            sink(np.float32(v >> 4) * d + m, item * 32 + 16 + l, buf, t, acc)
    return decode


def _q5_0_decoder(sink):
    @cuda.jit(device=True)
    def decode(raw, row, item, fp16_table, table_a, table_b, buf, t, acc):
        offset = item * 22
        d = _fp16_scale(raw, row, offset, fp16_table)
        high_bits = _u32_at(raw, row, offset + 2)
        for l in range(16):
            v = np.int32(raw[row, offset + 6 + l])
            q0 = (v & 0xF) | np.int32(((high_bits >> l) << 4) & 0x10)
            q1 = (v >> 4) | np.int32((high_bits >> (l + 12)) & 0x10)
            sink(np.float32(q0 - 16) * d, item * 32 + l, buf, t, acc)
            sink(np.float32(q1 - 16) * d, item * 32 + 16 + l, buf, t, acc)
    return decode


def _q5_1_decoder(sink):
    @cuda.jit(device=True)
    def decode(raw, row, item, fp16_table, table_a, table_b, buf, t, acc):
        offset = item * 24
        d = _fp16_scale(raw, row, offset, fp16_table)
        m = _fp16_scale(raw, row, offset + 2, fp16_table)
        high_bits = _u32_at(raw, row, offset + 4)
        for l in range(16):
            v = np.int32(raw[row, offset + 8 + l])
            q0 = (v & 0xF) | np.int32(((high_bits >> l) << 4) & 0x10)
            q1 = (v >> 4) | np.int32((high_bits >> (l + 12)) & 0x10)
            sink(np.float32(q0) * d + m, item * 32 + l, buf, t, acc)
            sink(np.float32(q1) * d + m, item * 32 + 16 + l, buf, t, acc)
    return decode


def _iq4_nl_decoder(sink):
    @cuda.jit(device=True)
    def decode(raw, row, item, fp16_table, table_a, table_b, buf, t, acc):
        # table_a: the 16 non-linear levels
        offset = item * 18
        d = _fp16_scale(raw, row, offset, fp16_table)
        for l in range(16):
            v = np.int32(raw[row, offset + 2 + l])
            sink(d * table_a[v & 0xF], item * 32 + l, buf, t, acc)
            sink(d * table_a[v >> 4], item * 32 + 16 + l, buf, t, acc)
    return decode


# K-quants and IQ2_XXS: item i is elements 32 * (i % 8) .. + 31 of super-block i // 8.


def _q2_k_decoder(sink):
    # super-block: scales[16] (4-bit scale | 4-bit min), qs[64] (2 bits), fp16 d, fp16 dmin
    @cuda.jit(device=True)
    def decode(raw, row, item, fp16_table, table_a, table_b, buf, t, acc):
        offset = (item // 8) * 84
        part = item % 8
        d = _fp16_scale(raw, row, offset + 80, fp16_table)
        dmin = _fp16_scale(raw, row, offset + 82, fp16_table)
        quants = offset + 16 + 32 * (part // 4)
        shift = 2 * (part % 4)
        for half in range(2):
            scale_byte = np.int32(raw[row, offset + 2 * part + half])
            dl = d * np.float32(scale_byte & 0xF)
            ml = dmin * np.float32(scale_byte >> 4)
            for l in range(16 * half, 16 * half + 16):
                q = (np.int32(raw[row, quants + l]) >> shift) & 3
                sink(dl * np.float32(q) - ml, item * 32 + l, buf, t, acc)
    return decode


def _q3_k_decoder(sink):
    # super-block: hmask[32], qs[64] (2 low bits), scales[12] (16 x 6 bits), fp16 d
    @cuda.jit(device=True)
    def decode(raw, row, item, fp16_table, table_a, table_b, buf, t, acc):
        offset = (item // 8) * 110
        part = item % 8
        d_all = _fp16_scale(raw, row, offset + 108, fp16_table)
        quants = offset + 32 + 32 * (part // 4)
        shift = 2 * (part % 4)
        for half in range(2):
            dl = d_all * np.float32(_q3_k_scale(raw, row, offset + 96, 2 * part + half))
            for l in range(16 * half, 16 * half + 16):
                q = (np.int32(raw[row, quants + l]) >> shift) & 3
                # a clear high bit means the level sits 4 lower (ggml's hmask convention)
                q -= 4 * (1 - ((np.int32(raw[row, offset + l]) >> part) & 1))
                sink(dl * np.float32(q), item * 32 + l, buf, t, acc)
    return decode


def _q45_k_decoder(sink, five_bits):
    # super-block: fp16 d, fp16 dmin, scales[12] (8 x 6-bit scale and min), [qh[32]], qs[128]
    type_size = 176 if five_bits else 144
    quants_at = 48 if five_bits else 16

    @cuda.jit(device=True)
    def decode(raw, row, item, fp16_table, table_a, table_b, buf, t, acc):
        offset = (item // 8) * type_size
        part = item % 8
        d = _fp16_scale(raw, row, offset, fp16_table)
        dmin = _fp16_scale(raw, row, offset + 2, fp16_table)
        d1 = d * np.float32(_k4_scale(raw, row, offset + 4, part))
        m1 = dmin * np.float32(_k4_min(raw, row, offset + 4, part))
        quants = offset + quants_at + 32 * (part // 2)
        shift = 4 * (part % 2)
        for l in range(32):
            q = (np.int32(raw[row, quants + l]) >> shift) & 0xF
            if five_bits:  # a compile-time constant: the branch is folded away
                q |= ((np.int32(raw[row, offset + 16 + l]) >> part) & 1) << 4
            sink(d1 * np.float32(q) - m1, item * 32 + l, buf, t, acc)
    return decode


def _q6_k_decoder(sink):
    # super-block: ql[128] (4 low bits), qh[64] (2 high bits), int8 scales[16], fp16 d
    @cuda.jit(device=True)
    def decode(raw, row, item, fp16_table, table_a, table_b, buf, t, acc):
        offset = (item // 8) * 210
        part = item % 8
        upper = part // 4     # which 128-element half of the super-block
        quarter = part % 4    # which 32-element quarter of that half
        d = _fp16_scale(raw, row, offset + 208, fp16_table)
        low_bytes = offset + 64 * upper + 32 * (quarter & 1)
        low_shift = 4 * (quarter >> 1)
        high_bytes = offset + 128 + 32 * upper
        for half in range(2):
            dl = d * np.float32(_signed_byte(raw[row, offset + 192 + 2 * part + half]))
            for l in range(16 * half, 16 * half + 16):
                low = (np.int32(raw[row, low_bytes + l]) >> low_shift) & 0xF
                high = (np.int32(raw[row, high_bytes + l]) >> (2 * quarter)) & 3
                sink(dl * np.float32((low | (high << 4)) - 32), item * 32 + l, buf, t, acc)
    return decode


def _iq2_xxs_decoder(sink):
    # super-block: fp16 d, then per 32 elements 8 bytes: 4 grid indices, then a little-endian
    # u32 of 4 x 7 sign bits and a 4-bit scale. table_a: grid (256, 8); table_b: ksigns (128,).
    @cuda.jit(device=True)
    def decode(raw, row, item, fp16_table, table_a, table_b, buf, t, acc):
        offset = (item // 8) * 66
        group = offset + 2 + 8 * (item % 8)
        d = _fp16_scale(raw, row, offset, fp16_table)
        aux = _u32_at(raw, row, group + 4)
        db = d * (np.float32(0.5) + np.float32(aux >> 28)) * np.float32(0.25)
        for l in range(4):
            grid_index = np.int32(raw[row, group + l])
            signs = np.int32(table_b[(aux >> (7 * l)) & 127])
            for e in range(8):
                w = db * table_a[grid_index, e]
                if (signs >> e) & 1:
                    w = -w  # exact, like the CPU's multiply by -1
                sink(w, item * 32 + 8 * l + e, buf, t, acc)
    return decode


#: name -> (decoder factory, elements per item, dtype the raw bytes are viewed as or None)
_DECODERS = {
    "F32": (_f32_decoder, 1, np.float32),
    "F16": (_f16_decoder, 1, np.uint16),
    "BF16": (_bf16_decoder, 1, np.uint16),
    "Q8_0": (_q8_0_decoder, 32, None),
    "Q4_0": (_q4_0_decoder, 32, None),
    "Q4_1": (_q4_1_decoder, 32, None),
    "Q5_0": (_q5_0_decoder, 32, None),
    "Q5_1": (_q5_1_decoder, 32, None),
    "Q2_K": (_q2_k_decoder, 32, None),
    "Q3_K": (_q3_k_decoder, 32, None),
    "Q4_K": (lambda sink: _q45_k_decoder(sink, False), 32, None),
    "Q5_K": (lambda sink: _q45_k_decoder(sink, True), 32, None),
    "Q6_K": (_q6_k_decoder, 32, None),
    "IQ4_NL": (_iq4_nl_decoder, 32, None),
    "IQ2_XXS": (_iq2_xxs_decoder, 32, None),
}
assert tuple(_DECODERS) == SUPPORTED


# --- kernel factories -------------------------------------------------------------------------


def _build_matmul_kernel(decode, elements_per_item, rows_per_group):
    # shared slots per warp: (row of W taken this round, row of the group) pairs
    slots = WARP if config.ENABLE_CUDASIM else rows_per_group

    @cuda.jit
    def kernel(raw, x, out, fp16_table, table_a, table_b, w_rows_per_warp):
        # two buffers, alternating by round: one barrier per round. One spare column: lanes
        # reading column i of different slots hit different banks.
        lane_sums = cuda.shared.array((2, WARPS_PER_BLOCK, slots, WARP + 1), float32)
        warp = cuda.threadIdx.x // WARP
        lane = cuda.threadIdx.x % WARP
        n_rows = raw.shape[0]
        rows_per_round = cuda.gridDim.x * WARPS_PER_BLOCK * w_rows_per_warp
        first_row = cuda.blockIdx.y * rows_per_group
        acc = cuda.local.array(rows_per_group, float32)
        n_slots = w_rows_per_warp * rows_per_group
        buf = 0
        # every thread of the block runs the same number of rounds (no early exit: all must
        # reach the barrier)
        for round_start in range(0, n_rows, rows_per_round):
            warp_first = round_start + (cuda.blockIdx.x * WARPS_PER_BLOCK + warp) * w_rows_per_warp
            for j in range(w_rows_per_warp):
                row = warp_first + j
                for r in range(rows_per_group):
                    acc[r] = float32(0.0)
                if row < n_rows:
                    for item in range(lane, x.shape[1] // elements_per_item, WARP):
                        decode(raw, row, item, fp16_table, table_a, table_b, x, first_row, acc)
                for r in range(rows_per_group):
                    lane_sums[buf, warp, j * rows_per_group + r, lane] = acc[r]
            cuda.syncthreads()
            # lane s adds the 32 lane sums of slot s in lane order (the order fixed by n_in
            # alone) and writes that output
            if lane < n_slots:
                row = warp_first + lane // rows_per_group
                t = first_row + lane % rows_per_group
                if row < n_rows and t < x.shape[0]:
                    total = lane_sums[buf, warp, lane, 0]
                    for other in range(1, WARP):
                        total += lane_sums[buf, warp, lane, other]
                    out[t, row] = total
            buf = 1 - buf  # the next round writes the other buffer while this one is read
    return kernel


def _build_expert_kernel(decode, elements_per_item):
    # the matmul kernel with groups of one row, where each (row, slot) pair p reads its own
    # expert's matrix: out[p] = x[p // n_used] @ W[expert[p]].T (blockIdx.y = p)
    slots = WARP if config.ENABLE_CUDASIM else 1

    @cuda.jit
    def kernel(raw3, x, expert, n_used, out, fp16_table, table_a, table_b, w_rows_per_warp):
        lane_sums = cuda.shared.array((2, WARPS_PER_BLOCK, slots, WARP + 1), float32)
        warp = cuda.threadIdx.x // WARP
        lane = cuda.threadIdx.x % WARP
        pair = cuda.blockIdx.y
        raw = raw3[expert[pair]]
        x_row = pair // n_used
        n_rows = raw.shape[0]
        rows_per_round = cuda.gridDim.x * WARPS_PER_BLOCK * w_rows_per_warp
        acc = cuda.local.array(1, float32)
        buf = 0
        for round_start in range(0, n_rows, rows_per_round):
            warp_first = round_start + (cuda.blockIdx.x * WARPS_PER_BLOCK + warp) * w_rows_per_warp
            for j in range(w_rows_per_warp):
                row = warp_first + j
                acc[0] = float32(0.0)
                if row < n_rows:
                    for item in range(lane, x.shape[1] // elements_per_item, WARP):
                        decode(raw, row, item, fp16_table, table_a, table_b, x, x_row, acc)
                lane_sums[buf, warp, j, lane] = acc[0]
            cuda.syncthreads()
            if lane < w_rows_per_warp:
                row = warp_first + lane
                if row < n_rows:
                    total = lane_sums[buf, warp, lane, 0]
                    for other in range(1, WARP):
                        total += lane_sums[buf, warp, lane, other]
                    out[pair, row] = total
            buf = 1 - buf
    return kernel


def _build_dequantize_kernel(decode, elements_per_item):
    @cuda.jit
    def kernel(raw, ids, out, fp16_table, table_a, table_b):
        # one thread per (requested row, item)
        i = cuda.grid(1)
        items_per_row = out.shape[1] // elements_per_item
        if i < out.shape[0] * items_per_row:
            t = i // items_per_row
            unused_acc = cuda.local.array(1, float32)  # the store sink has no accumulators
            decode(raw, ids[t], i % items_per_row, fp16_table, table_a, table_b, out, t, unused_acc)
    return kernel


class _FormatKernels:
    __slots__ = ("factory", "_matmul", "_experts", "dequantize", "elements_per_item", "view_dtype",
                 "tables")

    def __init__(self, name):
        self.factory, self.elements_per_item, self.view_dtype = _DECODERS[name]
        self._matmul = {}
        self._experts = None
        self.dequantize = _build_dequantize_kernel(self.factory(_store_weight), self.elements_per_item)
        self.tables = _device_tables(name)

    def experts(self):
        """The per-pair expert kernel (built on first use)."""
        if self._experts is None:
            self._experts = _build_expert_kernel(self.factory(_accumulate_into_group(1)),
                                                 self.elements_per_item)
        return self._experts

    def matmul(self, rows_per_group: int):
        """The matmul kernel for groups of ``rows_per_group`` rows (built on first use)."""
        kernel = self._matmul.get(rows_per_group)
        if kernel is None:
            kernel = self._matmul[rows_per_group] = _build_matmul_kernel(
                self.factory(_accumulate_into_group(rows_per_group)), self.elements_per_item,
                rows_per_group)
        return kernel


_KERNELS: dict[str, _FormatKernels] = {}
_TABLES: dict[str, object] = {}


def _uploaded(key, make):
    # lookup tables go to the device once per process, on first use
    if key not in _TABLES:
        _TABLES[key] = cuda.to_device(np.ascontiguousarray(make()))
    return _TABLES[key]


def _device_tables(name):
    fp16 = _uploaded("fp16", lambda: FP16_TO_FP32)
    placeholder = _uploaded("placeholder", lambda: np.zeros(1, np.float32))
    if name == "BF16":
        bf16 = _uploaded("bf16", lambda: (np.arange(65536, dtype=np.uint32) << 16).view(np.float32))
        return fp16, bf16, placeholder
    if name == "IQ4_NL":
        return fp16, _uploaded("iq4_nl", lambda: IQ4_NL_VALUES), placeholder
    if name == "IQ2_XXS":
        return (fp16, _uploaded("iq2_xxs_grid", lambda: IQ2_XXS_GRID_VALUES),
                _uploaded("iq2_xxs_signs", lambda: IQ2_XXS_KSIGNS))
    return fp16, placeholder, placeholder


def _kernels(fmt_name: str) -> _FormatKernels:
    found = _KERNELS.get(fmt_name)
    if found is None:
        if fmt_name not in _DECODERS:
            raise ValueError(f"no CUDA matmul for {fmt_name!r} (supported: {', '.join(SUPPORTED)})")
        found = _KERNELS[fmt_name] = _FormatKernels(fmt_name)
    return found


def _device_array(a):
    # numba device arrays pass through; other __cuda_array_interface__ objects are wrapped
    return a if getattr(a, "__cuda_ndarray__", False) else cuda.as_cuda_array(a, sync=False)


def _check_dtype(a, dtype, what):
    # a wrong dtype would silently compile another specialization, with other rounding
    if np.dtype(a.dtype) != dtype:
        raise ValueError(f"{what} must be {np.dtype(dtype).name}, got {a.dtype}")


def _weight_view(kernels, fmt_name, raw, n_in):
    raw = _device_array(raw)
    _check_dtype(raw, np.uint8, "raw")
    if raw.ndim != 2 or tuple(raw.shape) != byte_shape((raw.shape[0], n_in), fmt_name):
        raise ValueError(f"raw has shape {tuple(raw.shape)}, expected {fmt_name} bytes "
                         f"{byte_shape((raw.shape[0], n_in), fmt_name)}")
    return raw if kernels.view_dtype is None else raw.view(kernels.view_dtype)


# --- public API -------------------------------------------------------------------------------


def matmul(fmt_name: str, raw, x, out) -> None:
    """out[t, j] = sum_i W[j, i] * x[t, i] for all rows t; raw: device uint8 (n_out, row_bytes);
    x: device float32 (k, n_in) C-contiguous; out: device float32 (k, n_out) C-contiguous.

    One launch, asynchronous on the default stream; any k >= 1. Each out[t, j] is bit-identical
    whatever k is and whichever rows share the launch (see the module docstring)."""
    kernels = _kernels(fmt_name)
    x, out = _device_array(x), _device_array(out)
    if x.ndim != 2 or out.ndim != 2:
        raise ValueError(
            f"x and out must be 2-D, got shapes {tuple(x.shape)} and {tuple(out.shape)}")
    _check_dtype(x, np.float32, "x")
    _check_dtype(out, np.float32, "out")
    k, n_in = x.shape
    weights = _weight_view(kernels, fmt_name, raw, n_in)
    n_out = weights.shape[0]
    if tuple(out.shape) != (k, n_out):
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {(k, n_out)}")
    if k == 0 or n_out == 0:
        return
    if k > ROWS_PER_GROUP * 65535:  # gridDim.y's limit
        raise ValueError(f"x has {k} rows; split it into launches of at most "
                         f"{ROWS_PER_GROUP * 65535}")
    group = next(g for g in GROUP_SIZES if g >= min(k, ROWS_PER_GROUP))
    # rows of W per warp and round: one on a GPU (many warps in flight); under the simulator
    # as many as the warp's 32 lanes can reduce at once (its cost is threads x barriers)
    w_rows_per_warp = WARP // group if config.ENABLE_CUDASIM else 1
    warps = min((n_out + w_rows_per_warp - 1) // w_rows_per_warp, MAX_WARPS)
    blocks = ((warps + WARPS_PER_BLOCK - 1) // WARPS_PER_BLOCK, (k + group - 1) // group)
    kernels.matmul(group)[blocks, _MATMUL_THREADS](weights, x, out, *kernels.tables,
                                                    w_rows_per_warp)


def expert_matmul(fmt_name: str, raw3, x, expert, n_used: int, out) -> None:
    """out[p] = x[p // n_used] @ W[expert[p]].T for every (row, slot) pair p: the routed
    experts of a mixture-of-experts block. raw3: device uint8 (n_expert, n_out, row_bytes);
    x: device float32 (k, n_in); expert: device int64 (k * n_used,) (not bounds-checked);
    out: device float32 (k * n_used, n_out). A pair gets the bits a plain ``matmul`` of its row
    by its expert's matrix gives (the same decoder, lanes and order). One asynchronous launch."""
    kernels = _kernels(fmt_name)
    x, out, expert = _device_array(x), _device_array(out), _device_array(expert)
    _check_dtype(x, np.float32, "x")
    _check_dtype(out, np.float32, "out")
    _check_dtype(expert, np.int64, "expert")
    raw3 = _device_array(raw3)
    _check_dtype(raw3, np.uint8, "raw3")
    n_pairs, n_in = expert.shape[0], x.shape[1]
    if raw3.ndim != 3 or tuple(raw3.shape[1:]) != byte_shape((raw3.shape[1], n_in), fmt_name):
        raise ValueError(f"raw3 has shape {tuple(raw3.shape)}, expected (n_expert,) + {fmt_name} "
                         f"bytes of rows of {n_in}")
    n_out = raw3.shape[1]
    if x.ndim != 2 or n_pairs != x.shape[0] * n_used or tuple(out.shape) != (n_pairs, n_out):
        raise ValueError(f"x {tuple(x.shape)}, expert {tuple(expert.shape)} and out "
                         f"{tuple(out.shape)} do not fit {n_used} experts per row of {n_out}")
    if n_pairs == 0 or n_out == 0:
        return
    weights = raw3 if kernels.view_dtype is None else raw3.view(kernels.view_dtype)
    w_rows_per_warp = WARP if config.ENABLE_CUDASIM else 1
    warps = min((n_out + w_rows_per_warp - 1) // w_rows_per_warp, MAX_WARPS)
    blocks = ((warps + WARPS_PER_BLOCK - 1) // WARPS_PER_BLOCK, n_pairs)
    kernels.experts()[blocks, _MATMUL_THREADS](weights, x, expert, n_used, out, *kernels.tables,
                                               w_rows_per_warp)


def dequantize_rows(fmt_name: str, raw, ids, out) -> None:
    """out[t, :] = row ids[t] of W decoded to float32 (the token-embedding lookup); ids device
    int64 (k,) (not bounds-checked: they stay on the device); out device float32 (k, n_in).
    Bit-identical to ``ds4tools.formats.dequantize`` of those rows. One asynchronous launch."""
    kernels = _kernels(fmt_name)
    out = _device_array(out)
    ids = _device_array(ids)
    _check_dtype(out, np.float32, "out")
    _check_dtype(ids, np.int64, "ids")
    if out.ndim != 2 or ids.ndim != 1 or ids.shape[0] != out.shape[0]:
        raise ValueError(f"ids must be (k,) and out (k, n_in); got {tuple(ids.shape)} and "
                         f"{tuple(out.shape)}")
    weights = _weight_view(kernels, fmt_name, raw, out.shape[1])
    n_threads = out.shape[0] * (out.shape[1] // kernels.elements_per_item)
    if n_threads == 0:
        return
    blocks = (n_threads + DEQUANT_THREADS - 1) // DEQUANT_THREADS
    kernels.dequantize[blocks, DEQUANT_THREADS](weights, ids, out, *kernels.tables)
