"""The decoder's row operations on an NVIDIA GPU: numba.cuda counterparts of engine/kernels.py.

Every function here is a host-side launcher: it takes numba device arrays (float32, C-contiguous
unless said), launches ONE kernel on the default stream and returns at once (the work is
asynchronous, ordered after earlier launches; nothing is copied back or synchronized). Shapes
and meaning are those of the CPU kernels of the same name in ``ds4tools.engine.kernels``.

Thread layouts
--------------
* Element-wise ops (add_bias, add_into, scale, swiglu, rope, store_kv_*, store_rows,
  copy_strided, decode_f16): one thread per output element (rope: per rotated pair; store_kv:
  per (row, kv head, dim)), ELEMENT_THREADS per block over the flattened index. No thread reads
  what another writes, so there is nothing to order.
* rmsnorm: one block of ROW_THREADS threads per row. Thread ``tid`` sums the squares (float64,
  as ggml and the CPU kernel do) of elements tid, tid + ROW_THREADS, ... in that order; the
  ROW_THREADS partial sums are then added in thread order from shared memory. Then every
  thread scales its own elements. layer_norm: the same layout, for the mean, then the variance.
* rotate_rows: one block per row; the row is copied to shared memory, then thread tid writes
  outputs tid, tid + ROW_THREADS, ..., each a dot over the row in index order.
* dsa_scores: one thread per (row, position): the heads, then each head's dimensions, in order.
* attention: one block of ATTENTION_THREADS threads (one warp) per (query row t, query head h);
  head h reads kv head h // (n_head // n_kv_head). Keys are visited in tiles of
  ATTENTION_THREADS, from key 0 up to limits[t]:
    1. thread j scores key j0 + j of the tile (dot product over the key width, in order);
    2. the tile's maximum and, after exponentiation against the running maximum, the tile's sum
       of weights are added in thread order from shared memory;
    3. the running total and the per-dimension accumulators are rescaled by
       exp(old max - new max) (an online softmax, so scores need no scratch memory; a tile that
       does not raise the maximum rescales by exactly 1), then thread i adds weight * value for
       the tile's keys in key order into dims i, i + ATTENTION_THREADS, ... (a per-thread
       local array of DIMS_PER_THREAD floats: value width <= MAX_HEAD_DIM);
    4. out = accumulator * (1 / total), written once at the end.
  With ``selected`` (a sparse attention's choice) key j of row t is cache row selected[t, j],
  and limits[t] counts them. Value reads are coalesced (consecutive threads, consecutive
  dims); key reads are not (thread j reads key row j) -- simple first, a shared-memory key tile
  would be the next step.

Why this is batch-invariant (lossless speculative decoding)
-----------------------------------------------------------
A row's result never depends on how many rows share the launch or what they hold: each block
works on one row (and one head) only; every reduction -- the sum of squares, the scores, the
tile maxima and sums, the tile-by-tile running softmax, the weighted sum of values -- runs in an
order fixed by the row's own length (n, or limits[t]) and by the module's constant thread
counts, never by k, the grid size or scheduling; there are no atomics. So row t of a k=5
verification batch has the very bits it has when decoded alone.

Arithmetic
----------
Float32 throughout except rmsnorm's float64 sum (as on the CPU). Importing this module imports
``ds4tools.formats.cuda``, which tells NVVM not to contract a*b+c into FMAs: products and sums
round separately, as numpy does in the simulator, so the simulator checks the GPU's own
arithmetic (only exp differs: libdevice's expf against the simulator's rounded double exp).
exp is clamped to the CPU's exp_f32 range, so silu and softmax weights see the same limits.
The reductions are not in the CPU kernels' order, so results agree with the CPU to float32
rounding (~1e-6 relative, attention ~1e-5), not bit for bit -- except add_bias, add_into,
scale, store_kv_*, store_rows, copy_strided, decode_f16 (exactly the CPU's bits; the fp16
stores round with the CPU's own f32_bits_to_f16).
"""
import math

import numpy as np
from numba import cuda

from ....formats import cuda as _formats_cuda  # noqa: F401  (no FMA contraction in NVVM)
from ....formats.floats import f32_bits_to_f16

ELEMENT_THREADS = 64     # threads per block of the element-wise kernels
ROW_THREADS = 64         # threads per row in rmsnorm
ATTENTION_THREADS = 32   # threads per (row, head) in attention = keys per tile (power of two)
DIMS_PER_THREAD = 16     # accumulator registers per attention thread: values <= 32 * 16
MAX_HEAD_DIM = ATTENTION_THREADS * DIMS_PER_THREAD

