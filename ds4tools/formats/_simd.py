"""The IQ formats' row unpackers for their float32 matmuls, as LLVM vector IR (numba intrinsics).

numba cannot turn a 16-entry table lookup into a byte shuffle, nor build IQ2_XXS's signed grid
levels from table words, so both are written here in IR (plumbing from ``_llvm_ir``). The int8
paths unpack into ``_int8dot``'s group layout instead (UNPACK_IQ4_NL, UNPACK_IQ2_XXS).

Arrays passed in must be 1-D and C-contiguous (slices of C-contiguous rows are). No bounds
checks.
"""
from __future__ import annotations

import llvmlite.ir as ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ._llvm_ir import I8, I32, I64, c_array, data_ptr, host_features, load, lookup16, store, vec


def _check_1d(*arrs):
    for a in arrs:
        if not c_array(a):
            raise TypeError(f"_simd: expected a 1-D C-contiguous array, got {a}")


@intrinsic
def unpack_nibbles_lut16(typingctx, row, table, w, nb, block_bytes, skip):
    """Per block b of ``row`` (block_bytes bytes; the 16 nibble bytes start at ``skip``),
    w[32b + j] = table[low nibble of byte j], w[32b + 16 + j] = table[high nibble] (table: 16
    bytes): byte shuffles on x86, a portable select chain elsewhere (``_llvm_ir.lookup16``)."""
    _check_1d(row, table, w)
    sig = types.void(row, table, w, types.intp, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        ra, ta, wa, n, bb, sk = args
        pr = data_ptr(context, builder, signature.args[0], ra)
        pt = data_ptr(context, builder, signature.args[1], ta)
        pw = data_ptr(context, builder, signature.args[2], wa)
        v16 = vec(I8, 16)
        tbl = load(builder, pt, ir.Constant(I64, 0), v16)
        feats = host_features(context)
        low = ir.Constant(v16, [15] * 16)
        four = ir.Constant(v16, [4] * 16)
        with cgutils.for_range(builder, n) as loop:
            b = loop.index
            byts = load(builder, pr, builder.add(builder.mul(b, bb), sk), v16)
            idx = builder.shuffle_vector(builder.and_(byts, low), builder.lshr(byts, four),
                                         ir.Constant(vec(I32, 32), list(range(32))))
            store(builder, lookup16(builder, feats, tbl, idx), pw,
                  builder.mul(b, ir.Constant(b.type, 32)))

    return sig, codegen


@intrinsic
def unpack_iq2_xxs_blocks(typingctx, row, grid64, smask64, w, ls, nsb):
    """IQ2_XXS super-blocks (66 bytes: fp16 d, then 8 x (4 grid bytes, uint32 signs+scale)) ->
    w int8 (grid value with its sign) and ls int32 (odd block scale 2s+1) per 32-block.

    grid64: uint64 (256,), the grid points' 8 bytes; smask64: uint64 (128,), per sign pattern
    0xFF in the bytes to negate."""
    _check_1d(row, grid64, smask64, w, ls)
    sig = types.void(row, grid64, smask64, w, ls, types.intp)

    def codegen(context, builder, signature, args):
        pr, pg, ps, pw, pl = (data_ptr(context, builder, signature.args[i], args[i])
                              for i in range(5))
        n = args[5]
        v4 = vec(I64, 4)
        with cgutils.for_range(builder, n) as loop:
            sb = loop.index
            for ib in range(8):  # unrolled: constant offsets within the super-block
                i = builder.add(builder.mul(sb, ir.Constant(sb.type, 8)), ir.Constant(sb.type, ib))
                o = builder.add(builder.mul(sb, ir.Constant(sb.type, 66)),
                                ir.Constant(sb.type, 2 + 8 * ib))
                # the uint32 of signs and scale (GGUF is little-endian, as are numba's targets)
                aux = load(builder, pr, builder.add(o, ir.Constant(o.type, 4)), I32)
                gv = ir.Constant(v4, ir.Undefined)
                mv = ir.Constant(v4, ir.Undefined)
                for l in range(4):
                    g = builder.zext(builder.load(builder.gep(pr, [builder.add(o, ir.Constant(o.type, l))])), I64)
                    s = builder.zext(builder.and_(builder.lshr(aux, ir.Constant(I32, 7 * l)),
                                                  ir.Constant(I32, 127)), I64)
                    gv = builder.insert_element(gv, builder.load(builder.gep(pg, [g])), ir.Constant(I32, l))
                    mv = builder.insert_element(mv, builder.load(builder.gep(ps, [s])), ir.Constant(I32, l))
                g8 = builder.bitcast(gv, vec(I8, 32))
                m8 = builder.bitcast(mv, vec(I8, 32))
                scale = builder.add(builder.shl(builder.lshr(aux, ir.Constant(I32, 28)), ir.Constant(I32, 1)),
                                    ir.Constant(I32, 1))
                store(builder, builder.sub(builder.xor(g8, m8), m8), pw, builder.mul(i, ir.Constant(i.type, 32)))
                builder.store(scale, builder.gep(pl, [i]))

    return sig, codegen
