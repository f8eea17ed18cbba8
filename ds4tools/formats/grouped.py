"""Grouped matmul for mixture-of-experts: a 3-D expert tensor applied to the rows routed to it.

GGUF stores a MoE layer's experts as one 3-D tensor (``ffn_gate_exps``, ``ffn_up_exps``,
``ffn_down_exps``): raw bytes ``(n_expert, n_out, row_bytes)``. A forward pass routes each of its
``k`` rows (tokens) to ``n_used`` experts; ``grouped_matmul`` computes, for every row ``t`` and
slot ``j``, ``x[t] @ W[expert_ids[t, j]].T`` in one call:

* the activations are quantized once (int8 path) for all experts, or can be passed in already
  quantized (``act``), so gate and up share them;
* each expert that some row uses is read once: all its routed rows go through the format's
  multi-row kernel together (``_cpu_matmul_q8`` / ``_cpu_matmul``); experts no row uses are
  never touched (a memory-mapped tensor's pages for them are not even faulted in);
* a row's result is bit-identical to a plain ``formats.matmul`` of that row with that expert's
  matrix in the same mode: the kernels give the same bits for a row whatever rows share the
  call, and activation rows are quantized independently. So a token's output does not depend on
  which other tokens share its batch or its experts.

The K-quants (Q2_K..Q6_K, the formats of the Q*_K mixes) on the int8 path run every used
expert in one parallel call (``grouped_kq``, below): the (row, slot) pairs sorted by expert,
each (expert, 16 weight rows) one task, so both threads stream every call and no Python runs
per expert; the MoE block also runs gate and up of all experts in one such call. So do Q8_0
and Q4_0..Q5_1 on the float32 path (``_grouped_legacy_f32``): latent attention's per-head
matrices (``attn_k_b``, rows of 64: Q5_0 or Q8_0 in llama.cpp's mixes, too short for the int8
path) are such a tensor with every head used by every token. The other formats (and the
other paths) loop over the used experts in Python, one compiled multi-row call each: measured
(2 cores, busy machine, tiny 32x256 experts so the kernels cost nothing) about 5 us of Python
routing per used expert at k=1 (10 us at k=16) plus 3-5 us per kernel dispatch.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from . import kquants as _kq
from . import legacy as _legacy
from ._int8dot import (DOT_K_4x1_AFF, DOT_K_4x1_PAIR, DOT_K_4x1_SYM, DOT_K_4x2_AFF, DOT_K_4x2_PAIR,
                       DOT_K_4x2_SYM, K_AFFINE, K_PAIRED, K_TILE_ROWS, KPAIR_BYTES, KSUM,
                       KSUM_STORE_4x4)
from ._numeric import FP16_TO_FP32
from .activations import QuantizedActivations, quantize_activations, quantize_q8_k_rows
from .base import QuantFormat


def _get_format(fmt) -> QuantFormat:
    from . import get_format  # the package's lookup; imported here to avoid an import cycle
    return get_format(fmt)


_ZERO = np.zeros(1, np.int64)


def route(expert_ids: np.ndarray, n_expert: int):
    """Group (row, slot) pairs by expert: yields (expert, rows, slots, unique_rows, inverse)
    for every used expert in increasing order, where rows[i], slots[i] is a pair routed to
    the expert, unique_rows the distinct rows (sorted) and unique_rows[inverse] == rows."""
    k, n_used = expert_ids.shape
    flat = expert_ids.ravel()
    order = np.argsort(flat, kind="stable")
    es = flat[order]
    starts = np.flatnonzero(np.r_[True, es[1:] != es[:-1]]) if es.size else np.zeros(0, np.int64)
    ends = np.r_[starts[1:], es.size]
    for s, e in zip(starts.tolist(), ends.tolist()):
        sel = order[s:e]  # increasing: the rows come sorted
        rows = sel // n_used
        slots = sel - rows * n_used
        if e - s == 1:
            yield int(es[s]), rows, slots, rows, _ZERO
            continue
        new_row = np.empty(e - s, np.bool_)
        new_row[0] = True
        np.not_equal(rows[1:], rows[:-1], out=new_row[1:])
        inv = np.cumsum(new_row) - 1
        yield int(es[s]), rows, slots, rows[new_row], inv


def _subset(act: QuantizedActivations, rows: np.ndarray, k: int) -> QuantizedActivations:
    if rows.size == k:  # every row (rows are distinct and sorted): no copy
        return act
    return QuantizedActivations(act.kind, act.q[rows], act.d[rows], act.sums[rows])


def grouped_matmul(raw3d, fmt, n_out: int, n_in: int, x, expert_ids, out=None, int8: bool = True,
                   act: QuantizedActivations | None = None) -> np.ndarray:
    """out[t, j] = x[t] @ W[expert_ids[t, j]].T for the experts of a 3-D tensor.

    ``raw3d``: uint8 ``(n_expert, n_out, row_bytes)`` raw GGUF blocks of ``fmt`` (any array
    that reshapes to that without a copy, e.g. a memmap); ``x``: float32 ``(k, n_in)``;
    ``expert_ids``: integers ``(k, n_used)`` in ``[0, n_expert)`` (a row may name an expert in
    more than one slot); ``out``: float32 ``(k, n_used, n_out)`` C-contiguous, or None.
    ``int8``: ggml's int8-activation path where the format has one, else the float32 path
    (as ``formats.matmul``). ``act``: x already quantized to the format's ``act_type`` (int8
    path only), to share one quantization between matrices that read the same input.
    """
    f = _get_format(fmt)
    n_out, n_in = int(n_out), int(n_in)
    if n_in <= 0 or n_out <= 0 or n_in % f.block_size:
        raise ValueError(f"bad matrix shape ({n_out}, {n_in}) for {f.name} (block {f.block_size})")
    row_bytes = f.row_bytes(n_in)
    r = np.asarray(raw3d)
    if r.dtype != np.uint8:
        raise ValueError(f"raw3d must be uint8 bytes, got dtype {r.dtype}")
    per_expert = n_out * row_bytes
    if r.size % per_expert or r.size == 0:
        raise ValueError(f"raw3d has {r.size} bytes, not a whole number of {f.name} "
                         f"({n_out}, {n_in}) matrices ({per_expert} bytes each)")
    if not r.flags.c_contiguous:
        raise ValueError("raw3d must be C-contiguous (copying it would read every expert)")
    n_expert = r.size // per_expert
    r = r.reshape(n_expert, n_out, row_bytes)

    xa = np.asarray(x)
    if xa.dtype.kind != "f" or xa.ndim != 2 or xa.shape[1] != n_in:
        raise ValueError(f"x must be floating point of shape (k, {n_in}), got {xa.dtype} {xa.shape}")
    xa = np.ascontiguousarray(xa, dtype=np.float32)
    k = xa.shape[0]
    ids = np.asarray(expert_ids)
    if ids.dtype.kind not in "iu" or ids.ndim != 2 or ids.shape[0] != k:
        raise ValueError(f"expert_ids must be integers of shape ({k}, n_used), got {ids.dtype} {ids.shape}")
    ids = ids.astype(np.int64, copy=False)
    if ids.size and (ids.min() < 0 or ids.max() >= n_expert):
        raise ValueError(f"expert_ids must lie in [0, {n_expert}), got {ids.min()}..{ids.max()}")
    n_used = ids.shape[1]
    if out is None:
        out = np.empty((k, n_used, n_out), np.float32)
    elif (not isinstance(out, np.ndarray) or out.shape != (k, n_used, n_out)
          or out.dtype != np.float32 or not out.flags.c_contiguous):
        raise ValueError(f"out must be C-contiguous float32 of shape {(k, n_used, n_out)}")

    use_int8 = int8 and f.has_int8_matmul
    if use_int8:
        if act is None:
            act = quantize_activations(xa, f.act_type)
        elif act.kind != f.act_type or act.q.shape != (k, n_in):
            raise ValueError(f"act must be {f.act_type} activations of shape ({k}, {n_in})")
    kind = kq_kind(f) if use_int8 else None
    if kind is not None:  # the K-quants: one parallel call for every used expert
        grouped_kq_act(kind, r, act.q, act.d, act.sums, ids, out.reshape(k * n_used, n_out))
        return out
    kind = None if use_int8 else LEGACY_F32_KIND.get(f.name)
    if kind is not None:  # the 32-block formats' float32 path: one parallel call as well
        grouped_legacy_f32(kind, r, FP16_TO_FP32, xa, ids, out.reshape(k * n_used, n_out))
        return out
    for e, rows, slots, uniq, inv in route(ids, n_expert):
        tmp = np.empty((uniq.size, n_out), np.float32)
        if use_int8:
            f._cpu_matmul_q8(r[e], _subset(act, uniq, k), tmp)
        else:
            f._cpu_matmul(r[e], xa if uniq.size == k else xa[uniq], tmp)
        if rows.size == 1:
            out[rows[0], slots[0]] = tmp[0]
        else:
            out[rows, slots] = tmp[inv]
    return out


# --- one compiled call for every used expert: the 32-block formats' float32 path ----------------
# The kernels of formats.matmul's float32 path (legacy._q8_0_matmul, legacy._matmul) decode two
# weight rows to floats and dot both with each activation row (legacy.dot_two_rows). This runs
# the same decode and the same dot, over the tokens routed to the rows' expert: a (row, token)
# result has the bits of a plain matmul of that token with that expert's matrix.

#: format name -> kind here: legacy.KIND (Q4_0..Q5_1, legacy._matmul) and 4 for Q8_0
LEGACY_F32_KIND = dict(_legacy.KIND, Q8_0=4)


@njit(parallel=True, fastmath=True, cache=True)
def _grouped_legacy_f32(kind, raw3d, lut, x, order, starts, experts, n_used, out):
    # out[p] (p = row * n_used + slot, the pairs of sort_pairs) = x[row] @ expert's rows; tasks
    # are (used expert, a chunk of pairs of weight rows) as legacy._matmul's, expert-major
    n_out = raw3d.shape[1]
    n_in = x.shape[1]
    n_pairs = (n_out + 1) // 2
    # pairs per task: legacy._matmul's 4, more for short rows (attn_k_b's 64: a task's two
    # scratch rows cost more than decoding and dotting 4 pairs of them)
    chunk = max(4, 2048 // n_in)
    per_expert = (n_pairs + chunk - 1) // chunk
    for task in prange(experts.shape[0] * per_expert):
        i = task // per_expert
        c = task - i * per_expert
        e = experts[i]
        w0 = np.empty(n_in, np.float32)
        w1 = np.empty(n_in, np.float32)
        for pair in range(c * chunk, min(n_pairs, c * chunk + chunk)):
            r0 = 2 * pair
            r1 = min(r0 + 1, n_out - 1)
            _legacy._decode_row_f32(kind, raw3d[e, r0], lut, w0)
            _legacy._decode_row_f32(kind, raw3d[e, r1], lut, w1)
            for pos in range(starts[i], starts[i + 1]):
                p = order[pos]
                out[p, r0], out[p, r1] = _legacy.dot_two_rows(w0, w1, x, p // n_used)


# --- one compiled call for every used expert (the K-quants' int8 path) -------------------------
# The loop above dispatches one multi-row call per used expert. For the K-quants (the formats of
# the Q*_K mixes) the experts are run instead by one parallel call per projection, or for gate
# and up together: the (row, slot) pairs are sorted by expert (``sort_pairs``), the activation
# rows gathered into that order once (``prepare_rows``), and every (expert, chunk of 16 weight
# rows, matrix) is one task of a single prange, tasks ordered chunk-major so that a static split
# of the range gives each thread part of every expert (expert-major, in chunks of 128 rows,
# where every expert has as many rows, as in a decode step: then each thread streams whole
# matrices front to back, 1B glm-dsa's routed experts 5-8% faster from memory). A task runs
# exactly what ``kquants._matmul_q8_kg`` runs for those rows (the fused register kernels for up
# to 4 tokens of the expert, else the tiles), and those give a (row, token) the same bits
# whatever path, split or token count computed it: so the results are bit-identical to
# ``grouped_matmul`` and to a plain matmul of the row.


_QK_K = 256


@njit(cache=True)
def sort_pairs(expert_ids, n_expert, order, starts, experts):
    """Counting sort of the (row, slot) pairs of ``expert_ids`` (k, n_used) by expert:
    ``order[p]`` is the flat pair index (row * n_used + slot) at position p, the pairs of the
    i-th used expert ``experts[i]`` (increasing) lie at positions starts[i]..starts[i+1]-1 in
    increasing row order. Returns the number of used experts."""
    k, n_used = expert_ids.shape
    counts = np.zeros(n_expert + 1, np.int64)
    for t in range(k):
        for j in range(n_used):
            counts[expert_ids[t, j] + 1] += 1
    n = 0
    for e in range(n_expert):
        if counts[e + 1]:
            experts[n] = e
            starts[n] = counts[e]
            n += 1
        counts[e + 1] += counts[e]
    starts[n] = k * n_used
    for t in range(k):
        for j in range(n_used):
            e = expert_ids[t, j]
            order[counts[e]] = t * n_used + j
            counts[e] += 1
    return n


@njit(cache=True, error_model="numpy")
def _prep_rows(kind, q, d, sums, rows, xq_f, xq_t, dx, dxs, tiles):
    # activation row rows[p] of (q, d, sums) into row p of the K layouts (kquants._prep_act_k*):
    # xq_f the group layout (the fused kernels), xq_t the pair layout (Q4_K / Q5_K tiles, when
    # ``tiles``), dx / dxs as the kernels take them
    for p in range(rows.shape[0]):
        t = rows[p]
        if K_PAIRED[kind]:
            _kq._prep_act_k_pair(q[t:t + 1], d[t:t + 1], sums[t:t + 1], xq_f[p:p + 1],
                                 dx[p:p + 1], dxs[p:p + 1], True)
            if tiles:
                _kq._prep_act_k_pair(q[t:t + 1], d[t:t + 1], sums[t:t + 1], xq_t[p:p + 1],
                                     dx[p:p + 1], dxs[p:p + 1], False)
        else:
            _kq._prep_act_k(q[t:t + 1], d[t:t + 1], sums[t:t + 1], 0 if K_AFFINE[kind] else 128,
                            xq_f[p:p + 1], dx[p:p + 1], dxs[p:p + 1])


def prepare_rows(kind: int, act: QuantizedActivations, rows: np.ndarray, max_count: int):
    """The Q8_K activation rows ``rows`` (in that order) laid out for ``grouped_kq``;
    ``max_count``: the most pairs any one expert has (from 5 the Q4_K / Q5_K tiles need their
    own layout)."""
    return prepared_rows(kind, act.q, act.d, act.sums, rows, max_count)


@njit(cache=True)
def prepared_rows(kind, q, d, sums, rows, max_count):
    """(xq_f, xq_t, dx, dxs): the Q8_K activations (q, d, sums)'s rows ``rows`` in the K
    layouts (see prepare_rows)."""
    tiles = K_PAIRED[kind] and max_count > _kq._QK_FUSED_TOKENS
    m = rows.shape[0]
    n = q.shape[1]
    nsb = n // _QK_K
    xq_f = np.empty((m, n), np.uint8)
    if K_PAIRED[kind]:
        n_pairs = (nsb + 1) // 2
        xq_t = np.empty((m, KPAIR_BYTES * n_pairs) if tiles else (1, 1), np.uint8)
        dx = np.empty((m, 16 * n_pairs), np.float32)
        dxs = np.empty((m, 16 * n_pairs), np.float32)
    else:
        xq_t = np.empty((1, 1), np.uint8)
        dx = np.empty((m, nsb), np.float32)
        dxs = np.empty((m, n // 16 if K_AFFINE[kind] else 1), np.float32)
    _prep_rows(kind, q, d, sums, rows, xq_f, xq_t, dx, dxs, tiles)
    return xq_f, xq_t, dx, dxs


@njit(cache=True)
def _check_ids(expert_ids, n_expert):
    for t in range(expert_ids.shape[0]):
        for j in range(expert_ids.shape[1]):
            if expert_ids[t, j] < 0 or expert_ids[t, j] >= n_expert:
                raise ValueError("expert_ids out of range")


@njit(cache=True)
def grouped_kq_act(kind, raw3d, q, d, sums, expert_ids, out):
    """The K-quant grouped matmul from Q8_K activations (q, d, sums) of k rows, in one compiled
    call: out (k * n_used, n_out), row t * n_used + j = activation row t times expert
    expert_ids[t, j]. Returns the number of distinct experts read."""
    k, n_used = expert_ids.shape
    n_expert = raw3d.shape[0]
    _check_ids(expert_ids, n_expert)
    P = k * n_used
    if P == 0:
        return 0
    order = np.empty(P, np.int64)
    starts = np.empty(n_expert + 1, np.int64)
    experts = np.empty(n_expert, np.int64)
    n = sort_pairs(expert_ids, n_expert, order, starts, experts)
    rows = np.empty(P, np.int64)
    max_count = 1
    for p in range(P):
        rows[p] = order[p] // n_used
    for i in range(n):
        max_count = max(max_count, starts[i + 1] - starts[i])
    xq_f, xq_t, dx, dxs = prepared_rows(kind, q, d, sums, rows, max_count)
    res = np.empty((P, raw3d.shape[1]), np.float32)
    grouped_kq_shared(kind, raw3d, raw3d, 1, xq_f, xq_t, dx, dxs, starts, experts, n, res, res,
                      kind, _NO_ROWS, _NO_ROWS, xq_f, xq_t, dx, dxs, 0, res, res)
    for p in range(P):
        out[order[p]] = res[p]
    return n


@njit(cache=True)
def grouped_kq_f32(kind, raw3d, x, expert_ids, out):
    """grouped_kq_act of float32 rows x (k, n_in), quantized to Q8_K here."""
    q, d, sums = quantize_q8_k_rows(x)
    return grouped_kq_act(kind, raw3d, q, d, sums, expert_ids, out)


@njit(cache=True)
def grouped_legacy_f32(kind, raw3d, lut, x, expert_ids, out):
    """_grouped_legacy_f32 with the pairs sorted here: out (k * n_used, n_out) as
    grouped_kq_act's. Returns the number of distinct experts read."""
    k, n_used = expert_ids.shape
    n_expert = raw3d.shape[0]
    _check_ids(expert_ids, n_expert)
    order = np.empty(k * n_used, np.int64)
    starts = np.empty(n_expert + 1, np.int64)
    experts = np.empty(n_expert, np.int64)
    n = sort_pairs(expert_ids, n_expert, order, starts, experts)
    _grouped_legacy_f32(kind, raw3d, lut, x, order, starts[:n + 1], experts[:n], n_used, out)
    return n


