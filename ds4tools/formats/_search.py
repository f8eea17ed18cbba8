"""ggml's scale searches (make_qx_quants and friends), bit for bit and vectorizable.

Every K-quant and the imatrix paths of the 32-element formats pick each group's scale (and
min) with one of these searches. They are plain ``@njit`` functions on small arrays, so the CPU
kernels (``prange`` over rows) and the CUDA kernels (one thread per block, ``cuda.local.array``
buffers) run the same code. Each reproduces ggml's float32 arithmetic operation for operation:
the same sums in the same order, ``nearest_int`` as ggml's ``+ 12582912.f`` bit trick, ints
converted to float32 exactly where C converts them.

Two shapes of the same arithmetic, both vectorizable:

* many groups at once (``*_lanes``, ``*_groups``): the bulk work, every sub-block of a row (or
  of a CUDA thread's super-block) searched together, one SIMD lane per group, each lane
  running ggml's exact sequence of candidates. Data sit "transposed": value i of group g at
  [i * ng + g].
* one group, candidates side by side (``make_qx_quants``, ``make_qp_quants``, used on a
  super-block's 16 or 8 sub-scales): ggml tries candidate scales one after the other; here each
  candidate has an array slot and still sums its terms in ggml's order, and the winner is then
  chosen by walking the candidates in ggml's order with ggml's comparisons.

Conventions: ``x`` and weights ``w`` are float32 arrays of (at least) ``n`` values, quants go to
int32 arrays, ``scratch`` / ``work`` are float32 arrays (SCRATCH values, LANE_WORK per group).
Affine searches also return ``the_min`` as ggml's out-parameter (minus the offset).
"""
import numpy as np
from numba import njit

from ._llvm_ir import float32_bits
from .floats import f32_bits_to_f16

#: ggml's threshold under which a group counts as all zero
GROUP_MAX_EPS = np.float32(1e-15)
#: candidate slots of the one-group searches: make_qx_quants tries 18 scales after its first
MAX_CANDIDATES = 18
#: float32 scratch values make_qx_quants and make_qp_quants need
SCRATCH = 3 * MAX_CANDIDATES


@njit(cache=True)
def nearest_int(v):
    """ggml's nearest_int on a float32, bit for bit: half to even, and for |v| >= 2**22 (which
    ggml's assert excludes but release builds compute) the same wrapped value."""
    bits = float32_bits(v + np.float32(12582912.0))
    return (np.int64(bits) & 0x7FFFFF) - 0x400000


@njit(cache=True)
def to_fp16(v):
    """float32 -> fp16 bit pattern, round to nearest even (GGML_FP32_TO_FP16), in integer ops."""
    return f32_bits_to_f16(np.int64(float32_bits(v)) & 0xFFFFFFFF)


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


# --- many groups at once: one lane per group --------------------------------------------------
# (make_qkx2/3_quants also move their min whenever a candidate wins, so their candidates could
# not advance side by side anyway.)

#: float32 work values per group for affine_search_lanes
LANE_WORK = 18
#: groups that run make_q3_quants' rounds of descent together
Q3_CHUNK = 256