assert ROW_THREADS & (ROW_THREADS - 1) == 0 and ROW_THREADS % 32 == 0
assert ATTENTION_THREADS & (ATTENTION_THREADS - 1) == 0 and ATTENTION_THREADS % 32 == 0

_NEG_INF = np.float32(-np.inf)
_EXP_MIN = np.float32(-87.33654)   # the clamp of kernels.exp_f32: e**x stays a normal float
_EXP_MAX = np.float32(88.72283)
_ONE = np.float32(1.0)
_ZERO = np.float32(0.0)


def _element_grid(n_items: int) -> tuple[int, int]:
    return (n_items + ELEMENT_THREADS - 1) // ELEMENT_THREADS, ELEMENT_THREADS


# --- device helpers ----------------------------------------------------------------------------


@cuda.jit(device=True)
def _exp(x):
    """e**x in float32, clamped like kernels.exp_f32 (never 0 or inf)."""
    return np.float32(math.exp(min(max(x, _EXP_MIN), _EXP_MAX)))


@cuda.jit(device=True)
def _block_sum(scratch, tid, value):
    """Sum of every thread's value, added in thread order by every thread from the shared
    array scratch (one slot per thread): two barriers, where a halving tree takes one per
    level (numba's simulator, which runs the tests, pays for every barrier with every thread).
    Every thread of the block must call it; all get the same sum."""
    scratch[tid] = value
    cuda.syncthreads()
    total = scratch[0]
    for i in range(1, scratch.shape[0]):
        total = total + scratch[i]
    cuda.syncthreads()  # everyone has read scratch before it is reused
    return total


@cuda.jit(device=True)
def _block_max(scratch, tid, value):
    """Maximum of every thread's value (as _block_sum, in thread order)."""
    scratch[tid] = value
    cuda.syncthreads()
    top = scratch[0]
    for i in range(1, scratch.shape[0]):
        b = scratch[i]
        top = top if top >= b else b
    cuda.syncthreads()
    return top


# --- normalization and element-wise ops --------------------------------------------------------


@cuda.jit
def _rmsnorm_kernel(x, weight, eps, out):
    row = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    n = x.shape[1]
    scratch = cuda.shared.array(ROW_THREADS, np.float64)
    sum_sq = np.float64(0.0)
    for i in range(tid, n, ROW_THREADS):  # a fixed stride: the same split for every row
        v = np.float64(x[row, i])
        sum_sq += v * v
    total = _block_sum(scratch, tid, sum_sq)
    # as the CPU: mean and reciprocal root in float64, the scaling in float32
    scale = np.float32(1.0 / math.sqrt(total / n + eps))
    for i in range(tid, n, ROW_THREADS):  # each thread rewrites only what it read: out may be x
        out[row, i] = (x[row, i] * scale) * weight[i]


def rmsnorm(x, weight, eps, out):
    """out[t] = x[t] / rms(x[t]) * weight; x, out (k, n); weight (n,). out may be x.
    Also the per-head norm, on x reshaped to (k * heads, head_dim)."""
    if x.shape[0] == 0:
        return
    _rmsnorm_kernel[x.shape[0], ROW_THREADS](x, weight, float(eps), out)


@cuda.jit
def _add_bias_kernel(x, bias):
    idx = cuda.grid(1)
    n = x.shape[1]
    if idx < x.shape[0] * n:
        t = idx // n
        i = idx - t * n
        x[t, i] += bias[i]


def add_bias(x, bias):
    """x[t] += bias for every row; x (k, n), bias (n,)."""
    if x.size == 0:
        return
    blocks, threads = _element_grid(x.size)
    _add_bias_kernel[blocks, threads](x, bias)


@cuda.jit
def _add_into_kernel(x, y):
    idx = cuda.grid(1)
    n = x.shape[1]
    if idx < x.shape[0] * n:
        t = idx // n
        i = idx - t * n
        x[t, i] += y[t, i]


def add_into(x, y):
    """x += y (the residual stream); both (k, n)."""
    if x.size == 0:
        return
    blocks, threads = _element_grid(x.size)
    _add_into_kernel[blocks, threads](x, y)


@cuda.jit
def _swiglu_kernel(gate, up, out):
    idx = cuda.grid(1)
    n = gate.shape[1]
    if idx < gate.shape[0] * n:
        t = idx // n
        i = idx - t * n
        g = gate[t, i]
        # silu(g) = g / (1 + exp(-g)), in ggml's order of operations
        out[t, i] = g / (_ONE + _exp(-g)) * up[t, i]


