"""CUDA kernels for the K-quants: one thread per 256-element super-block, same block functions.

ggml's K-quant imatrix paths only look inside the super-block (their sigma2 is the block's),
so one launch does it: the thread stages its floats, weights and scratch in local memory and
calls ``kquants.quantize_row`` on its super-block as a row of one.
"""
import numpy as np
from numba import cuda, float32, int32, uint8

from .. import kquants as K
from . import grid

QK_K = K.QK_K
MAX_TYPE_SIZE = max(K.TYPE_SIZE)
INT_SCRATCH = K.int_scratch(QK_K)
FLOAT_SCRATCH = K.float_scratch(QK_K)


@cuda.jit
def _quantize_blocks(kind, x, qw, weighted, out):
    i = cuda.grid(1)
    nb = x.shape[1] // QK_K
    if i < x.shape[0] * nb:
        r = i // nb
        b = i % nb
        xb = cuda.local.array(QK_K, float32)
        wq = cuda.local.array(QK_K, float32)
        ob = cuda.local.array(MAX_TYPE_SIZE, uint8)
        iw = cuda.local.array(INT_SCRATCH, int32)
        fw = cuda.local.array(FLOAT_SCRATCH, float32)
        for j in range(QK_K):
            xb[j] = x[r, b * QK_K + j]
            wq[j] = qw[b * QK_K + j]
        K.quantize_row(kind, xb, wq, weighted, ob, iw, fw)
        ts = out.shape[1] // nb
        for j in range(ts):
            out[r, b * ts + j] = ob[j]


@cuda.jit
def _dequantize_blocks(kind, raw, out):
    i = cuda.grid(1)
    nb = out.shape[1] // QK_K
    if i < out.shape[0] * nb:
        r = i // nb
        b = i % nb
        ts = raw.shape[1] // nb
        ib = cuda.local.array(MAX_TYPE_SIZE, uint8)
        yb = cuda.local.array(QK_K, float32)
        for j in range(ts):
            ib[j] = raw[r, b * ts + j]
        K.dequantize_block(kind, ib, yb)
        for j in range(QK_K):
            out[r, b * QK_K + j] = yb[j]


def quantize(fmt, x, imatrix):
    rows, n = x.shape
    weighted = imatrix is not None
    qw = imatrix if weighted else np.zeros(n, np.float32)
    d_out = cuda.device_array((rows, fmt.row_bytes(n)), np.uint8)
    g, t = grid(rows * (n // QK_K))
    _quantize_blocks[g, t](K.KIND[fmt.name], cuda.to_device(x), cuda.to_device(qw), weighted, d_out)
    return d_out.copy_to_host()


def dequantize(fmt, raw, n_per_row):
    d_out = cuda.device_array((raw.shape[0], n_per_row), np.float32)
    g, t = grid(raw.shape[0] * (n_per_row // QK_K))
    _dequantize_blocks[g, t](K.KIND[fmt.name], cuda.to_device(raw), d_out)
    return d_out.copy_to_host()
