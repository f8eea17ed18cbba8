"""ggml's scale searches (make_qx_quants and friends), one block's arrays at a time.

Every K-quant and the imatrix paths of the 32-element formats pick a block's scale (and min)
with one of these searches. They are plain ``@njit`` functions on small arrays, so the CPU
kernels (``prange`` over rows) and the CUDA kernels (one thread per block, ``cuda.local.array``
buffers) run the same code. Each reproduces ggml's float32 arithmetic operation for operation:
the same sums in the same order, ``nearest_int`` as ggml's ``+ 12582912.f`` bit trick, ints
converted to float32 exactly where C converts them.

ggml tries a handful of candidate scales one after the other. Here the candidates advance side
by side, one array slot each: every slot still sums its terms in ggml's order, so each result is
the same float, but the inner loop over candidates vectorizes. The winner is then chosen by
walking the candidates in ggml's order with ggml's comparisons, and its quants are recomputed.

Conventions: ``x`` and weights ``w`` are float32 arrays of (at least) ``n`` values, quants go to
an int32 array ``L``, ``scratch`` is a float32 array of ``SCRATCH`` values. Functions return the
scale (and, for the affine searches, ``the_min`` as ggml's out-parameter: minus the offset).
"""
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

#: ggml's threshold under which a group counts as all zero
GROUP_MAX_EPS = np.float32(1e-15)
#: candidate slots: make_qkx3_quants with nstep=36 tries 37 scales
MAX_CANDIDATES = 40
#: float32 scratch values a search needs
SCRATCH = 8 * MAX_CANDIDATES


@intrinsic
def float32_bits(typingctx, value):
    """The bit pattern of a float32 as an int32 (C's memcpy from float to int)."""
    if value != types.float32:
        return None  # a float64 here would be a precision bug: refuse to compile
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.int32(types.float32), codegen


@njit(cache=True)
def nearest_int(v):
    """ggml's nearest_int on a float32, bit for bit: half to even, and for |v| >= 2**22 (which
    ggml's assert excludes but release builds compute) the same wrapped value."""
    bits = float32_bits(v + np.float32(12582912.0))
    return (np.int64(bits) & 0x7FFFFF) - 0x400000


@njit(cache=True)
def as_int8(v):
    """C's conversion of an int to int8_t (wraps)."""
    return ((v + 128) & 0xFF) - 128


# --- symmetric scales: q in [-nmax, nmax-1] -------------------------------------------------


@njit(cache=True, error_model="numpy")
def make_qx_quants(n, nmax, x, L, w, scratch):
    """ggml's make_qx_quants with rmse_type 1 and weights ``w`` (pass x*x where ggml has none).

    L[i] = q + nmax in [0, 2 nmax - 1]. Returns the scale."""
    amax = np.float32(0.0)
    vmax = np.float32(0.0)
    for i in range(n):
        ax = abs(x[i])
        if ax > amax:
            amax = ax
            vmax = x[i]
    if amax < GROUP_MAX_EPS:
        for i in range(n):
            L[i] = 0
        return np.float32(0.0)
    fnmax = np.float32(nmax)
    iscale = -fnmax / vmax
    sumlx = np.float32(0.0)
    suml2 = np.float32(0.0)
    for i in range(n):
        l = max(-nmax, min(nmax - 1, nearest_int(iscale * x[i])))
        L[i] = l + nmax
        fl = np.float32(l)
        sumlx += w[i] * x[i] * fl
        suml2 += w[i] * fl * fl
    scale = sumlx / suml2 if suml2 != 0 else np.float32(0.0)
    best = scale * sumlx
    # candidates is = -9..-1, 1..9
    nc = 18
    isc = scratch[0:nc]
    slx = scratch[MAX_CANDIDATES:MAX_CANDIDATES + nc]
    sl2 = scratch[2 * MAX_CANDIDATES:2 * MAX_CANDIDATES + nc]
    for c in range(nc):
        step = c - 9 if c < 9 else c - 8
        isc[c] = -(fnmax + np.float32(0.1) * np.float32(step)) / vmax
        slx[c] = 0
        sl2[c] = 0
    for i in range(n):
        xi = x[i]
        wx = w[i] * xi
        wi = w[i]
        for c in range(nc):
            fl = np.float32(max(-nmax, min(nmax - 1, nearest_int(isc[c] * xi))))
            slx[c] += wx * fl
            sl2[c] += wi * fl * fl
    win = -1
    for c in range(nc):
        if sl2[c] > 0 and slx[c] * slx[c] > best * sl2[c]:
            scale = slx[c] / sl2[c]
            best = scale * slx[c]
            win = c
    if win >= 0:
        s = isc[win]
        for i in range(n):
            L[i] = nmax + max(-nmax, min(nmax - 1, nearest_int(s * x[i])))
    return scale