def swiglu(gate, up, out):
    """out = silu(gate) * up, all (k, n). out may be gate."""
    if gate.size == 0:
        return
    blocks, threads = _element_grid(gate.size)
    _swiglu_kernel[blocks, threads](gate, up, out)


# --- rotary position embedding ------------------------------------------------------------------


@cuda.jit
def _rope_kernel(x, positions, cos, sin, neox):
    idx = cuda.grid(1)
    heads = x.shape[1]
    half = cos.shape[1]
    if idx < x.shape[0] * heads * half:
        pair = idx % half  # one thread per rotated pair: it reads and writes only its two dims
        row_head = idx // half
        t = row_head // heads
        h = row_head - t * heads
        if neox:
            first = pair
            second = pair + half
        else:
            first = 2 * pair
            second = 2 * pair + 1
        p = positions[t]
        c = cos[p, pair]
        s = sin[p, pair]
        a = x[t, h, first]
        b = x[t, h, second]
        x[t, h, first] = a * c - b * s
        x[t, h, second] = a * s + b * c


def rope(x, positions, cos, sin, neox):
    """Rotate x (k, heads, head_dim) in place by the angles of positions (device int64 (k,)).

    cos, sin: (n_positions, n_rot // 2); dims from n_rot on pass through. neox=False: pairs
    (2i, 2i + 1) (llama.cpp's "norm" mode); neox=True: pairs (i, i + n_rot / 2)."""
    n_items = x.shape[0] * x.shape[1] * cos.shape[1]
    if n_items == 0:
        return
    blocks, threads = _element_grid(n_items)
    _rope_kernel[blocks, threads](x, positions, cos, sin, bool(neox))


# --- KV cache writes ---------------------------------------------------------------------------


@cuda.jit
def _store_kv_f32_kernel(cache_k, cache_v, k_rows, v_rows, positions):
    idx = cuda.grid(1)
    n_kv, head_dim = k_rows.shape[1], k_rows.shape[2]
    if idx < k_rows.shape[0] * n_kv * head_dim:
        i = idx % head_dim
        row_head = idx // head_dim
        t = row_head // n_kv
        g = row_head - t * n_kv
        p = positions[t]
        cache_k[g, p, i] = k_rows[t, g, i]
        cache_v[g, p, i] = v_rows[t, g, i]


def store_kv_f32(cache_k, cache_v, k_rows, v_rows, positions):
    """cache_* (n_kv_head, n_ctx, head_dim) float32 <- rows (k, n_kv_head, head_dim) at
    positions (device int64 (k,))."""
    if k_rows.size == 0:
        return
    blocks, threads = _element_grid(k_rows.size)
    _store_kv_f32_kernel[blocks, threads](cache_k, cache_v, k_rows, v_rows, positions)


@cuda.jit
def _store_kv_f16_kernel(cache_k, cache_v, k_bits, v_bits, positions):
    idx = cuda.grid(1)
    n_kv, head_dim = k_bits.shape[1], k_bits.shape[2]
    if idx < k_bits.shape[0] * n_kv * head_dim:
        i = idx % head_dim
        row_head = idx // head_dim
        t = row_head // n_kv
        g = row_head - t * n_kv
        p = positions[t]
        # the CPU's own rounding function (an @njit callee compiles for the device)
        cache_k[g, p, i] = f32_bits_to_f16(np.int64(k_bits[t, g, i]))
        cache_v[g, p, i] = f32_bits_to_f16(np.int64(v_bits[t, g, i]))


def store_kv_f16(cache_k, cache_v, k_rows, v_rows, positions):
    """As store_kv_f32 into an fp16 cache (uint16 bit patterns, rounded to nearest even exactly
    as the CPU's store_kv_f16)."""
    if k_rows.size == 0:
        return
    blocks, threads = _element_grid(k_rows.size)
    # float32 -> its bit pattern: a free reinterpretation of the device buffer
    _store_kv_f16_kernel[blocks, threads](cache_k, cache_v, k_rows.view(np.uint32),
                                          v_rows.view(np.uint32), positions)


@cuda.jit
def _store_rows_f32_kernel(cache, rows, positions):
    idx = cuda.grid(1)
    width = rows.shape[1]
    if idx < rows.shape[0] * width:
        t = idx // width
        i = idx - t * width
        cache[positions[t], i] = rows[t, i]


