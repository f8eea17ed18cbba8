"""Hyper-connections (DeepSeek V4): the residual stream is ``hc`` parallel streams per token; each
block reads a weighted mix of them and writes its output back through a learned mixing matrix.

Per token, with X the (hc, n_embd) streams and fn / scale / base the block's tensors
(``hc_attn_*`` or ``hc_ffn_*``):

    m     = fn @ rmsnorm(flatten(X))                  (2 + hc) * hc mixes (no norm weight)
    pre   = sigmoid(m[:hc] * scale[0] + base[:hc]) + eps
    post  = 2 * sigmoid(m[hc:2hc] * scale[1] + base[hc:2hc])
    comb  = sinkhorn(m[2hc:] * scale[2] + base[2hc:])   (hc, hc): comb[dst, src]
    input = sum_s pre[s] * X[s]                          what the block sees
    X'[d] = post[d] * block(input) + sum_s comb[d, s] * X[s]

sinkhorn: softmax over dst for every src, + eps, then the columns (sum over src, + eps) are
normalised, then ``iterations - 1`` more rounds of rows (sum over dst) then columns. The head
collapses the streams once more with ``output_hc_*`` (pre weights only) before the final norm.

Every function works row by row, so a token's result does not depend on its batch. With a
float32 fn (F16 / BF16 files are widened at load) a block's hc_pre is one compiled call.
"""
from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, error_model="numpy")
def flat_rmsnorm(x, eps, out):
    """out[t] = x[t] / sqrt(mean(x[t]^2) + eps) over the flattened streams (no weight)."""
    k, n = x.shape
    for t in range(k):
        s = 0.0
        for i in range(n):
            v = np.float64(x[t, i])
            s += v * v
        scale = np.float32(1.0 / np.sqrt(np.float32(s / n) + eps))
        for i in range(n):
            out[t, i] = x[t, i] * scale


@njit(cache=True, error_model="numpy")
def _sigmoid(v):
    return np.float32(1.0) / (np.float32(1.0) + np.exp(-v))


@njit(cache=True, error_model="numpy")
def mix_weights(mixes, scale, base, hc, eps, iters, pre, post, comb):
    """From the mixes (k, (2 + hc) * hc): pre (k, hc), post (k, hc), comb (k, hc, hc) [dst, src]."""
    k = mixes.shape[0]
    f1 = np.float32(1.0)
    e = np.float32(eps)
    for t in range(k):
        m = mixes[t]
        for j in range(hc):
            pre[t, j] = _sigmoid(m[j] * scale[0] + base[j]) + e
            post[t, j] = np.float32(2.0) * _sigmoid(m[hc + j] * scale[1] + base[hc + j])
        c = comb[t]
        for s in range(hc):  # the mixes hold comb with dst fastest
            for d in range(hc):
                c[d, s] = m[2 * hc + s * hc + d] * scale[2] + base[2 * hc + s * hc + d]
        for s in range(hc):  # softmax over dst
            mx = c[0, s]
            for d in range(1, hc):
                mx = max(mx, c[d, s])
            tot = 0.0
            for d in range(hc):
                v = np.exp(c[d, s] - mx)
                c[d, s] = v
                tot += v
            inv = f1 / np.float32(tot)
            for d in range(hc):
                c[d, s] = c[d, s] * inv + e
        for it in range(iters):
            if it > 0:  # rows: for every src, the sum over dst
                for s in range(hc):
                    tot = np.float32(0.0)
                    for d in range(hc):
                        tot += c[d, s]
                    tot += e
                    for d in range(hc):
                        c[d, s] = c[d, s] / tot
            for d in range(hc):  # columns: for every dst, the sum over src
                tot = np.float32(0.0)
                for s in range(hc):
                    tot += c[d, s]
                tot += e
                for s in range(hc):
                    c[d, s] = c[d, s] / tot


@njit(cache=True, error_model="numpy")
def collapse(x, pre, hc, n, out):
    """out[t] = sum_s pre[t, s] * x[t, s*n:(s+1)*n], streams added in order."""
    k = x.shape[0]
    for t in range(k):
        p0 = pre[t, 0]
        for i in range(n):
            out[t, i] = x[t, i] * p0
        for s in range(1, hc):
            p = pre[t, s]
            for i in range(n):
                out[t, i] = out[t, i] + x[t, s * n + i] * p


@njit(cache=True, error_model="numpy")
def expand(y, x, post, comb, hc, n, out):
    """out[t, d] = post[t, d] * y[t] + sum_s comb[t, d, s] * x[t, s] (streams flattened)."""
    k = x.shape[0]
    for t in range(k):
        for d in range(hc):
            pd = post[t, d]
            for i in range(n):
                v = y[t, i] * pd
                for s in range(hc):
                    v = v + x[t, s * n + i] * comb[t, d, s]
                out[t, d * n + i] = v


