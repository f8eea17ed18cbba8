"""One token's K-quant int8 dots shaped for AVX2 (no AVX-512): the quants in their stored order.

The K kernels of ``_int8dot`` put every super-block in the 16-lane group layout (4 bytes of each
sub-block per 64-byte chunk). With AVX-512 that is one word permutation per chunk; on AVX2 a
512-bit permutation across two registers takes several instructions, and a decoding step spent
120-200 instructions per super-block and row (measured in the assembly, Zen 3).

Here a token's dot with a super-block reads the quants as stored:

* 32 quant bytes (one sub-block of 32, or two of 16) come out of the packed bits with byte
  shifts and masks, as unsigned values (the symmetric formats' offset kept: Q3_K q + 4, Q6_K
  q + 32), and meet the 32 activation bytes of the same values in Q8_K's natural order in one
  vpmaddubsw + vpmaddwd: 8 int32 lanes of 4 products each (no saturation: q <= 63, |x| <= 128).
* A transpose-and-add network (``_quads``, ``_octets``) turns those vectors into one int32 lane
  per sub-block. The symmetric formats subtract offset x the activations' sums of 16 (Q8_K's
  bsums). Every lane is then the exact integer dot of its sub-block, the same integers as the
  group-layout kernels reach.
* The float steps per lane are those of ``_int8dot``'s K kernels (dw = float(scale) x d, m =
  float(min) x -dmin, ``acc = fma(float(isum), dw * dx, acc)`` [``acc = fma(m, dxs, acc)``]),
  and the lanes are put back in the group order before the same fixed-tree sum, so a token's
  result is bit-identical to the tiles' and the other fused kernels' (tests compare them).

The network leaves the 16-value sub-blocks of Q2_K, Q3_K and Q6_K in the order ``NET_ORDER``
(sub-blocks 0, 2, 4, 6, 1, 3, 5, 7, then 8..15 alike); scales, sums and ``dxs`` are picked in
that order and the accumulator is reordered once per row at the end.
"""
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from . import _int8dot
from ._llvm_ir import (F32, I8, I16, I32, I64, as_i64, const, host_features, intrinsic_fn,
                       load, loop, mask, pick, row_ptr, splat, splat_const, tree_sum_f32, vec)

V32I8, V16I8 = vec(I8, 32), vec(I8, 16)
V8I32, V16I32, V16F = vec(I32, 8), vec(I32, 16), vec(F32, 16)

TYPE_SIZE = (84, 110, 144, 176, 210)
#: lane l of a 16-value format's accumulator holds sub-block NET_ORDER[l]
NET_ORDER = (0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15)
_BACK = tuple(NET_ORDER.index(i) for i in range(16))


def uses_avx2(context) -> bool:
    return _int8dot.USE_AVX2 and "avx2" in host_features(context)


def _dot32(b, q, x, avx2):
    """<8 x i32>: lane l = sum of q[4l + e] * x[4l + e], q unsigned and x signed <32 x i8>."""
    if avx2:
        maddubs, maddwd, _, ones = _int8dot._avx2_fns(b)
        return b.call(maddwd, [b.call(maddubs, [q, x]), ones])
    v32i32 = vec(I32, 32)
    p = b.mul(b.zext(q, v32i32), b.sext(x, v32i32))
    p = b.add(pick(b, p, range(0, 32, 2)), pick(b, p, range(1, 32, 2)))
    return b.add(pick(b, p, range(0, 16, 2)), pick(b, p, range(1, 16, 2)))


def _quads(b, vs):
    """Four <8 x i32> -> lanes [v0[0:4], v1[0:4], v2[0:4], v3[0:4], v0[4:8], ..., v3[4:8]]
    summed (unpack-and-add steps that stay within 128-bit halves)."""
    def step(u, v, lo, hi):
        return b.add(b.shuffle_vector(u, v, mask(lo)), b.shuffle_vector(u, v, mask(hi)))
    t = step(vs[0], vs[1], [0, 8, 1, 9, 4, 12, 5, 13], [2, 10, 3, 11, 6, 14, 7, 15])
    u = step(vs[2], vs[3], [0, 8, 1, 9, 4, 12, 5, 13], [2, 10, 3, 11, 6, 14, 7, 15])
    return step(t, u, [0, 1, 8, 9, 4, 5, 12, 13], [2, 3, 10, 11, 6, 7, 14, 15])


def _octets(b, vs):
    """Eight <8 x i32> -> lane j = the sum of vs[j]'s 8 lanes."""
    u0, u1 = _quads(b, vs[:4]), _quads(b, vs[4:])
    return b.add(b.shuffle_vector(u0, u1, mask([0, 1, 2, 3, 8, 9, 10, 11])),
                 b.shuffle_vector(u0, u1, mask([4, 5, 6, 7, 12, 13, 14, 15])))


