"""F32, F16 and BF16: element-wise conversion, rounding exactly as ggml does (nearest even)."""
import numpy as np
from gguf import GGMLQuantizationType as T
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from .base import QuantFormat, register
from ._llvm_ir import (F32 as _F32, I16 as _I16, c_array, const, data_ptr, f32_from_bits,
                       host_features, loop)
from ._numeric import FP16_TO_FP32


@njit(cache=True)
def f32_bits_to_f16(u):
    """float32 bit pattern -> fp16 bit pattern, round to nearest even (NaN stays a quiet NaN)."""
    sign = (u >> 16) & 0x8000
    a = u & 0x7FFFFFFF
    if a > 0x7F800000:
        return sign | 0x7E00
    if a >= 0x477FF000:  # 65520 and above round to infinity
        return sign | 0x7C00
    if a < 0x38800000:  # below 2**-14: an fp16 subnormal, value = k * 2**-24
        if a < 0x33000000:  # at most 2**-25: rounds to zero (a tie goes to the even zero)
            return sign
        m = (a & 0x7FFFFF) | 0x800000
        shift = 126 - (a >> 23)
        k = m >> shift
        rem = m & ((1 << shift) - 1)
        half = 1 << (shift - 1)
        if rem > half or (rem == half and (k & 1)):
            k += 1
        return sign | k
    k = (((a >> 23) - 112) << 10) | ((a >> 13) & 0x3FF)
    rem = a & 0x1FFF
    if rem > 0x1000 or (rem == 0x1000 and (k & 1)):
        k += 1
    return sign | k


@njit(parallel=True, cache=True)
def _quantize_f16(bits, out):
    rows, n = bits.shape
    for r in prange(rows):
        for i in range(n):
            out[r, i] = f32_bits_to_f16(np.int64(bits[r, i]))


@njit(parallel=True, cache=True)
def _quantize_bf16(bits, out):
    rows, n = bits.shape
    for r in prange(rows):
        for i in range(n):
            u = np.int64(bits[r, i])
            if (u & 0x7FFFFFFF) > 0x7F800000:
                out[r, i] = (u >> 16) | 64
            else:
                out[r, i] = (u + (0x7FFF + ((u >> 16) & 1))) >> 16


@njit(parallel=True, cache=True)
def _dequantize_f16(h, lut, out):
    rows, n = h.shape
    for r in prange(rows):
        for i in range(n):
            out[r, i] = lut[h[r, i]]


@njit(parallel=True, cache=True)
def _dequantize_bf16(h, out):
    rows, n = h.shape
    for r in prange(rows):
        for i in range(n):
            out[r, i] = np.uint32(h[r, i]) << 16


@njit(parallel=True, cache=True)
def _copy_f32(src, out):
    rows, n = src.shape
    for r in prange(rows):
        for i in range(n):
            out[r, i] = src[r, i]


@njit(parallel=True, fastmath=True, cache=True)
def _matmul_f32(w, x, out):
    n_out, n_in = w.shape
    k = x.shape[0]
    for r in prange(n_out):
        for t in range(k):
            acc = np.float32(0.0)
            for i in range(n_in):
                acc += w[r, i] * x[t, i]
            out[t, r] = acc


@njit(cache=True, error_model="numpy")
def f16_row_to_f32(h, out):
    """out[i] = the float32 value of fp16 bit pattern h[i] (uint16), exactly (the values of
    FP16_TO_FP32, NaN payloads too), in integer and float operations that vectorize instead of
    a gather from that 256 KB table (the 4096x14336 F16 mat-vec from memory: 6.5 -> 8.8 GB/s,
    the two interleaved in one process on a 2-core AVX-512 host). No fastmath: subnormals are em * 2^-24, computed from an integer (no subnormal input to a
    float operation, which costs a microcode assist on Intel cores)."""
    for i in range(h.shape[0]):
        u = np.int32(h[i])
        em = np.int32(u & np.int32(0x7FFF))
        sub = np.float32(em) * np.float32(5.9604644775390625e-08)  # 2^-24
        # exponent rebased by 112 (15 -> 127); by 224 for inf / NaN (31 -> 255, payload kept)
        rebase = np.int32(224 << 23) if em >= np.int32(0x7C00) else np.int32(112 << 23)
        nrm = f32_from_bits(np.int32((em << np.int32(13)) + rebase))
        v = nrm if em >= np.int32(0x400) else sub
        out[i] = -v if u & np.int32(0x8000) else v


#: set to False to leave out the F16C conversion (tests compare the two)
USE_F16C = True


