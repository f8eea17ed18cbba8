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

Also here: ``DECODE_F32_*``, one row of Q4_0..Q5_1 blocks to float32 as vector IR, for the
exact float32 matmuls (bit-identical to legacy._decode_row).
"""
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

#: blocks per group: lanes of the int and float accumulators; rows are padded with zero
#: blocks to a multiple of GROUP_BLOCKS (zero scales and offsets: they add exact zeros)
GROUP_BLOCKS = 16
#: bytes (int8 values) per group
GROUP_BYTES = GROUP_BLOCKS * 32
#: chunks per group (4 values of each block per chunk)
GROUP_CHUNKS = 8

#: per kind (the kernels' numbering: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): block bytes, offset of the
#: 16 nibble bytes (or Q8_0's 32 int8), offset of the 32 high bits (-1: none), the offset
#: added to every quant to make it unsigned, whether an fp16 offset m follows d
UNPACK_LAYOUTS = (
    (18, 2, -1, 8, False),
    (20, 4, -1, 0, True),
    (22, 6, 2, 16, False),
    (24, 8, 4, 0, True),
    (34, 2, -1, 128, False),
)
#: value offset per kind (see UNPACK_LAYOUTS), for the dots
WEIGHT_OFFSET = tuple(lay[3] for lay in UNPACK_LAYOUTS)

#: set to False to leave out the VNNI / AVX2 integer routes (tests compare the routes)
USE_VNNI = True
USE_AVX2 = True

_I8, _I16, _I32, _I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_F32 = ir.FloatType()


def _const(v, t=_I64):
    return ir.Constant(t, v)


def _vconst(vals, t):
    vals = list(vals)
    return ir.Constant(ir.VectorType(t, len(vals)), [ir.Constant(t, v) for v in vals])


def _mask(ix):
    return _vconst(ix, _I32)


def _splat(v, t):
    return ir.Constant(ir.VectorType(t, 16), [ir.Constant(t, v)] * 16)


def _load(builder, p, off, ty, align=1):
    return builder.load(builder.bitcast(builder.gep(p, [off]), ty.as_pointer()), align=align)


def _as_i64(builder, v):
    return builder.sext(v, _I64) if v.type.width < 64 else v


def _route(context, small):
    """How the chunk dots are computed for the CPU numba compiles for: "vnni" (AVX-512 VNNI
    vpdpbusd), "avx2" (vpmaddubsw + vpmaddwd; only for small weights, u <= 127, where the
    saturating pair sums of vpmaddubsw cannot saturate) or "generic" (portable IR)."""
    try:
        features = context.codegen()._get_host_cpu_features().split(",")
    except Exception:  # numba internals moved: take the portable route
        return "generic"
    if USE_VNNI and "+avx512vnni" in features:
        return "vnni"
    if USE_AVX2 and small and "+avx2" in features:
        return "avx2"
    return "generic"


def _intrinsic_fn(builder, name, ret, args):
    mod = builder.module
    fn = mod.globals.get(name)
    if fn is None:
        fn = ir.Function(mod, ir.FunctionType(ret, args), name=name)
    return fn


def _loop(builder, n, phis, body_fn, name, start=None):
    """for g in range(start, n): phis = body_fn(g, phis). phis: [(type, initial value)];
    returns the final values."""
    fn = builder.function
    pre = builder.block
    hdr = fn.append_basic_block(name + ".hdr")
    body = fn.append_basic_block(name + ".body")
    done = fn.append_basic_block(name + ".done")
    builder.branch(hdr)
    builder.position_at_end(hdr)
    g = builder.phi(_I64)
    g.add_incoming(_const(0) if start is None else start, pre)
    vals = []
    for ty, init in phis:
        p = builder.phi(ty)
        p.add_incoming(init, pre)
        vals.append(p)
    builder.cbranch(builder.icmp_signed("<", g, n), body, done)
    builder.position_at_end(body)
    new = body_fn(g, vals)
    end = builder.block
    g.add_incoming(builder.add(g, _const(1)), end)
    for p, v in zip(vals, new):
        p.add_incoming(v, end)
    builder.branch(hdr)
    builder.position_at_end(done)
    return vals


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
        v32i8, v16i16 = ir.VectorType(_I8, 32), ir.VectorType(_I16, 16)
        v8i32 = ir.VectorType(_I32, 8)
        maddubs = _intrinsic_fn(builder, "llvm.x86.avx2.pmadd.ub.sw", v16i16, [v32i8, v32i8])
        maddwd = _intrinsic_fn(builder, "llvm.x86.avx2.pmadd.wd", v8i32, [v16i16, v16i16])
        ones = ir.Constant(v16i16, [ir.Constant(_I16, 1)] * 16)
        halves = []
        for h in range(2):
            sel = _mask(range(32 * h, 32 * h + 32))
            pairs = builder.call(maddubs, [builder.shuffle_vector(u, u, sel),
                                           builder.shuffle_vector(x, x, sel)])
            halves.append(builder.call(maddwd, [pairs, ones]))
        return builder.add(acc, builder.shuffle_vector(halves[0], halves[1], _mask(range(16))))
    v64i32 = ir.VectorType(_I32, 64)
    p = builder.mul(builder.zext(u, v64i32), builder.sext(x, v64i32))
    p2 = builder.add(builder.shuffle_vector(p, p, _mask(range(0, 64, 2))),
                     builder.shuffle_vector(p, p, _mask(range(1, 64, 2))))  # (v)pmaddwd
    p4 = builder.add(builder.shuffle_vector(p2, p2, _mask(range(0, 32, 2))),
                     builder.shuffle_vector(p2, p2, _mask(range(1, 32, 2))))
    return builder.add(acc, p4)


def _emit_dots(context, builder, rows, toks, accp, g0, g1, small, affine):
    """IR for the dots of every weight row in ``rows`` (u, dw, m pointers) with every token in
    ``toks`` (x, xcorr, dx, dxs pointers) over groups g0..g1-1, continuing the 16-lane float
    accumulators stored at ``accp`` (16 floats per (row, token), rows outer) and storing them
    back. Returns [float for (row, token)]: the accumulators' fixed-tree sums. Symmetric
    formats (not ``affine``) subtract xcorr (offset * sum(q)) from the integer sums; affine
    ones add m * dxs instead."""
    v64i8, v16i32, v16f = ir.VectorType(_I8, 64), ir.VectorType(_I32, 16), ir.VectorType(_F32, 16)
    route = _route(context, small)
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
                isum[r, t] = _dot_chunk(builder, isum[r, t], uv[r], xv[t], route)
        gb = builder.mul(g, _const(GROUP_BLOCKS))
        dws = [_load(builder, r[1], gb, v16f, 4) for r in rows]
        dxs = [_load(builder, t[2], gb, v16f, 4) for t in toks]
        if affine:
            ms = [_load(builder, r[2], gb, v16f, 4) for r in rows]
            dxss = [_load(builder, t[3], gb, v16f, 4) for t in toks]
        else:
            corr = [_load(builder, t[1], gb, v16i32, 4) for t in toks]
        out = []
        for (r, t), acc in zip(pairs, accs):
            s = isum[r, t] if affine else builder.sub(isum[r, t], corr[t])
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


def _row_ptr(context, builder, aryty, val, idx):
    ary = context.make_array(aryty)(context, builder, val)
    stride = builder.extract_value(ary.strides, 0)
    p8 = builder.gep(builder.bitcast(ary.data, _I8.as_pointer()), [builder.mul(idx, stride)])
    return builder.bitcast(p8, ary.data.type)


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


def _make_unpack(kind):
    ts, qoff, qhoff, offset, has_m = UNPACK_LAYOUTS[kind]

    @intrinsic
    def unpack(typingctx, rr, lut, u, dw, m, ngroups):
        """Groups 0..ngroups-1 (16 blocks each) of one raw row rr (uint8) -> unsigned quants u
        (uint8) in the group layout, scales dw[b] = lut[fp16 d] and (formats with an offset)
        m[b] = lut[fp16 m]. No bounds checks: rr must hold 16 * ngroups whole blocks."""
        sig = types.void(rr, lut, u, dw, m, ngroups)

        def codegen(context, builder, sig, args):
            rp, lutp, up, dwp, mp = [context.make_array(sig.args[i])(context, builder, args[i]).data
                                     for i in range(5)]
            v4i32, v16i32 = ir.VectorType(_I32, 4), ir.VectorType(_I32, 16)

            def fp16(off):
                bits = builder.zext(_load(builder, rp, off, _I16), _I64)
                return builder.load(builder.gep(lutp, [bits]))

            def body(g, _):
                gb = builder.mul(g, _const(GROUP_BLOCKS))
                go = builder.mul(g, _const(GROUP_BLOCKS * ts))
                offs = [builder.add(go, _const(i * ts)) for i in range(GROUP_BLOCKS)]
                for i in range(GROUP_BLOCKS):
                    bi = builder.add(gb, _const(i))
                    builder.store(fp16(offs[i]), builder.gep(dwp, [bi]))
                    if has_m:
                        builder.store(fp16(builder.add(offs[i], _const(2))), builder.gep(mp, [bi]))
                chunks = [None] * GROUP_CHUNKS
                for h in range(2 if offset == 128 else 1):  # Q8_0: 8 words per block
                    rows = [_load(builder, rp, builder.add(offs[i], _const(qoff + 16 * h)), v4i32)
                            for i in range(GROUP_BLOCKS)]
                    for c, t in enumerate(_transpose_words(builder, rows)):
                        if offset == 128:  # signed byte -> byte + 128
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
UNPACK_Q4_0, UNPACK_Q4_1, UNPACK_Q5_0, UNPACK_Q5_1, UNPACK_Q8_0 = (
    _make_unpack(k) for k in range(5))


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
