"""The decoder's compiled building blocks (everything but the matmuls, which live in formats).

Every kernel works on whole batches of rows in one call (never a Python loop over rows), and
computes each row with the same code and the same reduction order whatever the number of rows:
a row's result is bit-identical whether it came alone or inside a batch. Two habits keep it so:

* inner loops run over one row (a fixed length), never over a flattened (rows * n) array, so
  the split between a vectorized body and its scalar remainder is the same for every row;
* arrays passed in are C-contiguous (one compiled specialization for every batch size).

The parallel kernels split work by rows (attention: by (kv head, block of rows, pair of heads)),
which never changes what one row computes. Shapes: x (k, n) activations, (k, heads, head_dim)
for attention inputs.
"""
import math

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from ..formats._llvm_ir import (F32, I32, const, data_ptr, host_features, intrinsic_fn, load,
                                loop, mask, splat, store, tree_sum_f32, vec)
from ..formats.floats import f32_bits_to_f16

NEG_INF = np.float32(-np.inf)


# --- exp without libm ----------------------------------------------------------------------------
# numba calls libm's expf one element at a time (no SVML here). This exp is plain arithmetic,
# so the loops around it vectorize, and the vector body and its scalar remainder compute the
# very same bits. Relative error ~1e-7 (a degree-6 polynomial on |r| <= ln2/2).

@intrinsic
def _float32_from_bits(typingctx, bits):
    if bits != types.int32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.int32), codegen


_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693145751953125)        # ln 2 split so n * _LN2_HI is exact
_LN2_LO = np.float32(1.4286068203094173e-06)
_EXP_MIN = np.float32(-87.33654)               # e^x below 2**-126: returns ~1.2e-38
_EXP_MAX = np.float32(88.72283)


@njit(cache=True, fastmath=True, inline="always", error_model="numpy")
def exp_f32(x):
    """e**x for a float32 x, in float32 arithmetic (clamped to the normal range)."""
    x = min(max(x, _EXP_MIN), _EXP_MAX)
    n = np.floor(x * _LOG2E + np.float32(0.5))
    r = x - n * _LN2_HI - n * _LN2_LO
    p = np.float32(1.0 / 720.0)
    p = p * r + np.float32(1.0 / 120.0)
    p = p * r + np.float32(1.0 / 24.0)
    p = p * r + np.float32(1.0 / 6.0)
    p = p * r + np.float32(0.5)
    p = p * r + np.float32(1.0)
    p = p * r + np.float32(1.0)
    return p * _float32_from_bits(np.int32((np.int64(n) + 127) << 23))


# --- normalization and element-wise ops ------------------------------------------------------


@njit(cache=True, fastmath=True, error_model="numpy")
def _rmsnorm_row(x, weight, eps, out):
    # Sum of squares in float64 (ggml sums in ggml_float = double), the rest in float32.
    s = 0.0
    for i in range(x.shape[0]):
        v = np.float64(x[i])
        s += v * v
    scale = np.float32(1.0 / math.sqrt(s / x.shape[0] + eps))
    for i in range(x.shape[0]):
        out[i] = (x[i] * scale) * weight[i]


_RMSNORM_PAR_FROM = 1 << 16  # values from which rmsnorm runs row-parallel (prefill batches)