def _bshr(b, v, n):
    return b.lshr(v, splat_const(n, I8, v.type.count)) if n else v


def _bshl(b, v, n):
    return b.shl(v, splat_const(n, I8, v.type.count)) if n else v


def _band(b, v, m):
    return b.and_(v, splat_const(m, I8, v.type.count))


def _fp16(b, rp, lutp, off, neg=False):
    v = b.load(b.gep(lutp, [b.zext(load(b, rp, off, I16), I64)]))
    return b.fsub(ir.Constant(F32, -0.0), v) if neg else v  # exact negation


def _net16(b, vs):
    """Eight <8 x i32> of 16-value formats (vs[i]: values 32i..32i+31, two sub-blocks of 16)
    -> <16 x i32>, lane l = sub-block NET_ORDER[l]."""
    return b.shuffle_vector(_quads(b, vs[:4]), _quads(b, vs[4:]), mask(range(16)))


def _sb_sums16(b, kind, rp, o, xs, avx2):
    """Q2_K, Q3_K, Q6_K: the eight quant vectors of the super-block at byte o of the row, dotted
    with each token's activations (xs: per token 8 <32 x i8>): per token <16 x i32> in NET_ORDER
    (the offset not removed)."""
    at = lambda k: b.add(o, const(k))  # noqa: E731
    us = []
    if kind in (0, 1):  # qs byte 32h + l, bits 2jj: value 128h + 32jj + l
        qs0 = 16 if kind == 0 else 32
        if kind == 1:  # hmask byte l, bit 4h + jj: the value's quant is stored - 4 unless set
            hm = load(b, rp, o, V32I8)
        for h in range(2):
            qh = load(b, rp, at(qs0 + 32 * h), V32I8)
            for jj in range(4):
                u = _band(b, _bshr(b, qh, 2 * jj), 3)
                if kind == 1:
                    s = 4 * h + jj
                    hb = _band(b, hm, 1 << s)
                    hb = _bshr(b, hb, s - 2) if s > 2 else _bshl(b, hb, 2 - s)
                    u = b.or_(u, hb)
                us.append(u)
    else:  # Q6_K: ql byte 64h + l (l < 64) nibble n: value 128h + 64n + l; qh byte 32h + l
        # bits 2jj: the high 2 bits of value 128h + 32jj + l
        for h in range(2):
            ql = [load(b, rp, at(64 * h + 32 * i), V32I8) for i in range(2)]
            qh = load(b, rp, at(128 + 32 * h), V32I8)
            for jj in range(4):
                lo = ql[jj % 2]
                lo = _band(b, lo, 15) if jj < 2 else _bshr(b, lo, 4)
                hi = _bshl(b, _band(b, _bshr(b, qh, 2 * jj), 3), 4)
                us.append(b.or_(lo, hi))
    return [_net16(b, [_dot32(b, u, xv, avx2) for u, xv in zip(us, x)]) for x in xs]


def _net_pick16(b, v):
    return b.shuffle_vector(v, v, mask(NET_ORDER))


