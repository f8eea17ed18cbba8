"""CUDA kernels for the 32-element block formats: one thread per block, same block functions.

The imatrix paths of Q4_0..Q5_1 scale the weights by the whole row's mean square (ggml's
sigma2), so they take two launches: one thread per row sums it (in order, through the same
@njit helper as the CPU), then one thread per block quantizes its block as a row of one.
"""
import numpy as np
from numba import cuda, float32, int32, uint8

from .. import legacy as L
from . import grid

INT_SCRATCH = L.weighted_int_scratch(32)
FLOAT_SCRATCH = L.weighted_float_scratch(32)


@cuda.jit
def _q8_0_quantize(x, out):
    i = cuda.grid(1)
    if i < out.shape[0]:
        xb = cuda.local.array(32, float32)
        ob = cuda.local.array(34, uint8)
        for j in range(32):
            xb[j] = x[i, j]
        L.q8_0_quantize_block(xb, ob)
        for j in range(34):
            out[i, j] = ob[j]


@cuda.jit
def _q8_0_dequantize(raw, out):
    i = cuda.grid(1)
    if i < out.shape[0]:
        ib = cuda.local.array(34, uint8)
        yb = cuda.local.array(32, float32)
        for j in range(34):
            ib[j] = raw[i, j]
        L.q8_0_dequantize_block(ib, yb)
        for j in range(32):
            out[i, j] = yb[j]


@cuda.jit
def _row_sigma2(x, sigma2):
    r = cuda.grid(1)
    if r < x.shape[0]:
        xb = cuda.local.array(32, float32)
        s = float32(0.0)
        for b in range(x.shape[1] // 32):
            for j in range(32):
                xb[j] = x[r, b * 32 + j]
            s = L.sum_squares_from(s, xb)
        sigma2[r] = L.mean_from_sum(s, x.shape[1])


@cuda.jit
def _quantize_blocks(kind, x, out):
    i = cuda.grid(1)
    nb = x.shape[1] // 32
    if i < x.shape[0] * nb:
        r = i // nb
        b = i % nb
        xb = cuda.local.array(32, float32)
        ob = cuda.local.array(24, uint8)
        q = cuda.local.array(32, int32)
        for j in range(32):
            xb[j] = x[r, b * 32 + j]
        L.quantize_block(kind, xb, ob, q)
        ts = out.shape[1] // nb
        for j in range(ts):
            out[r, b * ts + j] = ob[j]


@cuda.jit
def _quantize_blocks_weighted(kind, x, qw, sigma2, out):
    i = cuda.grid(1)
    nb = x.shape[1] // 32
    if i < x.shape[0] * nb:
        r = i // nb
        b = i % nb
        xb = cuda.local.array(32, float32)
        wq = cuda.local.array(32, float32)
        ob = cuda.local.array(24, uint8)
        iw = cuda.local.array(INT_SCRATCH, int32)
        fw = cuda.local.array(FLOAT_SCRATCH, float32)
        for j in range(32):
            xb[j] = x[r, b * 32 + j]
            wq[j] = qw[b * 32 + j]
        L.quantize_row_weighted(kind, xb, wq, sigma2[r], ob, iw, fw)
        ts = out.shape[1] // nb
        for j in range(ts):
            out[r, b * ts + j] = ob[j]


@cuda.jit
def _dequantize_blocks(kind, raw, out):
    i = cuda.grid(1)
    nb = out.shape[1] // 32
    if i < out.shape[0] * nb:
        r = i // nb
        b = i % nb
        ts = raw.shape[1] // nb
        ib = cuda.local.array(24, uint8)
        yb = cuda.local.array(32, float32)
        for j in range(ts):
            ib[j] = raw[r, b * ts + j]
        L.dequantize_block(kind, ib, yb)
        for j in range(32):
            out[r, b * 32 + j] = yb[j]


def quantize(fmt, x, imatrix):
    if fmt.name == "Q8_0":
        blocks = x.reshape(-1, fmt.block_size)
        d_out = cuda.device_array((blocks.shape[0], fmt.type_size), np.uint8)
        g, t = grid(blocks.shape[0])
        _q8_0_quantize[g, t](cuda.to_device(blocks), d_out)
        return d_out.copy_to_host().reshape(x.shape[0], -1)
    rows, n = x.shape
    kind = L.KIND[fmt.name]
    d_x = cuda.to_device(x)
    d_out = cuda.device_array((rows, fmt.row_bytes(n)), np.uint8)
    g, t = grid(rows * (n // 32))
    if imatrix is None:
        _quantize_blocks[g, t](kind, d_x, d_out)
    else:
        d_sigma2 = cuda.device_array(rows, np.float32)
        _row_sigma2[grid(rows)](d_x, d_sigma2)
        _quantize_blocks_weighted[g, t](kind, d_x, cuda.to_device(imatrix), d_sigma2, d_out)
    return d_out.copy_to_host()


def dequantize(fmt, raw, n_per_row):
    if fmt.name == "Q8_0":
        blocks = raw.reshape(-1, fmt.type_size)
        d_out = cuda.device_array((blocks.shape[0], fmt.block_size), np.float32)
        g, t = grid(blocks.shape[0])
        _q8_0_dequantize[g, t](cuda.to_device(blocks), d_out)
        return d_out.copy_to_host().reshape(raw.shape[0], n_per_row)
    d_out = cuda.device_array((raw.shape[0], n_per_row), np.float32)
    g, t = grid(raw.shape[0] * (n_per_row // 32))
    _dequantize_blocks[g, t](L.KIND[fmt.name], cuda.to_device(raw), d_out)
    return d_out.copy_to_host()
