"""The decoder's compiled building blocks (everything but the matmuls, which live in formats).

Every kernel works on whole batches of rows in one call (never a Python loop over rows), and
computes each row with the same code and the same reduction order whatever the number of rows:
a row's result is bit-identical whether it came alone or inside a batch. Two habits keep it so:

* inner loops run over one row (a fixed length), never over a flattened (rows * n) array, so
  the split between a vectorized body and its scalar remainder is the same for every row;
* arrays passed in are C-contiguous (one compiled specialization for every batch size).

The parallel kernels split work by rows (or by (row, head) pairs), which never changes what one
row computes. Shapes: x (k, n) activations, (k, heads, head_dim) for attention inputs.
"""
import math

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

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


@njit(cache=True, error_model="numpy")
def rmsnorm(x, weight, eps, out):
    """out[t] = x[t] / rms(x[t]) * weight; x, out (rows, n); weight (n,). out may be x.

    One thread: the work is tiny next to the matmuls, and a parallel region would cost more
    than it saves (per-head q/k norms pass rows * heads rows of head_dim)."""
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


@njit(cache=True, fastmath=True, error_model="numpy")
def swiglu(gate, up, out):
    """out = silu(gate) * up, silu(g) = g / (1 + exp(-g)) as ggml computes it."""
    for t in range(gate.shape[0]):
        for i in range(gate.shape[1]):
            g = gate[t, i]
            out[t, i] = g / (np.float32(1.0) + exp_f32(-g)) * up[t, i]


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


@njit(cache=True, fastmath=True, error_model="numpy")
def _attend(q, keys, values, n_visible, scale, scores, acc, out):
    """One query row of one head against the first n_visible cache rows (keys, values:
    (n_ctx, head_dim) float32): out = softmax(scale * keys @ q) @ values."""
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
def attention_f32(q, cache_k, cache_v, limits, scale, out):
    """Causal (or any prefix-limited) attention over a float32 cache.

    q, out: (k, n_head, head_dim); cache_k, cache_v: (n_kv_head, n_ctx, head_dim); query row t
    sees cache rows [0, limits[t]). Head h reads kv head h // (n_head // n_kv_head) (GQA)."""
    k, n_head, hd = q.shape
    group = n_head // cache_k.shape[0]
    for job in prange(k * n_head):
        t = job // n_head
        h = job - t * n_head
        g = h // group
        n_visible = limits[t]
        scores = np.empty(n_visible, np.float32)
        acc = np.empty(hd, np.float32)
        _attend(q[t, h], cache_k[g], cache_v[g], n_visible, scale, scores, acc, out[t, h])


@njit(parallel=True, cache=True, error_model="numpy")
def _decode_f16_rows(cache, n_rows, lut, out):
    # (n_kv_head, n_ctx, hd) uint16 -> (n_kv_head, n_rows, hd) float32, for the visible rows.
    for g in prange(cache.shape[0]):
        for j in range(n_rows):
            for i in range(cache.shape[2]):
                out[g, j, i] = lut[cache[g, j, i]]


@njit(parallel=True, cache=True, error_model="numpy")
def _attention_decoded(q, keys, values, limits, scale, out):
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


def attention_f16(q, cache_k, cache_v, limits, scale, out, lut):
    """attention_f32 over an fp16 cache (uint16 bit patterns): the visible rows are decoded
    once per call with the FP16_TO_FP32 table, then the same per-row code runs."""
    n_rows = int(limits.max())
    n_kv, _, hd = cache_k.shape
    keys = np.empty((n_kv, n_rows, hd), np.float32)
    values = np.empty((n_kv, n_rows, hd), np.float32)
    _decode_f16_rows(cache_k, n_rows, lut, keys)
    _decode_f16_rows(cache_v, n_rows, lut, values)
    _attention_decoded(q, keys, values, limits, scale, out)