@njit(cache=True, error_model="numpy")
def make_q3_quants(n, nmax, x, L):
    """ggml's make_q3_quants with do_rmse: weights x*x, then up to 5 rounds of coordinate
    descent on single quants. L[i] = q + nmax. Returns the scale."""
    amax = np.float32(0.0)
    vmax = np.float32(0.0)
    for i in range(n):
        ax = abs(x[i])
        if ax > amax:
            amax = ax
            vmax = x[i]
    if amax < GROUP_MAX_EPS:
        for i in range(n):
            L[i] = 0
        return np.float32(0.0)
    iscale = -np.float32(nmax) / vmax
    sumlx = np.float32(0.0)
    suml2 = np.float32(0.0)
    for i in range(n):
        l = max(-nmax, min(nmax - 1, nearest_int(iscale * x[i])))
        L[i] = l
        w = x[i] * x[i]
        fl = np.float32(l)
        sumlx += w * x[i] * fl
        suml2 += w * fl * fl
    for _ in range(5):
        changed = 0
        for i in range(n):
            w = x[i] * x[i]
            fl = np.float32(L[i])
            slx = sumlx - w * x[i] * fl
            if slx > 0:
                sl2 = suml2 - w * fl * fl
                new_l = max(-nmax, min(nmax - 1, nearest_int(x[i] * sl2 / slx)))
                if new_l != L[i]:
                    fn = np.float32(new_l)
                    slx += w * x[i] * fn
                    sl2 += w * fn * fn
                    if sl2 > 0 and slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[i] = new_l
                        sumlx = slx
                        suml2 = sl2
                        changed += 1
        if changed == 0:
            break
    for i in range(n):
        L[i] += nmax
    return sumlx / suml2 if suml2 > 0 else np.float32(0.0)


# --- affine scales: x ~ scale * q + min, q in [0, nmax] -------------------------------------


@njit(cache=True, error_model="numpy")
def _affine_search(n, nmax, x, w, L, vmin, vmax, sum_w, sum_x, rmin, rdelta, nstep, use_mad,
                   scratch):
    # The common part of make_qkx2_quants and make_qkx3_quants, after their min/max scan.
    rmin = np.float32(rmin)
    rdelta = np.float32(rdelta)
    fnmax = np.float32(nmax)
    iscale = fnmax / (vmax - vmin)
    scale = np.float32(1.0) / iscale
    best = np.float32(0.0)
    for i in range(n):
        l = max(0, min(nmax, nearest_int(iscale * (x[i] - vmin))))
        L[i] = l
        diff = scale * np.float32(l) + vmin - x[i]
        diff = abs(diff) if use_mad else diff * diff
        best += w[i] * diff
    if nstep < 1:
        return scale, -vmin
    # ggml moves `min` to each accepted candidate's min, and later candidates start from it:
    # score all remaining candidates side by side from the current min, accept the first one
    # that beats the best (ggml's order), and rescore the candidates after it from its min.
    nc = nstep + 1
    C = MAX_CANDIDATES
    isc = scratch[0:nc]
    s_l = scratch[C:C + nc]
    s_l2 = scratch[2 * C:2 * C + nc]
    s_xl = scratch[3 * C:3 * C + nc]
    t_scale = scratch[4 * C:4 * C + nc]
    t_min = scratch[5 * C:5 * C + nc]
    err = scratch[6 * C:6 * C + nc]
    det = scratch[7 * C:7 * C + nc]
    first = 0
    while first < nc:
        span = vmax - vmin
        for c in range(first, nc):
            isc[c] = (rmin + rdelta * np.float32(c) + fnmax) / span
            s_l[c] = 0
            s_l2[c] = 0
            s_xl[c] = 0
        for i in range(n):
            xm = x[i] - vmin
            xi = x[i]
            wi = w[i]
            for c in range(first, nc):
                fl = np.float32(max(0, min(nmax, nearest_int(isc[c] * xm))))
                wl = wi * fl
                s_l[c] += wl
                s_l2[c] += wl * fl
                s_xl[c] += wl * xi
        for c in range(first, nc):
            d = sum_w * s_l2[c] - s_l[c] * s_l[c]
            det[c] = d
            ts = (sum_w * s_xl[c] - sum_x * s_l[c]) / d
            tm = (s_l2[c] * sum_x - s_l[c] * s_xl[c]) / d
            if tm > 0:
                tm = np.float32(0.0)
                ts = s_xl[c] / s_l2[c]
            t_scale[c] = ts
            t_min[c] = tm
            err[c] = 0
        for i in range(n):
            xm = x[i] - vmin
            xi = x[i]
            wi = w[i]
            for c in range(first, nc):
                fl = np.float32(max(0, min(nmax, nearest_int(isc[c] * xm))))
                diff = t_scale[c] * fl + t_min[c] - xi
                diff = abs(diff) if use_mad else diff * diff
                err[c] += wi * diff
        win = -1
        for c in range(first, nc):
            if det[c] > 0 and err[c] < best:
                win = c
                break
        if win < 0:
            break
        s = isc[win]
        for i in range(n):
            L[i] = max(0, min(nmax, nearest_int(s * (x[i] - vmin))))
        best = err[win]
        scale = t_scale[win]
        vmin = t_min[win]
        first = win + 1
    return scale, -vmin