@intrinsic
def f16c_row_to_f32(typingctx, h, out):
    """As f16_row_to_f32 for the first len(h) // 8 * 8 values, by the CPU's conversion
    instruction (vcvtph2ps, 8 values per instruction: F16C, which every AVX2 CPU has), and
    returns that count; 0 (nothing converted) where numba compiles for a CPU without F16C.
    The values are exact; a signalling NaN comes back quiet. The 4096x14336 F16 mat-vec (AVX2
    code, 2 threads): 9.3 -> 17.6 GB/s of weights in cache, 8.9 -> 16.1 from memory."""
    if not (c_array(h, types.uint16) and c_array(out, types.float32)):
        return None
    sig = types.int64(h, out)

    def codegen(context, builder, sig, args):
        if not (USE_F16C and "f16c" in host_features(context)):
            return const(0)
        hp = data_ptr(context, builder, sig.args[0], args[0])
        op = data_ptr(context, builder, sig.args[1], args[1])
        ha = context.make_array(sig.args[0])(context, builder, args[0])
        n8 = builder.udiv(builder.extract_value(ha.shape, 0), const(8))
        v8h, v8i16 = ir.VectorType(ir.HalfType(), 8), ir.VectorType(_I16, 8)
        v8f = ir.VectorType(_F32, 8)

        def body(i, _):
            o = builder.mul(i, const(8))
            bits = builder.load(builder.bitcast(builder.gep(hp, [o]), v8i16.as_pointer()),
                                align=2)
            builder.store(builder.fpext(builder.bitcast(bits, v8h), v8f),
                          builder.bitcast(builder.gep(op, [o]), v8f.as_pointer()), align=4)
            return []

        loop(builder, n8, [], body, "f16c")
        return builder.mul(n8, const(8))
    return sig, codegen


@njit(cache=True)
def f16_row_to_f32_fast(h, out):
    """out = the float32 values of the fp16 bits h: by F16C where the CPU has it (a
    signalling NaN then comes back quiet), else f16_row_to_f32."""
    done = f16c_row_to_f32(h, out)
    f16_row_to_f32(h[done:], out[done:])


@njit(parallel=True, fastmath=True, cache=True)
def _matmul_f16(h, x, out):
    n_out, n_in = h.shape
    k = x.shape[0]
    for r in prange(n_out):
        row = np.empty(n_in, np.float32)
        f16_row_to_f32_fast(h[r], row)
        for t in range(k):
            acc = np.float32(0.0)
            for i in range(n_in):
                acc += row[i] * x[t, i]
            out[t, r] = acc


@njit(parallel=True, fastmath=True, cache=True)
def _matmul_bf16(h, x, out):
    n_out, n_in = h.shape
    k = x.shape[0]
    for r in prange(n_out):
        row = np.empty(n_in, np.uint32)
        for i in range(n_in):
            row[i] = np.uint32(h[r, i]) << 16
        rowf = row.view(np.float32)
        for t in range(k):
            acc = np.float32(0.0)
            for i in range(n_in):
                acc += rowf[i] * x[t, i]
            out[t, r] = acc


@register
class F32(QuantFormat):
    name, ggml_type, block_size, type_size = "F32", T.F32, 1, 4

    def _cpu_quantize(self, x, imatrix):
        out = np.empty(x.shape, np.float32)
        _copy_f32(x, out)
        return out.view(np.uint8)

    def _cpu_dequantize(self, raw, n_per_row):
        out = np.empty((raw.shape[0], n_per_row), np.float32)
        _copy_f32(raw.view(np.float32), out)
        return out

    def _cpu_matmul(self, raw, x, out):
        _matmul_f32(raw.view(np.float32), x, out)

    def _cuda_quantize(self, x, imatrix):
        from .cuda import floats as k
        return k.quantize_f32(x)

    def _cuda_dequantize(self, raw, n_per_row):
        from .cuda import floats as k
        return k.dequantize_f32(raw, n_per_row)


@register
class F16(QuantFormat):
    name, ggml_type, block_size, type_size = "F16", T.F16, 1, 2

    def _cpu_quantize(self, x, imatrix):
        out = np.empty(x.shape, np.uint16)
        _quantize_f16(x.view(np.uint32), out)
        return out.view(np.uint8)

    def _cpu_dequantize(self, raw, n_per_row):
        out = np.empty((raw.shape[0], n_per_row), np.float32)
        _dequantize_f16(raw.view(np.uint16), FP16_TO_FP32, out)
        return out

    def _cpu_matmul(self, raw, x, out):
        _matmul_f16(raw.view(np.uint16), x, out)

    def _cuda_quantize(self, x, imatrix):
        from .cuda import floats as k
        return k.quantize_f16(x)

    def _cuda_dequantize(self, raw, n_per_row):
        from .cuda import floats as k
        return k.dequantize_f16(raw, n_per_row)


@register
class BF16(QuantFormat):
    name, ggml_type, block_size, type_size = "BF16", T.BF16, 1, 2

    def _cpu_quantize(self, x, imatrix):
        out = np.empty(x.shape, np.uint16)
        _quantize_bf16(x.view(np.uint32), out)
        return out.view(np.uint8)

    def _cpu_dequantize(self, raw, n_per_row):
        out = np.empty((raw.shape[0], n_per_row), np.float32)
        _dequantize_bf16(raw.view(np.uint16), out.view(np.uint32))
        return out

    def _cpu_matmul(self, raw, x, out):
        _matmul_bf16(raw.view(np.uint16), x, out)

    def _cuda_quantize(self, x, imatrix):
        from .cuda import floats as k
        return k.quantize_bf16(x)

    def _cuda_dequantize(self, raw, n_per_row):
        from .cuda import floats as k
        return k.dequantize_bf16(raw, n_per_row)