@njit(cache=True, error_model="numpy")
def affine_search_lanes(ng, n, nmax, tx, tw, tL, rmin, rdelta, nstep, use_mad, strict,
                        scale_out, min_out, work):
    """make_qkx2_quants (strict=False) or make_qkx3_quants (strict=True: a group with
    max <= min is empty) on ng groups of n values at once, in the transposed layout.
    Writes the quants to tL, the scales to scale_out and ggml's the_min to min_out."""
    rmin = np.float32(rmin)
    rdelta = np.float32(rdelta)
    fnmax = np.float32(nmax)
    vmin = work[0:ng]
    vmax = work[ng:2 * ng]
    sum_w = work[2 * ng:3 * ng]
    sum_x = work[3 * ng:4 * ng]
    best = work[4 * ng:5 * ng]
    scale = work[5 * ng:6 * ng]
    isc = work[6 * ng:7 * ng]
    s_l = work[7 * ng:8 * ng]
    s_l2 = work[8 * ng:9 * ng]
    s_xl = work[9 * ng:10 * ng]
    t_scale = work[10 * ng:11 * ng]
    t_min = work[11 * ng:12 * ng]
    err = work[12 * ng:13 * ng]
    det = work[13 * ng:14 * ng]
    win_isc = work[14 * ng:15 * ng]
    win_min = work[15 * ng:16 * ng]
    won = work[16 * ng:17 * ng]
    empty = work[17 * ng:18 * ng]
    for g in range(ng):
        v = tx[g]
        vmin[g] = v
        vmax[g] = v
        sum_w[g] = tw[g]
        sum_x[g] = tw[g] * v
    for i in range(1, n):
        o = i * ng
        for g in range(ng):
            v = tx[o + g]
            w = tw[o + g]
            vmin[g] = v if v < vmin[g] else vmin[g]
            vmax[g] = v if v > vmax[g] else vmax[g]
            sum_w[g] += w
            sum_x[g] += w * v
    for g in range(ng):
        if vmin[g] > 0:
            vmin[g] = np.float32(0.0)
        if strict:
            empty[g] = np.float32(1.0) if vmax[g] <= vmin[g] else np.float32(0.0)
        else:
            empty[g] = np.float32(1.0) if vmax[g] == vmin[g] else np.float32(0.0)
        isc[g] = fnmax / (vmax[g] - vmin[g])
        scale[g] = np.float32(1.0) / isc[g]
        best[g] = np.float32(0.0)
        won[g] = np.float32(0.0)
    for i in range(n):
        o = i * ng
        for g in range(ng):
            v = tx[o + g]
            l = max(0, min(nmax, nearest_int(isc[g] * (v - vmin[g]))))
            tL[o + g] = l
            diff = scale[g] * np.float32(l) + vmin[g] - v
            diff = abs(diff) if use_mad else diff * diff
            best[g] += tw[o + g] * diff
    for step in range(nstep + 1 if nstep >= 1 else 0):
        num = rmin + rdelta * np.float32(step) + fnmax
        for g in range(ng):
            isc[g] = num / (vmax[g] - vmin[g])
            s_l[g] = 0
            s_l2[g] = 0
            s_xl[g] = 0
        for i in range(n):
            o = i * ng
            for g in range(ng):
                v = tx[o + g]
                fl = np.float32(max(0, min(nmax, nearest_int(isc[g] * (v - vmin[g])))))
                wl = tw[o + g] * fl
                s_l[g] += wl
                s_l2[g] += wl * fl
                s_xl[g] += wl * v
        for g in range(ng):
            d = sum_w[g] * s_l2[g] - s_l[g] * s_l[g]
            det[g] = d
            ts = (sum_w[g] * s_xl[g] - sum_x[g] * s_l[g]) / d
            tm = (s_l2[g] * sum_x[g] - s_l[g] * s_xl[g]) / d
            if tm > 0:
                tm = np.float32(0.0)
                ts = s_xl[g] / s_l2[g]
            t_scale[g] = ts
            t_min[g] = tm
            err[g] = 0
        for i in range(n):
            o = i * ng
            for g in range(ng):
                v = tx[o + g]
                fl = np.float32(max(0, min(nmax, nearest_int(isc[g] * (v - vmin[g])))))
                diff = t_scale[g] * fl + t_min[g] - v
                diff = abs(diff) if use_mad else diff * diff
                err[g] += tw[o + g] * diff
        for g in range(ng):
            if det[g] > 0 and err[g] < best[g] and empty[g] == 0:
                best[g] = err[g]
                scale[g] = t_scale[g]
                win_isc[g] = isc[g]
                win_min[g] = vmin[g]
                vmin[g] = t_min[g]
                won[g] = np.float32(1.0)
    for i in range(n):
        o = i * ng
        for g in range(ng):
            if empty[g] != 0:
                tL[o + g] = 0
            elif won[g] != 0:
                tL[o + g] = max(0, min(nmax, nearest_int(win_isc[g] * (tx[o + g] - win_min[g]))))
    for g in range(ng):
        scale_out[g] = np.float32(0.0) if empty[g] != 0 else scale[g]
        min_out[g] = -vmin[g]


