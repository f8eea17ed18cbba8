"""Int8 block dot products for the 32-element formats, written as LLVM vector IR (numba
intrinsics).

The int8-activation matmuls need, per 32-element block b, the exact integer dot
isum_b = sum_j w_j x_j of a weight block and an activation block (ggml's Q8_0), then
sum_b isum_b * dw_b * dx_b (+ m_b * dx_b * sum_j x_j for formats with an offset m) in float.
Plain numba loops either leave the block dots scalar or reduce every block to a scalar
horizontally, per token. Here the shape is stated directly:

* Group layout. 16 blocks form a group of 512 bytes: chunk c (c = 0..7) holds values
  4c..4c+3 of each of the 16 blocks, block i at bytes 64c + 4i .. 64c + 4i + 3. Weight rows are
  unpacked into it once per row (``UNPACK_*``: unsigned bytes u = w + offset, the offset 8, 16
  or 128 of Q4_0, Q5_0 and Q8_0, 0 for Q4_1 and Q5_1); activations once per matmul.
* Dot (``DOT_RxT_*``: R weight rows x T tokens, loads shared): per chunk one u8 x s8 multiply
  adding groups of 4 products into 16 int32 lanes, lane i = block i; with AVX-512 VNNI that is
  one vpdpbusd per chunk, with AVX2 (4/5-bit weights) vpmaddubsw + vpmaddwd, elsewhere generic
  IR that LLVM lowers to (v)pmaddwd and adds. After 8 chunks lane i holds sum_j u_j x_j of
  block i; minus offset * sum_j x_j (exact, precomputed per token) it is isum_i. Then one
  int->float conversion and multiply-add for the 16 blocks together.

Exactness: integer sums are exact (|u| <= 255, |x| <= 127, 32 products per block), and the
float work is a fixed sequence per (row, token): lane i accumulates blocks i, i + 16, ... in
order, ``acc = acc + float(isum) * (dw * dx)`` (then ``+ m * dxs`` for Q4_1 / Q5_1, whose
isum has no offset) with separate multiplies and adds (no FMA contraction: LLVM fuses nothing
without fast-math flags), then a fixed tree adds the 16 lanes. Every tile shape emits that same
sequence per (row, token), and the integer route (VNNI, AVX2 or generic) only changes how exact
integers are reached, so a token's result never depends on the batch size, the tile or the
thread split.

Also here: ``DECODE_F32_*``, one row of Q4_0..Q5_1 or Q8_0 blocks to float32 as vector IR,
for the exact float32 matmuls (bit-identical to legacy._decode_row and _q8_0_decode_row).
"""
import numpy as np
from gguf import quants as _gguf_quants
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ._llvm_ir import (F32 as _F32, I8 as _I8, I16 as _I16, I32 as _I32, I64 as _I64,
                       as_i64 as _as_i64, const as _const, host_features,
                       host_cpu_features, intrinsic_fn as _intrinsic_fn, load as _load,
                       loop as _loop, mask as _mask, pick as _pick,
                       lookup16, row_ptr as _row_ptr, splat, splat_const as _splat,
                       vconst as _vconst)

#: blocks per group: lanes of the int and float accumulators; rows are padded with zero
#: blocks to a multiple of GROUP_BLOCKS (zero scales and offsets: they add exact zeros)
GROUP_BLOCKS = 16
#: bytes (int8 values) per group
GROUP_BYTES = GROUP_BLOCKS * 32
#: chunks per group (4 values of each block per chunk)
GROUP_CHUNKS = 8

#: per kind (the kernels' numbering: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL): block bytes, offset
#: of the 16 nibble bytes (or Q8_0's 32 int8), offset of the 32 high bits (-1: none), the
#: offset added to every quant to make it unsigned, whether an fp16 offset m follows d.
#: IQ4_NL's nibbles index IQ4_NL_LEVELS (signed levels; + 128 unsigned, as Q8_0's bytes).
UNPACK_LAYOUTS = (
    (18, 2, -1, 8, False),
    (20, 4, -1, 0, True),
    (22, 6, 2, 16, False),
    (24, 8, 4, 0, True),
    (34, 2, -1, 128, False),
    (18, 2, -1, 128, False),
)
#: kind 6, IQ2_XXS (not in UNPACK_LAYOUTS: 256-value super-blocks of 66 bytes, two per group)
KIND_IQ2_XXS = 6
#: value offset per kind (see UNPACK_LAYOUTS; IQ2_XXS's signed levels + 128), for the dots
WEIGHT_OFFSET = tuple(lay[3] for lay in UNPACK_LAYOUTS) + (128,)
#: raw bytes per group (16 blocks of 32 values) per kind
GROUP_RAW_BYTES = tuple(GROUP_BLOCKS * lay[0] for lay in UNPACK_LAYOUTS) + (132,)
#: the formats' defining tables (from the gguf package, as iq4_nl.py and iq2_xxs.py take them):
#: IQ4_NL's 16 levels, and per IQ2_XXS grid point its 8 magnitudes (8, 25 or 43) as bytes of
#: a little-endian uint64
IQ4_NL_LEVELS = tuple(int(v) for v in _gguf_quants.IQ4_NL.kvalues)
IQ2_XXS_GRID = tuple(
    sum(int(_gguf_quants.IQ2_XXS.grid_map[(c >> (2 * j)) & 3]) << (8 * j) for j in range(8))
    for c in np.frombuffer(bytes.fromhex(_gguf_quants.IQ2_XXS.grid_hex.decode("ascii")), "<u2"))

#: set to False to leave out the VNNI / AVX2 integer routes (tests compare the routes)
USE_VNNI = True
USE_AVX2 = True

def _route(context, small):
    """How the chunk dots are computed for the CPU numba compiles for: "vnni" (AVX-512 VNNI
    vpdpbusd), "avx2" (vpmaddubsw + vpmaddwd, for small weights, u <= 127, where the
    saturating pair sums of vpmaddubsw cannot saturate), "avx2-sign" (any u: ggml's sign trick
    on u - 128, plus 128 * the sums of x) or "generic" (portable IR)."""
    return _route_for(host_features(context), small)


def _route_for(features, small):
    if USE_VNNI and "avx512vnni" in features:
        return "vnni"
    if USE_AVX2 and "avx2" in features:
        return "avx2" if small else "avx2-sign"
    return "generic"


def _clamped(builder, start, count, last):
    """The indices start .. start + count - 1, each clamped to ``last``: the weight rows or
    activation rows a fused kernel reads (those past the last repeat it; their results are
    not written)."""
    out = []
    for i in range(count):
        v = builder.add(start, _const(i))
        out.append(builder.select(builder.icmp_signed("<", v, last), v, last))
    return out


def _avx2_fns(builder):
    """AVX2's vpmaddubsw, vpmaddwd and vpsignb (256-bit) and the int16 ones vpmaddwd sums
    pairs with."""
    v32i8, v16i16, v8i32 = ir.VectorType(_I8, 32), ir.VectorType(_I16, 16), ir.VectorType(_I32, 8)
    return (_intrinsic_fn(builder, "llvm.x86.avx2.pmadd.ub.sw", v16i16, [v32i8, v32i8]),
            _intrinsic_fn(builder, "llvm.x86.avx2.pmadd.wd", v8i32, [v16i16, v16i16]),
            _intrinsic_fn(builder, "llvm.x86.avx2.psign.b", v32i8, [v32i8, v32i8]),
            ir.Constant(v16i16, [ir.Constant(_I16, 1)] * 16))


def _dot_chunk(builder, acc, u, x, route):
    """acc (16 x i32) + per lane i the sum of the 4 products u[4i+e] * x[4i+e] (u unsigned,
    x signed bytes, <64 x i8>)."""
    v16i32 = ir.VectorType(_I32, 16)
    if route == "vnni":
        # llvm.x86.avx512.vpdpbusd.512 with the i32-vector operand types every LLVM since 9
        # accepts (newer ones upgrade them to their <64 x i8> form)
        fn = _intrinsic_fn(builder, "llvm.x86.avx512.vpdpbusd.512", v16i32, [v16i32] * 3)
        return builder.call(fn, [acc, builder.bitcast(u, v16i32), builder.bitcast(x, v16i32)])
    if route == "avx2":
        maddubs, maddwd, _, ones = _avx2_fns(builder)
        halves = []
        for h in range(2):
            sel = _mask(range(32 * h, 32 * h + 32))
            pairs = builder.call(maddubs, [builder.shuffle_vector(u, u, sel),
                                           builder.shuffle_vector(x, x, sel)])
            halves.append(builder.call(maddwd, [pairs, ones]))
        return builder.add(acc, builder.shuffle_vector(halves[0], halves[1], _mask(range(16))))
    if route == "avx2-sign":
        # u up to 255 would saturate vpmaddubsw's pair sums: take q = u - 128 (signed) and
        # vpmaddubsw(|q|, x * sign(q)), which stays within int16 while x >= -127 (ggml's
        # activation quantizers give -127..127), then add back 128 * the lane's sum of x:
        # the integer dot of u and x exactly, as the other routes
        v32i8, v8i32 = ir.VectorType(_I8, 32), ir.VectorType(_I32, 8)
        maddubs, maddwd, psign, ones = _avx2_fns(builder)
        ones8 = ir.Constant(v32i8, [ir.Constant(_I8, 1)] * 32)
        top = ir.Constant(v32i8, [ir.Constant(_I8, -128)] * 32)
        seven = ir.Constant(v8i32, [ir.Constant(_I32, 7)] * 8)
        halves = []
        for h in range(2):
            sel = _mask(range(32 * h, 32 * h + 32))
            uh, xh = builder.shuffle_vector(u, u, sel), builder.shuffle_vector(x, x, sel)
            q = builder.xor(uh, top)
            qx = builder.call(maddwd, [builder.call(maddubs, [builder.call(psign, [q, q]),
                                                              builder.call(psign, [xh, q])]), ones])
            sx = builder.call(maddwd, [builder.call(maddubs, [ones8, xh]), ones])
            halves.append(builder.add(qx, builder.shl(sx, seven)))
        return builder.add(acc, builder.shuffle_vector(halves[0], halves[1], _mask(range(16))))
    v64i32 = ir.VectorType(_I32, 64)
    p = builder.mul(builder.zext(u, v64i32), builder.sext(x, v64i32))
    p2 = builder.add(builder.shuffle_vector(p, p, _mask(range(0, 64, 2))),
                     builder.shuffle_vector(p, p, _mask(range(1, 64, 2))))  # (v)pmaddwd
    p4 = builder.add(builder.shuffle_vector(p2, p2, _mask(range(0, 32, 2))),
                     builder.shuffle_vector(p2, p2, _mask(range(1, 32, 2))))
    return builder.add(acc, p4)


def _dot_chunks(builder, acc, chunks, route, pair_bound):
    """acc + the chunk dots of ``chunks`` [(u, x)] (as _dot_chunk, in turn). On the "avx2"
    route the vpmaddubsw pair sums of up to 32767 // pair_bound chunks are added as int16
    before one vpmaddwd: exact, since ``pair_bound`` bounds |a pair sum| (2 * max u * max |x|)
    and so no int16 sum can leave the int16 range. Per chunk that saves a vpmaddwd and turns
    an int32 add into an int16 one: a third of a few-token K kernel's integer work per token
    (FUSED_K8_Q4_K in cache: 15% less time)."""
    per = 32767 // pair_bound
    if route != "avx2" or per < 2:
        for u, x in chunks:
            acc = _dot_chunk(builder, acc, u, x, route)
        return acc
    maddubs, maddwd, _, ones = _avx2_fns(builder)
    for i in range(0, len(chunks), per):
        halves = []
        for h in range(2):
            sel = _mask(range(32 * h, 32 * h + 32))
            s16 = None
            for u, x in chunks[i:i + per]:
                pairs = builder.call(maddubs, [builder.shuffle_vector(u, u, sel),
                                               builder.shuffle_vector(x, x, sel)])
                s16 = pairs if s16 is None else builder.add(s16, pairs)
            halves.append(builder.call(maddwd, [s16, ones]))
        acc = builder.add(acc, builder.shuffle_vector(halves[0], halves[1], _mask(range(16))))
    return acc


def _emit_dots(context, builder, rows, toks, accp, g0, g1, small, affine):
    """IR for the dots of every weight row in ``rows`` (u, dw, m pointers) with every token in
    ``toks`` (x, xcorr, dx, dxs pointers) over groups g0..g1-1, continuing the 16-lane float
    accumulators stored at ``accp`` (16 floats per (row, token), rows outer) and storing them
    back. Returns [float for (row, token)]: the accumulators' fixed-tree sums. Symmetric
    formats (not ``affine``) subtract xcorr (offset * sum(q)) from the integer sums; affine
    ones add m * dxs instead."""
    v64i8, v16i32, v16f = ir.VectorType(_I8, 64), ir.VectorType(_I32, 16), ir.VectorType(_F32, 16)
    route = _route(context, small)
    # the "avx2-sign" route (unsigned bytes u = q + 128: Q8_0, IQ4_NL, IQ2_XXS) dots the signed
    # q = u ^ 0x80 as they are: the integers isum - xcorr (xcorr = 128 * sum(x)) in one go,
    # without the 128 * sum(x) per chunk and token _dot_chunk would add back
    signed = route == "avx2-sign"
    pairs = [(r, t) for r in range(len(rows)) for t in range(len(toks))]
    acc_ptrs = [builder.bitcast(builder.gep(accp, [_const(16 * i)]), v16f.as_pointer())
                for i in range(len(pairs))]
    acc0 = [builder.load(p, align=4) for p in acc_ptrs]

    def body(g, accs):
        base = builder.mul(g, _const(GROUP_BYTES))
        isum = {rt: ir.Constant(v16i32, [ir.Constant(_I32, 0)] * 16) for rt in pairs}
        for c in range(GROUP_CHUNKS):
            off = builder.add(base, _const(64 * c))
            uv = [_load(builder, r[0], off, v64i8) for r in rows]
            xv = [_load(builder, t[0], off, v64i8) for t in toks]
            for r, t in pairs:
                if signed:
                    qv = builder.xor(uv[r], _splat(-128, _I8, 64))
                    isum[r, t] = builder.add(isum[r, t], _signed_dot_chunk(builder, qv, xv[t]))
                else:
                    isum[r, t] = _dot_chunk(builder, isum[r, t], uv[r], xv[t], route)
        gb = builder.mul(g, _const(GROUP_BLOCKS))
        dws = [_load(builder, r[1], gb, v16f, 4) for r in rows]
        dxs = [_load(builder, t[2], gb, v16f, 4) for t in toks]
        if affine:
            ms = [_load(builder, r[2], gb, v16f, 4) for r in rows]
            dxss = [_load(builder, t[3], gb, v16f, 4) for t in toks]
        elif not signed:
            corr = [_load(builder, t[1], gb, v16i32, 4) for t in toks]
        out = []
        for (r, t), acc in zip(pairs, accs):
            s = isum[r, t] if affine or signed else builder.sub(isum[r, t], corr[t])
            scale = builder.fmul(dws[r], dxs[t])
            acc = builder.fadd(acc, builder.fmul(builder.sitofp(s, v16f), scale))
            if affine:
                acc = builder.fadd(acc, builder.fmul(ms[r], dxss[t]))
            out.append(acc)
        return out

    accs = _loop(builder, g1, [(v16f, a) for a in acc0], body, "dot", start=g0)
    for acc, p in zip(accs, acc_ptrs):
        builder.store(acc, p, align=4)
    res = []
    for acc in accs:
        h = acc
        for width in (8, 4, 2):
            h = builder.fadd(builder.shuffle_vector(h, h, _mask(range(width))),
                             builder.shuffle_vector(h, h, _mask(range(width, 2 * width))))
        res.append(builder.fadd(builder.extract_element(h, ir.Constant(_I32, 0)),
                                builder.extract_element(h, ir.Constant(_I32, 1))))
    return res