@njit(cache=True, error_model="numpy")
def make_qkx2_quants(n, nmax, x, w, L, rmin, rdelta, nstep, use_mad, scratch):
    """ggml's make_qkx2_quants: returns (scale, the_min); x ~ scale * L - the_min."""
    vmin = x[0]
    vmax = x[0]
    sum_w = w[0]
    sum_x = sum_w * x[0]
    for i in range(1, n):
        if x[i] < vmin:
            vmin = x[i]
        if x[i] > vmax:
            vmax = x[i]
        sum_w += w[i]
        sum_x += w[i] * x[i]
    if vmin > 0:
        vmin = np.float32(0.0)
    if vmax == vmin:
        for i in range(n):
            L[i] = 0
        return np.float32(0.0), -vmin
    return _affine_search(n, nmax, x, w, L, vmin, vmax, sum_w, sum_x, rmin, rdelta, nstep,
                          use_mad, scratch)


@njit(cache=True, error_model="numpy")
def make_qkx3_quants(n, nmax, x, w, L, rmin, rdelta, nstep, use_mad, scratch):
    """ggml's make_qkx3_quants with weights: like make_qkx2_quants, but a group whose max is
    not above its (clamped) min is all zero."""
    vmin = x[0]
    vmax = x[0]
    sum_w = w[0]
    sum_x = sum_w * x[0]
    for i in range(1, n):
        if x[i] < vmin:
            vmin = x[i]
        if x[i] > vmax:
            vmax = x[i]
        sum_w += w[i]
        sum_x += w[i] * x[i]
    if vmin > 0:
        vmin = np.float32(0.0)
    if vmax <= vmin:
        for i in range(n):
            L[i] = 0
        return np.float32(0.0), -vmin
    return _affine_search(n, nmax, x, w, L, vmin, vmax, sum_w, sum_x, rmin, rdelta, nstep,
                          use_mad, scratch)


# --- positive scales of scales: q in [0, nmax] ----------------------------------------------


@njit(cache=True, error_model="numpy")
def make_qp_quants(n, nmax, x, L, w, scratch):
    """ggml's make_qp_quants (quantizes a block's sub-scales). L holds what C's uint8_t L[]
    holds, wrap-around included. Returns the scale."""
    vmax = np.float32(0.0)
    for i in range(n):
        vmax = vmax if vmax > x[i] else x[i]
    if vmax < GROUP_MAX_EPS:
        for i in range(n):
            L[i] = 0
        return np.float32(0.0)
    fnmax = np.float32(nmax)
    iscale = fnmax / vmax
    for i in range(n):
        L[i] = nearest_int(iscale * x[i]) & 0xFF
    scale = np.float32(1.0) / iscale
    best = np.float32(0.0)
    for i in range(n):
        diff = x[i] - scale * np.float32(L[i])
        best += w[i] * diff * diff
    # candidates is = -4..-1, 1..4
    nc = 8
    C = MAX_CANDIDATES
    isc = scratch[0:nc]
    scs = scratch[C:C + nc]
    mse = scratch[2 * C:2 * C + nc]
    for c in range(nc):
        step = c - 4 if c < 4 else c - 3
        isc[c] = (np.float32(0.1) * np.float32(step) + fnmax) / vmax
        scs[c] = np.float32(1.0) / isc[c]
        mse[c] = 0
    for i in range(n):
        xi = x[i]
        wi = w[i]
        for c in range(nc):
            diff = xi - scs[c] * np.float32(min(nmax, nearest_int(isc[c] * xi)))
            mse[c] += wi * diff * diff
    for c in range(nc):
        if mse[c] < best:
            best = mse[c]
            iscale = isc[c]
    sumlx = np.float32(0.0)
    suml2 = np.float32(0.0)
    for i in range(n):
        l = min(nmax, nearest_int(iscale * x[i]))
        L[i] = l & 0xFF
        fl = np.float32(l)
        sumlx += w[i] * x[i] * fl
        suml2 += w[i] * fl * fl
    for _ in range(5):
        changed = 0
        for i in range(n):
            wi = w[i]
            fl = np.float32(L[i])
            slx = sumlx - wi * x[i] * fl
            sl2 = suml2 - wi * fl * fl
            if slx > 0 and sl2 > 0:
                new_l = min(nmax, nearest_int(x[i] * sl2 / slx))
                if new_l != L[i]:
                    fn = np.float32(new_l)
                    slx += wi * x[i] * fn
                    sl2 += wi * fn * fn
                    if slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[i] = new_l & 0xFF
                        sumlx = slx
                        suml2 = sl2
                        changed += 1
        if changed == 0:
            break
    return sumlx / suml2 if suml2 > 0 else np.float32(0.0)