@njit(cache=True)
def to_lanes(ng, size, x, tx):
    """Plain layout (group g at [g * size:(g + 1) * size]) to the transposed one."""
    for g in range(ng):
        for i in range(size):
            tx[i * ng + g] = x[g * size + i]


@njit(cache=True)
def from_lanes(ng, size, tx, x):
    for g in range(ng):
        for i in range(size):
            x[g * size + i] = tx[i * ng + g]


@njit(cache=True, error_model="numpy")
def affine_search_groups(ng, size, nmax, x, w, L, rmin, rdelta, nstep, use_mad, strict,
                         scale_out, min_out, tx, tw, tL, work):
    """affine_search_lanes on ng consecutive groups of ``size`` values in plain layout
    (x, w, L); tx, tw, tL: scratch like x, w, L; work: LANE_WORK * ng floats."""
    to_lanes(ng, size, x, tx)
    to_lanes(ng, size, w, tw)
    affine_search_lanes(ng, size, nmax, tx, tw, tL, rmin, rdelta, nstep, use_mad, strict,
                        scale_out, min_out, work)
    from_lanes(ng, size, tL, L)


@njit(cache=True, error_model="numpy")
def _largest_magnitude(ng, n, tx, vmax, amax):
    # per group, the first value of largest magnitude (ggml's `if (ax > amax)` scan)
    for g in range(ng):
        vmax[g] = np.float32(0.0)
        amax[g] = np.float32(0.0)
    for i in range(n):
        o = i * ng
        for g in range(ng):
            v = tx[o + g]
            ax = abs(v)
            bigger = ax > amax[g]
            vmax[g] = v if bigger else vmax[g]
            amax[g] = ax if bigger else amax[g]


@njit(cache=True, error_model="numpy")
def symmetric_search_lanes(ng, n, nmax, tx, tw, tL, scale_out, work):
    """make_qx_quants (rmse_type 1, weights tw) on ng groups of n values in the transposed
    layout: tL = q + nmax, scale_out = the scales."""
    fnmax = np.float32(nmax)
    vmax = work[0:ng]
    amax = work[ng:2 * ng]
    isc = work[2 * ng:3 * ng]
    slx = work[3 * ng:4 * ng]
    sl2 = work[4 * ng:5 * ng]
    scale = work[5 * ng:6 * ng]
    best = work[6 * ng:7 * ng]
    win_isc = work[7 * ng:8 * ng]
    won = work[8 * ng:9 * ng]
    _largest_magnitude(ng, n, tx, vmax, amax)
    for step in range(19):  # ggml's first try (step 0), then is = -9..-1, 1..9
        if step == 0:
            for g in range(ng):
                isc[g] = -fnmax / vmax[g]
        else:
            k = step - 10 if step < 10 else step - 9
            for g in range(ng):
                isc[g] = -(fnmax + np.float32(0.1) * np.float32(k)) / vmax[g]
        for g in range(ng):
            slx[g] = 0
            sl2[g] = 0
        for i in range(n):
            o = i * ng
            for g in range(ng):
                v = tx[o + g]
                fl = np.float32(max(-nmax, min(nmax - 1, nearest_int(isc[g] * v))))
                slx[g] += tw[o + g] * v * fl
                sl2[g] += tw[o + g] * fl * fl
        if step == 0:
            for g in range(ng):
                scale[g] = slx[g] / sl2[g] if sl2[g] != 0 else np.float32(0.0)
                best[g] = scale[g] * slx[g]
                win_isc[g] = isc[g]
        else:
            for g in range(ng):
                if sl2[g] > 0 and slx[g] * slx[g] > best[g] * sl2[g]:
                    scale[g] = slx[g] / sl2[g]
                    best[g] = scale[g] * slx[g]
                    win_isc[g] = isc[g]
    for i in range(n):
        o = i * ng
        for g in range(ng):
            if amax[g] < GROUP_MAX_EPS:
                tL[o + g] = 0
            else:
                tL[o + g] = nmax + max(-nmax, min(nmax - 1, nearest_int(win_isc[g] * tx[o + g])))
    for g in range(ng):
        scale_out[g] = np.float32(0.0) if amax[g] < GROUP_MAX_EPS else scale[g]