def _make_dot(n_rows, n_toks, small, affine):
    @intrinsic
    def dot(typingctx, u, dw, m, x, xcorr, dx, dxs, acc, g0, g1, row, tok):
        for a, dt in ((u, types.uint8), (x, types.int8), (dw, types.float32), (m, types.float32),
                      (xcorr, types.int32), (dx, types.float32), (dxs, types.float32),
                      (acc, types.float32)):
            if not isinstance(a, types.Array) or a.dtype != dt or a.layout != "C" or a.ndim != 2:
                return None
        if not all(isinstance(v, types.Integer) for v in (g0, g1, row, tok)):
            return None
        sig = types.UniTuple(types.float32, n_rows * n_toks)(u, dw, m, x, xcorr, dx, dxs, acc,
                                                              g0, g1, row, tok)

        def codegen(context, builder, sig, args):
            g0, g1, r0, t0 = (_as_i64(builder, v) for v in args[8:12])
            accp = _row_ptr(context, builder, sig.args[7], args[7], builder.mul(t0, _const(n_rows)))
            rows = [tuple(_row_ptr(context, builder, sig.args[a], args[a],
                                   builder.add(r0, _const(i))) for a in (0, 1, 2))
                    for i in range(n_rows)]
            toks = [tuple(_row_ptr(context, builder, sig.args[a], args[a],
                                   builder.add(t0, _const(i))) for a in (3, 4, 5, 6))
                    for i in range(n_toks)]
            vals = _emit_dots(context, builder, rows, toks, accp, g0, g1, small, affine)
            return context.make_tuple(builder, sig.return_type, vals)

        return sig, codegen

    dot.__doc__ = f"""Dots of weight rows row..row+{n_rows - 1} of (u, dw, m) with activation rows
        tok..tok+{n_toks - 1} of (x, xcorr, dx, dxs) over groups g0..g1-1: a tuple of
        {n_rows * n_toks} float32, rows outer. The tile's 16-lane float accumulators live in
        rows n_rows * tok .. n_rows * tok + {n_rows * n_toks - 1} of acc (float32, 16 columns):
        zero them, then call once per run of groups, in order; the values returned after the
        last run are the results (bit-identical whatever the runs). u: uint8, x: int8 (rows, >= 512 * ngroups) in the
        group layout; dw, m, dx, dxs float32 and xcorr int32 (rows, >= 16 * ngroups), per block:
        weight scale and offset m, activation scale d, d * sum(q) and the weight offset
        (WEIGHT_OFFSET) times sum(q) of the activations. {"Reads m and dxs, not xcorr" if affine
        else "Reads xcorr, not m and dxs"}. {"Weights u <= 127" if small else "Any u <= 255"}.
        No bounds checks."""
    return dot


#: tiles of 2 weight rows x 2 tokens and 2 rows x 1 token (see _make_dot): Q8_0 (any u <= 255),
#: the symmetric 4/5-bit formats (u <= 31, which AVX2 can dot faster), the affine ones (with m)
DOT_2x2_Q8, DOT_2x1_Q8 = _make_dot(2, 2, False, False), _make_dot(2, 1, False, False)
DOT_2x2_SYM, DOT_2x1_SYM = _make_dot(2, 2, True, False), _make_dot(2, 1, True, False)
DOT_2x2_AFF, DOT_2x1_AFF = _make_dot(2, 2, True, True), _make_dot(2, 1, True, True)


# --- unpacking one row of blocks into the group layout -----------------------------------------


def _transpose_words(builder, rows):
    """rows: 16 vectors <4 x i32> (4 words of a block each) -> 4 vectors <16 x i32>, vector c
    = [rows[0][c], ..., rows[15][c]]."""
    quarters = []  # quarters[a][c]: <4 x i32> word c of rows 4a..4a+3
    for a in range(4):
        r = rows[4 * a:4 * a + 4]
        u0 = builder.shuffle_vector(r[0], r[1], _mask([0, 4, 1, 5]))
        u1 = builder.shuffle_vector(r[0], r[1], _mask([2, 6, 3, 7]))
        u2 = builder.shuffle_vector(r[2], r[3], _mask([0, 4, 1, 5]))
        u3 = builder.shuffle_vector(r[2], r[3], _mask([2, 6, 3, 7]))
        quarters.append([builder.shuffle_vector(u0, u2, _mask([0, 1, 4, 5])),
                         builder.shuffle_vector(u0, u2, _mask([2, 3, 6, 7])),
                         builder.shuffle_vector(u1, u3, _mask([0, 1, 4, 5])),
                         builder.shuffle_vector(u1, u3, _mask([2, 3, 6, 7]))])
    out = []
    for c in range(4):
        lo = builder.shuffle_vector(quarters[0][c], quarters[1][c], _mask(range(8)))
        hi = builder.shuffle_vector(quarters[2][c], quarters[3][c], _mask(range(8)))
        out.append(builder.shuffle_vector(lo, hi, _mask(range(16))))
    return out


def _block_offsets(builder, g, ts, nvalid):
    """Byte offsets (i64) of the 16 blocks of group g (i64) in a raw row of ``ts``-byte blocks.
    ``nvalid`` (i64, or None: all 16): only blocks 0..nvalid-1 exist; the others repeat block
    nvalid - 1, so nothing is read past the row's last block."""
    go = builder.mul(g, _const(GROUP_BLOCKS * ts))
    if nvalid is None:
        return [builder.add(go, _const(i * ts)) for i in range(GROUP_BLOCKS)]
    lastb = builder.sub(nvalid, _const(1))
    return [builder.add(go, builder.mul(
        builder.select(builder.icmp_signed("<", _const(i), nvalid), _const(i), lastb),
        _const(ts))) for i in range(GROUP_BLOCKS)]


def _fp16_at(builder, rp, lutp, off):
    """The fp16 at byte ``off`` of the row at rp, as float32 through the FP16_TO_FP32 table."""
    bits = builder.zext(_load(builder, rp, off, _I16), _I64)
    return builder.load(builder.gep(lutp, [bits]))


def _block_scales(builder, rp, lutp, offs, has_m):
    """<16 x float> of the blocks' fp16 scales d (at each block's start) and, with ``has_m``,
    of their offsets m (the next fp16; else None)."""
    v16f = ir.VectorType(_F32, 16)
    dw = ir.Constant(v16f, None)
    m = ir.Constant(v16f, None) if has_m else None
    for i in range(GROUP_BLOCKS):
        dw = builder.insert_element(dw, _fp16_at(builder, rp, lutp, offs[i]), ir.Constant(_I32, i))
        if has_m:
            m = builder.insert_element(m, _fp16_at(builder, rp, lutp, builder.add(offs[i], _const(2))),
                                       ir.Constant(_I32, i))
    return dw, m


def _emit_unpack_group(context, builder, kind, rp, lutp, g, nvalid=None):
    """IR for group g (i64) of the raw row at rp (i8*) of ``kind`` (UNPACK_LAYOUTS): its 8
    chunks (<16 x i32>, unsigned quants in the group layout), the 16 scales dw (<16 x float>)
    and offsets m (or None). ``nvalid`` (i64, or None: all 16): only blocks 0..nvalid-1 exist;
    the lanes of the others repeat block nvalid - 1 (no read past the row's last block)."""
    ts, qoff, qhoff, offset, has_m = UNPACK_LAYOUTS[kind]
    table = [v + offset for v in IQ4_NL_LEVELS] if kind == 5 else None
    wide = ts - qoff == 32  # Q8_0: 32 bytes per block, else 16 nibble bytes
    v4i32, v16i32 = ir.VectorType(_I32, 4), ir.VectorType(_I32, 16)
    offs = _block_offsets(builder, g, ts, nvalid)
    dw, m = _block_scales(builder, rp, lutp, offs, has_m)
    chunks = [None] * GROUP_CHUNKS
    for h in range(2 if wide else 1):  # Q8_0: 8 words per block
        rows = [_load(builder, rp, builder.add(offs[i], _const(qoff + 16 * h)), v4i32)
                for i in range(GROUP_BLOCKS)]
        for c, t in enumerate(_transpose_words(builder, rows)):
            if wide:  # signed byte -> byte + 128
                chunks[4 * h + c] = builder.xor(t, _splat(0x80808080, _I32))
            else:  # nibbles: word c holds values 4c.. (low) and 16 + 4c.. (high)
                chunks[c] = builder.and_(t, _splat(0x0F0F0F0F, _I32))
                chunks[4 + c] = builder.and_(builder.lshr(t, _splat(4, _I32)),
                                             _splat(0x0F0F0F0F, _I32))
    if qhoff >= 0:  # bit j of a block's qh is bit 4 of its value j
        qh = ir.Constant(v16i32, None)
        for i in range(GROUP_BLOCKS):
            qh = builder.insert_element(
                qh, _load(builder, rp, builder.add(offs[i], _const(qhoff)), _I32),
                ir.Constant(_I32, i))
        for c in range(GROUP_CHUNKS):
            nib = builder.and_(builder.lshr(qh, _splat(4 * c, _I32)), _splat(15, _I32))
            # bits 0..3 to bit 0 of bytes 0..3, then to bit 4
            spread = builder.and_(builder.mul(nib, _splat(0x00204081, _I32)),
                                  _splat(0x01010101, _I32))
            chunks[c] = builder.or_(chunks[c], builder.shl(spread, _splat(4, _I32)))
    if table is not None:  # IQ4_NL: the nibbles index its levels (+ 128)
        feats = host_features(context)
        for c in range(GROUP_CHUNKS):
            idx = builder.bitcast(chunks[c], ir.VectorType(_I8, 64))
            chunks[c] = builder.bitcast(lookup16(builder, feats, table, idx), v16i32)
    return chunks, dw, m


def _make_unpack(kind):
    @intrinsic
    def unpack(typingctx, rr, lut, u, dw, m, ngroups):
        """Groups 0..ngroups-1 (16 blocks each) of one raw row rr (uint8) -> unsigned quants u
        (uint8) in the group layout, scales dw[b] = lut[fp16 d] and (formats with an offset)
        m[b] = lut[fp16 m]. No bounds checks: rr must hold 16 * ngroups whole blocks."""
        sig = types.void(rr, lut, u, dw, m, ngroups)

        def codegen(context, builder, sig, args):
            rp, lutp, up, dwp, mp = [context.make_array(sig.args[i])(context, builder, args[i]).data
                                     for i in range(5)]
            v16i32, v16f = ir.VectorType(_I32, 16), ir.VectorType(_F32, 16)

            def body(g, _):
                chunks, dwv, mv = _emit_unpack_group(context, builder, kind, rp, lutp, g)
                gb = builder.mul(g, _const(GROUP_BLOCKS))
                for ptr, v in ((dwp, dwv), (mp, mv)):
                    if v is not None:
                        builder.store(v, builder.bitcast(builder.gep(ptr, [gb]), v16f.as_pointer()),
                                      align=4)
                base = builder.mul(g, _const(GROUP_BYTES))
                for c in range(GROUP_CHUNKS):
                    q = builder.bitcast(builder.gep(up, [builder.add(base, _const(64 * c))]),
                                        v16i32.as_pointer())
                    builder.store(chunks[c], q, align=1)
                return []

            _loop(builder, _as_i64(builder, args[5]), [], body, "unpack")
            return context.get_dummy_value()

        return sig, codegen

    return unpack


#: one per kind of UNPACK_LAYOUTS: (rr, lut, u, dw, m, ngroups)
UNPACK_Q4_0, UNPACK_Q4_1, UNPACK_Q5_0, UNPACK_Q5_1, UNPACK_Q8_0, UNPACK_IQ4_NL = (
    _make_unpack(k) for k in range(6))


def _pair_sums(builder, a, b):
    """<16 x i32>: lanes 0..7 the sums of a's lane pairs (2j, 2j + 1), lanes 8..15 b's."""
    return builder.add(builder.shuffle_vector(a, b, _mask(range(0, 32, 2))),
                       builder.shuffle_vector(a, b, _mask(range(1, 32, 2))))


def _block_sums_avx2(builder, parts):
    """AVX2's form of three levels of _pair_sums: ``parts`` are 8 <16 x i32>, vector v holding
    8 partial sums of block 2v (lanes 0..7) and 8 of block 2v + 1 (lanes 8..15); returns
    <16 x i32>, lane i = block i's sum (_block_sums8_avx2 per 8 blocks). The generic tree
    compiles to a vphaddd and a vpermq at every level: 42 port-5 operations per token and
    group against 26 here, and port 5 bounds a few-token kernel's loop on AVX2. The same exact
    integers either way."""
    blocks = []
    for p in parts:
        blocks += [builder.shuffle_vector(p, p, _mask(range(8))),
                   builder.shuffle_vector(p, p, _mask(range(8, 16)))]
    lo, hi = _block_sums8_avx2(builder, blocks[:8]), _block_sums8_avx2(builder, blocks[8:])
    return builder.shuffle_vector(lo, hi, _mask(range(16)))


