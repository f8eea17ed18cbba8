"""Shared plumbing for the formats' LLVM-IR intrinsics (numba ``@intrinsic`` code generators).

The hot loops of the int8 matmuls (``_int8dot``), the IQ formats' row unpackers (``_simd``) and
the legacy quantizers' block code (``_block32``) are written as LLVM vector IR; what they all
need lives here once: the scalar and vector types, constants and shuffle masks, unaligned loads
and stores at an element offset, the data pointer of a numba array (or of one of its rows), a
counted loop with phis, the host CPU's features (what numba compiles for), the x86 intrinsic
declarations, a fixed-order float reduction, and the bit-cast intrinsics (``f32_from_bits``,
``float32_bits``, ``store_le``).

numba's on-disk cache (``cache=True``) checks only the source file of the kernel that calls an
intrinsic, not the module that generates it: after editing this module, ``_int8dot``, ``_simd``
or ``_block32``, delete ``ds4tools/formats/__pycache__`` or the old machine code keeps running.
"""
import functools

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

I8, I16, I32, I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
F32 = ir.FloatType()


def vec(t, n):
    return ir.VectorType(t, n)


def const(v, t=I64):
    return ir.Constant(t, v)


def vconst(vals, t):
    """A constant vector of the values ``vals`` (element type t)."""
    vals = list(vals)
    return ir.Constant(vec(t, len(vals)), [ir.Constant(t, v) for v in vals])


def mask(ix):
    """A shuffle mask (<n x i32>) picking lanes ``ix``."""
    return vconst(ix, I32)


def splat_const(v, t, n=16):
    """The constant vector of n lanes ``v``."""
    return ir.Constant(vec(t, n), [ir.Constant(t, v)] * n)


def splat(builder, scalar, n):
    """A run-time value broadcast to n lanes."""
    vt = vec(scalar.type, n)
    v = builder.insert_element(ir.Constant(vt, ir.Undefined), scalar, ir.Constant(I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vt, ir.Undefined), mask([0] * n))


def pick(builder, v, lanes):
    """Lanes ``lanes`` of one vector."""
    return builder.shuffle_vector(v, ir.Constant(v.type, ir.Undefined), mask(lanes))


def load(builder, p, off, ty, align=1):
    """A ``ty`` read at element ``off`` of pointer p (unaligned unless told)."""
    return builder.load(builder.bitcast(builder.gep(p, [off]), ty.as_pointer()), align=align)


def store(builder, val, p, off, align=1):
    """``val`` written at element ``off`` of pointer p (unaligned unless told)."""
    builder.store(val, builder.bitcast(builder.gep(p, [off]), val.type.as_pointer()), align=align)


def as_i64(builder, v):
    return builder.sext(v, I64) if v.type.width < 64 else v


def data_ptr(context, builder, aty, val):
    """The data pointer of a numba array argument (type aty, value val)."""
    return context.make_array(aty)(context, builder, val).data


def row_ptr(context, builder, aty, val, idx):
    """The data pointer of row ``idx`` (an i64) of a 2-D numba array."""
    ary = context.make_array(aty)(context, builder, val)
    stride = builder.extract_value(ary.strides, 0)
    p8 = builder.gep(builder.bitcast(ary.data, I8.as_pointer()), [builder.mul(idx, stride)])
    return builder.bitcast(p8, ary.data.type)


def c_array(t, dtype=None, ndim=1):
    """Whether numba type t is a C-contiguous array of ``ndim`` dimensions (and ``dtype``)."""
    return (isinstance(t, types.Array) and t.ndim == ndim and t.layout == "C"
            and (dtype is None or t.dtype == dtype))


def host_features(context):
    """The LLVM features ("avx2", "avx512vnni", ...) of the CPU numba compiles for; empty
    when numba's internals do not say (the intrinsics then take their portable IR)."""
    try:
        feats = context.codegen()._get_host_cpu_features().split(",")
    except Exception:  # numba internals moved
        return frozenset()
    return frozenset(f[1:] for f in feats if f.startswith("+"))


@functools.cache
def host_cpu_features():
    """host_features of numba's CPU target, outside a compilation (for dispatch in Python;
    asked once: the target does not change within a process)."""
    from numba.core.registry import cpu_target
    return host_features(cpu_target.target_context)


def avx2_without_vnni() -> bool:
    """Whether numba compiles for a CPU with AVX2 but not AVX-512 VNNI: the hosts where the
    int8 kernels choose other shapes (the stored-order K kernels, fused passes)."""
    features = host_cpu_features()
    return "avx2" in features and "avx512vnni" not in features


def intrinsic_fn(builder, name, ret, args):
    """The declaration of LLVM function ``name`` in the builder's module (added once)."""
    mod = builder.module
    fn = mod.globals.get(name)
    if fn is None:
        fn = ir.Function(mod, ir.FunctionType(ret, args), name=name)
    return fn


def loop(builder, n, phis, body_fn, name, start=None):
    """for g in range(start, n): phis = body_fn(g, phis). phis: [(type, initial value)];
    returns the final values."""
    fn = builder.function
    pre = builder.block
    hdr = fn.append_basic_block(name + ".hdr")
    body = fn.append_basic_block(name + ".body")
    done = fn.append_basic_block(name + ".done")
    builder.branch(hdr)
    builder.position_at_end(hdr)
    g = builder.phi(I64)
    g.add_incoming(const(0) if start is None else start, pre)
    vals = []
    for ty, init in phis:
        p = builder.phi(ty)
        p.add_incoming(init, pre)
        vals.append(p)
    builder.cbranch(builder.icmp_signed("<", g, n), body, done)
    builder.position_at_end(body)
    new = body_fn(g, vals)
    end = builder.block
    g.add_incoming(builder.add(g, const(1)), end)
    for p, v in zip(vals, new):
        p.add_incoming(v, end)
    builder.branch(hdr)
    builder.position_at_end(done)
    return vals