@njit(cache=True, error_model="numpy")
def symmetric_search_groups(ng, size, nmax, x, w, L, scale_out, tx, tw, tL, work):
    """symmetric_search_lanes on ng consecutive groups in plain layout (see
    affine_search_groups)."""
    to_lanes(ng, size, x, tx)
    to_lanes(ng, size, w, tw)
    symmetric_search_lanes(ng, size, nmax, tx, tw, tL, scale_out, work)
    from_lanes(ng, size, tL, L)


@njit(cache=True, error_model="numpy")
def q3_search_lanes(ng, n, nmax, tx, tL, scale_out, work):
    """make_q3_quants with do_rmse on ng groups in the transposed layout: weights x*x, then up
    to 5 rounds of coordinate descent, each group stopping after a round that changed nothing."""
    vmax = work[0:ng]
    amax = work[ng:2 * ng]
    iscale = work[2 * ng:3 * ng]
    sumlx = work[3 * ng:4 * ng]
    suml2 = work[4 * ng:5 * ng]
    _largest_magnitude(ng, n, tx, vmax, amax)
    for g in range(ng):
        iscale[g] = -np.float32(nmax) / vmax[g]
        sumlx[g] = 0
        suml2[g] = 0
    for i in range(n):
        o = i * ng
        for g in range(ng):
            v = tx[o + g]
            l = max(-nmax, min(nmax - 1, nearest_int(iscale[g] * v)))
            tL[o + g] = l
            w = v * v
            fl = np.float32(l)
            sumlx[g] += w * v * fl
            suml2[g] += w * fl * fl
    # Most groups settle in the first round (and then stop, as ggml's `break` does): run that
    # round for all groups side by side, then the further rounds only for the groups that
    # changed, one by one.
    changed = work[5 * ng:6 * ng]
    for g in range(ng):
        changed[g] = 0
    for i in range(n):
        o = i * ng
        for g in range(ng):
            v = tx[o + g]
            w = v * v
            fl = np.float32(tL[o + g])
            slx0 = sumlx[g] - w * v * fl
            sl20 = suml2[g] - w * fl * fl
            new_l = max(-nmax, min(nmax - 1, nearest_int(v * sl20 / slx0)))
            fn = np.float32(new_l)
            slx = slx0 + w * v * fn
            sl2 = sl20 + w * fn * fn
            take = ((slx0 > 0) & (new_l != tL[o + g]) & (sl2 > 0)
                    & (slx * slx * suml2[g] > sumlx[g] * sumlx[g] * sl2))
            # selects rather than a branch, so that the loop over groups vectorizes
            tL[o + g] = new_l if take else tL[o + g]
            sumlx[g] = slx if take else sumlx[g]
            suml2[g] = sl2 if take else suml2[g]
            changed[g] += np.float32(take)
    for g in range(ng):
        if changed[g] == 0:
            continue
        slx_g = sumlx[g]
        sl2_g = suml2[g]
        for _ in range(4):
            n_changed = 0
            for i in range(n):
                o = i * ng + g
                v = tx[o]
                w = v * v
                fl = np.float32(tL[o])
                slx = slx_g - w * v * fl
                if slx > 0:
                    sl2 = sl2_g - w * fl * fl
                    new_l = max(-nmax, min(nmax - 1, nearest_int(v * sl2 / slx)))
                    if new_l != tL[o]:
                        fn = np.float32(new_l)
                        slx += w * v * fn
                        sl2 += w * fn * fn
                        if sl2 > 0 and slx * slx * sl2_g > slx_g * slx_g * sl2:
                            tL[o] = new_l
                            slx_g = slx
                            sl2_g = sl2
                            n_changed += 1
            if n_changed == 0:
                break
        sumlx[g] = slx_g
        suml2[g] = sl2_g
    for i in range(n):
        o = i * ng
        for g in range(ng):
            tL[o + g] = 0 if amax[g] < GROUP_MAX_EPS else tL[o + g] + nmax
    for g in range(ng):
        if amax[g] < GROUP_MAX_EPS or not suml2[g] > 0:
            scale_out[g] = np.float32(0.0)
        else:
            scale_out[g] = sumlx[g] / suml2[g]