def _block_sums8_avx2(builder, blocks):
    """<8 x i32>, lane j = the sum of the 8 lanes of blocks[j] (8 <8 x i32>). Two levels of
    vphaddd leave, per 4 blocks, the sums of their low 16 bytes in one 128-bit half and of
    their high 16 bytes in the other; one vpblendd, one vperm2i128 and an add then meet the
    halves in block order."""
    v8i32 = ir.VectorType(_I32, 8)
    phadd = _intrinsic_fn(builder, "llvm.x86.avx2.phadd.d", v8i32, [v8i32, v8i32])
    while len(blocks) > 2:
        blocks = [builder.call(phadd, [a, b]) for a, b in zip(blocks[::2], blocks[1::2])]
    a, b = blocks
    return builder.add(builder.shuffle_vector(a, b, _mask([0, 1, 2, 3, 12, 13, 14, 15])),
                       builder.shuffle_vector(a, b, _mask([4, 5, 6, 7, 8, 9, 10, 11])))


def _signed_dot_chunk(builder, w, x):
    """<16 x i32>: lane i = the sum of the 4 products w[4i+e] * x[4i+e] of signed bytes (AVX2:
    vpmaddubsw(|w|, x * sign(w)), exact while x >= -127, as ggml's Q8_0 activations are)."""
    maddubs, maddwd, psign, ones = _avx2_fns(builder)
    halves = []
    for h in range(2):
        sel = _mask(range(32 * h, 32 * h + 32))
        wh, xh = builder.shuffle_vector(w, w, sel), builder.shuffle_vector(x, x, sel)
        halves.append(builder.call(maddwd, [builder.call(maddubs, [builder.call(psign, [wh, wh]),
                                                                    builder.call(psign, [xh, wh])]),
                                            ones]))
    return builder.shuffle_vector(halves[0], halves[1], _mask(range(16)))


def _emit_q8_0_natural(builder, route, rp, lutp, g, nvalid, xv):
    """Q8_0's group g of the raw row at rp dotted with activations in their natural order
    (xv: per token the 8 <64 x i8> of the group, blocks 2v, 2v + 1 in vector v), without
    the group layout's transpose: per vector v the two blocks' quants (two 32-byte loads)
    + 128, one chunk dot (8 lanes per block), then 3 levels of pair sums put block i's exact
    sum in lane i. Returns ([<16 x i32> per token], dw). On the "avx2-sign" route the signed
    quants are dotted as they are (_signed_dot_chunk): the sums then carry no offset, and the
    caller subtracts none."""
    ts = 34
    v8i32, v16i32 = ir.VectorType(_I32, 8), ir.VectorType(_I32, 16)
    v64i8 = ir.VectorType(_I8, 64)
    offs = _block_offsets(builder, g, ts, nvalid)
    dw, _ = _block_scales(builder, rp, lutp, offs, False)
    zero = ir.Constant(v16i32, [ir.Constant(_I32, 0)] * 16)
    parts = [[] for _ in xv]
    for v in range(GROUP_CHUNKS):
        lo = _load(builder, rp, builder.add(offs[2 * v], _const(2)), v8i32)
        hi = _load(builder, rp, builder.add(offs[2 * v + 1], _const(2)), v8i32)
        w = builder.shuffle_vector(lo, hi, _mask(range(16)))
        if route == "avx2-sign":  # the signed quants as they are: no offset to remove
            for t, x in enumerate(xv):
                parts[t].append(_signed_dot_chunk(builder, builder.bitcast(w, v64i8), x[v]))
            continue
        u = builder.bitcast(builder.xor(w, _splat(0x80808080, _I32)), v64i8)
        for t, x in enumerate(xv):
            parts[t].append(_dot_chunk(builder, zero, u, x[v], route))
    sums = []
    for p in parts:
        if route in ("avx2", "avx2-sign"):
            sums.append(_block_sums_avx2(builder, p))
            continue
        while len(p) > 1:
            p = [_pair_sums(builder, a, b) for a, b in zip(p[::2], p[1::2])]
        sums.append(p[0])
    return sums, dw


def _emit_nibbles_quad(context, builder, route, kind, rp, lutp, g, nvalid, xv):
    """Q4_0, Q4_1 or IQ4_NL's group g of the raw row at rp dotted with activations in the
    quad order (xv: per token the 8 <64 x i8> of the group; vector 2a + h holds, per 16-byte
    lane j, values 16h..16h+15 of block 4a + j) without the group layout's transpose: per 4
    blocks one vector of their nibble bytes (four 16-byte loads), its low and high nibbles
    dotted (4 lanes per block), then 2 levels of pair sums put block i's exact sum in lane i.
    Returns ([<16 x i32> per token], dw, m or None)."""
    ts, qoff, _, offset, has_m = UNPACK_LAYOUTS[kind]
    table = [v + offset for v in IQ4_NL_LEVELS] if kind == 5 else None
    v4i32, v16i32 = ir.VectorType(_I32, 4), ir.VectorType(_I32, 16)
    v64i8 = ir.VectorType(_I8, 64)
    offs = _block_offsets(builder, g, ts, nvalid)

    dw, m = _block_scales(builder, rp, lutp, offs, has_m)
    feats = host_features(context) if table is not None else None
    zero = ir.Constant(v16i32, [ir.Constant(_I32, 0)] * 16)
    parts = [[] for _ in xv]
    for a in range(4):
        q = [_load(builder, rp, builder.add(offs[4 * a + j], _const(qoff)), v4i32)
             for j in range(4)]
        q = builder.shuffle_vector(builder.shuffle_vector(q[0], q[1], _mask(range(8))),
                                   builder.shuffle_vector(q[2], q[3], _mask(range(8))),
                                   _mask(range(16)))
        halves = [builder.and_(q, _splat(0x0F0F0F0F, _I32)),
                  builder.and_(builder.lshr(q, _splat(4, _I32)), _splat(0x0F0F0F0F, _I32))]
        halves = [builder.bitcast(h, v64i8) for h in halves]
        if table is not None:
            halves = [lookup16(builder, feats, table, h) for h in halves]
        for t, x in enumerate(xv):
            acc = _dot_chunk(builder, zero, halves[0], x[2 * a], route)
            parts[t].append(_dot_chunk(builder, acc, halves[1], x[2 * a + 1], route))
    sums = []
    for p in parts:
        while len(p) > 1:
            p = [_pair_sums(builder, a, b) for a, b in zip(p[::2], p[1::2])]
        sums.append(p[0])
    return sums, dw, m


#: kinds whose fused kernels read the activations in the natural order (Q8_0) or in the quad
#: order (Q4_0, Q4_1, IQ4_NL; see _emit_nibbles_quad); the others (Q5_0, Q5_1) in the group
#: layout, as the tiles
FUSED_NATURAL = (4,)
FUSED_QUAD = (0, 1, 5)
#: ... in the slot order (IQ2_XXS; see _emit_iq2_xxs_slots): value 8b + v of block 16g + i at
#: byte 512g + 64v + 4i + b, where iq2_xxs_slot_order() (else in the group layout)
FUSED_SLOTS = (KIND_IQ2_XXS,)


#: the fused kernels prefetch the rows this many rows ahead (the same group or super-block):
#: one decoding thread streams rows faster than the hardware prefetchers alone bring them, and
#: a few-token kernel busy with arithmetic leaves them to wait on memory without it
PREFETCH_ROWS = 8


def _prefetcher(context, builder, aty, val, rps, ts):
    """A function of a unit index (a group, a super-block: ``ts`` raw bytes) emitting
    prefetches of that unit's bytes in the rows PREFETCH_ROWS after each of ``rps`` (hints:
    never a fault, even past the end)."""
    ary = context.make_array(aty)(context, builder, val)
    ahead = builder.mul(builder.extract_value(ary.strides, 0), _const(PREFETCH_ROWS))
    i8p = _I8.as_pointer()
    fn = _intrinsic_fn(builder, "llvm.prefetch.p0i8", ir.VoidType(), [i8p, _I32, _I32, _I32])
    args = [ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)]
    bases = [builder.gep(builder.bitcast(rp, i8p), [ahead]) for rp in rps]

    def emit(sb):
        o = builder.mul(sb, _const(ts))
        for b in bases:
            for off in range(0, ts, 64):
                builder.call(fn, [builder.gep(b, [builder.add(o, _const(off))])] + args)
    return emit


def _make_fused(kind, n_rows, n_toks):
    iq2 = kind == KIND_IQ2_XXS  # raw units of 66 bytes = 8 blocks (super-blocks)
    ts = 66 if iq2 else UNPACK_LAYOUTS[kind][0]
    affine = False if iq2 else UNPACK_LAYOUTS[kind][4]
    small = kind < 4

    @intrinsic
    def fused(typingctx, raw, lut, x, xcorr, dx, dxs, tok, row, n_out):
        """Dots of tokens tok..tok+T-1 of (x, xcorr, dx, dxs) (as for the tiles) with weight
        rows row..row+R-1 (each clamped to n_out - 1) of raw (uint8 (rows, row bytes)),
        unpacked group by group in registers (no scratch; a last partial group's missing
        lanes are left out, not zero-padded): R * T float32, rows outer, bit-identical to
        the tiles' results."""
        sig = types.UniTuple(types.float32, n_rows * n_toks)(raw, lut, x, xcorr, dx, dxs, tok,
                                                              row, n_out)

        def codegen(context, builder, sig, args):
            v64i8, v16i32, v16f = (ir.VectorType(_I8, 64), ir.VectorType(_I32, 16),
                                   ir.VectorType(_F32, 16))
            route = _route(context, small)
            # IQ2_XXS outside the slot order: magnitudes (at most 43) dotted with the
            # activations negated where the level is (|x| <= 127), as ggml does, on the small
            # weights' route, in place of the signed levels + 128 and their offset sums: the
            # same integers (AVX2 code, 4096 x 14336 from memory, k = 1: 1.37x the bytes per
            # second); on AVX2 in the natural order (_emit_iq2_xxs_natural), else in the group
            # layout
            signs_on_x = iq2 and not _slot_order(host_features(context))
            natural_iq2 = iq2 and _iq2_natural(host_features(context))
            small_route = _route(context, True)
            t0, r0, n = (_as_i64(builder, v) for v in args[6:9])
            lutp = context.make_array(sig.args[1])(context, builder, args[1]).data
            ra = context.make_array(sig.args[0])(context, builder, args[0])
            nb = builder.udiv(builder.extract_value(ra.shape, 1), _const(ts))
            if iq2:
                nb = builder.mul(nb, _const(8))
            nfull = builder.udiv(nb, _const(GROUP_BLOCKS))
            rem = builder.urem(nb, _const(GROUP_BLOCKS))
            last = builder.sub(n, _const(1))
            rps = [_row_ptr(context, builder, sig.args[0], args[0], r)
                   for r in _clamped(builder, r0, n_rows, last)]
            # tokens past the activations' last are read as the last (FUSED8 serves 5 to 8)
            xa = context.make_array(sig.args[2])(context, builder, args[2])
            last_t = builder.sub(builder.extract_value(xa.shape, 0), _const(1))
            toks = [tuple(_row_ptr(context, builder, sig.args[a], args[a], ti)
                          for a in (2, 3, 4, 5)) for ti in _clamped(builder, t0, n_toks, last_t)]
            zero = ir.Constant(v16f, [ir.Constant(_F32, 0.0)] * 16)
            pf = _prefetcher(context, builder, sig.args[0], args[0], rps, GROUP_RAW_BYTES[kind])

            def group(g, accs, nvalid):
                if nvalid is None:
                    pf(g)
                base = builder.mul(g, _const(GROUP_BYTES))
                gb = builder.mul(g, _const(GROUP_BLOCKS))
                xv = [[_load(builder, tp[0], builder.add(base, _const(64 * c)), v64i8)
                       for c in range(GROUP_CHUNKS)] for tp in toks]
                dxv = [_load(builder, tp[2], gb, v16f, 4) for tp in toks]
                if affine:
                    dxsv = [_load(builder, tp[3], gb, v16f, 4) for tp in toks]
                else:
                    corr = [_load(builder, tp[1], gb, v16i32, 4) for tp in toks]
                    if iq2 and not signs_on_x:  # its dots start from -corr (see below)
                        negcorr = [builder.sub(ir.Constant(v16i32, [ir.Constant(_I32, 0)] * 16),
                                               cv) for cv in corr]
                out = []
                for i, rp in enumerate(rps):
                    if kind == 4:
                        isums, dwv = _emit_q8_0_natural(builder, route, rp, lutp, g, nvalid, xv)
                    elif kind in FUSED_QUAD:
                        isums, dwv, mv = _emit_nibbles_quad(context, builder, route, kind, rp,
                                                            lutp, g, nvalid, xv)
                    elif natural_iq2:
                        isums, dwv = _emit_iq2_xxs_natural(
                            context, builder, rp, lutp, g, nvalid, [tp[0] for tp in toks], base)
                    elif iq2 and signs_on_x:
                        uv, dwv = _emit_iq2_xxs_group(context, builder, rp, lutp, g, nvalid,
                                                      split=True)
                    elif iq2:
                        uv, dwv = _emit_iq2_xxs_slots(context, builder, rp, lutp, g, nvalid)
                    else:
                        chunks, dwv, mv = _emit_unpack_group(context, builder, kind, rp, lutp,
                                                             g, nvalid)
                        uv = [builder.bitcast(ch, v64i8) for ch in chunks]
                    for t in range(n_toks):
                        if kind == 4 or kind in FUSED_QUAD or natural_iq2:
                            isum = isums[t]
                        elif iq2 and signs_on_x:  # |level| . (x * sign): v . x exactly
                            isum = ir.Constant(v16i32, [ir.Constant(_I32, 0)] * 16)
                            for c in range(GROUP_CHUNKS):
                                mag, neg = uv[c]
                                xs = builder.sub(builder.xor(xv[t][c], neg), neg)
                                isum = _dot_chunk(builder, isum, mag, xs, small_route)
                        elif iq2:  # the dots added to -corr: isum - corr in one go
                            isum = negcorr[t]
                            for c in range(GROUP_CHUNKS):
                                isum = _dot_chunk(builder, isum, uv[c], xv[t][c], route)
                        else:
                            isum = ir.Constant(v16i32, [ir.Constant(_I32, 0)] * 16)
                            for c in range(GROUP_CHUNKS):
                                isum = _dot_chunk(builder, isum, uv[c], xv[t][c], route)
                        exact = affine or iq2 or (kind == 4 and route == "avx2-sign")
                        s_ = isum if exact else builder.sub(isum, corr[t])
                        scale = builder.fmul(dwv, dxv[t])
                        acc = accs[i * n_toks + t]
                        acc = builder.fadd(acc, builder.fmul(builder.sitofp(s_, v16f), scale))
                        if affine:
                            acc = builder.fadd(acc, builder.fmul(mv, dxsv[t]))
                        out.append(acc)
                return out

            accs = _loop(builder, nfull, [(v16f, zero)] * (n_rows * n_toks),
                         lambda g, a: group(g, a, None), "fused")
            pre = builder.block
            with builder.if_then(builder.icmp_signed(">", rem, _const(0))):
                new = group(nfull, accs, rem)
                keep = builder.icmp_signed("<", _vconst(range(16), _I32),
                                           splat(builder, builder.trunc(rem, _I32), 16))
                new = [builder.select(keep, a1, a0) for a0, a1 in zip(accs, new)]
                tail_end = builder.block
            phis = []
            for a0, a1 in zip(accs, new):
                p = builder.phi(v16f)
                p.add_incoming(a0, pre)
                p.add_incoming(a1, tail_end)
                phis.append(p)
            res = []
            for h in phis:
                for width in (8, 4, 2):
                    h = builder.fadd(builder.shuffle_vector(h, h, _mask(range(width))),
                                     builder.shuffle_vector(h, h, _mask(range(width, 2 * width))))
                res.append(builder.fadd(builder.extract_element(h, ir.Constant(_I32, 0)),
                                        builder.extract_element(h, ir.Constant(_I32, 1))))
            return context.make_tuple(builder, sig.return_type, res)

        return sig, codegen

    return fused


