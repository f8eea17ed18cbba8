"""CUDA kernels for IQ4_NL and IQ2_XXS: one thread per (super-)block, same block functions.

IQ2_XXS's search tables (43692 + ~120k entries) do not fit a thread's local memory or the
64 KB of constant memory, so its kernels read them (and the decoder's grid) from global memory: the @njit block
function takes them as arrays. The simulator hands kernels wrapped host arrays, which @njit
callees cannot take, so there ``global_table`` unwraps them; on a GPU it is an identity that
numba inlines away.
"""
import numpy as np
from numba import config, cuda, float32, int64, uint8

from .. import iq2_xxs as I2
from .. import iq4_nl as I4
from . import grid
from .._search import SCRATCH

if config.ENABLE_CUDASIM:
    def global_table(a):
        return a._item._ary
else:
    @cuda.jit(device=True, inline="always")
    def global_table(a):
        return a


# --- IQ4_NL ---------------------------------------------------------------------------------

_N_CANDIDATES = I4.N_CANDIDATES  # a plain global, so numba sees a compile-time constant

@cuda.jit
def _iq4_nl_quantize(x, w, use_qw, values, mids, steps, out):
    i = cuda.grid(1)
    if i < out.shape[0]:
        xb = cuda.local.array(32, float32)
        qw = cuda.local.array(32, float32)
        ob = cuda.local.array(18, uint8)
        weight = cuda.local.array(32, float32)
        cand = cuda.local.array((3, _N_CANDIDATES), float32)
        vals = cuda.local.array(16, float32)
        mid = cuda.local.array(15, float32)
        step = cuda.local.array(15, float32)
        for j in range(16):
            vals[j] = values[j]
        for j in range(15):
            mid[j] = mids[j]
            step[j] = steps[j]
        blocks_per_row = w.shape[0] // 32
        col = (i % blocks_per_row) * 32
        for j in range(32):
            xb[j] = x[i, j]
            qw[j] = w[col + j]
        I4.iq4_nl_quantize_block(xb, qw, use_qw, vals, mid, step, ob, weight, cand)
        for j in range(18):
            out[i, j] = ob[j]


@cuda.jit
def _iq4_nl_dequantize(raw, values, out):
    i = cuda.grid(1)
    if i < out.shape[0]:
        ib = cuda.local.array(18, uint8)
        yb = cuda.local.array(32, float32)
        vals = cuda.local.array(16, float32)
        for j in range(16):
            vals[j] = values[j]
        for j in range(18):
            ib[j] = raw[i, j]
        I4.iq4_nl_dequantize_block(ib, vals, yb)
        for j in range(32):
            out[i, j] = yb[j]


def quantize_iq4_nl(x, imatrix):
    rows, n = x.shape
    blocks = x.reshape(-1, 32)
    use_qw = imatrix is not None
    w = imatrix if use_qw else np.zeros(n, np.float32)
    d_out = cuda.device_array((blocks.shape[0], I4.BLOCK_BYTES), np.uint8)
    g, t = grid(blocks.shape[0])
    _iq4_nl_quantize[g, t](cuda.to_device(blocks), cuda.to_device(w), use_qw,
                           cuda.to_device(I4.KVALUES), cuda.to_device(I4.MIDPOINTS),
                           cuda.to_device(I4.STEPS), d_out)
    return d_out.copy_to_host().reshape(rows, -1)


def dequantize_iq4_nl(raw, n_per_row):
    blocks = raw.reshape(-1, I4.BLOCK_BYTES)
    d_out = cuda.device_array((blocks.shape[0], 32), np.float32)
    g, t = grid(blocks.shape[0])
    _iq4_nl_dequantize[g, t](cuda.to_device(blocks), cuda.to_device(I4.KVALUES), d_out)
    return d_out.copy_to_host().reshape(raw.shape[0], n_per_row)


# --- IQ2_XXS --------------------------------------------------------------------------------

@cuda.jit
def _iq2_xxs_quantize(x, w, code_map, neighbours, out):
    i = cuda.grid(1)
    if i < out.shape[0]:
        xbl = cuda.local.array(256, float32)
        qwl = cuda.local.array(256, float32)
        ob = cuda.local.array(66, uint8)
        scratch = cuda.local.array((6, SCRATCH), float32)
        ints = cuda.local.array((4, 36), int64)
        blocks_per_row = w.shape[0] // 256
        col = (i % blocks_per_row) * 256
        for j in range(256):
            xbl[j] = x[i, j]
            qwl[j] = w[col + j]
        I2.iq2_xxs_quantize_block(xbl, qwl, global_table(code_map), global_table(neighbours),
                                  ob, scratch, ints)
        for j in range(66):
            out[i, j] = ob[j]


@cuda.jit
def _iq2_xxs_dequantize(raw, grid_values, signs, out):
    i = cuda.grid(1)
    if i < out.shape[0]:
        ib = cuda.local.array(66, uint8)
        yb = cuda.local.array(256, float32)
        for j in range(66):
            ib[j] = raw[i, j]
        I2.iq2_xxs_dequantize_block(ib, global_table(grid_values), global_table(signs), yb)
        for j in range(256):
            out[i, j] = yb[j]


def quantize_iq2_xxs(x, imatrix):
    rows, n = x.shape
    code_map, neighbours = I2.search_tables()
    blocks = x.reshape(-1, 256)
    d_out = cuda.device_array((blocks.shape[0], I2.BLOCK_BYTES), np.uint8)
    g, t = grid(blocks.shape[0])
    _iq2_xxs_quantize[g, t](cuda.to_device(blocks), cuda.to_device(imatrix),
                            cuda.to_device(code_map), cuda.to_device(neighbours), d_out)
    return d_out.copy_to_host().reshape(rows, -1)


def dequantize_iq2_xxs(raw, n_per_row):
    blocks = raw.reshape(-1, I2.BLOCK_BYTES)
    d_out = cuda.device_array((blocks.shape[0], 256), np.float32)
    g, t = grid(blocks.shape[0])
    _iq2_xxs_dequantize[g, t](cuda.to_device(blocks), cuda.to_device(I2.GRID_VALUES),
                              cuda.to_device(I2.SIGN_FACTORS), d_out)
    return d_out.copy_to_host().reshape(raw.shape[0], n_per_row)