@cuda.jit
def _store_rows_f16_kernel(cache, bits, positions):
    idx = cuda.grid(1)
    width = bits.shape[1]
    if idx < bits.shape[0] * width:
        t = idx // width
        i = idx - t * width
        cache[positions[t], i] = f32_bits_to_f16(np.int64(bits[t, i]))


def store_rows(cache, rows, positions):
    """cache (n_ctx, width) <- rows (k, width) float32 at positions (device int64 (k,)): float32
    as they are, or into a uint16 cache as fp16 rounded like the CPU's (MLA's latent cache)."""
    if rows.size == 0:
        return
    blocks, threads = _element_grid(rows.size)
    if cache.dtype == np.float32:
        _store_rows_f32_kernel[blocks, threads](cache, rows, positions)
    else:
        _store_rows_f16_kernel[blocks, threads](cache, rows.view(np.uint32), positions)


@cuda.jit
def _copy_2d_kernel(dst, src):
    idx = cuda.grid(1)
    n = dst.shape[1]
    if idx < dst.shape[0] * n:
        t = idx // n
        i = idx - t * n
        dst[t, i] = src[t, i]


@cuda.jit
def _copy_3d_kernel(dst, src):
    idx = cuda.grid(1)
    n1, n2 = dst.shape[1], dst.shape[2]
    if idx < dst.shape[0] * n1 * n2:
        i = idx % n2
        th = idx // n2
        t = th // n1
        h = th - t * n1
        dst[t, h, i] = src[t, h, i]


def copy_strided(dst, src):
    """dst[...] = src for 2-D or 3-D arrays of one shape, either a strided view (a plain copy:
    exact)."""
    if dst.shape != src.shape or dst.ndim not in (2, 3):
        raise ValueError(f"copy: shapes {dst.shape} and {src.shape} (2-D or 3-D, equal)")
    if dst.size == 0:
        return
    blocks, threads = _element_grid(dst.size)
    kernel = _copy_2d_kernel if dst.ndim == 2 else _copy_3d_kernel
    kernel[blocks, threads](dst, src)


@cuda.jit
def _layer_norm_kernel(x, weight, bias, eps, out):
    row = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    n = x.shape[1]
    scratch = cuda.shared.array(ROW_THREADS, np.float64)
    total = np.float64(0.0)
    for i in range(tid, n, ROW_THREADS):
        total += np.float64(x[row, i])
    mean = np.float32(_block_sum(scratch, tid, total)) / np.float32(n)
    sq = np.float64(0.0)
    for i in range(tid, n, ROW_THREADS):
        y = x[row, i] - mean
        sq += np.float64(y * y)
    var = np.float32(_block_sum(scratch, tid, sq) / n)
    scale = _ONE / np.float32(math.sqrt(var + eps))
    for i in range(tid, n, ROW_THREADS):  # each thread rewrites only what it read: out may be x
        out[row, i] = (x[row, i] - mean) * scale * weight[i] + bias[i]


def layer_norm(x, weight, bias, eps, out):
    """out[t] = (x[t] - mean) / sqrt(var + eps) * weight + bias (kernels.layer_norm: sums in
    float64, the rest float32); x, out (k, n). One block per row, as rmsnorm."""
    if x.shape[0] == 0:
        return
    _layer_norm_kernel[x.shape[0], ROW_THREADS](x, weight, bias, np.float32(eps), out)


@cuda.jit
def _rotate_rows_kernel(x, h):
    row = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    d = x.shape[1]
    saved = cuda.shared.array(MAX_ROTATE, np.float32)
    for i in range(tid, d, ROW_THREADS):
        saved[i] = x[row, i]
    cuda.syncthreads()
    for i in range(tid, d, ROW_THREADS):
        s = _ZERO
        for j in range(d):  # in index order, as the CPU
            s += h[i, j] * saved[j]
        x[row, i] = s


MAX_ROTATE = 1024  # the widest row rotate_rows takes (the DSA indexer's heads are 128 wide)


def rotate_rows(x, h):
    """x (m, d) <- x @ h in place, h (d, d) symmetric (the DSA indexer's Hadamard rotation):
    one block per row, the row kept in shared memory while its outputs are written."""
    if x.shape[1] > MAX_ROTATE:
        raise ValueError(f"rotate_rows: rows of {x.shape[1]} > {MAX_ROTATE}")
    if x.shape[0] == 0:
        return
    _rotate_rows_kernel[x.shape[0], ROW_THREADS](x, h)


