"""CUDA kernels for F32, F16 and BF16 (one thread per element)."""
import numpy as np
from numba import cuda

from ..floats import f32_bits_to_f16
from .._numeric import FP16_TO_FP32
from . import grid


@cuda.jit
def _f16_kernel(bits, out):
    i = cuda.grid(1)
    if i < bits.shape[0]:
        out[i] = f32_bits_to_f16(np.int64(bits[i]))


@cuda.jit
def _bf16_kernel(bits, out):
    i = cuda.grid(1)
    if i < bits.shape[0]:
        u = np.int64(bits[i])
        if (u & 0x7FFFFFFF) > 0x7F800000:
            out[i] = (u >> 16) | 64
        else:
            out[i] = (u + (0x7FFF + ((u >> 16) & 1))) >> 16


@cuda.jit
def _f16_to_f32_kernel(h, lut, out):
    i = cuda.grid(1)
    if i < h.shape[0]:
        out[i] = lut[h[i]]


@cuda.jit
def _bf16_to_f32_kernel(h, out):
    i = cuda.grid(1)
    if i < h.shape[0]:
        out[i] = np.uint32(h[i]) << 16


@cuda.jit
def _copy_kernel(src, out):
    i = cuda.grid(1)
    if i < src.shape[0]:
        out[i] = src[i]


def _run(kernel, src, out, *extra):
    d_src = cuda.to_device(src.reshape(-1))
    d_out = cuda.device_array(out.size, out.dtype)
    blocks, threads = grid(out.size)
    kernel[blocks, threads](d_src, *extra, d_out)
    return d_out.copy_to_host().reshape(out.shape)


def quantize_f32(x):
    return _run(_copy_kernel, x, np.empty(x.shape, np.float32)).view(np.uint8)


def quantize_f16(x):
    return _run(_f16_kernel, x.view(np.uint32), np.empty(x.shape, np.uint16)).view(np.uint8)


def quantize_bf16(x):
    return _run(_bf16_kernel, x.view(np.uint32), np.empty(x.shape, np.uint16)).view(np.uint8)


def dequantize_f32(raw, n):
    return _run(_copy_kernel, raw.view(np.float32), np.empty((raw.shape[0], n), np.float32))


def dequantize_f16(raw, n):
    lut = cuda.to_device(FP16_TO_FP32)
    return _run(_f16_to_f32_kernel, raw.view(np.uint16), np.empty((raw.shape[0], n), np.float32), lut)


def dequantize_bf16(raw, n):
    out = _run(_bf16_to_f32_kernel, raw.view(np.uint16), np.empty((raw.shape[0], n), np.uint32))
    return out.view(np.float32)
