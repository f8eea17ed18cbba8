"""Explicit vector code (LLVM IR through numba intrinsics) for the IQ formats' int8 matmuls.

numba's loop vectorizer widens the small integer types of a block dot product to int64 and
cannot turn a 16-entry table lookup into a byte shuffle, so the hot loops of the IQ4_NL and
IQ2_XXS int8 paths are written here as LLVM vector IR. The IR is target independent except for
one byte shuffle (x86 SSSE3 ``pshufb``), used only where the host has it; LLVM lowers the
rest to whatever the host offers (the int16 pair products to ``vpmaddwd`` / ``vpdpwssd`` on
x86). Every lane's arithmetic is fixed by the IR (no fast-math flags), so a result does not
depend on how many activation rows a call carries.

Arrays passed in must be 1-D and C-contiguous (slices of C-contiguous rows are).
"""
from __future__ import annotations

import platform

import llvmlite.ir as ir
import numpy as np
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

I8, I16, I32, I64, F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()


def _vec(t, n):
    return ir.VectorType(t, n)


def _host_has_pshufb() -> bool:
    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686", "x86"):
        return False
    try:
        import llvmlite.binding as llvm
        return bool(llvm.get_host_cpu_features().get("ssse3", False))
    except Exception:  # pragma: no cover - feature query unavailable
        return False


#: whether the IQ4_NL table lookup can use the x86 byte shuffle (else a portable numba loop)
HAS_PSHUFB = _host_has_pshufb()


def _data(context, builder, aty, val):
    return context.make_array(aty)(context, builder, val).data


def _vload(builder, ptr, idx, vt):
    """Load a vector of type vt from element ptr[idx] (unaligned)."""
    p = builder.gep(ptr, [idx])
    return builder.load(builder.bitcast(p, vt.as_pointer()), align=1)


def _vstore(builder, val, ptr, idx):
    p = builder.gep(ptr, [idx])
    builder.store(val, builder.bitcast(p, val.type.as_pointer()), align=1)


def _const_idx(*vals):
    return ir.Constant(_vec(I32, len(vals)), list(vals))


def _splat(builder, scalar, n):
    vt = _vec(scalar.type, n)
    v = builder.insert_element(ir.Constant(vt, ir.Undefined), scalar, ir.Constant(I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vt, ir.Undefined), _const_idx(*([0] * n)))


def _pair_sums(builder, w, x):
    """<32 x i8> w, x -> <16 x i32>: lane l = w[2l]*x[2l] + w[2l+1]*x[2l+1] (pmaddwd)."""
    ws = builder.sext(builder.sext(w, _vec(I16, 32)), _vec(I32, 32))
    xs = builder.sext(builder.sext(x, _vec(I16, 32)), _vec(I32, 32))
    m = builder.mul(ws, xs, flags=["nsw"])
    even = builder.shuffle_vector(m, m, _const_idx(*range(0, 32, 2)))
    odd = builder.shuffle_vector(m, m, _const_idx(*range(1, 32, 2)))
    return builder.add(even, odd, flags=["nsw"])


def _tree_sum_f32(builder, v):
    """Sum of a <16 x float> in a fixed order: halves added lane-wise, down to one lane."""
    n = 16
    while n > 1:
        h = n // 2
        lo = builder.shuffle_vector(v, v, _const_idx(*range(h)))
        hi = builder.shuffle_vector(v, v, _const_idx(*range(h, n)))
        v = builder.fadd(lo, hi)
        n = h
    return builder.extract_element(v, ir.Constant(I32, 0))


def _check_1d(*arrs):
    for a in arrs:
        if not isinstance(a, types.Array) or a.ndim != 1 or a.layout != "C":
            raise TypeError(f"_simd: expected a 1-D C-contiguous array, got {a}")