#: rows per fused call (FUSED{T}_*: FUSED_ROWS rows x T tokens, T = 1..4 and 8), one per
#: kind of UNPACK_LAYOUTS: (raw, lut, x, xcorr, dx, dxs, tok, row, n_out) -> R * T float32.
#: One row at a time, so that a thread reads its weights as one ascending stream: several rows
#: dotted side by side interleave their streams, which the hardware prefetchers follow badly
#: when rows are short (Zen 4, Q8_0 2816x1024 matrices streamed from DRAM, 2 threads: 4 rows
#: 9-11 GB/s, 1 row 13-23 GB/s, for the same speed from L3; decoding a 350M Q8_0 model 1.49x).
#: The activations a row reuses come from L1 instead of registers.
FUSED_ROWS = 1
FUSED1_Q4_0, FUSED1_Q4_1, FUSED1_Q5_0, FUSED1_Q5_1, FUSED1_Q8_0, FUSED1_IQ4_NL = (
    _make_fused(k, FUSED_ROWS, 1) for k in range(6))
FUSED2_Q4_0, FUSED2_Q4_1, FUSED2_Q5_0, FUSED2_Q5_1, FUSED2_Q8_0, FUSED2_IQ4_NL = (
    _make_fused(k, FUSED_ROWS, 2) for k in range(6))
FUSED3_Q4_0, FUSED3_Q4_1, FUSED3_Q5_0, FUSED3_Q5_1, FUSED3_Q8_0, FUSED3_IQ4_NL = (
    _make_fused(k, FUSED_ROWS, 3) for k in range(6))
FUSED4_Q4_0, FUSED4_Q4_1, FUSED4_Q5_0, FUSED4_Q5_1, FUSED4_Q8_0, FUSED4_IQ4_NL = (
    _make_fused(k, FUSED_ROWS, 4) for k in range(6))
#: 5 to 8 tokens: one row per call whatever FUSED_ROWS (legacy._fused_span8 steps one row and
#: keeps the first k of the 8 values)
FUSED8_Q4_0, FUSED8_Q4_1, FUSED8_Q5_0, FUSED8_Q5_1, FUSED8_Q8_0, FUSED8_IQ4_NL = (
    _make_fused(k, 1, 8) for k in range(6))


# --- IQ2_XXS: a group is two super-blocks (16 blocks of 32, 132 raw bytes) ----------------------
# Block 8s + b of a group is block b of super-block s: its grid word (4 indices, slot l = values
# 8l..8l+7) and its sign word (4 x 7 sign bits, the 4-bit scale s in bits 28..31). IQ2_XXS's
# weights and activations use the slot order instead of the group layout with AVX-512 VBMI and
# GFNI (FUSED_SLOTS, iq2_xxs_slot_order(); the tiles only need the two to agree and lane i to be
# block i): chunk v holds value v of each of a block's 4 slots, value 8b + v of block i at byte
# 64v + 4i + b. The unpacker (for the tiles) and the fused k <= 2 kernels take the bytes
# u = level * sign + 128 from _emit_iq2_xxs_slots: there a handful of byte-table lookups per
# group and one vpermb per chunk; elsewhere the 8-byte grid points in the group layout
# (_emit_iq2_xxs_group: by gathers on AVX-512, by one byte load and one 8-byte load each on
# AVX2), which the activations then take too: rebuilding the slot order from it took byte
# shuffles that cost AVX2 more than the grid loads. On AVX2 the fused kernels read the
# activations in their natural order instead (_emit_iq2_xxs_natural, iq2_xxs_natural()). The
# scale is d * (2s + 1) / 8 per block on every route (exact: ggml's d * (0.5 + s) * 0.25).

#: set to False to leave out IQ2_XXS's VBMI + GFNI route (and its vpermps scale table; tests
#: compare the routes)
USE_VBMI = True
#: set to False to load IQ2_XXS's grid points one by one on AVX-512 hosts too (elsewhere they
#: are: AVX2 compilers lower a gather to loads of indices pulled out of vector registers)
USE_GATHER = True


def _slot_order(features) -> bool:
    return USE_VBMI and {"avx512vbmi", "gfni"} <= features


def _iq2_natural(features) -> bool:
    return not _slot_order(features) and _route_for(features, True) == "avx2"


def iq2_xxs_natural() -> bool:
    """Whether IQ2_XXS's fused kernels read the activations in their natural order on this
    host (AVX2 without AVX-512 VNNI: _emit_iq2_xxs_natural), as Q8_0's do."""
    return _iq2_natural(host_cpu_features())


def iq2_xxs_slot_order() -> bool:
    """Whether IQ2_XXS's kernels (and so its activations) use the slot order on this host,
    else the group layout (see above)."""
    return _slot_order(host_cpu_features())


_IQ2_LEVEL = {8: 0, 25: 1, 43: 2}
#: per grid point its 16-bit code, bits 2j..2j+1 the level (0, 1, 2: magnitude 8, 25, 43) of
#: value j
IQ2_XXS_CODES = tuple(sum(_IQ2_LEVEL[(v >> (8 * j)) & 255] << (2 * j) for j in range(8))
                      for v in IQ2_XXS_GRID)
#: ggml's ksigns: per 7 stored sign bits the 8 signs (bit j set: value j negative)
IQ2_XXS_KSIGNS = tuple(_gguf_quants.IQ2_XXS.ksigns)


def _bytes_const(vals):
    return _vconst([((int(v) + 128) & 255) - 128 for v in vals], _I8)


def _opaque_i64(builder, v):
    """v (i64), passed through an empty inline asm: a value LLVM cannot see through."""
    return builder.call(ir.InlineAsm(ir.FunctionType(_I64, [_I64]), "", "=r,0"), [v])


def _opaque_ptr(builder, p):
    """p, passed through _opaque_i64: loads through it are not merged with loads of the
    same bytes through p (LLVM would take IQ2_XXS's index bytes out of the vector of words
    already loaded, one vpextrq and vmovq per pair: more work than a byte load each)."""
    return builder.inttoptr(_opaque_i64(builder, builder.ptrtoint(p, _I64)), p.type)


def _iq2_xxs_superblocks(builder, g, nvalid):
    """The byte offsets of group g's two super-blocks (the first twice where ``nvalid`` says
    only it exists)."""
    go = builder.mul(g, _const(132))
    so = [go, builder.add(go, _const(66))]
    if nvalid is not None:
        so[1] = builder.select(builder.icmp_signed(">", nvalid, _const(8)), so[1], go)
    return so