@njit(cache=True, error_model="numpy")
def mix_and_collapse(mixes, scale, base, hc, eps, iters, x, n, pre, post, comb, out):
    """mix_weights then collapse, in one call."""
    mix_weights(mixes, scale, base, hc, eps, iters, pre, post, comb)
    collapse(x, pre, hc, n, out)


class HyperConnection:
    """One block's (or the head's) mixing tensors: fn a Linear ((2 + hc) * hc or hc rows,
    hc * n_embd columns), scale (3,) or (1,), base. An F16 / BF16 fn is widened to float32
    once at load: the same values and the same float32 products (the half-float kernels decode
    each row to float32 first), without decoding 2 + hc rows of hc * n_embd per token (a few
    MB per model: 24 x 16384 per block in DSV4 Flash)."""

    __slots__ = ("fn", "scale", "base")

    def __init__(self, fn, scale: np.ndarray, base: np.ndarray):
        if fn.fmt.name in ("F16", "BF16"):
            from .weights import Linear
            w = np.ascontiguousarray(fn.dequantize(), np.float32)
            fn = Linear(fn.name, w.reshape(-1).view(np.uint8), "F32", (fn.n_out, fn.n_in))
        self.fn, self.scale, self.base = fn, scale, base


@njit(cache=True, error_model="numpy", fastmath=True)
def _matvec_rows(w, x, out):
    """out[t, r] = w[r] . x[t] in float32 (one thread: (2 + hc) * hc rows are a small job)."""
    n_out, n_in = w.shape
    for r in range(n_out):
        for t in range(x.shape[0]):
            acc = np.float32(0.0)
            for i in range(n_in):
                acc += w[r, i] * x[t, i]
            out[t, r] = acc


@njit(cache=True, error_model="numpy")
def hc_pre_fused(x, fn, scale, base, hc, n, rms_eps, eps, iters, pre, post, comb, out):
    """hc_pre in one call for a float32 fn: the flat norm, the mixes, their weights, the
    collapse."""
    k = x.shape[0]
    normed = np.empty_like(x)
    flat_rmsnorm(x, rms_eps, normed)
    mixes = np.empty((k, fn.shape[0]), np.float32)
    _matvec_rows(fn, normed, mixes)
    mix_weights(mixes, scale, base, hc, eps, iters, pre, post, comb)
    collapse(x, pre, hc, n, out)


def hc_pre(x: np.ndarray, w: HyperConnection, hc: int, n: int, rms_eps: float, eps: float,
           iters: int):
    """The block input (k, n) and the (post, comb) its output is written back with."""
    k = x.shape[0]
    f = np.float32
    if w.fn.fmt.name == "F32":
        pre = np.empty((k, hc), f)
        post = np.empty((k, hc), f)
        comb = np.empty((k, hc, hc), f)
        out = np.empty((k, n), f)
        hc_pre_fused(x, w.fn.raw.view(f), w.scale, w.base, hc, n, f(rms_eps), f(eps), iters,
                     pre, post, comb, out)
        return out, post, comb
    normed = np.empty_like(x)
    flat_rmsnorm(x, f(rms_eps), normed)
    mixes = np.empty((k, (2 + hc) * hc), f)
    w.fn.matmul(normed, mixes)
    pre = np.empty((k, hc), f)
    post = np.empty((k, hc), f)
    comb = np.empty((k, hc, hc), f)
    out = np.empty((k, n), f)
    mix_and_collapse(mixes, w.scale, w.base, hc, f(eps), iters, x, n, pre, post, comb, out)
    return out, post, comb


def hc_post(y: np.ndarray, x: np.ndarray, post, comb, hc: int, n: int) -> np.ndarray:
    out = np.empty_like(x)
    expand(y, x, post, comb, hc, n, out)
    return out


@njit(cache=True, error_model="numpy")
def head_weights(mixes, scale, base, eps, pre):
    k, hc = mixes.shape
    for t in range(k):
        for j in range(hc):
            pre[t, j] = _sigmoid(mixes[t, j] * scale[0] + base[j]) + np.float32(eps)


def hc_head(x: np.ndarray, w: HyperConnection, hc: int, n: int, rms_eps: float,
            eps: float) -> np.ndarray:
    """The head's collapse of the streams (k, hc * n) into one row (k, n)."""
    k = x.shape[0]
    f = np.float32
    normed = np.empty_like(x)
    flat_rmsnorm(x, f(rms_eps), normed)
    mixes = np.empty((k, hc), f)
    if w.fn.fmt.name == "F32":
        _matvec_rows(w.fn.raw.view(f), normed, mixes)
    else:
        w.fn.matmul(normed, mixes)
    pre = np.empty((k, hc), f)
    head_weights(mixes, w.scale, w.base, f(eps), pre)
    out = np.empty((k, n), f)
    collapse(x, pre, hc, n, out)
    return out