@intrinsic
def dot_q8_0_blocks(typingctx, w, dw, x, dx, nb):
    """sum over nb 32-blocks of dw[b] * dx[b] * (w[32b:32b+32] . x[32b:32b+32]).

    w, x: int8; dw, dx: float32. Lane-wise: per block the 16 int32 pair sums are converted to
    float and added, times dw*dx, to 16 float accumulators; the lanes are summed at the end in a
    fixed tree order."""
    _check_1d(w, dw, x, dx)
    sig = types.float32(w, dw, x, dx, types.intp)

    def codegen(context, builder, signature, args):
        wa, dwa, xa, dxa, n = args
        n = context.cast(builder, n, signature.args[4], types.intp)
        pw = _data(context, builder, signature.args[0], wa)
        pdw = _data(context, builder, signature.args[1], dwa)
        px = _data(context, builder, signature.args[2], xa)
        pdx = _data(context, builder, signature.args[3], dxa)
        acc = cgutils.alloca_once_value(builder, ir.Constant(_vec(F32, 16), [0.0] * 16))
        with cgutils.for_range(builder, n) as loop:
            b = loop.index
            o = builder.mul(b, ir.Constant(b.type, 32))
            p = _pair_sums(builder, _vload(builder, pw, o, _vec(I8, 32)), _vload(builder, px, o, _vec(I8, 32)))
            pf = builder.sitofp(p, _vec(F32, 16))
            sc = builder.fmul(builder.load(builder.gep(pdw, [b])), builder.load(builder.gep(pdx, [b])))
            builder.store(builder.fadd(builder.load(acc), builder.fmul(pf, _splat(builder, sc, 16))), acc)
        return _tree_sum_f32(builder, builder.load(acc))

    return sig, codegen


