"""Explicit vector code (LLVM IR through numba intrinsics) for the reference quantizers of the
32-value block formats Q4_0, Q4_1, Q5_0 and Q5_1 (``legacy._quantize_ref``).

numba's loop vectorizer handles neither a 32-value block's reductions (a constant 32-trip loop
is unrolled into scalar code) nor the nibble packing, so one block's work is written here as
LLVM vector IR on <32 x float>, which LLVM lowers to whatever SIMD the host has:

* ``block_key_extrema``: smallest and largest value of a block, as int32 sort keys (the float's
  bits with the magnitude bits flipped for negatives: int32 order is float order, -0 < +0),
  both reductions sharing one vector for the horizontal steps.
* ``QUANT_Q4_0`` .. ``QUANT_Q5_1``: ggml's quantize_row_q*_ref for one block given its scale
  (and min): per value (x [- min]) * id + bias (8.5, 0.5, 16.5, 0.5: float32 multiply, then
  add, no fused multiply-add), truncated to int32, clamped to 15 / 31 (Q5_1: no clamp, as
  ggml's (uint8_t) cast), low 8 bits kept; the 16 nibble-packed bytes are stored, the Q5 high
  bits returned as the block's 32-bit qh.
(The bit casts the quantizers also use, ``store_le`` and ``f32_from_bits``, live in ``_llvm_ir``.)

Nothing is bounds-checked: callers pass whole blocks. Arrays must be 1-D and C-contiguous.
"""
import llvmlite.ir as ir
from numba import types
from numba.extending import intrinsic

from ._llvm_ir import F32, I8, I32, c_array as _c_array, data_ptr, mask as _idx
from ._llvm_ir import pick as _pick, splat as _splat, vec as _vec


def _smin(builder, a, b):
    return builder.select(builder.icmp_signed("<", a, b), a, b)


def _fold(builder, v, n):
    """Element-wise smin of the two halves of an n-lane vector."""
    return _smin(builder, _pick(builder, v, range(n // 2)), _pick(builder, v, range(n // 2, n)))


def _ptr(context, builder, aty, ary, off, t):
    data = data_ptr(context, builder, aty, ary)
    return builder.bitcast(builder.gep(data, [off]), t.as_pointer())


@intrinsic
def block_key_extrema(typingctx, x, off):
    """(smallest, largest) sort key of the float32 values x[off:off + 32]."""
    if not (_c_array(x, types.float32) and isinstance(off, types.Integer)):
        return None
    ret = types.UniTuple(types.int32, 2)

    def codegen(context, builder, sig, args):
        v32 = _vec(I32, 32)
        v = builder.load(_ptr(context, builder, sig.args[0], args[0], args[1], v32), align=1)
        neg = builder.ashr(v, ir.Constant(v32, [31] * 32))
        k = builder.xor(v, builder.and_(neg, ir.Constant(v32, [0x7FFFFFFF] * 32)))
        nk = builder.xor(k, ir.Constant(v32, [-1] * 32))  # the largest k is ~(the smallest ~k)
        for n in (32, 16):  # 32 -> 8 lanes, element-wise
            k = _fold(builder, k, n)
            nk = _fold(builder, nk, n)
        c = builder.shuffle_vector(k, nk, _idx(range(16)))  # then both in one vector
        for lo, hi in (((0, 1, 2, 3, 8, 9, 10, 11), (4, 5, 6, 7, 12, 13, 14, 15)),
                       ((0, 1, 4, 5), (2, 3, 6, 7)), ((0, 2), (1, 3))):
            c = _smin(builder, _pick(builder, c, lo), _pick(builder, c, hi))
        kmin = builder.extract_element(c, ir.Constant(I32, 0))
        kmax = builder.not_(builder.extract_element(c, ir.Constant(I32, 1)))
        return context.make_tuple(builder, ret, [kmin, kmax])
    return ret(x, off), codegen


def _make_block_quantizer(clamp, bias, affine, five):
    @intrinsic
    def quantize(typingctx, x, off, vmin, inv, out, qs_off):
        if not (_c_array(x, types.float32) and isinstance(off, types.Integer)
                and vmin == types.float32 and inv == types.float32
                and _c_array(out, types.uint8) and isinstance(qs_off, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            xa, xo, mn, iv, oa, oo = args
            v = builder.load(_ptr(context, builder, sig.args[0], xa, xo, _vec(F32, 32)), align=1)
            if affine:
                v = builder.fsub(v, _splat(builder, mn, 32))
            v = builder.fmul(v, _splat(builder, iv, 32))
            v = builder.fadd(v, ir.Constant(_vec(F32, 32), [bias] * 32))
            q = builder.fptosi(v, _vec(I32, 32))
            if clamp is not None:
                q = _smin(builder, q, ir.Constant(_vec(I32, 32), [clamp] * 32))
            q = builder.trunc(q, _vec(I8, 32))
            lo, hi = _pick(builder, q, range(16)), _pick(builder, q, range(16, 32))
            if five:
                low4 = ir.Constant(_vec(I8, 16), [0x0F] * 16)
                lo, hi = builder.and_(lo, low4), builder.and_(hi, low4)
            packed = builder.or_(lo, builder.shl(hi, ir.Constant(_vec(I8, 16), [4] * 16)))
            builder.store(packed, _ptr(context, builder, sig.args[4], oa, oo, packed.type), align=1)
            if not five:
                return ir.Constant(I32, 0)
            bit4 = builder.and_(q, ir.Constant(_vec(I8, 32), [0x10] * 32))
            bit4 = builder.icmp_unsigned("!=", bit4, ir.Constant(_vec(I8, 32), [0] * 32))
            return builder.bitcast(bit4, I32)  # lane j -> bit j
        return types.int32(x, off, vmin, inv, out, qs_off), codegen
    return quantize


#: (x, off, vmin, id, out, qs_off) -> qh: one block x[off:off + 32] quantized with scale
#: 1 / ``id`` (and min ``vmin``: Q4_1, Q5_1), nibbles stored at out[qs_off:qs_off + 16]
QUANT_Q4_0 = _make_block_quantizer(15, 8.5, False, False)
QUANT_Q4_1 = _make_block_quantizer(15, 0.5, True, False)
QUANT_Q5_0 = _make_block_quantizer(31, 16.5, False, True)
QUANT_Q5_1 = _make_block_quantizer(None, 0.5, True, True)
