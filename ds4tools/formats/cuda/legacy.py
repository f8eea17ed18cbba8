"""CUDA kernels for the 32-element block formats: one thread per block, same block functions."""
import numpy as np
from numba import cuda, float32, uint8

from .. import legacy as L
from . import grid


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


_QUANTIZE = {"Q8_0": _q8_0_quantize}
_DEQUANTIZE = {"Q8_0": _q8_0_dequantize}


def quantize(fmt, x, imatrix):
    blocks = x.reshape(-1, fmt.block_size)
    d_out = cuda.device_array((blocks.shape[0], fmt.type_size), np.uint8)
    g, t = grid(blocks.shape[0])
    _QUANTIZE[fmt.name][g, t](cuda.to_device(blocks), d_out)
    return d_out.copy_to_host().reshape(x.shape[0], -1)


def dequantize(fmt, raw, n_per_row):
    blocks = raw.reshape(-1, fmt.type_size)
    d_out = cuda.device_array((blocks.shape[0], fmt.block_size), np.float32)
    g, t = grid(blocks.shape[0])
    _DEQUANTIZE[fmt.name][g, t](cuda.to_device(blocks), d_out)
    return d_out.copy_to_host().reshape(raw.shape[0], n_per_row)