@intrinsic
def unpack_nibbles_lut16(typingctx, row, table, w, nb, block_bytes, skip):
    """x86 pshufb: per block b of ``row`` (block_bytes bytes; the 16 nibble bytes start at
    ``skip``), w[32b + j] = table[low nibble of byte j], w[32b + 16 + j] = table[high nibble]."""
    _check_1d(row, table, w)
    sig = types.void(row, table, w, types.intp, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        ra, ta, wa, n, bb, sk = args
        pr = _data(context, builder, signature.args[0], ra)
        pt = _data(context, builder, signature.args[1], ta)
        pw = _data(context, builder, signature.args[2], wa)
        v16 = _vec(I8, 16)
        tbl = _vload(builder, pt, ir.Constant(I64, 0), v16)
        fnty = ir.FunctionType(v16, [v16, v16])
        pshufb = cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.ssse3.pshuf.b.128")
        low = ir.Constant(v16, [15] * 16)
        four = ir.Constant(v16, [4] * 16)
        with cgutils.for_range(builder, n) as loop:
            b = loop.index
            src = builder.add(builder.mul(b, bb), sk)
            byts = _vload(builder, pr, src, v16)
            lo = builder.call(pshufb, [tbl, builder.and_(byts, low)])
            hi = builder.call(pshufb, [tbl, builder.lshr(byts, four)])
            _vstore(builder, builder.shuffle_vector(lo, hi, _const_idx(*range(32))), pw,
                    builder.mul(b, ir.Constant(b.type, 32)))

    return sig, codegen


def _iq2_xxs_unpack_codegen(fold):
    def codegen(context, builder, signature, args):
        ra, ga, sa, wa, la, n = args
        pr = _data(context, builder, signature.args[0], ra)
        pg = _data(context, builder, signature.args[1], ga)
        ps = _data(context, builder, signature.args[2], sa)
        pw = _data(context, builder, signature.args[3], wa)
        pl = _data(context, builder, signature.args[4], la)
        v4 = _vec(I64, 4)
        with cgutils.for_range(builder, n) as loop:
            sb = loop.index
            for ib in range(8):  # unrolled: constant offsets within the super-block
                i = builder.add(builder.mul(sb, ir.Constant(sb.type, 8)), ir.Constant(sb.type, ib))
                o = builder.add(builder.mul(sb, ir.Constant(sb.type, 66)), ir.Constant(sb.type, 2 + 8 * ib))
                # the uint32 of signs and scale (GGUF is little-endian, as are numba's targets)
                aux = builder.load(builder.bitcast(builder.gep(pr, [builder.add(o, ir.Constant(o.type, 4))]),
                                                   I32.as_pointer()), align=1)
                gv = ir.Constant(v4, ir.Undefined)
                mv = ir.Constant(v4, ir.Undefined)
                for l in range(4):
                    g = builder.zext(builder.load(builder.gep(pr, [builder.add(o, ir.Constant(o.type, l))])), I64)
                    s = builder.zext(builder.and_(builder.lshr(aux, ir.Constant(I32, 7 * l)), ir.Constant(I32, 127)), I64)
                    gv = builder.insert_element(gv, builder.load(builder.gep(pg, [g])), ir.Constant(I32, l))
                    mv = builder.insert_element(mv, builder.load(builder.gep(ps, [s])), ir.Constant(I32, l))
                g8 = builder.bitcast(gv, _vec(I8, 32))
                m8 = builder.bitcast(mv, _vec(I8, 32))
                w8 = builder.sub(builder.xor(g8, m8), m8)
                scale = builder.add(builder.shl(builder.lshr(aux, ir.Constant(I32, 28)), ir.Constant(I32, 1)),
                                    ir.Constant(I32, 1))
                dst = builder.mul(i, ir.Constant(i.type, 32))
                if fold:  # |level * scale| <= 43 * 31: int16
                    w16 = builder.mul(builder.sext(w8, _vec(I16, 32)), _splat(builder, builder.trunc(scale, I16), 32))
                    _vstore(builder, w16, pw, dst)
                else:
                    _vstore(builder, w8, pw, dst)
                builder.store(scale, builder.gep(pl, [i]))
    return codegen


@intrinsic
def unpack_iq2_xxs_blocks(typingctx, row, grid64, smask64, w, ls, nsb):
    """IQ2_XXS super-blocks (66 bytes: fp16 d, then 8 x (4 grid bytes, uint32 signs+scale)) ->
    w int8 (grid value with its sign) and ls int32 (odd block scale 2s+1) per 32-block.

    grid64: uint64 (256,), the grid points' 8 bytes; smask64: uint64 (128,), per sign pattern
    0xFF in the bytes to negate."""
    _check_1d(row, grid64, smask64, w, ls)
    return types.void(row, grid64, smask64, w, ls, types.intp), _iq2_xxs_unpack_codegen(False)


@intrinsic
def unpack_iq2_xxs_blocks_i16(typingctx, row, grid64, smask64, w, ls, nsb):
    """As unpack_iq2_xxs_blocks, with w int16: the signed level times its block's odd scale."""
    _check_1d(row, grid64, smask64, w, ls)
    return types.void(row, grid64, smask64, w, ls, types.intp), _iq2_xxs_unpack_codegen(True)


@intrinsic
def dot_i16_superblocks(typingctx, w, dw, x, dx, nsb):
    """sum over nsb 256-super-blocks of dw[s] * dx[s] * (w . x over the super-block): w int16
    (scales folded in), x int8; the integer part exact in 16 int32 lanes (pmaddwd, accumulated:
    vpdpwssd where the host has it), one horizontal sum per super-block, the float part in
    super-block order."""
    _check_1d(w, dw, x, dx)
    sig = types.float32(w, dw, x, dx, types.intp)

    def codegen(context, builder, signature, args):
        wa, dwa, xa, dxa, n = args
        pw = _data(context, builder, signature.args[0], wa)
        pdw = _data(context, builder, signature.args[1], dwa)
        px = _data(context, builder, signature.args[2], xa)
        pdx = _data(context, builder, signature.args[3], dxa)
        acc = cgutils.alloca_once_value(builder, ir.Constant(F32, 0.0))
        fnty = ir.FunctionType(I32, [_vec(I32, 16)])
        reduce_add = cgutils.get_or_insert_function(builder.module, fnty, "llvm.vector.reduce.add.v16i32")
        with cgutils.for_range(builder, n) as loop:
            s = loop.index
            lanes = ir.Constant(_vec(I32, 16), [0] * 16)
            for ib in range(8):
                o = builder.mul(builder.add(builder.mul(s, ir.Constant(s.type, 8)), ir.Constant(s.type, ib)),
                                ir.Constant(s.type, 32))
                wv = builder.sext(_vload(builder, pw, o, _vec(I16, 32)), _vec(I32, 32))
                xv = builder.sext(_vload(builder, px, o, _vec(I8, 32)), _vec(I32, 32))
                m = builder.mul(wv, xv, flags=["nsw"])
                even = builder.shuffle_vector(m, m, _const_idx(*range(0, 32, 2)))
                odd = builder.shuffle_vector(m, m, _const_idx(*range(1, 32, 2)))
                lanes = builder.add(lanes, builder.add(even, odd, flags=["nsw"]))
            isum = builder.call(reduce_add, [lanes])
            d = builder.fmul(builder.load(builder.gep(pdw, [s])), builder.load(builder.gep(pdx, [s])))
            builder.store(builder.fadd(builder.load(acc), builder.fmul(d, builder.sitofp(isum, F32))), acc)
        return builder.load(acc)

    return sig, codegen