def tree_sum_f32(builder, v):
    """The sum of a float vector's lanes in a fixed order: halves added lane-wise, down to one."""
    n = v.type.count
    while n > 1:
        h = n // 2
        v = builder.fadd(pick(builder, v, range(h)), pick(builder, v, range(h, n)))
        n = h
    return builder.extract_element(v, ir.Constant(I32, 0))


def tree_sums_f32x16(builder, vs):
    """tree_sum_f32 of each of 16 float vectors of 16 lanes, as one vector (lane j: the sum of
    vs[j]): the same additions on the same operands, done for all 16 at once with shuffles that
    pair two vectors' halves per level (~2 operations per sum instead of ~8)."""
    assert len(vs) == 16 and all(v.type.count == 16 for v in vs)
    # each working vector holds, per lane, (source vector, partial index) in `tags`
    cur = [(v, [(j, i) for i in range(16)]) for j, v in enumerate(vs)]
    width = 16  # partials per source vector at this level
    while width > 1:
        h = width // 2
        nxt = []
        for a, b in zip(cur[0::2], cur[1::2]):
            both = a[1] + b[1]  # lane tags of the concatenation a ++ b (32 lanes)
            lo, hi, tags = [], [], []
            for src in sorted({t[0] for t in both}):
                lanes = {t[1]: n for n, t in enumerate(both) if t[0] == src}
                for i in range(h):  # partial i of the next level = i + (i + h) of this one
                    lo.append(lanes[i])
                    hi.append(lanes[i + h])
                    tags.append((src, i))
            nxt.append((builder.fadd(builder.shuffle_vector(a[0], b[0], mask(lo)),
                                     builder.shuffle_vector(a[0], b[0], mask(hi))), tags))
        cur = nxt
        width = h
    (v, tags), = cur
    order = [tags.index((j, 0)) for j in range(16)]
    return builder.shuffle_vector(v, ir.Constant(v.type, ir.Undefined), mask(order))


# --- bit casts ------------------------------------------------------------------------------


@intrinsic
def f32_from_bits(typingctx, bits):
    """The float32 whose bit pattern is the int32 ``bits``."""
    if bits != types.int32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], F32)
    return types.float32(types.int32), codegen


@intrinsic
def float32_bits(typingctx, value):
    """The bit pattern of a float32 as an int32 (C's memcpy from float to int)."""
    if value != types.float32:
        return None  # a float64 here would be a precision bug: refuse to compile

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], I32)
    return types.int32(types.float32), codegen


@intrinsic
def store_le(typingctx, arr, off, val):
    """Store integer ``val`` (its own width) at byte offset ``off`` of a uint8 array (GGUF is
    little endian, as every host numba targets here)."""
    if not (c_array(arr, types.uint8) and isinstance(off, types.Integer)
            and isinstance(val, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        a, o, v = args
        store(builder, v, data_ptr(context, builder, sig.args[0], a), o)
        return context.get_dummy_value()
    return types.none(arr, off, val), codegen


# --- byte table lookups -----------------------------------------------------------------------


def lookup16(builder, features, table, idx):
    """Per byte of ``idx`` (<n x i8>, values 0..15, n a multiple of 16) the byte table[idx]:
    x86 byte shuffles (pshufb of the widest kind ``features`` (host_features) has, the table
    repeated per 16 bytes), elsewhere a portable chain of 16 compares and selects. ``table``:
    16 Python ints (constants) or an IR <16 x i8> value."""
    n = idx.type.count
    if isinstance(table, ir.Value) and not isinstance(table, ir.Constant):
        def table_vec(width):
            return builder.shuffle_vector(table, table, mask([j % 16 for j in range(width)]))

        def entry(v):
            return splat(builder, builder.extract_element(table, ir.Constant(I32, v)), n)
    else:
        table = [((int(v) + 128) & 255) - 128 for v in table]  # as signed bytes
        assert len(table) == 16

        def table_vec(width):
            return vconst(table * (width // 16), I8)

        def entry(v):
            return splat_const(table[v], I8, n)
    for feat, width, name in (("avx512bw", 64, "llvm.x86.avx512.pshuf.b.512"),
                              ("avx2", 32, "llvm.x86.avx2.pshuf.b"),
                              ("ssse3", 16, "llvm.x86.ssse3.pshuf.b.128")):
        if feat in features and n % width == 0:
            vt = vec(I8, width)
            fn = intrinsic_fn(builder, name, vt, [vt, vt])
            tbl = table_vec(width)
            parts = [builder.call(fn, [tbl, pick(builder, idx, range(o, o + width))])
                     for o in range(0, n, width)]
            while len(parts) > 1:  # concatenate, pairwise
                parts = [builder.shuffle_vector(a, b, mask(range(2 * a.type.count)))
                         for a, b in zip(parts[::2], parts[1::2])]
            return parts[0]
    out = entry(0)
    for v in range(1, 16):
        hit = builder.icmp_unsigned("==", idx, splat_const(v, I8, n))
        out = builder.select(hit, entry(v), out)
    return out