def _iq2_xxs_words(context, builder, rp, lutp, g, nvalid):
    """Group g's grid words q0 and sign words q1 (<16 x i32>, lane i = block i), the block
    scales dw = d * (2s + 1) / 8 (<16 x float>) and the super-blocks' byte offsets (see
    _iq2_xxs_superblocks; _emit_iq2_xxs_group for ``nvalid``)."""
    v16i32, v16f = ir.VectorType(_I32, 16), ir.VectorType(_F32, 16)
    so = _iq2_xxs_superblocks(builder, g, nvalid)
    words = [_load(builder, rp, builder.add(so[s], _const(2)), v16i32) for s in range(2)]
    q0 = builder.shuffle_vector(words[0], words[1], _mask(range(0, 32, 2)))  # grid indices
    q1 = builder.shuffle_vector(words[0], words[1], _mask(range(1, 32, 2)))  # signs, scale
    # scales: d * (2s + 1) * 0.125, d per super-block (lanes 0..7, 8..15)
    ds = [_fp16_at(builder, rp, lutp, so[s]) for s in range(2)]
    dv = ir.Constant(v16f, None)
    for i in range(16):
        dv = builder.insert_element(dv, ds[i // 8], ir.Constant(_I32, i))
    sc = builder.lshr(q1, _splat(28, _I32))
    if USE_VBMI and "avx512f" in host_features(context):  # (2s + 1) / 8 from a table (vpermps)
        permps = _intrinsic_fn(builder, "llvm.x86.avx512.permvar.sf.512", v16f, [v16f, v16i32])
        f = builder.call(permps, [ir.Constant(v16f, [(2 * v + 1) / 8 for v in range(16)]), sc])
    else:
        ls = builder.add(builder.shl(sc, _splat(1, _I32)), _splat(1, _I32))
        f = builder.fmul(builder.sitofp(ls, v16f), ir.Constant(v16f, [0.125] * 16))
    dw = builder.fmul(dv, f)  # exact either way: 11 x 5 significant bits
    return q0, q1, dw, so


def _iq2_xxs_grid(builder):
    """The module's constant table of the 256 grid points (i64: 8 magnitudes as bytes)."""
    grid = builder.module.globals.get("ds4_iq2_xxs_grid")
    if grid is None:
        ty = ir.ArrayType(_I64, 256)
        grid = ir.GlobalVariable(builder.module, ty, "ds4_iq2_xxs_grid")
        grid.linkage = "internal"
        grid.global_constant = True
        grid.initializer = ir.Constant(ty, [((v + 2**63) % 2**64) - 2**63 for v in IQ2_XXS_GRID])
        grid.align = 64
    return grid


def _iq2_xxs_point(builder, grid, opaque_rp, off):
    """The grid point (i64) whose index is the row's byte at ``off``, that byte loaded as
    stored through opaque_rp (_opaque_ptr of the row) and the point from ``grid``
    (_iq2_xxs_grid): one byte load and one 8-byte load, where AVX2 has no fast gather."""
    ib = builder.load(builder.gep(opaque_rp, [off]))
    return builder.load(builder.gep(grid, [ir.Constant(_I32, 0), builder.zext(ib, _I64)]),
                        align=8)


def _iq2_xxs_sign_bytes(builder, q1):
    """<64 x i8>, byte 4i + l: the 8 signs of block i's slot l (bit j set: value 8l + j
    negative): the 7 stored bits (q1 >> 7l) & 127 and their parity as bit 7."""
    b7 = builder.and_(q1, _splat(0x7F, _I32))
    for l in range(1, 4):
        b7 = builder.or_(b7, builder.and_(builder.shl(q1, _splat(l, _I32)),
                                          _splat(0x7F << (8 * l), _I32)))
    p = builder.xor(b7, builder.lshr(b7, _splat(4, _I32)))
    p = builder.xor(p, builder.lshr(p, _splat(2, _I32)))
    p = builder.xor(p, builder.lshr(p, _splat(1, _I32)))
    return builder.bitcast(builder.or_(b7, builder.shl(builder.and_(p, _splat(0x01010101, _I32)),
                                                       _splat(7, _I32))), ir.VectorType(_I8, 64))


def _emit_iq2_xxs_natural(context, builder, rp, lutp, g, nvalid, xps, base):
    """IQ2_XXS's group g of the raw row at rp dotted with activations in their natural order
    (xps: per token the activations' row pointer, i8*; base: the group's byte offset), as
    ggml's AVX2 kernel does, on the "avx2" route: a block's 4 grid points side by side are its
    32 magnitudes in order, so no transpose into the group layout; per block a byte load and
    an 8-byte load per point, its 4 sign bytes (_iq2_xxs_sign_bytes, kept on the stack)
    broadcast and spread to its 32 values by one vpshufb, a byte that is negative exactly
    where the level is (bit + 128 - bit) for vpsignb on the activations, then one vpmaddubsw
    and one vpmaddwd; _block_sums8_avx2 puts block i's exact sum in lane i. The group's two
    super-blocks go through a loop whose trip count LLVM cannot see, so it is not unrolled:
    the unrolled group holds more values than AVX2's 16 registers. Against the group layout
    (AVX2 code, 256 x 14336 in cache, one thread, k = 1 / 2 / 4 / 8): 215 / 310 / 452 / 838
    us to 209 / 306 / 435 / 713. AVX-512 hosts without VBMI keep the group layout, where the
    gathers make it faster (AVX-512 VNNI code, k = 8: 479 us against 612 for this order).
    Returns ([<16 x i32> per token], dw)."""
    v8i32 = ir.VectorType(_I32, 8)
    v32i8, v4i64 = ir.VectorType(_I8, 32), ir.VectorType(_I64, 4)
    _, q1, dw, so = _iq2_xxs_words(context, builder, rp, lutp, g, nvalid)
    grid = _iq2_xxs_grid(builder)
    maddubs, maddwd, psign, ones = _avx2_fns(builder)
    slot = cgutils.alloca_once(builder, ir.VectorType(_I8, 64))
    builder.store(_iq2_xxs_sign_bytes(builder, q1), slot)
    swp = _opaque_ptr(builder, builder.bitcast(slot, _I32.as_pointer()))
    opaque_rp = _opaque_ptr(builder, rp)
    bit = _vconst([((1 << (j % 8)) ^ 128) - 128 for j in range(32)], _I8)
    top = _vconst([((128 - (1 << (j % 8)) if j % 8 < 7 else 1) ^ 128) - 128 for j in range(32)],
                  _I8)
    spread = _vconst([j // 8 for j in range(32)], _I8)
    pshufb = _intrinsic_fn(builder, "llvm.x86.avx2.pshuf.b", v32i8, [v32i8, v32i8])
    two = _opaque_i64(builder, _const(2))
    zero8 = ir.Constant(v8i32, [ir.Constant(_I32, 0)] * 8)

    def half(w, vals):
        sob = builder.select(builder.icmp_signed("==", w, _const(0)), so[0], so[1])
        xo = builder.add(base, builder.mul(w, _const(256)))
        blocks = [[] for _ in xps]
        for j in range(8):  # block 8w + j: block j of super-block w
            pts = ir.Constant(v4i64, None)
            for l in range(4):
                point = _iq2_xxs_point(builder, grid, opaque_rp,
                                       builder.add(sob, _const(2 + 8 * j + l)))
                pts = builder.insert_element(pts, point, ir.Constant(_I32, l))
            mag = builder.bitcast(pts, v32i8)
            sw = builder.load(builder.gep(swp, [builder.add(builder.mul(w, _const(8)),
                                                            _const(j))]), align=4)
            sb = builder.call(pshufb, [builder.bitcast(splat(builder, sw, 8), v32i8), spread])
            m = builder.add(builder.and_(sb, bit), top)
            for t, xp in enumerate(xps):
                x = _load(builder, xp, builder.add(xo, _const(32 * j)), v32i8)
                pairs = builder.call(maddubs, [mag, builder.call(psign, [x, m])])
                blocks[t].append(builder.call(maddwd, [pairs, ones]))
        first = builder.icmp_signed("==", w, _const(0))
        out = []
        for t in range(len(xps)):
            r = _block_sums8_avx2(builder, blocks[t])
            out += [builder.select(first, r, vals[2 * t]),
                    builder.select(first, vals[2 * t + 1], r)]
        return out

    vals = _loop(builder, two, [(v8i32, zero8)] * (2 * len(xps)), half, "iq2half")
    sums = [builder.shuffle_vector(vals[2 * t], vals[2 * t + 1], _mask(range(16)))
            for t in range(len(xps))]
    return sums, dw


def _emit_iq2_xxs_group(context, builder, rp, lutp, g, nvalid=None, split=False):
    """IR for group g (i64) of the raw IQ2_XXS row at rp (i8*): its 8 chunks (<64 x i8>, u =
    level * sign + 128 in the group layout) and the 16 block scales dw (<16 x float>), by
    portable IR: per slot l the 16 blocks' 8-byte grid points (a constant table in the module)
    by one gather where AVX-512 has it, else by loads of the index bytes and the points one by
    one (AVX2 code, 4096 x 14336 from memory, 2 threads: 1.35x the bytes per second of the
    gathers, which LLVM lowers to indices extracted from vector registers there), whose low and
    high words are chunks 2l and 2l + 1; the signs computed (7
    stored bits and their parity as the eighth) and applied by a compare and select.
    ``nvalid`` (i64, or None: 16): 8 when only the first super-block exists; the lanes of the
    missing one then repeat it (nothing is read past the row's end). ``split``: each chunk as
    (magnitudes, -1 where the level is negative else 0) instead, for dots that move the signs
    onto the activations (see _make_fused)."""
    v64i8, v16i64 = ir.VectorType(_I8, 64), ir.VectorType(_I64, 16)
    q0, q1, dw, so = _iq2_xxs_words(context, builder, rp, lutp, g, nvalid)
    chunks = []
    grid = _iq2_xxs_grid(builder)
    base = splat(builder, builder.ptrtoint(grid, _I64), 16)
    ptrs_t = ir.VectorType(_I64.as_pointer(), 16)
    gather = _intrinsic_fn(builder, "llvm.masked.gather.v16i64.v16p0", v16i64,
                           [ptrs_t, _I32, ir.VectorType(ir.IntType(1), 16), v16i64])
    all_lanes = ir.Constant(ir.VectorType(ir.IntType(1), 16), [1] * 16)
    scalar = not (USE_GATHER and "avx512f" in host_features(context))
    if scalar:
        opaque_rp = _opaque_ptr(builder, rp)

    def grid_points(l):
        """Slot l's 16 grid points (<16 x i64>, lane i = block i)."""
        if not scalar:
            ix = builder.zext(builder.and_(builder.lshr(q0, _splat(8 * l, _I32)),
                                           _splat(255, _I32)), v16i64)
            ptrs = builder.inttoptr(builder.add(base, builder.shl(ix, _splat(3, _I64))), ptrs_t)
            return builder.call(gather, [ptrs, ir.Constant(_I32, 8), all_lanes,
                                         ir.Constant(v16i64, None)])
        gv = ir.Constant(v16i64, None)
        for i in range(16):
            point = _iq2_xxs_point(builder, grid, opaque_rp,
                                   builder.add(so[i // 8], _const(2 + 8 * (i % 8) + l)))
            gv = builder.insert_element(gv, point, ir.Constant(_I32, i))
        return gv
    sw = _iq2_xxs_sign_bytes(builder, q1)
    for l in range(4):
        gw = builder.bitcast(grid_points(l), ir.VectorType(_I32, 32))
        for h in range(2):  # low words: chunk 2l, high words: chunk 2l + 1
            mag = builder.bitcast(_pick(builder, gw, range(h, 32, 2)), v64i8)  # vpermt2d
            # byte 4i + e: bit 4h + e of block i's sign byte l
            sb = builder.shuffle_vector(sw, sw, _mask([4 * (j // 4) + l for j in range(64)]))
            bit = _vconst([((1 << (4 * h + j % 4)) ^ 128) - 128 for j in range(64)], _I8)
            neg = builder.icmp_unsigned("!=", builder.and_(sb, bit), _splat(0, _I8, 64))
            if split:
                chunks.append((mag, builder.sext(neg, v64i8)))
                continue
            chunks.append(builder.select(neg, builder.sub(_splat(-128, _I8, 64), mag),
                                         builder.add(mag, _splat(-128, _I8, 64))))
    return chunks, dw


def _iq2_xxs_slot_tables():
    """The byte tables of _emit_iq2_xxs_slots (Python ints)."""
    lev = [[(c >> (2 * j)) & 3 for j in range(8)] for c in IQ2_XXS_CODES]
    # per grid point and half h: levels l0..l3 of values 4h..4h+3 at bits 0-1, 2 + 5, 3-4, 6-7
    halves = [[l[4 * h] | (l[4 * h + 2] & 1) << 2 | l[4 * h + 1] << 3 | (l[4 * h + 2] >> 1) << 5
               | l[4 * h + 3] << 6 for l in lev] for h in range(2)]
    # per pair k of values (2k, 2k + 1) and 7 stored sign bits: their signs at bits 2 and 5
    signs = [[((s >> 2 * k) & 1) << 2 | ((s >> (2 * k + 1)) & 1) << 5 for s in IQ2_XXS_KSIGNS]
             for k in range(4)]

    def u(level, neg):
        m = (8, 25, 43, 0)[level]
        return 128 - m if neg else 128 + m

    # level + sign of the pair's first value at bits 0-2, of its second at bits 3-5
    values = [[u(j & 3, (j >> 2) & 1) for j in range(64)],
              [u((j >> 3) & 3, (j >> 5) & 1) for j in range(64)]]
    return halves, signs, values


_IQ2_SLOT_TABLES = _iq2_xxs_slot_tables()


def _emit_iq2_xxs_slots(context, builder, rp, lutp, g, nvalid=None):
    """As _emit_iq2_xxs_group, but the 8 chunks in the slot order (FUSED_SLOTS): chunk v holds
    value v of each slot, block i's dword lane bytes b = 0..3 being its values 8b + v.

    VBMI + GFNI route: per group, the 64 grid indices look up two bytes each (two tables of
    256: 4 vpermi2b, 2 blends), the levels of values 4h..4h+3, and the 64 7-bit sign fields
    (one vpmultishiftqb) four bytes each (four tables of 128, vpermi2b), the signs of values
    2k and 2k + 1 at bits 2 and 5. Merged (vpternlogd; a vgf2p8affineqb moves the second pair
    of levels down), byte k of a (block, slot) holds level and sign of values 2k and 2k + 1 at
    bits 0-2 and 3-5, so a chunk is one vpermb of a 64-entry table (u by those 6 bits). Other
    hosts: the group layout's chunks (_emit_iq2_xxs_group; iq2_xxs_slot_order() is false)."""
    v64i8 = ir.VectorType(_I8, 64)
    if not _slot_order(host_features(context)):
        return _emit_iq2_xxs_group(context, builder, rp, lutp, g, nvalid)
    q0, q1, dw, so = _iq2_xxs_words(context, builder, rp, lutp, g, nvalid)
    halves, signs, values = _IQ2_SLOT_TABLES
    perm2 = _intrinsic_fn(builder, "llvm.x86.avx512.vpermi2var.qi.512", v64i8, [v64i8] * 3)
    perm = _intrinsic_fn(builder, "llvm.x86.avx512.permvar.qi.512", v64i8, [v64i8] * 2)
    mshift = _intrinsic_fn(builder, "llvm.x86.avx512.pmultishift.qb.512", v64i8, [v64i8] * 2)
    gf2 = _intrinsic_fn(builder, "llvm.x86.vgf2p8affineqb.512", v64i8, [v64i8, v64i8, _I8])
    idx = builder.bitcast(q0, v64i8)  # byte 4i + l: grid index of block i, slot l
    upper = builder.icmp_signed("<", idx, _splat(0, _I8, 64))
    lev = []
    for table in halves:
        t = [_bytes_const(table[64 * k:64 * k + 64]) for k in range(4)]
        lev.append(builder.select(upper, builder.call(perm2, [t[2], idx, t[3]]),
                                  builder.call(perm2, [t[0], idx, t[1]])))
    # byte 4i + l: bits 7l..7l+6 of block i's sign word (bit 7: anything)
    fields = builder.call(mshift, [_bytes_const([32 * ((j // 4) % 2) + 7 * (j % 4)
                                                 for j in range(64)]), builder.bitcast(q1, v64i8)])
    # out bit i = parity(matrix byte 7 - i & x): bits 2, 5, 6, 7 -> 0, 1, 3, 4
    down = _bytes_const([{7: 1 << 2, 6: 1 << 5, 4: 1 << 6, 3: 1 << 7}.get(j % 8, 0)
                         for j in range(64)])
    keep = _splat(~0x24, _I8, 64)
    table_u = [_bytes_const(v) for v in values]
    chunks = []
    for k in range(4):
        sk = builder.call(perm2, [_bytes_const(signs[k][:64]), fields,
                                  _bytes_const(signs[k][64:])])
        h = lev[k // 2]
        if k % 2:
            pair = builder.call(gf2, [h, down, ir.Constant(_I8, 0)])
        else:
            pair = builder.and_(h, keep)
        pair = builder.or_(pair, sk)
        chunks += [builder.call(perm, [table_u[0], pair]), builder.call(perm, [table_u[1], pair])]
    return chunks, dw


@intrinsic
def UNPACK_IQ2_XXS(typingctx, rr, lut, u, dw, m, ngroups):
    """Groups 0..ngroups-1 of one raw IQ2_XXS row rr (uint8; a group is two super-blocks, 132
    bytes) -> u (uint8) in the slot order where iq2_xxs_slot_order(), else the group layout
    (as the activations are handed over):
    the signed levels grid * sign + 128, and dw[b] = d * (2s + 1) / 8 per 32-block (exact:
    ggml's d * (0.5 + s) * 0.25; its final 1/8 folded in). m is not touched. No bounds
    checks. See _emit_iq2_xxs_slots."""
    sig = types.void(rr, lut, u, dw, m, ngroups)

    def codegen(context, builder, sig, args):
        rp, lutp, up, dwp = [context.make_array(sig.args[i])(context, builder, args[i]).data
                             for i in range(4)]
        v64i8, v16f = ir.VectorType(_I8, 64), ir.VectorType(_F32, 16)

        def body(g, _):
            chunks, scale = _emit_iq2_xxs_slots(context, builder, rp, lutp, g)
            gb = builder.mul(g, _const(GROUP_BLOCKS))
            builder.store(scale, builder.bitcast(builder.gep(dwp, [gb]), v16f.as_pointer()),
                          align=4)
            ub = builder.mul(g, _const(GROUP_BYTES))
            for c, val in enumerate(chunks):
                q = builder.bitcast(builder.gep(up, [builder.add(ub, _const(64 * c))]),
                                    v64i8.as_pointer())
                builder.store(val, q, align=1)
            return []

        _loop(builder, _as_i64(builder, args[5]), [], body, "unpack")
        return context.get_dummy_value()

    return sig, codegen


#: IQ2_XXS's fused kernels (as FUSED1_* / FUSED2_*; activations in the slot order, as its
#: tiles take them)
FUSED1_IQ2_XXS = _make_fused(KIND_IQ2_XXS, FUSED_ROWS, 1)
FUSED2_IQ2_XXS = _make_fused(KIND_IQ2_XXS, FUSED_ROWS, 2)
FUSED3_IQ2_XXS = _make_fused(KIND_IQ2_XXS, FUSED_ROWS, 3)
FUSED4_IQ2_XXS = _make_fused(KIND_IQ2_XXS, FUSED_ROWS, 4)
FUSED8_IQ2_XXS = _make_fused(KIND_IQ2_XXS, 1, 8)  # one row per call, as FUSED8_* above


# --- float decoding of one row (the exact float32 matmuls of Q4_0, Q4_1, Q5_0, Q5_1) -----------


def _make_decode_f32(kind):
    ts, qoff, qhoff, offset, has_m = UNPACK_LAYOUTS[kind]

    @intrinsic
    def decode(typingctx, rr, lut, y, nblocks):
        """Blocks 0..nblocks-1 of one raw row rr (uint8) -> float32 y, as ggml's dequantize_row:
        float(q - offset) * d, or float(q) * d + m (a multiply, then an add: no FMA)."""
        sig = types.void(rr, lut, y, nblocks)

        def codegen(context, builder, sig, args):
            rp, lutp, yp = [context.make_array(sig.args[i])(context, builder, args[i]).data
                            for i in range(3)]
            v16i8, v16i32 = ir.VectorType(_I8, 16), ir.VectorType(_I32, 16)
            v16f = ir.VectorType(_F32, 16)

            def fp16_splat(off):
                bits = builder.zext(_load(builder, rp, off, _I16), _I64)
                v = builder.load(builder.gep(lutp, [bits]))
                v = builder.insert_element(ir.Constant(v16f, None), v, ir.Constant(_I32, 0))
                return builder.shuffle_vector(v, v, _mask([0] * 16))

            def body(b, _):
                o = builder.mul(b, _const(ts))
                d = fp16_splat(o)
                m = fp16_splat(builder.add(o, _const(2))) if has_m else None
                z = builder.zext(_load(builder, rp, builder.add(o, _const(qoff)), v16i8), v16i32)
                halves = [builder.and_(z, _splat(15, _I32)), builder.lshr(z, _splat(4, _I32))]
                if qhoff >= 0:
                    qh = _load(builder, rp, builder.add(o, _const(qhoff)), _I32)
                    qh = builder.insert_element(ir.Constant(v16i32, None), qh, ir.Constant(_I32, 0))
                    qh = builder.shuffle_vector(qh, qh, _mask([0] * 16))
                    for h in range(2):
                        bit = builder.lshr(qh, _vconst(range(16 * h, 16 * h + 16), _I32))
                        bit = builder.shl(builder.and_(bit, _splat(1, _I32)), _splat(4, _I32))
                        halves[h] = builder.or_(halves[h], bit)
                yo = builder.mul(b, _const(32))
                for h in range(2):
                    q = halves[h]
                    if offset:
                        q = builder.sub(q, _splat(offset, _I32))
                    v = builder.fmul(builder.sitofp(q, v16f), d)
                    if has_m:
                        v = builder.fadd(v, m)
                    p = builder.bitcast(builder.gep(yp, [builder.add(yo, _const(16 * h))]),
                                        v16f.as_pointer())
                    builder.store(v, p, align=4)
                return []

            _loop(builder, _as_i64(builder, args[3]), [], body, "decode")
            return context.get_dummy_value()

        return sig, codegen

    return decode


#: float decoders of Q4_0, Q4_1, Q5_0, Q5_1: (rr, lut, y, nblocks)
DECODE_F32_Q4_0, DECODE_F32_Q4_1, DECODE_F32_Q5_0, DECODE_F32_Q5_1 = (
    _make_decode_f32(k) for k in range(4))


@intrinsic
def DECODE_F32_Q8_0(typingctx, rr, lut, y, nblocks):
    """Blocks 0..nblocks-1 of one raw Q8_0 row rr (uint8) -> float32 y: float(q) * d, one
    multiply per value as legacy._q8_0_decode_row (bit-identical), but one block per step of
    32 lanes, where numba's loop over a block paid its vector loop's set-up per block of 32
    (the exact Q8_0 mat-vec in cache, AVX2 code, one thread: 576 x 192 17.2 -> 14.1 us,
    2048 x 192 58 -> 47 us)."""
    sig = types.void(rr, lut, y, nblocks)

    def codegen(context, builder, sig, args):
        rp, lutp, yp = [context.make_array(sig.args[i])(context, builder, args[i]).data
                        for i in range(3)]
        v32i8, v32f = ir.VectorType(_I8, 32), ir.VectorType(_F32, 32)

        def body(b, _):
            o = builder.mul(b, _const(34))
            d = builder.load(builder.gep(lutp, [builder.zext(_load(builder, rp, o, _I16), _I64)]))
            q = _load(builder, rp, builder.add(o, _const(2)), v32i8)
            v = builder.fmul(builder.sitofp(q, v32f), splat(builder, d, 32))
            builder.store(v, builder.bitcast(builder.gep(yp, [builder.mul(b, _const(32))]),
                                             v32f.as_pointer()), align=4)
            return []

        _loop(builder, _as_i64(builder, args[3]), [], body, "decode")
        return context.get_dummy_value()

    return sig, codegen


# === K-quants (Q2_K..Q6_K): a 256-value super-block as one group of 16 sub-blocks of 16 =========
# (appended for the K-quants' int8 path, kquants.py; nothing above depends on it.)
# A super-block is one group of KGROUP_BYTES: chunk c (c = 0..3) holds values 4c..4c+3 of each
# of its 16 sub-blocks of 16 values, sub-block i at bytes 64c + 4i .. 64c + 4i + 3. Q4_K and
# Q5_K, whose scales cover sub-blocks of 32, use the K pair layout instead (K_PAIRED): two
# super-blocks per group of KPAIR_BYTES, lane i = sub-block i % 8 of the pair's super-block
# i // 8, chunk c (0..7) = its values 4c..4c+3, so that one float step serves 512 values (an
# odd last super-block: the second half zero). UNPACK_K_* build these layouts
# straight from the packed bits into a row's scratch (FUSED_K1_* / FUSED_K2_* the same in
# registers, dotted at once with 1 or 2 tokens), a chunk being one word permutation of the raw
# quants (vpermd / vpermt2d), a per-lane shift or rotate (vpsrlvd / vprolvd) and a mask, plus
# per lane the float scale dw = d * (the sub-block's scale) and:
# * affine formats (Q2_K, Q4_K, Q5_K): unsigned quants u = q (<= 31) and the offset
#   m = -dmin * (the sub-block's min); the activations stay signed int8 and bring, per
#   sub-block, dxs = dx * bsum (Q8_K's sums of 16);
# * symmetric ones (Q3_K, Q6_K): signed quants w = q (-4..3, -32..31) and corr = -128 * sum(w)
#   per sub-block; the activations come as unsigned bytes x + 128, and the integer dot starts
#   at corr: corr + sum (x + 128) w = sum x w (no per-token correction to load).
# The tiles (DOT_K_RxT_*: R weight rows x T tokens, all loads shared) take per chunk one
# unsigned x signed byte dot adding groups of 4 into 16 int32 lanes (_dot_chunk: vpdpbusd with
# VNNI, vpmaddubsw + vpmaddwd on AVX2 - no saturation: |pair| <= 2 * 255 * 32 - generic IR
# elsewhere; on AVX2 the pair sums of several chunks added as int16 first, _dot_chunks), lane
# i = sub-block i's exact sum, then per lane and group:
#     acc = fma(float(isum), dw * dx, acc)   [affine: acc = fma(m, dxs, acc)]
# (llvm.fma: one rounding on every target; dx is the activations' scale of the lane's
# super-block),
# and KSUM (the fused kernels likewise) adds an accumulator's 16 lanes in a fixed tree at the
# end. The same float sequence runs per (row, token) whatever the tile or fused kernel, the
# integer route, k or the thread split.

from ._llvm_ir import store as _store, tree_sum_f32, tree_sums_f32x16  # noqa: E402

#: sub-blocks (lanes) per K-quant group (= one super-block), its bytes and chunks
KGROUP_LANES = 16
KGROUP_BYTES = 256
KGROUP_CHUNKS = 4
#: per K-quant kind (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K): the offset of the stored quants (the
#: symmetric formats' unpacked quants are q = stored - offset) and whether it has mins
K_WEIGHT_OFFSET = (0, 4, 0, 0, 32)
K_AFFINE = (True, False, True, True, False)
#: per kind: whether a group is a pair of super-blocks (Q4_K, Q5_K: their sub-blocks of 32
#: values fill the 16 lanes from two super-blocks, so the float work per value halves), else
#: one super-block (lane = a sub-block of 16 values)
K_PAIRED = (False, False, True, True, False)
#: per kind: the bound on |a vpmaddubsw pair sum| of its dots (2 * max unsigned operand * max
#: |signed operand|: the affine formats' quants 0..3, 7 (Q3_K: -4..3 signed, against x + 128
#: <= 255), 15, 31, and Q6_K's -32..31 against x + 128; Q8_K's x is -128..127), for _dot_chunks
K_PAIR_BOUND = (2 * 3 * 128, 2 * 255 * 4, 2 * 15 * 128, 2 * 31 * 128, 2 * 255 * 32)
#: values (bytes) per group of a paired kind; an odd last super-block fills the first half
KPAIR_BYTES = 512
KPAIR_CHUNKS = 8


def _emit_tile_k(context, builder, rows, toks, acc_ptrs, g0, g1, affine, paired=False):
    """Groups g0..g1-1 of the dots of the weight rows ``rows`` ((w, dw, m, corr) pointers) with
    the tokens ``toks`` ((x, dx, dxs) pointers), continuing the 16-lane float accumulators at
    acc_ptrs[r][t] and storing them back. Paired groups (K_PAIRED) are 512 bytes and their dx
    is 16 floats per group (a super-block's d on its 8 lanes), else dx is one float per group."""
    v64i8, v16i32, v16f = ir.VectorType(_I8, 64), ir.VectorType(_I32, 16), ir.VectorType(_F32, 16)
    route = _route(context, True)
    fma = _intrinsic_fn(builder, "llvm.fma.v16f32", v16f, [v16f] * 3)
    pairs = [(r, t) for r in range(len(rows)) for t in range(len(toks))]
    acc0 = [builder.load(acc_ptrs[r][t], align=4) for r, t in pairs]

    n_chunks, gbytes = (KPAIR_CHUNKS, KPAIR_BYTES) if paired else (KGROUP_CHUNKS, KGROUP_BYTES)

    def body(g, accs):
        base = builder.mul(g, _const(gbytes))
        gb = builder.mul(g, _const(KGROUP_LANES))
        if affine:
            isum = {rt: ir.Constant(v16i32, [ir.Constant(_I32, 0)] * 16) for rt in pairs}
        else:  # the dots start at -128 * sum(w): the same integers as subtracting it after
            corr = [_load(builder, r[3], gb, v16i32, 4) for r in rows]
            isum = {(r, t): corr[r] for r, t in pairs}
        offs = [builder.add(base, _const(64 * c)) for c in range(n_chunks)]
        wv = [[_load(builder, r[0], off, v64i8) for off in offs] for r in rows]
        xv = [[_load(builder, t[0], off, v64i8) for off in offs] for t in toks]
        bound = max(b for kk, b in enumerate(K_PAIR_BOUND)
                    if K_AFFINE[kk] == affine and K_PAIRED[kk] == paired)
        for r, t in pairs:  # the unsigned operand first
            isum[r, t] = _dot_chunks(builder, isum[r, t],
                                     [(wv[r][c], xv[t][c]) if affine else (xv[t][c], wv[r][c])
                                      for c in range(n_chunks)], route, bound)
        dws = [_load(builder, r[1], gb, v16f, 4) for r in rows]
        if paired:
            dxs = [_load(builder, t[1], gb, v16f, 4) for t in toks]
        else:
            dxs = [splat(builder, builder.load(builder.gep(t[1], [g])), 16) for t in toks]
        if affine:
            ms = [_load(builder, r[2], gb, v16f, 4) for r in rows]
            dxss = [_load(builder, t[2], gb, v16f, 4) for t in toks]
        out = []
        for (r, t), acc in zip(pairs, accs):
            acc = builder.call(fma, [builder.sitofp(isum[r, t], v16f), builder.fmul(dws[r], dxs[t]),
                                     acc])
            if affine:
                acc = builder.call(fma, [ms[r], dxss[t], acc])
            out.append(acc)
        return out

    accs = _loop(builder, g1, [(v16f, a) for a in acc0], body, "kdot", start=g0)
    for (r, t), acc in zip(pairs, accs):
        builder.store(acc, acc_ptrs[r][t], align=4)


def _make_dot_k(n_rows, n_toks, affine, paired=False):
    @intrinsic
    def dot(typingctx, w, dw, m, corr, x, dx, dxs, acc, g0, g1, tok):
        for a, dt in ((w, types.uint8), (x, types.uint8), (dw, types.float32), (m, types.float32),
                      (corr, types.int32), (dx, types.float32), (dxs, types.float32),
                      (acc, types.float32)):
            if not isinstance(a, types.Array) or a.dtype != dt or a.layout != "C" or a.ndim != 2:
                return None
        if not all(isinstance(v, types.Integer) for v in (g0, g1, tok)):
            return None
        sig = types.void(w, dw, m, corr, x, dx, dxs, acc, g0, g1, tok)

        def codegen(context, builder, sig, args):
            g0, g1, t0 = (_as_i64(builder, v) for v in args[8:11])
            rows = [tuple(_row_ptr(context, builder, sig.args[a], args[a], _const(r))
                          for a in (0, 1, 2, 3)) for r in range(n_rows)]
            toks = [tuple(_row_ptr(context, builder, sig.args[a], args[a],
                                   builder.add(t0, _const(t))) for a in (4, 5, 6))
                    for t in range(n_toks)]
            acc_ptrs = [[builder.bitcast(_row_ptr(context, builder, sig.args[7], args[7],
                                                  builder.add(builder.mul(builder.add(t0, _const(t)),
                                                                          _const(n_rows)), _const(r))),
                                         ir.VectorType(_F32, 16).as_pointer())
                         for t in range(n_toks)] for r in range(n_rows)]
            _emit_tile_k(context, builder, rows, toks, acc_ptrs, g0, g1, affine, paired)
            return context.get_dummy_value()

        return sig, codegen

    dot.__doc__ = f"""Dots of the {n_rows} weight rows of (w, dw, m, corr) (rows 0..{n_rows - 1}:
        a task's unpacked rows) with activation rows tok..tok+{n_toks - 1} of (x, dx, dxs) over
        groups g0..g1-1. The 16-lane float accumulator of (row r, token t) is row
        t * {n_rows} + r of acc (float32, 16 columns): zero it, call once per run of groups, in
        order, then KSUM gives the result (bit-identical whatever the runs and tiles).
        w, x: uint8 bit patterns (rows, {512 if paired else 256} * ngroups) in the K
        {"pair" if paired else "group"} layout
        ({"w unsigned quants, x signed int8" if affine else "w signed quants, x unsigned x + 128"});
        dw, m (float32), corr (int32): (rows, 16 * ngroups) per lane; dx float32
        {"(k, 16 * ngroups) per lane" if paired else "(k, ngroups) per super-block"}; dxs float32
        (k, 16 * ngroups). {"Reads m and dxs, not corr"
        if affine else "Reads corr, not m and dxs"}. No bounds checks."""
    return dot


#: K-quant tiles of 4 weight rows x 2 tokens and 4 x 1: affine (Q2_K, Q4_K, Q5_K) and
#: symmetric (Q3_K, Q6_K)
DOT_K_4x2_AFF, DOT_K_4x1_AFF = _make_dot_k(4, 2, True), _make_dot_k(4, 1, True)
DOT_K_4x2_SYM, DOT_K_4x1_SYM = _make_dot_k(4, 2, False), _make_dot_k(4, 1, False)
#: and over paired groups (Q4_K, Q5_K)
DOT_K_4x2_PAIR, DOT_K_4x1_PAIR = _make_dot_k(4, 2, True, True), _make_dot_k(4, 1, True, True)
#: rows per K tile (the accumulators' row numbering depends on it)
K_TILE_ROWS = 4


@intrinsic
def KSUM(typingctx, acc, i):
    """The fixed-tree sum of the 16 lanes of row i of acc (float32, 16 columns)."""
    if not (isinstance(acc, types.Array) and acc.dtype == types.float32 and acc.ndim == 2
            and acc.layout == "C" and isinstance(i, types.Integer)):
        return None
    sig = types.float32(acc, i)

    def codegen(context, builder, sig, args):
        p = _row_ptr(context, builder, sig.args[0], args[0], _as_i64(builder, args[1]))
        v = builder.load(builder.bitcast(p, ir.VectorType(_F32, 16).as_pointer()), align=4)
        return tree_sum_f32(builder, v)

    return sig, codegen


@intrinsic
def KSUM_STORE_4x4(typingctx, acc, row, out, tok, col):
    """KSUM of acc rows row..row+15 (4 tokens x K_TILE_ROWS = 4 weight rows, token-major, as
    the K tiles number them) stored at out[tok + t, col + r] (t, r < 4): the same sums, all 16
    reduced at once (tree_sums_f32x16). No bounds checks."""
    if not (isinstance(acc, types.Array) and acc.dtype == types.float32 and acc.ndim == 2
            and acc.layout == "C" and isinstance(out, types.Array) and out.dtype == types.float32
            and out.ndim == 2 and out.layout == "C"
            and all(isinstance(v, types.Integer) for v in (row, tok, col))):
        return None
    sig = types.void(acc, row, out, tok, col)

    def codegen(context, builder, sig, args):
        v16f = ir.VectorType(_F32, 16)
        row0, t0, c0 = (_as_i64(builder, v) for v in (args[1], args[3], args[4]))
        vs = [builder.load(builder.bitcast(_row_ptr(context, builder, sig.args[0], args[0],
                                                    builder.add(row0, _const(j))),
                                           v16f.as_pointer()), align=4) for j in range(16)]
        sums = tree_sums_f32x16(builder, vs)
        for t in range(4):
            p = _row_ptr(context, builder, sig.args[2], args[2], builder.add(t0, _const(t)))
            _store(builder, _pick(builder, sums, range(4 * t, 4 * t + 4)), p, c0, 4)
        return context.get_dummy_value()

    return sig, codegen


def _lanes(builder, src, idx, shifts, mask):
    """Per lane i: (word idx[i] of src >> shifts[i]) & mask; src: one or two <n x i32> (a
    pair's words numbered on)."""
    a, b = (src[0], src[0]) if len(src) == 1 else src
    v = builder.shuffle_vector(a, b, _mask(idx))
    if any(shifts):
        v = builder.lshr(v, _vconst(shifts, _I32))
    return builder.and_(v, _splat(mask, _I32))


def _rot_lanes(builder, src, idx, rots, mask):
    """Per lane i: (word idx[i] of src rotated left by rots[i] (mod 32)) & mask: moves bits
    within each byte when every byte's source bits sit rots[i] lower (vprolvd)."""
    a, b = (src[0], src[0]) if len(src) == 1 else src
    v = builder.shuffle_vector(a, b, _mask(idx))
    v16i32 = ir.VectorType(_I32, 16)
    fshl = _intrinsic_fn(builder, "llvm.fshl.v16i32", v16i32, [v16i32] * 3)
    v = builder.call(fshl, [v, v, _vconst([r % 32 for r in rots], _I32)])
    return builder.and_(v, _splat(mask, _I32))


def _byte_lanes(builder, b16, idx, shifts, masks):
    """Per lane i: (byte idx[i] of b16 (<16 x i8>) >> shifts[i]) & masks[i], as <16 x i32>."""
    v = builder.zext(builder.shuffle_vector(b16, b16, _mask(idx)), ir.VectorType(_I32, 16))
    if any(shifts):
        v = builder.lshr(v, _vconst(shifts, _I32))
    return builder.and_(v, _vconst(masks, _I32))


def _emit_unpack_sb(builder, route, kind, rp, lutp, sb):
    """IR for super-block sb (i64) of the raw row at rp (i8*) of K-quant ``kind``: its 4 chunks
    of quants (<64 x i8>: unsigned q for the affine formats, signed q for Q3_K and Q6_K) in the
    K group layout, and per lane the float scale dw, the offset m (affine; else None) and corr
    (Q3_K, Q6_K: -128 * the lane's sum of quants, <16 x i32>, where the lane's integer dot
    starts; else None)."""
    ts = (84, 110, 144, 176, 210)[kind]
    offset = K_WEIGHT_OFFSET[kind]
    L = range(16)
    v3i32, v8i32 = ir.VectorType(_I32, 3), ir.VectorType(_I32, 8)
    v16i32, v64i8 = ir.VectorType(_I32, 16), ir.VectorType(_I8, 64)
    v16i8, v16f = ir.VectorType(_I8, 16), ir.VectorType(_F32, 16)

    def fp16_splat(off, neg=False):
        bits = builder.zext(_load(builder, rp, off, _I16), _I64)
        v = builder.load(builder.gep(lutp, [bits]))
        if neg:
            v = builder.fsub(ir.Constant(_F32, -0.0), v)  # exact negation
        return splat(builder, v, 16)

    def bytes12(off):  # 12 bytes as <16 x i8> (the last 4 repeat bytes 8..11)
        v = _load(builder, rp, off, v3i32)
        return builder.bitcast(builder.shuffle_vector(v, v, _mask([0, 1, 2, 2])), v16i8)

    o = builder.mul(sb, _const(ts))
    at = lambda k: builder.add(o, _const(k))  # noqa: E731
    chunks = []
    if kind in (0, 1):  # qs: byte 32h + l, bits 2jj: value 128h + 32jj + l
        qs = [_load(builder, rp, at(16 if kind == 0 else 32), v16i32)]
        for c in range(4):
            chunks.append(_lanes(builder, qs, [8 * (i // 8) + 4 * (i % 2) + c for i in L],
                                 [2 * ((i % 8) // 2) for i in L], 0x03030303))
        if kind == 1:  # hmask: bit e // 32 of byte e % 32 (set: q = stored - 4 >= 0) -> bit 2
            hm = [_load(builder, rp, o, v8i32)]
            for c in range(4):
                hb = _rot_lanes(builder, hm, [4 * (i % 2) + c for i in L], [2 - i // 2 for i in L],
                                0x04040404)
                chunks[c] = builder.or_(chunks[c], hb)
    elif kind in (2, 3):  # qs: byte 32h + l, nibble n: value 64h + 32n + l
        q0 = 16 if kind == 2 else 48
        qs = [_load(builder, rp, at(q0), v16i32), _load(builder, rp, at(q0 + 64), v16i32)]
        for c in range(4):
            chunks.append(_lanes(builder, qs, [8 * (i // 4) + 4 * (i % 2) + c for i in L],
                                 [4 * ((i // 2) % 2) for i in L], 0x0F0F0F0F))
        if kind == 3:  # qh: bit e // 32 of byte e % 32 is bit 4 of value e
            qh = [_load(builder, rp, at(16), v8i32)]
            for c in range(4):
                hb = _rot_lanes(builder, qh, [4 * (i % 2) + c for i in L], [4 - i // 2 for i in L],
                                0x10101010)
                chunks[c] = builder.or_(chunks[c], hb)
    else:  # Q6_K: ql byte 64h + 32(quarter & 1) + l, nibble quarter >> 1;
        # qh byte 32h + l bits 2 * quarter; value 128h + 32 quarter + l
        ql = [_load(builder, rp, o, v16i32), _load(builder, rp, at(64), v16i32)]
        qh = [_load(builder, rp, at(128), v16i32)]
        for c in range(4):
            lo = _lanes(builder, ql, [16 * (i // 8) + 8 * (((i % 8) // 2) & 1) + 4 * (i % 2) + c
                                      for i in L],
                        [4 * (((i % 8) // 2) >> 1) for i in L], 0x0F0F0F0F)
            hi = _rot_lanes(builder, qh, [8 * (i // 8) + 4 * (i % 2) + c for i in L],
                            [4 - 2 * ((i % 8) // 2) for i in L], 0x30303030)
            chunks.append(builder.or_(lo, hi))
    qv = [builder.bitcast(ch, v64i8) for ch in chunks]
    corr = None
    if offset:  # signed quants; corr = 128 * (a lane's sum): the chunks added bytewise
        qv = [builder.sub(q, _splat(offset, _I8, 64)) for q in qv]  # (|sum| <= 128), one dot
        bsum = builder.add(builder.add(qv[0], qv[1]), builder.add(qv[2], qv[3]))
        corr = _dot_chunk(builder, ir.Constant(v16i32, [ir.Constant(_I32, 0)] * 16),
                          _splat(-128, _I8, 64), bsum, route)
        # negated once here: the token dots start from it instead of subtracting it per token
        corr = builder.sub(ir.Constant(v16i32, [ir.Constant(_I32, 0)] * 16), corr)
    # per-lane scales (and mins)
    mn = None
    if kind == 0:  # scales[j]: scale | min << 4, fp16 d, dmin at 80, 82
        s = _load(builder, rp, o, v16i8)
        sc = _byte_lanes(builder, s, list(L), [0] * 16, [15] * 16)
        mn = _byte_lanes(builder, s, list(L), [4] * 16, [15] * 16)
        d, dmin = fp16_splat(at(80)), fp16_splat(at(82), True)
    elif kind == 1:  # 6-bit scales + 32 in 12 bytes, fp16 d at 108
        s = bytes12(at(96))
        lo = _byte_lanes(builder, s, [i % 8 for i in L], [4 * (i // 8) for i in L], [15] * 16)
        hi = _byte_lanes(builder, s, [8 + i % 4 for i in L], [2 * (i // 4) for i in L], [3] * 16)
        sc = builder.sub(builder.or_(lo, builder.shl(hi, _splat(4, _I32))), _splat(32, _I32))
        d = fp16_splat(at(108))
    elif kind in (2, 3):  # get_scale_min_k4(j = lane // 2) from 12 bytes at 4
        s = bytes12(at(4))
        j = [i // 2 for i in L]
        lo4 = [63 if jj < 4 else 15 for jj in j]
        hi2 = [0 if jj < 4 else 3 for jj in j]  # bits 6, 7 of another byte (j >= 4)
        sc = builder.or_(
            _byte_lanes(builder, s, [jj if jj < 4 else jj + 4 for jj in j], [0] * 16, lo4),
            builder.shl(_byte_lanes(builder, s, [max(jj - 4, 0) for jj in j], [6] * 16, hi2),
                        _splat(4, _I32)))
        mn = builder.or_(
            _byte_lanes(builder, s, [jj + 4 for jj in j], [0 if jj < 4 else 4 for jj in j], lo4),
            builder.shl(_byte_lanes(builder, s, j, [6] * 16, hi2), _splat(4, _I32)))
        d, dmin = fp16_splat(o), fp16_splat(at(2), True)
    else:  # int8 scales at 192, fp16 d at 208
        sc = builder.sext(_load(builder, rp, at(192), v16i8), v16i32)
        d = fp16_splat(at(208))
    dw = builder.fmul(builder.sitofp(sc, v16f), d)
    m = builder.fmul(builder.sitofp(mn, v16f), dmin) if mn is not None else None
    return qv, dw, m, corr


def _emit_unpack_pair(builder, kind, rp, lutp, pair, half=False):
    """IR for the pair group ``pair`` (i64: super-blocks 2 pair and 2 pair + 1) of the raw Q4_K /
    Q5_K row at rp: 8 chunks of unsigned quants (<64 x i8>) in the K pair layout, lane i =
    sub-block i % 8 of super-block 2 pair + i // 8, chunk c = values 32 (i % 8) + 4c .. + 3 of
    it; and per lane dw = d * scale and m = -dmin * min (<16 x float>). ``half``: the row ends
    after super-block 2 pair; lanes 8..15 are zeros (quants, dw) and -0.0 (m) without reading
    past it."""
    ts = (84, 110, 144, 176, 210)[kind]
    q0 = 16 if kind == 2 else 48
    J = [i % 8 for i in range(16)]  # a lane's sub-block within its super-block
    v8i32, v16i32 = ir.VectorType(_I32, 8), ir.VectorType(_I32, 16)
    v16i8, v16f = ir.VectorType(_I8, 16), ir.VectorType(_F32, 16)
    offs = [builder.mul(builder.add(builder.mul(pair, _const(2)), _const(s)), _const(ts))
            for s in range(1 if half else 2)]
    at = lambda s, k: builder.add(offs[s], _const(k))  # noqa: E731

    def both(load_one, zero):  # one value per super-block (zero for the missing half)
        return [load_one(s) for s in range(len(offs))] + ([zero] if half else [])

    # qs: byte 32h + l, nibble n holds value 64h + 32n + l: sub-block j = 2h + n, l = 4c + e,
    # that is word 8 (j // 2) + c of the super-block's 128 bytes, shifted by 4 (j % 2)
    zq = ir.Constant(v16i32, [ir.Constant(_I32, 0)] * 16)
    lo = both(lambda s: _load(builder, rp, at(s, q0), v16i32), zq)
    hi = both(lambda s: _load(builder, rp, at(s, q0 + 64), v16i32), zq)
    if kind == 3:  # qh: bit j of byte 4c + e is bit 4 of value 32j + 4c + e
        qh = both(lambda s: _load(builder, rp, at(s, 16), v8i32),
                  ir.Constant(v8i32, [ir.Constant(_I32, 0)] * 8))
    chunks = [None] * KPAIR_CHUNKS
    for c in range(4):  # chunks c and c + 4 share their word shuffles
        halves = [builder.shuffle_vector(lo[s], hi[s], _mask([8 * (j // 2) + c for j in range(8)]
                                                              + [8 * (j // 2) + c + 4 for j in range(8)]))
                  for s in range(2)]
        for cc, sel in ((c, list(range(8)) + list(range(16, 24))),
                        (c + 4, list(range(8, 16)) + list(range(24, 32)))):
            v = builder.shuffle_vector(halves[0], halves[1], _mask(sel))
            v = builder.and_(builder.lshr(v, _vconst([4 * (j % 2) for j in J], _I32)),
                             _splat(0x0F0F0F0F, _I32))
            if kind == 3:
                hb = builder.shuffle_vector(qh[0], qh[1], _mask([cc] * 8 + [8 + cc] * 8))
                fshl = _intrinsic_fn(builder, "llvm.fshl.v16i32", v16i32, [v16i32] * 3)
                hb = builder.call(fshl, [hb, hb, _vconst([(4 - j) % 32 for j in J], _I32)])
                v = builder.or_(v, builder.and_(hb, _splat(0x10101010, _I32)))
            chunks[cc] = builder.bitcast(v, ir.VectorType(_I8, 64))

    # get_scale_min_k4(j) from each super-block's 12 bytes at 4 (bytes 0..15 and 16..31 below)
    def bytes12(s):
        v = _load(builder, rp, at(s, 4), ir.VectorType(_I32, 3))
        return builder.bitcast(builder.shuffle_vector(v, v, _mask([0, 1, 2, 2])), v16i8)

    sb = both(bytes12, ir.Constant(v16i8, [ir.Constant(_I8, 0)] * 16))
    base = [16 * (i // 8) for i in range(16)]

    def lanes(idx, shifts, masks):  # per lane (byte base + idx >> shift) & mask, as i32
        v = builder.zext(builder.shuffle_vector(sb[0], sb[1], _mask([b + k for b, k in zip(base, idx)])),
                         v16i32)
        if any(shifts):
            v = builder.lshr(v, _vconst(shifts, _I32))
        return builder.and_(v, _vconst(masks, _I32))

    lo4 = [63 if j < 4 else 15 for j in J]
    hi2 = [0 if j < 4 else 3 for j in J]
    sc = builder.or_(lanes([j if j < 4 else j + 4 for j in J], [0] * 16, lo4),
                     builder.shl(lanes([max(j - 4, 0) for j in J], [6] * 16, hi2), _splat(4, _I32)))
    mn = builder.or_(lanes([j + 4 for j in J], [0 if j < 4 else 4 for j in J], lo4),
                     builder.shl(lanes(J, [6] * 16, hi2), _splat(4, _I32)))

    def fp16(s, k, neg=False):
        bits = builder.zext(_load(builder, rp, at(s, k), _I16), _I64)
        v = builder.load(builder.gep(lutp, [bits]))
        return builder.fsub(ir.Constant(_F32, -0.0), v) if neg else v  # exact negation

    def per_half(vals):  # two scalars -> 8 lanes each
        return builder.shuffle_vector(splat(builder, vals[0], 16), splat(builder, vals[1], 16),
                                      _mask(list(range(8)) + list(range(24, 32))))

    zf = ir.Constant(_F32, 0.0)
    d = per_half(both(lambda s: fp16(s, 0), zf))
    dmin = per_half(both(lambda s: fp16(s, 2, True), ir.Constant(_F32, -0.0)))
    dw = builder.fmul(builder.sitofp(sc, v16f), d)
    m = builder.fmul(builder.sitofp(mn, v16f), dmin)
    return chunks, dw, m


def _make_unpack_k(kind):
    @intrinsic
    def unpack(typingctx, rr, lut, w, dw, m, corr, nsb):
        """Super-blocks 0..nsb-1 of one raw row rr (uint8) -> quants w (uint8 bit patterns, 256
        per super-block) in the K group layout and per sub-block of 16: the float scale dw,
        the offset m (Q2_K, Q4_K, Q5_K) or corr = -128 * sum(w) (Q3_K, Q6_K; int32); the other
        array is not touched. Q4_K, Q5_K (K_PAIRED): groups of two super-blocks in the K pair
        layout, 512 bytes and 16 lanes (sub-blocks of 32) per group, ceil(nsb / 2) groups (an
        odd last super-block padded with zero quants and scales). No bounds checks."""
        sig = types.void(rr, lut, w, dw, m, corr, nsb)

        def codegen(context, builder, sig, args):
            rp, lutp, wp, dwp, mp, cp = [
                context.make_array(sig.args[i])(context, builder, args[i]).data for i in range(6)]
            v64i8 = ir.VectorType(_I8, 64)
            route = _route(context, True)

            def put(g, qv, dwv, mv, corrv):
                base = builder.mul(g, _const(64 * len(qv)))
                for c in range(len(qv)):
                    p = builder.bitcast(builder.gep(wp, [builder.add(base, _const(64 * c))]),
                                        v64i8.as_pointer())
                    builder.store(qv[c], p, align=1)
                lb = builder.mul(g, _const(KGROUP_LANES))
                for ptr, v in ((dwp, dwv), (mp, mv), (cp, corrv)):
                    if v is not None:
                        builder.store(v, builder.bitcast(builder.gep(ptr, [lb]), v.type.as_pointer()),
                                      align=4)

            nsb = _as_i64(builder, args[6])
            if K_PAIRED[kind]:
                def pair_body(half):
                    def body(g, _):
                        qv, dwv, mv = _emit_unpack_pair(builder, kind, rp, lutp, g, half)
                        put(g, qv, dwv, mv, None)
                        return []
                    return body

                whole = builder.udiv(nsb, _const(2))
                _loop(builder, whole, [], pair_body(False), "kunpack2")
                _loop(builder, builder.udiv(builder.add(nsb, _const(1)), _const(2)), [],
                      pair_body(True), "kunpack1", start=whole)
            else:
                def body(sb, _):
                    put(sb, *_emit_unpack_sb(builder, route, kind, rp, lutp, sb))
                    return []

                _loop(builder, nsb, [], body, "kunpack")
            return context.get_dummy_value()

        return sig, codegen

    return unpack


#: one per K-quant kind (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K): (rr, lut, w, dw, m, corr, nsb)
UNPACK_K_Q2_K, UNPACK_K_Q3_K, UNPACK_K_Q4_K, UNPACK_K_Q5_K, UNPACK_K_Q6_K = (
    _make_unpack_k(k) for k in range(5))


#: weight rows per call of the K-quants' few-token kernels (FUSED_K*, and _kquant_avx2's
#: NATURAL_K*): one, as FUSED_ROWS, for one ascending stream per thread (decoding a 350M
#: Q4_K_M model on Zen 4: 1.23x the 4-row kernels with VNNI, 1.24x without)
K_FUSED_ROWS = 1


def _make_fused_k(kind, n_rows, n_toks):
    affine = K_AFFINE[kind]
    ts = (84, 110, 144, 176, 210)[kind]

    @intrinsic
    def fused(typingctx, raw, lut, x, dx, dxs, tok, row, n_out):
        """Dots of tokens tok..tok+T-1 with weight rows row..row+R-1 (each clamped to n_out - 1)
        of raw (uint8 (rows, row bytes)), unpacked super-block by super-block in registers (no
        scratch): a tuple of R * T float32, rows outer; the same per-lane float sequence as the
        tiles and KSUM, so the same bits."""
        sig = types.UniTuple(types.float32, n_rows * n_toks)(raw, lut, x, dx, dxs, tok, row, n_out)

        def codegen(context, builder, sig, args):
            v64i8, v16i32, v16f = (ir.VectorType(_I8, 64), ir.VectorType(_I32, 16),
                                   ir.VectorType(_F32, 16))
            route = _route(context, True)
            fma = _intrinsic_fn(builder, "llvm.fma.v16f32", v16f, [v16f] * 3)
            t0, r0, n = (_as_i64(builder, v) for v in args[5:8])
            lutp = context.make_array(sig.args[1])(context, builder, args[1]).data
            xa = context.make_array(sig.args[2])(context, builder, args[2])
            nsb = builder.udiv(builder.extract_value(xa.shape, 1), _const(KGROUP_BYTES))
            last = builder.sub(n, _const(1))
            rps = [_row_ptr(context, builder, sig.args[0], args[0], r)
                   for r in _clamped(builder, r0, n_rows, last)]
            # tokens past the activations' last are read as the last (FUSED_K8 serves 5 to 8)
            last_t = builder.sub(builder.extract_value(xa.shape, 0), _const(1))
            toks = [tuple(_row_ptr(context, builder, sig.args[a], args[a], ti)
                          for a in (2, 3, 4)) for ti in _clamped(builder, t0, n_toks, last_t)]
            zero = ir.Constant(v16f, [ir.Constant(_F32, 0.0)] * 16)
            pf = _prefetcher(context, builder, sig.args[0], args[0], rps, ts)

            def body(sb, accs):
                pf(sb)
                base = builder.mul(sb, _const(KGROUP_BYTES))
                gb = builder.mul(sb, _const(KGROUP_LANES))
                xv = [[_load(builder, xp, builder.add(base, _const(64 * c)), v64i8) for c in range(4)]
                      for xp, _, _ in toks]
                dxv = [splat(builder, builder.load(builder.gep(dxp, [sb])), 16) for _, dxp, _ in toks]
                dxsv = [_load(builder, dxsp, gb, v16f, 4) if affine else None for _, _, dxsp in toks]
                out = []
                for i, rp in enumerate(rps):
                    qv, dwv, mv, corrv = _emit_unpack_sb(builder, route, kind, rp, lutp, sb)
                    for t in range(n_toks):
                        isum = ir.Constant(v16i32, [ir.Constant(_I32, 0)] * 16) if affine else corrv
                        isum = _dot_chunks(builder, isum, [(qv[c], xv[t][c]) if affine else
                                                           (xv[t][c], qv[c]) for c in range(4)],
                                           route, K_PAIR_BOUND[kind])
                        acc = builder.call(fma, [builder.sitofp(isum, v16f), builder.fmul(dwv, dxv[t]),
                                                 accs[i * n_toks + t]])
                        if affine:
                            acc = builder.call(fma, [mv, dxsv[t], acc])
                        out.append(acc)
                return out

            def pair_body(half):
                # Q4_K, Q5_K: the pair group's sums from each super-block's own layout (x in the
                # K group layout here, see kquants._matmul_q8_kg): a sub-block of 32 is two
                # adjacent lanes of 16, added exactly; then the pair's float step as the tiles
                # take it. Unpacking super-blocks one by one costs less per row than the pair
                # layout's shuffles, which only pay where a row serves many tokens.
                evens, odds = _mask(range(0, 32, 2)), _mask(range(1, 32, 2))
                zf = ir.Constant(v16f, [ir.Constant(_F32, 0.0)] * 16)
                mzf = ir.Constant(v16f, [ir.Constant(_F32, -0.0)] * 16)  # a missing half's m

                def body(g, accs):
                    sbs = [builder.mul(g, _const(2)), builder.add(builder.mul(g, _const(2)), _const(1))]
                    sbs = sbs[:1] if half else sbs
                    for sb in sbs:
                        pf(sb)
                    gb = builder.mul(g, _const(KGROUP_LANES))
                    xv = [[[_load(builder, xp, builder.add(builder.mul(sb, _const(KGROUP_BYTES)),
                                                           _const(64 * c)), v64i8)
                            for c in range(KGROUP_CHUNKS)] for sb in sbs] for xp, _, _ in toks]
                    dxv = [_load(builder, dxp, gb, v16f, 4) for _, dxp, _ in toks]
                    dxsv = [_load(builder, dxsp, gb, v16f, 4) for _, _, dxsp in toks]
                    out = []
                    for i, rp in enumerate(rps):
                        un = [_emit_unpack_sb(builder, route, kind, rp, lutp, sb) for sb in sbs]
                        dws = [u[1] for u in un] + ([zf] if half else [])
                        ms = [u[2] for u in un] + ([mzf] if half else [])
                        dwv = builder.shuffle_vector(dws[0], dws[1], evens)  # lanes 2j = 2j + 1
                        mv = builder.shuffle_vector(ms[0], ms[1], evens)
                        for t in range(n_toks):
                            sums = []
                            for h in range(len(sbs)):
                                sums.append(_dot_chunks(
                                    builder, ir.Constant(v16i32, [ir.Constant(_I32, 0)] * 16),
                                    [(un[h][0][c], xv[t][h][c]) for c in range(KGROUP_CHUNKS)],
                                    route, K_PAIR_BOUND[kind]))
                            if half:
                                sums.append(ir.Constant(v16i32, [ir.Constant(_I32, 0)] * 16))
                            isum = builder.add(builder.shuffle_vector(sums[0], sums[1], evens),
                                               builder.shuffle_vector(sums[0], sums[1], odds))
                            acc = builder.call(fma, [builder.sitofp(isum, v16f),
                                                     builder.fmul(dwv, dxv[t]), accs[i * n_toks + t]])
                            out.append(builder.call(fma, [mv, dxsv[t], acc]))
                    return out
                return body

            init = [(v16f, zero)] * (n_rows * n_toks)
            if K_PAIRED[kind]:
                ra = context.make_array(sig.args[0])(context, builder, args[0])
                nsb = builder.udiv(builder.extract_value(ra.shape, 1), _const(ts))
                whole = builder.udiv(nsb, _const(2))
                accs = _loop(builder, whole, init, pair_body(False), "kfused2")
                accs = _loop(builder, builder.udiv(builder.add(nsb, _const(1)), _const(2)),
                             list(zip([v16f] * len(accs), accs)), pair_body(True), "kfused1",
                             start=whole)
            else:
                accs = _loop(builder, nsb, init, body, "kfused")
            return context.make_tuple(builder, sig.return_type,
                                      [tree_sum_f32(builder, a) for a in accs])

        return sig, codegen

    return fused


#: tokens with weight rows unpacked in registers (K{T}: K_FUSED_ROWS rows x T tokens), per
#: K-quant kind: (raw, lut, x, dx, dxs, tok, row, n_out) -> R * T float32, rows outer
FUSED_K1_Q2_K, FUSED_K1_Q3_K, FUSED_K1_Q4_K, FUSED_K1_Q5_K, FUSED_K1_Q6_K = (
    _make_fused_k(k, K_FUSED_ROWS, 1) for k in range(5))
FUSED_K2_Q2_K, FUSED_K2_Q3_K, FUSED_K2_Q4_K, FUSED_K2_Q5_K, FUSED_K2_Q6_K = (
    _make_fused_k(k, K_FUSED_ROWS, 2) for k in range(5))
#: one token, 4 short rows per call (K_SHORT_ROW_BYTES): a row of one or two super-blocks is too
#: little work per call, and 4 such rows are one short contiguous run anyway (a MoE block's
#: down projection of 256 values: the one-row kernels decoded a 1B glm4moe 7% slower)
FUSED_K1S_Q2_K, FUSED_K1S_Q3_K, FUSED_K1S_Q4_K, FUSED_K1S_Q5_K, FUSED_K1S_Q6_K = (
    _make_fused_k(k, 4, 1) for k in range(5))
K_SHORT_ROWS = 4
K_SHORT_ROW_BYTES = 512
FUSED_K3_Q2_K, FUSED_K3_Q3_K, FUSED_K3_Q4_K, FUSED_K3_Q5_K, FUSED_K3_Q6_K = (
    _make_fused_k(k, K_FUSED_ROWS, 3) for k in range(5))
FUSED_K4_Q2_K, FUSED_K4_Q3_K, FUSED_K4_Q4_K, FUSED_K4_Q5_K, FUSED_K4_Q6_K = (
    _make_fused_k(k, K_FUSED_ROWS, 4) for k in range(5))
#: 5 to 8 tokens in one pass (the tokens past the last read as the last and dropped): on the
#: AVX-512 VNNI host 1.25-1.8x two passes of 4 and the rest, the same bits. One row per call
#: whatever K_FUSED_ROWS (kquants._fused_k_span8 steps one row and keeps the first k values)
FUSED_K8_Q2_K, FUSED_K8_Q3_K, FUSED_K8_Q4_K, FUSED_K8_Q5_K, FUSED_K8_Q6_K = (
    _make_fused_k(k, 1, 8) for k in range(5))
# === end of the K-quants section ===