def _make_natural_k(kind, n_rows, n_toks):
    ts = TYPE_SIZE[kind]
    affine = _int8dot.K_AFFINE[kind]
    paired = _int8dot.K_PAIRED[kind]

    @intrinsic
    def natural(typingctx, raw, lut, x, sums, dx, dxs, tok, row, n_out):
        """Dots of tokens tok..tok+T-1 (Q8_K quants x (k, n) in natural order, their int32 sums
        of 16 ``sums``; dx, dxs as _int8dot's K kernels take them: the pair layout for Q4_K and
        Q5_K) with weight rows row..row+R-1 (each clamped to n_out - 1) of raw: a tuple of R * T
        float32, rows outer, the same bits as FUSED_K*_* (see the module's docstring)."""
        sig = types.UniTuple(types.float32, n_rows * n_toks)(raw, lut, x, sums, dx, dxs, tok, row,
                                                             n_out)

        def codegen(context, builder, sig, args):
            b = builder
            avx2 = uses_avx2(context)
            fma = intrinsic_fn(b, "llvm.fma.v16f32", V16F, [V16F] * 3)
            t0, r0, n = (as_i64(b, v) for v in args[6:9])
            lutp = context.make_array(sig.args[1])(context, b, args[1]).data
            ra = context.make_array(sig.args[0])(context, b, args[0])
            nsb = b.udiv(b.extract_value(ra.shape, 1), const(ts))
            last = b.sub(n, const(1))
            rps = []
            for i in range(n_rows):
                r = b.add(r0, const(i))
                rps.append(row_ptr(context, b, sig.args[0], args[0],
                                   b.select(b.icmp_signed("<", r, last), r, last)))
            toks = [tuple(row_ptr(context, b, sig.args[a], args[a], b.add(t0, const(t)))
                          for a in (2, 3, 4, 5)) for t in range(n_toks)]
            pf = _int8dot._prefetcher(context, b, sig.args[0], args[0], rps, ts)
            zero = ir.Constant(V16F, [ir.Constant(F32, 0.0)] * 16)

            def xs(xp, sb):
                base = b.mul(sb, const(256))
                return [load(b, xp, b.add(base, const(32 * i)), V32I8) for i in range(8)]

            def body16(sb, accs):
                pf(sb)
                o16 = b.mul(sb, const(16))
                x, dxv, dxsv, corr = [], [], [], []
                for xp, sp, dxp, dxsp in toks:
                    x.append(xs(xp, sb))
                    dxv.append(splat(b, b.load(b.gep(dxp, [sb])), 16))
                    if affine:
                        dxsv.append(_net_pick16(b, load(b, dxsp, o16, V16F, 4)))
                    else:  # the stored offset times the sums of 16, in NET_ORDER
                        bs = _net_pick16(b, load(b, sp, o16, V16I32, 4))
                        corr.append(b.shl(bs, splat_const(2 if kind == 1 else 5, I32, 16)))
                out = []
                for i, rp in enumerate(rps):
                    o = b.mul(sb, const(ts))
                    isums = _sb_sums16(b, kind, rp, o, x, avx2)
                    if kind == 0:  # scales[j]: scale | min << 4; d, dmin at 80, 82
                        s = b.zext(_net_pick16(b, load(b, rp, o, V16I8)), V16I32)
                        sc = b.and_(s, splat_const(15, I32, 16))
                        mn = b.lshr(s, splat_const(4, I32, 16))
                        d = _fp16(b, rp, lutp, b.add(o, const(80)))
                        dmin = _fp16(b, rp, lutp, b.add(o, const(82)), True)
                    elif kind == 1:  # 6-bit scales - 32 in 12 bytes at 96, d at 108
                        w = load(b, rp, b.add(o, const(96)), vec(I32, 3))
                        s = b.bitcast(b.shuffle_vector(w, w, mask([0, 1, 2, 2])), V16I8)
                        J = NET_ORDER
                        lo = b.lshr(b.zext(b.shuffle_vector(s, s, mask([j % 8 for j in J])), V16I32),
                                    ir.Constant(V16I32, [ir.Constant(I32, 4 * (j // 8)) for j in J]))
                        hi = b.lshr(b.zext(b.shuffle_vector(s, s, mask([8 + j % 4 for j in J])), V16I32),
                                    ir.Constant(V16I32, [ir.Constant(I32, 2 * (j // 4)) for j in J]))
                        sc = b.sub(b.or_(b.and_(lo, splat_const(15, I32, 16)),
                                         b.shl(b.and_(hi, splat_const(3, I32, 16)),
                                               splat_const(4, I32, 16))),
                                   splat_const(32, I32, 16))
                        d = _fp16(b, rp, lutp, b.add(o, const(108)))
                    else:  # Q6_K: int8 scales at 192, d at 208
                        sc = b.sext(_net_pick16(b, load(b, rp, b.add(o, const(192)), V16I8)), V16I32)
                        d = _fp16(b, rp, lutp, b.add(o, const(208)))
                    dw = b.fmul(b.sitofp(sc, V16F), splat(b, d, 16))
                    if affine:
                        m = b.fmul(b.sitofp(mn, V16F), splat(b, dmin, 16))
                    for t in range(n_toks):
                        isum = isums[t] if affine else b.sub(isums[t], corr[t])
                        acc = b.call(fma, [b.sitofp(isum, V16F), b.fmul(dw, dxv[t]),
                                           accs[i * n_toks + t]])
                        if affine:
                            acc = b.call(fma, [m, dxsv[t], acc])
                        out.append(acc)
                return out

            def sb_pair_parts(rp, sb, x):
                """Q4_K / Q5_K super-block sb: per token (x: its 8 activation vectors each) the
                <8 x i32> sums of the 8 sub-blocks of 32, and <16 x float> [dw (8), m (8)]."""
                o = b.mul(sb, const(ts))
                at = lambda k: b.add(o, const(k))  # noqa: E731
                q0 = 16 if kind == 2 else 48
                if kind == 3:  # qh byte l bit j: bit 4 of value 32j + l
                    qh = load(b, rp, at(16), V32I8)
                sums = [[] for _ in x]
                for h in range(4):  # qs byte 32h + l, nibble n: value 64h + 32n + l
                    qs = load(b, rp, at(q0 + 32 * h), V32I8)
                    for nib in range(2):
                        j = 2 * h + nib
                        u = _band(b, qs, 15) if nib == 0 else _bshr(b, qs, 4)
                        if kind == 3:
                            hb = _band(b, qh, 1 << j)
                            hb = _bshr(b, hb, j - 4) if j > 4 else _bshl(b, hb, 4 - j)
                            u = b.or_(u, hb)
                        for t, xt in enumerate(x):
                            sums[t].append(_dot32(b, u, xt[j], avx2))
                # get_scale_min_k4 in 32-bit words (scales: bytes 0..7, mins: 8..15)
                w = [load(b, rp, at(4 + 4 * i), I32) for i in range(3)]
                c = lambda v: ir.Constant(I32, v)  # noqa: E731
                lo6 = lambda v: b.and_(v, c(0x3F3F3F3F))  # noqa: E731
                top2 = lambda v: b.shl(b.and_(b.lshr(v, c(6)), c(0x03030303)), c(4))  # noqa: E731
                words = [lo6(w[0]),
                         b.or_(b.and_(w[2], c(0x0F0F0F0F)), top2(w[0])),
                         lo6(w[1]),
                         b.or_(b.and_(b.lshr(w[2], c(4)), c(0x0F0F0F0F)), top2(w[1]))]
                v4 = ir.Constant(vec(I32, 4), ir.Undefined)
                for i, wd in enumerate(words):
                    v4 = b.insert_element(v4, wd, c(i))
                scm = b.sitofp(b.zext(b.bitcast(v4, V16I8), V16I32), V16F)
                dd = b.shuffle_vector(splat(b, _fp16(b, rp, lutp, o), 16),
                                      splat(b, _fp16(b, rp, lutp, at(2), True), 16),
                                      mask(list(range(8)) + list(range(24, 32))))
                return [_octets(b, st) for st in sums], b.fmul(scm, dd)

            def pair_body(half):
                zi = ir.Constant(V8I32, [ir.Constant(I32, 0)] * 8)
                # a missing half: zero quants and dw, m = -0.0 (as the other K kernels)
                zdm = ir.Constant(V16F, [ir.Constant(F32, 0.0)] * 8 + [ir.Constant(F32, -0.0)] * 8)

                def body(g, accs):
                    sbs = [b.mul(g, const(2))] + ([] if half else [b.add(b.mul(g, const(2)), const(1))])
                    for sb in sbs:
                        pf(sb)
                    gb = b.mul(g, const(16))
                    x = [[xs(tk[0], sb) for tk in toks] for sb in sbs]
                    dxv = [load(b, tk[2], gb, V16F, 4) for tk in toks]
                    dxsv = [load(b, tk[3], gb, V16F, 4) for tk in toks]
                    out = []
                    for i, rp in enumerate(rps):
                        parts = [sb_pair_parts(rp, sb, xv) for sb, xv in zip(sbs, x)]
                        if half:
                            parts.append(([zi] * n_toks, zdm))
                        dw = b.shuffle_vector(parts[0][1], parts[1][1],
                                              mask(list(range(8)) + list(range(16, 24))))
                        m = b.shuffle_vector(parts[0][1], parts[1][1],
                                             mask(list(range(8, 16)) + list(range(24, 32))))
                        for t in range(n_toks):
                            isum = b.shuffle_vector(parts[0][0][t], parts[1][0][t], mask(range(16)))
                            acc = b.call(fma, [b.sitofp(isum, V16F), b.fmul(dw, dxv[t]),
                                               accs[i * n_toks + t]])
                            out.append(b.call(fma, [m, dxsv[t], acc]))
                    return out
                return body

            init = [(V16F, zero)] * (n_rows * n_toks)
            if paired:
                whole = b.udiv(nsb, const(2))
                accs = loop(b, whole, init, pair_body(False), "knat2")
                accs = loop(b, b.udiv(b.add(nsb, const(1)), const(2)), [(V16F, a) for a in accs],
                            pair_body(True), "knat1", start=whole)
            else:
                accs = loop(b, nsb, init, body16, "knat")
                accs = [b.shuffle_vector(a, a, mask(_BACK)) for a in accs]
            return context.make_tuple(b, sig.return_type, [tree_sum_f32(b, a) for a in accs])

        return sig, codegen

    return natural


#: K_FUSED_ROWS weight rows x 1 token (K1) or 2 tokens (K2) per K-quant kind (Q2_K, Q3_K, Q4_K,
#: Q5_K, Q6_K): (raw, lut, x, sums, dx, dxs, tok, row, n_out) -> R T float32, rows outer
NATURAL_K1_Q2_K, NATURAL_K1_Q3_K, NATURAL_K1_Q4_K, NATURAL_K1_Q5_K, NATURAL_K1_Q6_K = (
    _make_natural_k(k, _int8dot.K_FUSED_ROWS, 1) for k in range(5))
NATURAL_K2_Q2_K, NATURAL_K2_Q3_K, NATURAL_K2_Q4_K, NATURAL_K2_Q5_K, NATURAL_K2_Q6_K = (
    _make_natural_k(k, _int8dot.K_FUSED_ROWS, 2) for k in range(5))