@cuda.jit
def _scale_kernel(x, factor):
    idx = cuda.grid(1)
    n = x.shape[1]
    if idx < x.shape[0] * n:
        t = idx // n
        i = idx - t * n
        x[t, i] = x[t, i] * factor


def scale(x, factor):
    """x *= factor (float32), x (k, n): exact (one rounding, as numpy's)."""
    if x.size == 0:
        return
    blocks, threads = _element_grid(x.size)
    _scale_kernel[blocks, threads](x, np.float32(factor))


@cuda.jit
def _dsa_scores_kernel(q, keys, w, limits, top_k, scores):
    t, j = cuda.grid(2)
    if t < q.shape[0] and j < scores.shape[1]:
        n = limits[t]
        if n > top_k and j < n:
            s = _ZERO
            for h in range(q.shape[1]):  # heads, then dimensions, in order (as the CPU)
                dot = _ZERO
                for i in range(q.shape[2]):
                    dot += q[t, h, i] * keys[j, i]
                if dot > 0:
                    s += dot * w[t, h]
            scores[t, j] = s


def dsa_scores(q, keys, w, limits, top_k, scores):
    """The DSA indexer's scores (kernels.dsa_scores): scores[t, j] = sum_h relu(q[t, h] .
    keys[j]) * w[t, h] for j < limits[t], for the rows that select (limits[t] > top_k); one
    thread per (row, position). q (k, n_head, d), keys (>= max limit, d), w (k, n_head)."""
    k, n = scores.shape
    if k * n == 0:
        return
    threads = (1, ELEMENT_THREADS)
    _dsa_scores_kernel[(k, (n + ELEMENT_THREADS - 1) // ELEMENT_THREADS), threads](
        q, keys, w, limits, np.int64(top_k), scores)


@cuda.jit
def _decode_f16_kernel(bits, lut, out):
    idx = cuda.grid(1)
    n = out.shape[1]
    if idx < out.shape[0] * n:
        t = idx // n
        i = idx - t * n
        out[t, i] = lut[bits[t, i]]


def decode_f16(bits, lut, out):
    """out (m, n) float32 <- the fp16 bit patterns bits[:m] (uint16) through lut (exact)."""
    if out.size == 0:
        return
    blocks, threads = _element_grid(out.size)
    _decode_f16_kernel[blocks, threads](bits, lut, out)


@cuda.jit
def _weighted_sum_kernel(expert_out, weights, out):
    t, i = cuda.grid(2)
    if t < out.shape[0] and i < out.shape[1]:
        acc = expert_out[t, 0, i] * weights[t, 0]
        for j in range(1, expert_out.shape[1]):  # the slots in rank order, as the CPU
            acc = acc + expert_out[t, j, i] * weights[t, j]
        out[t, i] = acc


def weighted_sum(expert_out, weights, out):
    """out[t] = sum_j weights[t, j] * expert_out[t, j] (k, n_slots, n), the slots added in
    order: a mixture of experts' routed output. One thread per output element."""
    k, n = out.shape
    if k * n == 0:
        return
    threads = (1, ELEMENT_THREADS)
    _weighted_sum_kernel[(k, (n + ELEMENT_THREADS - 1) // ELEMENT_THREADS), threads](
        expert_out, weights, out)


# --- attention ---------------------------------------------------------------------------------


@cuda.jit(device=True)
def _read_f32(cache, lut, g, j, i):
    return cache[g, j, i]


@cuda.jit(device=True)
def _read_f16(cache, lut, g, j, i):
    return lut[cache[g, j, i]]


@cuda.jit(device=True)
def _position_all(selected, t, j):
    return j


@cuda.jit(device=True)
def _position_selected(selected, t, j):
    return selected[t, j]


def _make_attention_kernel(read_cache, position):
    """The attention kernel over a cache whose element (g, j, i) is read_cache(cache, lut, g, j, i)
    as a float32, visiting the rows position(selected, t, 0..limits[t]-1) of query row t (every
    row below the limit, or a sparse attention's list: four kernels, because numba types both
    branches of a runtime test)."""

    @cuda.jit
    def attention_kernel(q, cache_k, cache_v, limits, selected, scale, lut, out):
        n_head, key_dim, value_dim = q.shape[1], q.shape[2], out.shape[2]
        row_head = cuda.blockIdx.x
        t = row_head // n_head
        h = row_head - t * n_head
        g = h // (n_head // cache_k.shape[0])
        tid = cuda.threadIdx.x
        limit = limits[t]  # the same for the whole block: every thread runs the same loops
        scratch = cuda.shared.array(ATTENTION_THREADS, np.float32)
        weights = cuda.shared.array(ATTENTION_THREADS, np.float32)
        acc = cuda.local.array(DIMS_PER_THREAD, np.float32)
        for d in range(DIMS_PER_THREAD):
            acc[d] = _ZERO
        running_max = _NEG_INF
        total = _ZERO
        for j0 in range(0, limit, ATTENTION_THREADS):
            key = j0 + tid
            score = _NEG_INF
            if key < limit:
                p = position(selected, t, key)
                dot = _ZERO
                for i in range(key_dim):
                    dot += q[t, h, i] * read_cache(cache_k, lut, g, p, i)
                score = dot * scale
            new_max = max(running_max, _block_max(scratch, tid, score))
            weight = _ZERO
            if key < limit:
                weight = _exp(score - new_max)
            weights[tid] = weight
            tile_total = _block_sum(scratch, tid, weight)  # (its barriers publish weights too)
            # earlier tiles were weighted against the old maximum: rescale them (by exactly 1
            # when the maximum did not move; by ~0 on the first tile, where all is still 0)
            rescale = _exp(running_max - new_max)
            total = total * rescale + tile_total
            running_max = new_max
            n_keys = min(ATTENTION_THREADS, limit - j0)
            for d in range(DIMS_PER_THREAD):
                i = tid + d * ATTENTION_THREADS
                if i < value_dim:
                    a = acc[d] * rescale
                    for j in range(n_keys):  # key order
                        a += weights[j] * read_cache(cache_v, lut, g,
                                                     position(selected, t, j0 + j), i)
                    acc[d] = a
            cuda.syncthreads()  # all have read weights before the next tile rewrites them
        inv_total = _ONE / total
        for d in range(DIMS_PER_THREAD):
            i = tid + d * ATTENTION_THREADS
            if i < value_dim:
                out[t, h, i] = acc[d] * inv_total

    return attention_kernel


_ATTENTION_KERNELS = {(f16, sparse): _make_attention_kernel(_read_f16 if f16 else _read_f32,
                                                             _position_selected if sparse
                                                             else _position_all)
                      for f16 in (False, True) for sparse in (False, True)}


def attention(q, cache_k, cache_v, limits, scale, out, f16_lut=None, selected=None):
    """softmax(scale * q . k) weighted sum of values over cache rows [0, limits[t]) for row t.

    q (k, n_head, key_dim), out (k, n_head, value_dim); cache_k (n_kv_head, n_ctx, key_dim),
    cache_v (n_kv_head, n_ctx, >= value_dim), either may be a strided view (MLA's latent cache
    passes its rows as keys and their first kv_lora_rank columns as values): float32, or uint16
    fp16 bit patterns when f16_lut (a device copy of formats._numeric.FP16_TO_FP32) is given;
    limits device int64 (k,). Query head h reads kv head h // (n_head // n_kv_head) (GQA).
    ``selected`` (device int64 (k, m), ascending): row t then visits the cache rows
    selected[t, :limits[t]] only (a sparse attention's choice; limits are the counts).
    A row with limit 0 gives NaN (0 / 0), as on the CPU."""
    k, n_head, key_dim = q.shape
    value_dim = out.shape[2]
    n_kv = cache_k.shape[0]
    if value_dim > MAX_HEAD_DIM:
        raise ValueError(f"attention: value width {value_dim} > {MAX_HEAD_DIM} "
                         f"(raise DIMS_PER_THREAD)")
    if cache_k.shape[2] != key_dim or cache_v.shape[2] < value_dim or cache_v.shape[0] != n_kv:
        raise ValueError("attention: the cache does not fit the query and output widths")
    if n_kv == 0 or n_head % n_kv:
        raise ValueError(f"attention: {n_head} query heads do not share {n_kv} kv heads evenly")
    if k * n_head == 0:
        return
    scale = np.float32(scale)  # a Python float would make the scores float64 on the device
    kernel = _ATTENTION_KERNELS[(f16_lut is not None, selected is not None)]
    # the f32 reader never touches lut, the dense kernel never touches selected: any device
    # array of a fixed type will do
    kernel[k * n_head, ATTENTION_THREADS](q, cache_k, cache_v, limits,
                                          limits.reshape(k, 1) if selected is None else selected,
                                          scale, cache_k if f16_lut is None else f16_lut, out)