@njit(parallel=True, cache=True, error_model="numpy")
def _rmsnorm_parallel(x, weight, eps, out):
    k = x.shape[0]
    for blk in prange((k + 15) // 16):
        for t in range(16 * blk, min(k, 16 * blk + 16)):
            _rmsnorm_row(x[t], weight, eps, out[t])


@njit(cache=True, error_model="numpy")
def rmsnorm(x, weight, eps, out):
    """out[t] = x[t] / rms(x[t]) * weight; x, out (rows, n); weight (n,). out may be x.

    One thread for small batches (a parallel region would cost more than it saves), row-parallel
    from _RMSNORM_PAR_FROM values (a 512-token prefill of a 350M model: 3% of its time on one
    thread); a row's bits do not depend on it."""
    if x.shape[0] * x.shape[1] >= _RMSNORM_PAR_FROM:
        _rmsnorm_parallel(x, weight, eps, out)
    else:
        for t in range(x.shape[0]):
            _rmsnorm_row(x[t], weight, eps, out[t])


@njit(cache=True, error_model="numpy")
def add_bias(x, bias):
    """x[t] += bias for every row."""
    for t in range(x.shape[0]):
        for i in range(x.shape[1]):
            x[t, i] += bias[i]


@njit(cache=True, error_model="numpy")
def add_into(x, y):
    """x += y (the residual stream), row by row."""
    for t in range(x.shape[0]):
        for i in range(x.shape[1]):
            x[t, i] += y[t, i]


_SWIGLU_CHUNK = 256       # floats per pass through the row's scratch
_SWIGLU_PAR_FROM = 64     # rows from which swiglu runs in parallel (starting threads costs rows)


@njit(cache=True, fastmath={"contract"}, error_model="numpy")
def _swiglu_row(g, u, out, tmp):
    # Computed into tmp, then copied: the decoder passes out = gate, and a loop writing the
    # array it reads fails LLVM's overlap check and runs scalar (8x slower). Only contraction
    # is allowed: fastmath's reciprocal estimate turned g / (1 + inf) (g < -88) into NaN.
    n = g.shape[0]
    for i0 in range(0, n, tmp.shape[0]):
        m = min(tmp.shape[0], n - i0)
        gc, uc, oc = g[i0:i0 + m], u[i0:i0 + m], out[i0:i0 + m]  # (plain indices vectorize)
        for i in range(m):
            x = gc[i]
            tmp[i] = x / (np.float32(1.0) + exp_f32(-x)) * uc[i]
        for i in range(m):
            oc[i] = tmp[i]


@njit(parallel=True, cache=True, error_model="numpy")
def _swiglu_parallel(gate, up, out):
    k = gate.shape[0]
    for blk in prange((k + 7) // 8):
        tmp = np.empty(_SWIGLU_CHUNK, np.float32)
        for t in range(8 * blk, min(k, 8 * blk + 8)):
            _swiglu_row(gate[t], up[t], out[t], tmp)


@njit(cache=True, error_model="numpy")
def swiglu(gate, up, out):
    """out = silu(gate) * up, silu(g) = g / (1 + exp(-g)) as ggml computes it. out may be gate.
    Row-parallel from _SWIGLU_PAR_FROM rows (a row's bits do not depend on it)."""
    if gate.shape[0] >= _SWIGLU_PAR_FROM:
        _swiglu_parallel(gate, up, out)
    else:
        tmp = np.empty(_SWIGLU_CHUNK, np.float32)
        for t in range(gate.shape[0]):
            _swiglu_row(gate[t], up[t], out[t], tmp)


@njit(cache=True, error_model="numpy")
def weighted_sum(expert_out, weights, out):
    """out[t] = sum_j weights[t, j] * expert_out[t, j] (k, n_slots, n): a mixture of experts'
    slots added in order (as ggml: each product rounded to float32, then the views added one
    after another)."""
    k, n_used, n = expert_out.shape
    for t in range(k):
        w0 = weights[t, 0]
        for i in range(n):
            out[t, i] = expert_out[t, 0, i] * w0
        for j in range(1, n_used):
            w = weights[t, j]
            for i in range(n):
                out[t, i] = out[t, i] + expert_out[t, j, i] * w


# --- rotary position embedding -----------------------------------------------------------------


@njit(cache=True, error_model="numpy")
def rope(x, positions, cos, sin, neox):
    """Rotate x (k, heads, head_dim) in place by the angles of each row's position.

    cos, sin: (n_positions, n_rot // 2) tables (see rope_tables); the first n_rot dimensions
    rotate, the rest pass through. neox=False: llama.cpp's "norm" mode, pairs (2i, 2i+1);
    neox=True: pairs (i, i + n_rot/2)."""
    k, heads, _ = x.shape
    half = cos.shape[1]
    for t in range(k):
        p = positions[t]
        for h in range(heads):
            xr = x[t, h]
            if neox:
                for i in range(half):
                    a = xr[i]
                    b = xr[i + half]
                    c = cos[p, i]
                    s = sin[p, i]
                    xr[i] = a * c - b * s
                    xr[i + half] = a * s + b * c
            else:
                for i in range(half):
                    a = xr[2 * i]
                    b = xr[2 * i + 1]
                    c = cos[p, i]
                    s = sin[p, i]
                    xr[2 * i] = a * c - b * s
                    xr[2 * i + 1] = a * s + b * c


def rope_tables(n_positions: int, n_rot: int, freq_base: float, *, freq_scale: float = 1.0,
                freq_factors=None, yarn=None) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin (n_positions, n_rot // 2) float32, computed in float64.

    theta(p, i) = p * freq_base ** (-2i / n_rot) / freq_factors[i], scaled by freq_scale
    (linear scaling), or blended YaRN-style when ``yarn`` = (n_ctx_orig, beta_fast,
    beta_slow, ext_factor, attn_factor) is given, as ggml's rope_yarn defines it."""
    half = n_rot // 2
    i = np.arange(half, dtype=np.float64)
    inv_freq = freq_base ** (-2.0 * i / n_rot)
    if freq_factors is not None:
        inv_freq = inv_freq / np.asarray(freq_factors, np.float64)[:half]
    p = np.arange(n_positions, dtype=np.float64)[:, None]
    theta_extrap = p * inv_freq[None, :]
    mscale = 1.0
    if yarn is None:
        theta = theta_extrap * freq_scale
    else:
        n_ctx_orig, beta_fast, beta_slow, ext_factor, attn_factor = yarn
        mscale = attn_factor
        theta = theta_extrap * freq_scale
        if ext_factor != 0.0:
            def corr_dim(n_rot_turns):
                return n_rot * math.log(n_ctx_orig / (n_rot_turns * 2 * math.pi)) / (2 * math.log(freq_base))
            low = max(0.0, math.floor(corr_dim(beta_fast)))
            high = min(n_rot - 1.0, math.ceil(corr_dim(beta_slow)))
            y = (i - low) / max(0.001, high - low)  # ggml's ramp, at i0 / 2 = i
            ramp = (1.0 - np.clip(y, 0.0, 1.0)) * ext_factor
            theta = theta * (1.0 - ramp) + theta_extrap * ramp
            mscale *= 1.0 + 0.1 * math.log(1.0 / freq_scale)
    cos = (np.cos(theta) * mscale).astype(np.float32)
    sin = (np.sin(theta) * mscale).astype(np.float32)
    return np.ascontiguousarray(cos), np.ascontiguousarray(sin)


# --- KV cache writes --------------------------------------------------------------------------


@njit(cache=True, error_model="numpy")
def store_kv_f32(cache_k, cache_v, k_rows, v_rows, positions):
    """cache_*: (n_kv_head, n_ctx, head_dim) float32; *_rows: (k, n_kv_head, head_dim)."""
    for t in range(k_rows.shape[0]):
        p = positions[t]
        for g in range(k_rows.shape[1]):
            for i in range(k_rows.shape[2]):
                cache_k[g, p, i] = k_rows[t, g, i]
                cache_v[g, p, i] = v_rows[t, g, i]


@njit(cache=True, error_model="numpy")
def store_kv_f16(cache_k, cache_v, k_rows, v_rows, positions):
    """As store_kv_f32 for an fp16 cache (uint16 bit patterns, rounded to nearest even)."""
    kb = k_rows.view(np.uint32)
    vb = v_rows.view(np.uint32)
    for t in range(k_rows.shape[0]):
        p = positions[t]
        for g in range(k_rows.shape[1]):
            for i in range(k_rows.shape[2]):
                cache_k[g, p, i] = f32_bits_to_f16(np.int64(kb[t, g, i]))
                cache_v[g, p, i] = f32_bits_to_f16(np.int64(vb[t, g, i]))


# --- attention -------------------------------------------------------------------------------
# One (query row, head) against its n_visible cache rows, in this fixed sequence whatever the
# batch (head_dim a multiple of 16; the scalar _attend below otherwise):
#
#   score_j = scale * tree(P_0 .. P_15), P_m = q[m] k_j[m] + q[16 + m] k_j[16 + m] + ... (one
#             fma each, in order, from 0), tree = tree_sum_f32's halving order (m with m + 8,
#             then m + 4, m + 2, m + 1)
#   e_j = exp16(score_j - max score); total = tree of 16 lane sums (block after block)
#   out = (sum over even j of e_j v_j + sum over odd j) / total (each sum one fma per key, in
#         key order)
#
# The score has two codings with the same operations: from the cache rows (_qk_rows: lanes are
# the 16 partials of one key, the tree done by shuffles across keys) for a few query rows, and
# from key blocks transposed once per call (_qk_cols: lanes are 16 keys, the partials separate
# registers, no shuffles) for many. Lanes past n_visible in a block are computed from whatever
# is there and then dropped (max, exp and sum select them away), so they never reach the result.
# Written as LLVM vector IR (llvm.fma: one rounding on every target, no reassociation), which
# numba's cache does not track: after editing formats/_llvm_ir.py, delete this __pycache__.

_V16 = vec(F32, 16)
_TILE_ROWS = 32     # query rows per job: their keys and values are read once from L2 per job
_SUPER_KEYS = 128   # keys per pass over a job's rows (32 KiB of keys or values stay in L1)
_COLS_FROM = 16     # batches from this many rows transpose the keys (_qk_cols)
_JOB_BLOCKS = 32    # runs of jobs the threads share out, each with at least
_BLOCK_PAIRS = 4096  # query-key pairs (~10 us: less work runs on one thread)


def _vf(v):
    return ir.Constant(_V16, [ir.Constant(F32, float(np.float32(v)))] * 16)


def _ix(builder, *terms):
    """The i64 sum of terms: IR values, Python ints, or (value, int) products."""
    out = None
    for t in terms:
        if isinstance(t, tuple):
            t = builder.mul(t[0], const(t[1]) if isinstance(t[1], int) else t[1])
        elif isinstance(t, int):
            t = const(t)
        out = t if out is None else builder.add(out, t)
    return out


def _fma16(builder, a, b, c):
    return builder.call(intrinsic_fn(builder, "llvm.fma.v16f32", _V16, [_V16] * 3), [a, b, c])


def _max16(builder, a, b):
    # a if a > b else b: a NaN in a is skipped (its lane turns NaN again in the exp)
    return builder.select(builder.fcmp_ordered(">", a, b), a, b)


def _f32_arrays(*ts):
    return all(isinstance(t, types.Array) and t.layout == "C" and t.dtype == types.float32
               for t in ts)


def _exp16(builder, x):
    """exp_f32 on 16 lanes, each product-sum one fma (NaN stays NaN)."""
    x = builder.select(builder.fcmp_ordered("<", x, _vf(_EXP_MIN)), _vf(_EXP_MIN), x)
    x = builder.select(builder.fcmp_ordered(">", x, _vf(_EXP_MAX)), _vf(_EXP_MAX), x)
    floor = intrinsic_fn(builder, "llvm.floor.v16f32", _V16, [_V16])
    n = builder.call(floor, [_fma16(builder, x, _vf(_LOG2E), _vf(0.5))])
    r = _fma16(builder, n, _vf(-_LN2_HI), x)
    r = _fma16(builder, n, _vf(-_LN2_LO), r)
    p = _vf(1.0 / 720.0)
    for c in (1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0):
        p = _fma16(builder, p, r, _vf(c))
    # 2**n: n + 1.5 * 2**23 holds n in its low mantissa bits, and the high bits leave with the
    # shift (a NaN gives some float, never LLVM's poison of fptosi(NaN))
    vi = vec(I32, 16)
    bits = builder.bitcast(builder.fadd(n, _vf(12582912.0)), vi)
    bits = builder.shl(builder.add(bits, ir.Constant(vi, [ir.Constant(I32, 127)] * 16)),
                       ir.Constant(vi, [ir.Constant(I32, 23)] * 16))
    return builder.fmul(p, builder.bitcast(bits, _V16))


# _qk_rows' tree: two keys' vectors paired per level, every add lane-wise within one key.
_TREE_L1 = (list(range(0, 8)) + list(range(16, 24)), list(range(8, 16)) + list(range(24, 32)))
_TREE_L2 = ([0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27],
            [4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31])
_TREE_L3 = ([i for k in range(4) for i in (4 * k, 4 * k + 1, 16 + 4 * k, 17 + 4 * k)],
            [i for k in range(4) for i in (4 * k + 2, 4 * k + 3, 18 + 4 * k, 19 + 4 * k)])
_TREE_L4 = ([i for k in range(4) for i in (4 * k, 4 * k + 2, 16 + 4 * k, 18 + 4 * k)],
            [i for k in range(4) for i in (4 * k + 1, 4 * k + 3, 17 + 4 * k, 19 + 4 * k)])
_TREE_ORDER = [4 * (j % 4) + j // 4 for j in range(16)]  # lane 4a + b holds key a + 4b


def _tree_pair(builder, a, b, levels):
    return builder.fadd(builder.shuffle_vector(a, b, mask(levels[0])),
                        builder.shuffle_vector(a, b, mask(levels[1])))


# The few-row kernels' register shapes: nq queries x 8 keys of 16-lane accumulators in _qk_rows,
# nq queries x 2 key parities x 4 output vectors in _pv, fit AVX-512's 32 registers of 16 lanes
# but spill AVX2's 16 of 8. There the keys go 4 // nq per pass and the output vectors one per
# pass (AVX2 code, 16 heads over 8 kv heads, 24 layers x 513 keys in cache, time over the
# AVX-512 shapes' at k = 1 / 4 / 8: 0.85 / 0.75 / 0.75).
#: set to False to compile the AVX2 shapes on any host (tests compare the two: the same bits)
WIDE_SHAPES = True


def _wide_registers(context):
    """Whether the few-row attention kernels take AVX-512's shapes (see above)."""
    return WIDE_SHAPES and "avx512f" in host_features(context)


def _qk_run(context, nq):
    """Keys per pass over the head's chunks in _qk_rows (see above)."""
    return 8 if _wide_registers(context) else 4 // nq


def _make_qk_rows(nq):
    @intrinsic
    def qk_rows(typingctx, q, qo, keys, ko, nblk, hd, scale, s, so, sstride):
        """s[so + r sstride + 16 b + j] = score of query row r (q from qo, rows hd apart)
        against key 16 b + j (keys from ko, rows hd apart), b < nblk."""
        if not _f32_arrays(q, keys, s):
            return None
        sig = types.void(q, types.intp, keys, types.intp, types.intp, types.intp, types.float32,
                         s, types.intp, types.intp)

        def codegen(context, builder, signature, args):
            aq, qo_, ak, ko_, nb_, hd_, sc, as_, so_, ss = args
            pq = data_ptr(context, builder, signature.args[0], aq)
            pk = data_ptr(context, builder, signature.args[2], ak)
            ps = data_ptr(context, builder, signature.args[7], as_)
            nc = builder.udiv(hd_, const(16))
            scv = splat(builder, sc, 16)

            def half_block(hb, carried):
                # keys 8 hb .. 8 hb + 7 and the first three tree levels; an odd half-block
                # finishes the tree with the even one before it (carried)
                k0 = builder.add(ko_, builder.mul(hb, builder.mul(hd_, const(8))))

                def chunk(u0, n_keys):
                    def body(c, accs):
                        col = builder.mul(c, const(16))
                        qv = [load(builder, pq, _ix(builder, qo_, (hd_, r), col), _V16)
                              for r in range(nq)]
                        out = list(accs)
                        for u in range(n_keys):
                            kv = load(builder, pk, _ix(builder, k0, (hd_, u0 + u), col), _V16)
                            for r in range(nq):
                                out[n_keys * r + u] = _fma16(builder, qv[r], kv,
                                                             out[n_keys * r + u])
                        return out
                    return body
                # keys in runs whose accumulators fit the registers (every key's lanes sum
                # over the chunks in the same order whatever the run: the same bits)
                run = _qk_run(context, nq)
                accs = [None] * (8 * nq)
                for u0 in range(0, 8, run):
                    part = loop(builder, nc, [(_V16, _vf(0.0))] * (run * nq), chunk(u0, run),
                                "qkc")
                    for r in range(nq):
                        accs[8 * r + u0:8 * r + u0 + run] = part[run * r:run * r + run]
                red = []
                for r in range(nq):
                    a = accs[8 * r:8 * r + 8]
                    v = [_tree_pair(builder, a[2 * i], a[2 * i + 1], _TREE_L1) for i in range(4)]
                    w = [_tree_pair(builder, v[i], v[i + 1], _TREE_L2) for i in (0, 2)]
                    red.append(_tree_pair(builder, w[0], w[1], _TREE_L3))
                with builder.if_then(builder.trunc(hb, ir.IntType(1))):
                    for r in range(nq):
                        f = _tree_pair(builder, carried[r], red[r], _TREE_L4)
                        f = builder.shuffle_vector(f, f, mask(_TREE_ORDER))
                        off = builder.add(builder.add(so_, builder.mul(const(r), ss)),
                                          builder.mul(builder.sub(hb, const(1)), const(8)))
                        store(builder, builder.fmul(f, scv), ps, off)
                return red
            loop(builder, builder.mul(nb_, const(2)), [(_V16, _vf(0.0))] * nq, half_block, "qkh")
            return context.get_dummy_value()
        return sig, codegen
    return qk_rows


def _make_qk_cols(nq, nc):
    @intrinsic
    def qk_cols(typingctx, q, qo, kt, ko, nblk, scale, s, so, sstride):
        """_qk_rows' scores (head_dim 16 nc) from transposed key blocks: kt from ko holds per
        block of 16 keys a (head_dim, 16) array."""
        if not _f32_arrays(q, kt, s):
            return None
        sig = types.void(q, types.intp, kt, types.intp, types.intp, types.float32, s,
                         types.intp, types.intp)
        hd = 16 * nc

        def codegen(context, builder, signature, args):
            aq, qo_, ak, ko_, nb_, sc, as_, so_, ss = args
            pq = data_ptr(context, builder, signature.args[0], aq)
            pk = data_ptr(context, builder, signature.args[2], ak)
            ps = data_ptr(context, builder, signature.args[6], as_)
            scv = splat(builder, sc, 16)

            def blocks(b, nbk):
                # nbk blocks from b: each broadcast q element feeds nbk fmas
                k0 = builder.add(ko_, builder.mul(b, const(16 * hd)))

                def partial(m):  # P_m of every (row, block)
                    accs = [_vf(0.0)] * (nq * nbk)
                    for c in range(nc):
                        i = 16 * c + m
                        kv = [load(builder, pk, builder.add(k0, const(16 * (i + hd * x))), _V16)
                              for x in range(nbk)]
                        for r in range(nq):
                            qi = load(builder, pq, _ix(builder, qo_, r * hd + i), F32)
                            qi = splat(builder, qi, 16)
                            for x in range(nbk):
                                accs[nbk * r + x] = _fma16(builder, qi, kv[x], accs[nbk * r + x])
                    return accs

                def tree(m, stride):  # tree_sum_f32's order over the partials, depth first
                    if stride == 16:
                        return partial(m)
                    lo, hi = tree(m, 2 * stride), tree(m + stride, 2 * stride)
                    return [builder.fadd(x, y) for x, y in zip(lo, hi)]
                f = tree(0, 1)
                for r in range(nq):
                    for x in range(nbk):
                        off = builder.add(builder.add(so_, builder.mul(const(r), ss)),
                                          builder.mul(builder.add(b, const(x)), const(16)))
                        store(builder, builder.fmul(f[nbk * r + x], scv), ps, off)

            def two(i, st):
                blocks(builder.mul(i, const(2)), 2)
                return []
            loop(builder, builder.udiv(nb_, const(2)), [], two, "qkt")
            with builder.if_then(builder.trunc(nb_, ir.IntType(1))):
                blocks(builder.sub(nb_, const(1)), 1)
            return context.get_dummy_value()
        return sig, codegen
    return qk_cols


_qk_rows1, _qk_rows2 = _make_qk_rows(1), _make_qk_rows(2)
_qk_cols1_4, _qk_cols2_4 = _make_qk_cols(1, 4), _make_qk_cols(2, 4)
_qk_cols1_8, _qk_cols2_8 = _make_qk_cols(1, 8), _make_qk_cols(2, 8)


def _make_softmax(nq):
    @intrinsic
    def softmax(typingctx, s, so, sstride, nv, inv, io):
        """Per row r < nq (s from so + r sstride): s[j] = exp16(s[j] - max) for j < nv, 0 up to
        the next multiple of 16 (s must reach it), and inv[io + r] = 1 / their total."""
        if not _f32_arrays(s, inv):
            return None
        sig = types.void(s, types.intp, types.intp, types.intp, inv, types.intp)

        def codegen(context, builder, signature, args):
            as_, so_, ss, nv_, ai, io_ = args
            ps = data_ptr(context, builder, signature.args[0], as_)
            pi = data_ptr(context, builder, signature.args[4], ai)
            rows = [builder.add(so_, builder.mul(const(r), ss)) for r in range(nq)]
            nfull = builder.udiv(nv_, const(16))
            rest = builder.trunc(builder.urem(nv_, const(16)), I32)
            vi = vec(I32, 16)
            lane = ir.Constant(vi, [ir.Constant(I32, i) for i in range(16)])
            valid = builder.icmp_signed("<", lane, splat(builder, rest, 16))
            tail = builder.mul(nfull, const(16))
            has_tail = builder.icmp_signed("!=", rest, ir.Constant(I32, 0))

            def then_phis(cond, fn, values):  # fn(values) if cond else values
                pre = builder.block
                with builder.if_then(cond):
                    new = fn(values)
                    blk = builder.block
                out = []
                for a, b in zip(new, values):
                    ph = builder.phi(_V16)
                    ph.add_incoming(a, blk)
                    ph.add_incoming(b, pre)
                    out.append(ph)
                return out

            def at(r, off):
                return builder.add(rows[r], off)

            def mx(b, st):  # two running maxima per row (a max is exact in any order)
                off = builder.mul(b, const(32))
                return [_max16(builder, load(builder, ps, at(r, _ix(builder, off, 16 * x)), _V16),
                               st[2 * r + x]) for r in range(nq) for x in range(2)]
            m2 = loop(builder, builder.udiv(nfull, const(2)), [(_V16, _vf(NEG_INF))] * (2 * nq),
                      mx, "smax")
            m = [_max16(builder, m2[2 * r], m2[2 * r + 1]) for r in range(nq)]
            m = then_phis(builder.trunc(nfull, ir.IntType(1)), lambda m: [
                _max16(builder, load(builder, ps, at(r, builder.sub(tail, const(16))), _V16), m[r])
                for r in range(nq)], m)
            m = then_phis(has_tail, lambda m: [_max16(builder, builder.select(
                valid, load(builder, ps, at(r, tail), _V16), _vf(NEG_INF)), m[r])
                for r in range(nq)], m)
            mv = []
            for v in m:
                for h in (8, 4, 2, 1):
                    rot = mask([(i + h) % 16 for i in range(16)])
                    v = _max16(builder, builder.shuffle_vector(v, v, rot), v)
                mv.append(builder.shuffle_vector(v, v, mask([0] * 16)))

            def ex(b, st):
                out = []
                for r in range(nq):
                    off = at(r, builder.mul(b, const(16)))
                    e = _exp16(builder, builder.fsub(load(builder, ps, off, _V16), mv[r]))
                    store(builder, e, ps, off)
                    out.append(builder.fadd(st[r], e))
                return out
            tot = loop(builder, nfull, [(_V16, _vf(0.0))] * nq, ex, "sexp")

            def last(tot):
                out = []
                for r in range(nq):
                    e = _exp16(builder, builder.fsub(load(builder, ps, at(r, tail), _V16), mv[r]))
                    e = builder.select(valid, e, _vf(0.0))
                    store(builder, e, ps, at(r, tail))
                    out.append(builder.fadd(tot[r], e))
                return out
            tot = then_phis(has_tail, last, tot)
            for r in range(nq):
                total = tree_sum_f32(builder, tot[r])
                builder.store(builder.fdiv(ir.Constant(F32, 1.0), total),
                              builder.gep(pi, [builder.add(io_, const(r))]))
            return context.get_dummy_value()
        return sig, codegen
    return softmax


_softmax1, _softmax2 = _make_softmax(1), _make_softmax(2)


def _pv_width(context):
    """Output vectors of 16 lanes per pass over the keys: 4 with AVX-512's 32 registers; one
    where there are 16 of 8 lanes (AVX2), as 2 queries x 2 parities x 4 vectors of accumulators
    spill them. Each lane adds its keys in the same order whatever the width: the same bits."""
    return 4 if _wide_registers(context) else 1


def _make_pv(nq):
    @intrinsic
    def pv(typingctx, p, po, pstride, values, vo, j0, j1, hd, acc, ao, first):
        """acc[ao + (2 r + parity) hd + i] += p[po + r pstride + j] values[vo + j hd + i] for
        j0 <= j < j1 (j0 even), one fma per key in key order into the sum of its parity (sums
        from 0 when first)."""
        if not _f32_arrays(p, values, acc):
            return None
        sig = types.void(p, types.intp, types.intp, values, types.intp, types.intp, types.intp,
                         types.intp, acc, types.intp, types.boolean)

        def codegen(context, builder, signature, args):
            ap, po_, pst, av, vo_, j0_, j1_, hd_, aa, ao_, first = args
            first = builder.trunc(first, ir.IntType(1)) if first.type != ir.IntType(1) else first
            pp = data_ptr(context, builder, signature.args[0], ap)
            pv_ = data_ptr(context, builder, signature.args[3], av)
            pa = data_ptr(context, builder, signature.args[8], aa)
            nc = builder.udiv(hd_, const(16))

            def columns(width, c0):  # output vectors c0 / 16 .. + width
                def ix(r, e, w):
                    return (2 * r + e) * width + w
                offs = [_ix(builder, ao_, (hd_, 2 * r + e), c0, 16 * w)
                        for r in range(nq) for e in range(2) for w in range(width)]
                init = [builder.select(first, _vf(0.0), load(builder, pa, o, _V16)) for o in offs]

                def keys(j, accs, parities):
                    out = list(accs)
                    for e in parities:
                        jj = builder.add(j, const(e))
                        row = builder.add(vo_, builder.mul(jj, hd_))
                        pr = [load(builder, pp, _ix(builder, po_, (pst, r), jj), F32) for r in range(nq)]
                        pr = [splat(builder, x, 16) for x in pr]
                        for w in range(width):
                            vv = load(builder, pv_, _ix(builder, row, c0, 16 * w), _V16)
                            for r in range(nq):
                                out[ix(r, e, w)] = _fma16(builder, pr[r], vv, out[ix(r, e, w)])
                    return out
                n = builder.sub(j1_, j0_)
                accs = loop(builder, builder.udiv(n, const(2)), [(_V16, v) for v in init],
                            lambda i, accs: keys(_ix(builder, j0_, (i, 2)), accs, (0, 1)), "pvk")
                pre = builder.block
                with builder.if_then(builder.trunc(n, ir.IntType(1))):  # a last even key
                    last = keys(builder.sub(j1_, const(1)), accs, (0,))
                    blk = builder.block
                fin = list(accs)
                for k in range(len(offs)):
                    if last[k] is not accs[k]:
                        fin[k] = builder.phi(_V16)
                        fin[k].add_incoming(last[k], blk)
                        fin[k].add_incoming(accs[k], pre)
                for v, o in zip(fin, offs):
                    store(builder, v, pa, o)

            W = _pv_width(context)
            nfull = builder.udiv(nc, const(W))
            loop(builder, nfull, [], lambda ci, st: columns(W, _ix(builder, (ci, 16 * W))) or [],
                 "pvc")
            rest = builder.urem(nc, const(W))
            for width in range(1, W):
                with builder.if_then(builder.icmp_signed("==", rest, const(width))):
                    columns(width, builder.mul(nfull, const(16 * W)))
            return context.get_dummy_value()
        return sig, codegen
    return pv


_pv1, _pv2 = _make_pv(1), _make_pv(2)


# A 16 x 16 transpose in registers: 32-bit, then 64-bit interleaves, then 128-bit lane moves.
_UNPACK = ([0, 16, 1, 17, 4, 20, 5, 21, 8, 24, 9, 25, 12, 28, 13, 29],
           [2, 18, 3, 19, 6, 22, 7, 23, 10, 26, 11, 27, 14, 30, 15, 31],
           [0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29],
           [2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31])
_LANES = ([0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27],
          [4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31])


def _transpose16(builder, r):
    def sh(a, b, ix):
        return builder.shuffle_vector(a, b, mask(ix))
    t = []
    for k in range(8):
        t += [sh(r[2 * k], r[2 * k + 1], _UNPACK[0]), sh(r[2 * k], r[2 * k + 1], _UNPACK[1])]
    u = []
    for k in range(4):
        a, b, c, d = t[4 * k:4 * k + 4]
        u += [sh(x, y, _UNPACK[2 + i]) for x, y in ((a, c), (b, d)) for i in (0, 1)]
    v = [None] * 16
    for k in range(4):
        for o in (0, 8):
            v[o + k] = sh(u[o + k], u[o + k + 4], _LANES[0])
            v[o + k + 4] = sh(u[o + k], u[o + k + 4], _LANES[1])
    return [sh(v[k], v[k + 8], _LANES[i]) for i in (0, 1) for k in range(8)]


@intrinsic
def _transpose_blocks(typingctx, keys, ko, hd, nblk, kt):
    """kt[(b hd + i) 16 + l] = keys[ko + (16 b + l) hd + i] for b < nblk (head_dim hd)."""
    if not _f32_arrays(keys, kt):
        return None
    sig = types.void(keys, types.intp, types.intp, types.intp, kt)

    def codegen(context, builder, signature, args):
        ak, ko_, hd_, nb_, at = args
        pk = data_ptr(context, builder, signature.args[0], ak)
        pt = data_ptr(context, builder, signature.args[4], at)
        nc = builder.udiv(hd_, const(16))

        def block(b, st):
            base = builder.add(ko_, builder.mul(b, builder.mul(hd_, const(16))))

            def chunk(c, st):
                col = builder.add(base, builder.mul(c, const(16)))
                rows = [load(builder, pk, _ix(builder, col, (hd_, l)), _V16) for l in range(16)]
                out = builder.mul(_ix(builder, (b, hd_), (c, 16)), const(16))
                for m, v in enumerate(_transpose16(builder, rows)):
                    store(builder, v, pt, builder.add(out, const(16 * m)))
                return []
            loop(builder, nc, [], chunk, "trc")
            return []
        loop(builder, nb_, [], block, "trb")
        return context.get_dummy_value()
    return sig, codegen


@njit(cache=True, error_model="numpy")
def _transpose_keys(keys, g, n_src, kt, tail):
    """kt[b, i, l] = keys[g, 16 b + l, i] for rows below n_src, 0 above."""
    hd = keys.shape[2]
    full = n_src // 16
    _transpose_blocks(keys, g * keys.shape[1] * hd, hd, full, kt)
    if full < kt.shape[0]:
        tail[0] = 0.0
        tail[0, :n_src - 16 * full] = keys[g, 16 * full:n_src]
        _transpose_blocks(tail, 0, hd, 1, kt[full:full + 1])


@njit(cache=True, error_model="numpy")
def _qk(nq, hd, cols, q, qo, keys, ko, nblk, scale, s, so, sstride):
    if cols:
        if hd == 64:
            if nq == 2:
                _qk_cols2_4(q, qo, keys, ko, nblk, scale, s, so, sstride)
            else:
                _qk_cols1_4(q, qo, keys, ko, nblk, scale, s, so, sstride)
        else:
            if nq == 2:
                _qk_cols2_8(q, qo, keys, ko, nblk, scale, s, so, sstride)
            else:
                _qk_cols1_8(q, qo, keys, ko, nblk, scale, s, so, sstride)
    elif nq == 2:
        _qk_rows2(q, qo, keys, ko, nblk, hd, scale, s, so, sstride)
    else:
        _qk_rows1(q, qo, keys, ko, nblk, hd, scale, s, so, sstride)


@njit(cache=True, error_model="numpy")
def _attend_tile(q, h, nq, t0, t1, keys, values, g, kt, limits, scale, s, acc, tail, inv, out):
    """Query heads h .. h + nq - 1 (nq 1 or 2, one kv head g) of rows t0 .. t1 - 1. kt: g's
    transposed key blocks, or an empty array (scores from the rows)."""
    n_head, hd = q.shape[1], q.shape[2]
    n_rows = keys.shape[1]
    vo = g * n_rows * hd
    w = s.shape[1]
    cols = kt.shape[0] > 0
    sbk = _SUPER_KEYS // 16
    nbmax = 0
    for t in range(t0, t1):
        nbmax = max(nbmax, (limits[t] + 15) // 16)
    # from the rows, a block running past the cache is read from a zero padded copy
    safe = nbmax if cols else n_rows // 16
    if nbmax > safe:
        tail[0] = 0.0
        tail[0, :n_rows - 16 * safe] = keys[g, 16 * safe:]
    for sb in range(0, nbmax, sbk):
        for t in range(t0, t1):
            nb = (limits[t] + 15) // 16
            r = 2 * (t - t0)
            qo = (t * n_head + h) * hd
            b1 = min(sb + sbk, nb, safe)
            if b1 > sb and cols:
                _qk(nq, hd, True, q, qo, kt, sb * 16 * hd, b1 - sb, scale, s, r * w + 16 * sb, w)
            elif b1 > sb:
                _qk(nq, hd, False, q, qo, keys, vo + sb * 16 * hd, b1 - sb, scale, s,
                    r * w + 16 * sb, w)
            if sb <= safe < min(sb + sbk, nb):
                _qk(nq, hd, False, q, qo, tail, 0, 1, scale, s, r * w + 16 * safe, w)
    for t in range(t0, t1):
        r = 2 * (t - t0)
        if nq == 2:
            _softmax2(s, r * w, w, limits[t], inv, r)
        else:
            _softmax1(s, r * w, w, limits[t], inv, r)
    for sb in range(0, nbmax, sbk):
        for t in range(t0, t1):
            j1 = min(limits[t], 16 * (sb + sbk))
            if j1 > 16 * sb:
                r = 2 * (t - t0)
                if nq == 2:
                    _pv2(s, r * w, w, values, vo, 16 * sb, j1, hd, acc, r * 2 * hd, sb == 0)
                else:
                    _pv1(s, r * w, w, values, vo, 16 * sb, j1, hd, acc, r * 2 * hd, sb == 0)
    for t in range(t0, t1):
        r = 2 * (t - t0)
        for u in range(nq):
            iv = inv[r + u]
            o, even, odd = out[t, h + u], acc[r + u, :hd], acc[r + u, hd:]  # (vectorizes)
            if limits[t] == 0:  # no key: 0 / 0, as the scalar kernel gives
                even[:] = 0.0
                odd[:] = 0.0
            for i in range(hd):
                o[i] = (even[i] + odd[i]) * iv


@njit(cache=True, error_model="numpy")
def _attention_run(q, keys, values, limits, scale, out, kt, cols, blk, n_blocks):
    """Run ``blk`` of ``n_blocks`` of the jobs (kv head, _TILE_ROWS query rows, pair of query
    heads), kv head major, with its own scratch; the split never changes a job."""
    k, n_head, hd = q.shape
    n_kv = keys.shape[0]
    group = n_head // n_kv
    pairs = (group + 1) // 2
    rows = min(k, _TILE_ROWS)
    n_tiles = (k + rows - 1) // rows
    per_g = n_tiles * pairs
    n_jobs = n_kv * per_g
    nb = (limits.max() + 15) // 16
    no_kt = np.empty((0, hd, 16), np.float32)
    # the scratch in one allocation: score rows (padded by 16: a power-of-two stride maps them
    # to few L1 sets), accumulators, 1 / totals, a zero padded key block
    w = 16 * nb + 16
    n_s, n_acc = 2 * rows * w, 4 * rows * hd
    buf = np.empty(n_s + n_acc + 2 * rows + 16 * hd, np.float32)
    s = buf[:n_s].reshape(2 * rows, w)
    acc = buf[n_s:n_s + n_acc].reshape(2 * rows, 2 * hd)
    inv = buf[n_s + n_acc:n_s + n_acc + 2 * rows]
    tail = buf[n_s + n_acc + 2 * rows:].reshape(1, 16, hd)
    for job in range(blk * n_jobs // n_blocks, (blk + 1) * n_jobs // n_blocks):
        g = job // per_g
        rest = job - g * per_g
        tile = rest // pairs
        pr = rest - tile * pairs
        _attend_tile(q, g * group + 2 * pr, min(2, group - 2 * pr), tile * rows,
                     min(k, tile * rows + rows), keys, values, g, kt[g] if cols else no_kt,
                     limits, scale, s, acc, tail, inv, out)


@njit(parallel=True, cache=True, error_model="numpy")
def _attention_tiles(q, keys, values, limits, scale, out):
    # the jobs in up to _JOB_BLOCKS contiguous runs shared out to the threads
    k, n_head, hd = q.shape
    n_kv = keys.shape[0]
    group = n_head // n_kv
    n_jobs = n_kv * ((k + min(k, _TILE_ROWS) - 1) // min(k, _TILE_ROWS)) * ((group + 1) // 2)
    n_src = limits.max()
    nb = (n_src + 15) // 16
    cols = k >= _COLS_FROM and (hd == 64 or hd == 128)
    kt = np.empty((n_kv if cols else 0, nb, hd, 16), np.float32)
    if cols:
        for g in prange(n_kv):
            _transpose_keys(keys, g, n_src, kt[g], np.empty((1, 16, hd), np.float32))
    n_blocks = max(1, min(n_jobs, _JOB_BLOCKS, limits.sum() * n_head // _BLOCK_PAIRS))
    for blk in prange(n_blocks):
        _attention_run(q, keys, values, limits, scale, out, kt, cols, blk, n_blocks)


@njit(cache=True, error_model="numpy")
def _attention_serial(q, keys, values, limits, scale, out):
    """_attention_tiles' jobs on the calling thread, for batches below _COLS_FROM rows and
    _BLOCK_PAIRS query-key pairs (one run of jobs there): a decoding step's row over a short
    context, where entering a parallel region cost as much as the work (35 against 18 us for
    16 heads over 80 rows, Zen 3)."""
    kt = np.empty((0, 1, q.shape[2], 16), np.float32)
    _attention_run(q, keys, values, limits, scale, out, kt, False, 0, 1)


@njit(cache=True, fastmath=True, error_model="numpy")
def _attend(q, keys, values, n_visible, scale, scores, acc, out):
    """One query row of one head against the first n_visible cache rows (keys, values:
    (n_ctx, head_dim) float32): out = softmax(scale * keys @ q) @ values. For a head_dim
    that is no multiple of 16."""
    hd = q.shape[0]
    m = NEG_INF
    for j in range(n_visible):
        s = np.float32(0.0)
        for i in range(hd):
            s += q[i] * keys[j, i]
        s *= scale
        scores[j] = s
        m = max(m, s)
    total = np.float32(0.0)
    for j in range(n_visible):
        e = exp_f32(scores[j] - m)
        scores[j] = e
        total += e
    for i in range(hd):
        acc[i] = np.float32(0.0)
    for j in range(n_visible):
        w = scores[j]
        for i in range(hd):
            acc[i] += w * values[j, i]
    inv = np.float32(1.0) / total
    for i in range(hd):
        out[i] = acc[i] * inv


@njit(parallel=True, cache=True, error_model="numpy")
def _attention_scalar(q, keys, values, limits, scale, out):
    k, n_head, hd = q.shape
    group = n_head // keys.shape[0]
    for job in prange(k * n_head):
        t = job // n_head
        h = job - t * n_head
        g = h // group
        n_visible = limits[t]
        scores = np.empty(n_visible, np.float32)
        acc = np.empty(hd, np.float32)
        _attend(q[t, h], keys[g], values[g], n_visible, scale, scores, acc, out[t, h])


@njit(cache=True, error_model="numpy")
def attention_f32(q, cache_k, cache_v, limits, scale, out):
    """Causal (or any prefix-limited) attention over a float32 cache.

    q, out: (k, n_head, head_dim); cache_k, cache_v: (n_kv_head, n_ctx, head_dim); query row t
    sees cache rows [0, limits[t]). Head h reads kv head h // (n_head // n_kv_head) (GQA)."""
    if q.shape[2] % 16:
        _attention_scalar(q, cache_k, cache_v, limits, scale, out)
    elif q.shape[0] < _COLS_FROM and limits.sum() * q.shape[1] < _BLOCK_PAIRS:
        _attention_serial(np.ascontiguousarray(q), np.ascontiguousarray(cache_k),
                          np.ascontiguousarray(cache_v), limits, np.float32(scale), out)
    else:  # (the vector kernels address C-contiguous arrays: copies only if these are not)
        _attention_tiles(np.ascontiguousarray(q), np.ascontiguousarray(cache_k),
                         np.ascontiguousarray(cache_v), limits, np.float32(scale), out)


@njit(parallel=True, cache=True, error_model="numpy")
def _decode_f16_rows(cache, n_rows, lut, out):
    # (n_kv_head, n_ctx, hd) uint16 -> (n_kv_head, n_rows, hd) float32, for the visible rows.
    for g in prange(cache.shape[0]):
        for j in range(n_rows):
            for i in range(cache.shape[2]):
                out[g, j, i] = lut[cache[g, j, i]]


def attention_f16(q, cache_k, cache_v, limits, scale, out, lut):
    """attention_f32 over an fp16 cache (uint16 bit patterns): the visible rows are decoded
    once per call with the FP16_TO_FP32 table, then the same per-row code runs."""
    n_rows = int(limits.max())
    n_kv, _, hd = cache_k.shape
    keys = np.empty((n_kv, n_rows, hd), np.float32)
    values = np.empty((n_kv, n_rows, hd), np.float32)
    _decode_f16_rows(cache_k, n_rows, lut, keys)
    _decode_f16_rows(cache_v, n_rows, lut, values)
    attention_f32(q, keys, values, limits, scale, out)


# --- layer norm, row rotation and the DSA indexer's scores ---------------------------------------


@njit(cache=True, error_model="numpy")
def layer_norm(x, weight, bias, eps, out):
    """out = (x - mean) / sqrt(var + eps) * weight + bias per row, as ggml_norm then the scale and
    the bias: sums in float64, everything else float32."""
    n = x.shape[1]
    for t in range(x.shape[0]):
        total = 0.0
        for i in range(n):
            total += np.float64(x[t, i])
        mean = np.float32(total) / np.float32(n)
        sq = 0.0
        for i in range(n):
            y = x[t, i] - mean
            out[t, i] = y
            sq += np.float64(y * y)
        var = np.float32(sq / n)
        scale = np.float32(1.0) / np.float32(np.sqrt(var + np.float32(eps)))
        for i in range(n):
            out[t, i] = out[t, i] * scale * weight[i] + bias[i]


@njit(cache=True, fastmath=True, error_model="numpy")
def rotate_rows(x, h, tmp):
    """x (m, d) <- x @ h in place (h symmetric, d x d), one row at a time in a fixed order."""
    d = x.shape[1]
    for t in range(x.shape[0]):
        for i in range(d):
            s = np.float32(0.0)
            for j in range(d):
                s += h[i, j] * x[t, j]
            tmp[i] = s
        for i in range(d):
            x[t, i] = tmp[i]


@njit(cache=True, fastmath=True, error_model="numpy")
def _row_scores(q, keys, w, n_visible, scores):
    """scores[j] = sum_h relu(q[h] . keys[j]) * w[h] for j < n_visible (heads in order)."""
    n_head, d = q.shape
    for j in range(n_visible):
        s = np.float32(0.0)
        for h in range(n_head):
            dot = np.float32(0.0)
            for i in range(d):
                dot += q[h, i] * keys[j, i]
            if dot > 0:
                s += dot * w[h]
        scores[j] = s


#: positions per scoring task: a decode step's one row is scored by every thread
SCORE_BLOCK = 64


@njit(parallel=True, cache=True, error_model="numpy")
def dsa_scores(q, keys, w, limits, top_k, scores):
    """The DSA indexer's scores (dsa.py): scores[t, :limits[t]] for the rows that select
    (limits[t] > top_k), in tasks of (row, SCORE_BLOCK positions); a position's score is
    _row_scores' whatever the split."""
    per = (scores.shape[1] + SCORE_BLOCK - 1) // SCORE_BLOCK
    for task in prange(q.shape[0] * per):
        t = task // per
        j0 = (task - t * per) * SCORE_BLOCK
        n = limits[t]
        if n <= top_k or j0 >= n:
            continue
        j1 = min(n, j0 + SCORE_BLOCK)
        _row_scores(q[t], keys[j0:j1], w[t], j1 - j0, scores[t, j0:j1])