@njit(cache=True, error_model="numpy")
def _kq_rows(kind, raw, lut, xq_f, xq_t, dx, dxs, s, e, out, r_lo, r_hi, run, tb):
    # kquants._matmul_q8_kg for weight rows r_lo..r_hi-1 (whole tiles but the matrix's last)
    # of raw and the activation rows s..e-1, into out[s:e, r_lo:r_hi]
    n_out = raw.shape[0]
    k = e - s
    R = K_TILE_ROWS
    if k <= _kq._QK_FUSED_TOKENS:
        _kq._fused_k_span(kind, raw, lut, xq_f, dx, dxs, s, k, r_lo, r_hi, out)
        return
    ts = _kq.TYPE_SIZE[kind]
    nsb = raw.shape[1] // ts
    affine = kind == 0 or kind == 2 or kind == 3
    paired = kind == 2 or kind == 3
    xq = xq_t if paired else xq_f
    n_in = xq.shape[1]
    n_groups = (nsb + 1) // 2 if paired else nsb
    if paired:
        run = max(1, run // 2)
    w = np.empty((R, n_in), np.uint8)
    dw = np.empty((R, 16 * n_groups), np.float32)
    m = np.empty((R, 16 * n_groups), np.float32)
    corr = np.empty((R, 16 * n_groups), np.int32)
    acc = np.empty((R * tb, 16), np.float32)
    for r0 in range(r_lo, r_hi, R):
        for i in range(R):
            _kq._unpack_row_k(kind, raw[min(r0 + i, n_out - 1)], lut, w[i], dw[i], m[i], corr[i], nsb)
        for t0 in range(s, e, tb):
            t1 = min(e, t0 + tb)
            xb, dxb, dxsb = xq[t0:t1], dx[t0:t1], dxs[t0:t1]
            kb = t1 - t0
            acc[:R * kb, :] = 0
            for g0 in range(0, n_groups, run):
                g1 = min(n_groups, g0 + run)
                for t in range(0, kb - 1, 2):
                    if paired:
                        DOT_K_4x2_PAIR(w, dw, m, corr, xb, dxb, dxsb, acc, g0, g1, t)
                    elif affine:
                        DOT_K_4x2_AFF(w, dw, m, corr, xb, dxb, dxsb, acc, g0, g1, t)
                    else:
                        DOT_K_4x2_SYM(w, dw, m, corr, xb, dxb, dxsb, acc, g0, g1, t)
                if kb % 2:
                    if paired:
                        DOT_K_4x1_PAIR(w, dw, m, corr, xb, dxb, dxsb, acc, g0, g1, kb - 1)
                    elif affine:
                        DOT_K_4x1_AFF(w, dw, m, corr, xb, dxb, dxsb, acc, g0, g1, kb - 1)
                    else:
                        DOT_K_4x1_SYM(w, dw, m, corr, xb, dxb, dxsb, acc, g0, g1, kb - 1)
            t = 0
            if r0 + R <= n_out:
                for t in range(0, kb - 3, 4):
                    KSUM_STORE_4x4(acc, t * R, out, t0 + t, r0)
                t = kb - kb % 4
            for i in range(min(R, n_out - r0)):
                for tt in range(t, kb):
                    out[t0 + tt, r0 + i] = KSUM(acc, tt * R + i)


#: weight rows per task of grouped_kq (a multiple of K_TILE_ROWS), and when every expert has as
#: many rows (a decode step: 16-row tasks cost the 1B glm4moe's 8 down projections 1.6x the
#: kernel time of 256-row ones)
_GROUPED_ROWS_PER_TASK = 16
_UNIFORM_ROWS_PER_TASK = 128


_NO_ROWS = np.zeros((1, 1), np.uint8)


def grouped_kq(kind, raw_a, raw_b, n_mats, xq_f, xq_t, dx, dxs, starts, experts, n_groups,
               out_a, out_b):
    """For every used expert i (``experts[i]``, activation rows starts[i]..starts[i+1]-1 of the
    layouts ``prepare_rows`` made): out_a[rows] = rows @ raw_a[expert].T and, when ``n_mats``
    is 2, out_b[rows] = rows @ raw_b[expert].T (gate and up together). raw_*: uint8
    (n_expert, n_out, row bytes) of K-quant ``kind``; one parallel call, its tasks
    (16 weight rows, matrix, expert) ordered chunk-major (a static split of the range gives
    each thread part of every expert), or (128 rows, ...) expert-major when every expert has
    as many rows."""
    grouped_kq_shared(kind, raw_a, raw_b, n_mats, xq_f, xq_t, dx, dxs, starts, experts, n_groups,
                      out_a, out_b, kind, _NO_ROWS, _NO_ROWS, xq_f, xq_t, dx, dxs, 0, out_a, out_b)


def kq_kind(fmt) -> int | None:
    """The K-quant kind of a format (the grouped_kq path), or None."""
    f = fmt if isinstance(fmt, QuantFormat) else _get_format(fmt)
    return _kq.KIND.get(f.name) if isinstance(f, _kq._KQuant) else None


@njit(parallel=True, cache=True, error_model="numpy")
def grouped_kq_shared(kind, raw_a, raw_b, n_mats, xq_f, xq_t, dx, dxs, starts, experts, n_groups,
                      out_a, out_b, s_kind, s_raw_a, s_raw_b, s_xq_f, s_xq_t, s_dx, s_dxs, s_rows,
                      s_out_a, s_out_b):
    """grouped_kq plus one more matrix (pair) that every one of ``s_rows`` rows goes through, in
    the same parallel call: a MoE block's shared expert (s_raw_*: uint8 (n_out_s, row bytes) of
    K-quant ``s_kind``, activations prepared for it, s_out_a[:s_rows] = rows @ s_raw_a.T ...;
    its tasks matrix-major)."""
    # every expert the same number of rows (a decode step): its tasks in a row, so a thread
    # streams each matrix front to back, in tasks of more rows (fewer calls down to the
    # kernels); otherwise chunk-major, each thread part of every expert
    uniform = True
    for i in range(1, n_groups):
        if starts[i + 1] - starts[i] != starts[1] - starts[0]:
            uniform = False
    n_out = raw_a.shape[1]
    per = _UNIFORM_ROWS_PER_TASK if uniform else _GROUPED_ROWS_PER_TASK
    n_chunks = (n_out + per - 1) // per
    n_main = n_chunks * n_mats * n_groups
    s_out = s_raw_a.shape[0]
    s_chunks = (s_out + per - 1) // per if s_rows > 0 else 0
    for task in prange(n_main + s_chunks * n_mats):
        if task < n_main:
            if uniform:
                i = task // (n_mats * n_chunks)
                rest = task - i * (n_mats * n_chunks)
                mat = rest // n_chunks
                r_lo = (rest - mat * n_chunks) * per
            else:
                i = task % n_groups
                rest = task // n_groups
                mat = rest % n_mats
                r_lo = (rest // n_mats) * per
            r_hi = min(n_out, r_lo + per)
            e = experts[i]
            if mat == 0:
                _kq_rows(kind, raw_a[e], FP16_TO_FP32, xq_f, xq_t, dx, dxs, starts[i],
                         starts[i + 1], out_a, r_lo, r_hi, _kq._QK_RUN_GROUPS, _kq._QK_TOKEN_BLOCK)
            else:
                _kq_rows(kind, raw_b[e], FP16_TO_FP32, xq_f, xq_t, dx, dxs, starts[i],
                         starts[i + 1], out_b, r_lo, r_hi, _kq._QK_RUN_GROUPS, _kq._QK_TOKEN_BLOCK)
        else:
            st = task - n_main
            mat = st // s_chunks
            r_lo = (st - mat * s_chunks) * per
            r_hi = min(s_out, r_lo + per)
            if mat == 0:
                _kq_rows(s_kind, s_raw_a, FP16_TO_FP32, s_xq_f, s_xq_t, s_dx, s_dxs, 0, s_rows,
                         s_out_a, r_lo, r_hi, _kq._QK_RUN_GROUPS, _kq._QK_TOKEN_BLOCK)
            else:
                _kq_rows(s_kind, s_raw_b, FP16_TO_FP32, s_xq_f, s_xq_t, s_dx, s_dxs, 0, s_rows,
                         s_out_b, r_lo, r_hi, _kq._QK_RUN_GROUPS, _kq._QK_TOKEN_BLOCK)

