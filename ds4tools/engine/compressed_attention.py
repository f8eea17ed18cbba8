"""Compressed attention (DeepSeek V4): one shared KV head, attended as a sliding window of raw
rows plus compressed entries, each summarising ``ratio`` consecutive positions.

Compression, per layer with ratio r > 0, from two projections of the attention input h_t:

    kv_t    = Wkv h_t                          (coff * d)   coff = 2 when r = 4 (overlapping)
    score_t = Wgate h_t + ape[t mod r]         (coff * d)

Entry b (positions b*r .. b*r + r - 1) exists once position b*r + r - 1 is in; per dimension c
it is the softmax(score)-weighted sum of kv over its positions; with overlap (r = 4) also over
the previous entry's positions, reading their first half (c) while its own read the second
half (d + c); entry 0's missing predecessors weigh nothing. Then RMSNorm (the compressor's
norm) and rope at position b*r on the last n_rot dimensions. A query at position p sees the
raw rows p - n_swa < s <= p and the entries b < (p + 1) // r: all of them for r = 128, and for
r = 4 the ``top_k`` the indexer scores highest:

    score_b = sum_h relu(q_h . k_b) * w_h      q = Wq_idx (normed q latent), roped at p;
                                                w = Wproj h / sqrt(d_idx * n_idx_head);
                                                k_b: an indexer entry, compressed as above
                                                with its own tensors (d_idx wide)

(llama.cpp multiplies both sides by a Hadamard matrix first: orthogonal, so the same scores.)
The attention over the chosen keys (the values are the keys) has a sink per head: softmax over
[scores..., sink_h], the sink's share dropped.

``CompressedCache`` keeps what the next positions need, not every position's inputs:

    raw rows      a ring of n_swa + R rows per layer (slot p mod cap): the window and the
                  rows a rollback of up to R positions brings back into it
    compressor    a ring of (2 r if overlapping else r) + R rows of (kv, score) per
                  compressed layer (and its indexer): the open block, its predecessor, and
                  what a rollback of R positions reopens
    entries       (n_ctx // r + 1, d) per compressed layer, (n_ctx // 4 + 1, d_idx) per
                  indexer: the compressed keys, one per completed block

R is ``CacheLayout.rollback`` (MAX_ROLLBACK = 64: the longest verify, a prompt-lookup
anchor plus 64 drafts, leaves at most 64 rows to roll back). A forward's new rows are read
from its own arrays (the batch may be longer than a ring) and then stored. An entry depends
only on positions below its end, so truncating the cache to n (moving the length) leaves
exactly the state a fresh prefill of n positions builds, provided the rings still hold the
rows n needs: ``truncate`` refuses n below (highest position written + 1) - R, except 0.
With a context no larger than a ring, the ring is the whole context and nothing is refused.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit, prange

from . import kernels

#: rows a truncate may roll back (the rings keep them): a verify of 1 + 64 drafts
MAX_ROLLBACK = 64


@dataclass(frozen=True)
class CacheLayout:
    """Per layer: ratio (0, 4 or 128), the widths of its rows; n_swa (None: the raw rows of
    every position are kept) and the rollback depth R the rings are sized for."""
    ratios: tuple
    head_dim: int
    idx_dim: int
    n_swa: int | None = None
    rollback: int = MAX_ROLLBACK


@dataclass(frozen=True)
class CompressedSnapshot:
    length: int
    high: int
    arrays: tuple


def _caps(layout: CacheLayout, n_ctx: int) -> tuple:
    """(raw ring rows, [compressor ring rows per layer, 0 where none])."""
    R = layout.rollback
    raw = n_ctx if layout.n_swa is None else min(n_ctx, layout.n_swa + R)
    comp = [0 if r == 0 else min(n_ctx, (2 * r if r == 4 else r) + R) for r in layout.ratios]
    return raw, comp


class CompressedCache:
    """The raw-row rings (n_layer, cap, head_dim) and, for the compressed layers, the
    compressors' input rings and the entries per block. ``length`` as KVCache's; ``high``:
    one past the highest position written since the cache was last emptied."""

    cache_type = "f32"

    def __init__(self, layout: CacheLayout, n_ctx: int):
        if n_ctx <= 0:
            raise ValueError("cache dimensions must be positive")
        f = np.float32
        d, di = layout.head_dim, layout.idx_dim
        self.layout = layout
        self.n_ctx = n_ctx
        self.length = 0
        self.high = 0
        n_layer = len(layout.ratios)
        cap_raw, caps = _caps(layout, n_ctx)
        self.raw = np.zeros((n_layer, cap_raw, d), f)
        self.comp_kv, self.comp_score, self.comp = [], [], []
        self.idx_kv, self.idx_score, self.idx = [], [], []
        for r, cap in zip(layout.ratios, caps):
            coff = 2 if r == 4 else 1
            has = r > 0
            nb = n_ctx // r + 1 if has else 0
            self.comp_kv.append(np.zeros((cap, coff * d), f) if has else None)
            self.comp_score.append(np.zeros((cap, coff * d), f) if has else None)
            self.comp.append(np.zeros((nb, d), f) if has else None)
            ind = r == 4
            self.idx_kv.append(np.zeros((cap, 2 * di), f) if ind else None)
            self.idx_score.append(np.zeros((cap, 2 * di), f) if ind else None)
            self.idx.append(np.zeros((nb, di), f) if ind else None)
        lossless = cap_raw >= n_ctx and all(c >= n_ctx for c in caps if c)
        #: how far below ``high`` a truncate may go (the whole context when nothing wraps)
        self.max_rollback = n_ctx if lossless else layout.rollback

    @staticmethod
    def nbytes_for(layout: CacheLayout, n_ctx: int) -> int:
        """The bytes a cache of this layout holds at n_ctx positions (without allocating it)."""
        d, di = layout.head_dim, layout.idx_dim
        cap_raw, caps = _caps(layout, n_ctx)
        total = len(layout.ratios) * cap_raw * d
        for r, cap in zip(layout.ratios, caps):
            if r:
                coff = 2 if r == 4 else 1
                total += 2 * cap * coff * d + (n_ctx // r + 1) * d
            if r == 4:
                total += 2 * cap * 2 * di + (n_ctx // r + 1) * di
        return 4 * total

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self._arrays())

    @property
    def n_layer(self) -> int:
        return self.raw.shape[0]

    def truncate(self, n: int) -> None:
        """Forget positions n and above (O(1)); the entries they completed go with them. A
        rollback deeper than ``max_rollback`` below the highest position written is refused
        (the rings no longer hold the rows it needs), except to 0."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {n}")
        if n and n < self.high - self.max_rollback:
            raise ValueError(f"cannot truncate the compressed cache to {n}: it keeps the state "
                             f"of the last {self.max_rollback} positions written (up to "
                             f"{self.high - 1}) for a rollback; rerun from 0 instead")
        self.length = n
        if n == 0:
            self.high = 0

    def clear(self) -> None:
        self.length = 0
        self.high = 0

    def wrote(self, positions: np.ndarray) -> None:
        """Note the rows at ``positions`` (contiguous) as written."""
        if positions.shape[0]:
            self.high = max(self.high, int(positions[-1]) + 1)

    def store_raw(self, slot: int, positions: np.ndarray, rows: np.ndarray) -> None:
        """Store the raw rows of contiguous ``positions`` into layer ``slot``'s ring."""
        store_ring(self.raw[slot], positions, rows)
        self.wrote(positions)

    def raw_rows(self, slot: int, positions) -> np.ndarray:
        """The raw rows of layer ``slot`` at ``positions`` (each must still be in the ring)."""
        positions = np.asarray(positions, np.int64)
        cap = self.raw.shape[1]
        if positions.size and (positions.min() < max(0, self.high - cap) or positions.max() >= self.high):
            raise ValueError(f"the ring holds positions {max(0, self.high - cap)}..{self.high - 1}")
        return self.raw[slot, positions % cap]

    def _arrays(self):
        out = [self.raw]
        for lst in (self.comp_kv, self.comp_score, self.comp, self.idx_kv, self.idx_score, self.idx):
            out.extend(a for a in lst if a is not None)
        return out

    def snapshot(self) -> CompressedSnapshot:
        """A copy of every array (the rings and the entries)."""
        return CompressedSnapshot(self.length, self.high, tuple(a.copy() for a in self._arrays()))

    def restore(self, snap: CompressedSnapshot) -> None:
        mine = self._arrays()
        if len(mine) != len(snap.arrays) or any(a.shape != b.shape for a, b in zip(mine, snap.arrays)):
            raise ValueError("snapshot does not fit this cache")
        for a, b in zip(mine, snap.arrays):
            a[...] = b
        self.length = snap.length
        self.high = snap.high


def store_ring(ring: np.ndarray, positions: np.ndarray, rows: np.ndarray) -> None:
    """ring[p mod cap] = row for the last (at most cap) of the contiguous ``positions``."""
    cap = ring.shape[0]
    m = min(positions.shape[0], cap)
    if m:
        ring[positions[-m:] % cap] = rows[-m:]


# --- compression --------------------------------------------------------------------------------


@njit(cache=True, error_model="numpy")
def compress_entries(kv, score, ring_kv, ring_score, positions, ratio, overlap, d, out):
    """Build the entries that the rows at ``positions`` complete: out[b] for every position p
    with (p + 1) % ratio == 0, b = p // ratio (see the module doc). The inputs of position s:
    kv / score row s - positions[0] from s = positions[0] on, the rings' row s mod cap below."""
    n_src = 2 * ratio if overlap else ratio
    p0 = positions[0]
    cap = ring_kv.shape[0]
    w = np.empty(n_src, np.float32)
    for t in range(positions.shape[0]):
        p = positions[t]
        if (p + 1) % ratio != 0:
            continue
        b = p // ratio
        start = b * ratio
        for c in range(d):
            # gather the sources' scores: [previous block (first half) | own block (second half)]
            mx = -np.inf
            for j in range(n_src):
                if overlap and j < ratio:
                    s = start - ratio + j
                    if s < 0:
                        v = -np.inf
                    else:
                        v = score[s - p0, c] if s >= p0 else ring_score[s % cap, c]
                else:
                    s = start + (j - ratio if overlap else j)
                    cc = c + d if overlap else c
                    v = score[s - p0, cc] if s >= p0 else ring_score[s % cap, cc]
                w[j] = v
                mx = max(mx, v)
            tot = 0.0
            for j in range(n_src):
                e = np.exp(w[j] - mx) if w[j] != -np.inf else np.float32(0.0)
                w[j] = e
                tot += e
            inv = np.float32(1.0 / tot)
            acc = np.float32(0.0)
            for j in range(n_src):
                if overlap and j < ratio:
                    s = start - ratio + j
                    if s < 0:
                        v = np.float32(0.0)
                    else:
                        v = kv[s - p0, c] if s >= p0 else ring_kv[s % cap, c]
                else:
                    s = start + (j - ratio if overlap else j)
                    cc = c + d if overlap else c
                    v = kv[s - p0, cc] if s >= p0 else ring_kv[s % cap, cc]
                acc += v * (w[j] * inv)
            out[b, c] = acc


def build_entries(kv, score, positions, ratio, ring_kv, ring_score, norm, rms_eps, rope, n_rot,
                  out):
    """Compress, norm and rope the entries completed at ``positions`` into out (n_block, d):
    kv / score are the positions' compressor inputs, the rings hold the earlier ones."""
    d = out.shape[1]
    done = positions[(positions + 1) % ratio == 0]
    if done.size == 0:
        return
    compress_entries(kv, score, ring_kv, ring_score, positions, ratio, ratio == 4, d, out)
    blocks = done // ratio
    rows = np.ascontiguousarray(out[blocks])
    kernels.rmsnorm(rows, norm, np.float32(rms_eps), rows)
    kernels.rope(rows.reshape(len(blocks), 1, d)[:, :, d - n_rot:], blocks * ratio, rope[0], rope[1],
                 False)
    out[blocks] = rows


# --- the indexer and the attention ------------------------------------------------------------


@njit(cache=True, error_model="numpy")
def _dot64(a, b, n):
    """sum a[i] * b[i] in float64, over eight interleaved partial sums (a fixed order: the
    same result for a row wherever it is computed; independent sums pipeline)."""
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = 0.0
    m = n - n % 8
    for i in range(0, m, 8):
        s0 += np.float64(a[i]) * b[i]
        s1 += np.float64(a[i + 1]) * b[i + 1]
        s2 += np.float64(a[i + 2]) * b[i + 2]
        s3 += np.float64(a[i + 3]) * b[i + 3]
        s4 += np.float64(a[i + 4]) * b[i + 4]
        s5 += np.float64(a[i + 5]) * b[i + 5]
        s6 += np.float64(a[i + 6]) * b[i + 6]
        s7 += np.float64(a[i + 7]) * b[i + 7]
    for i in range(m, n):
        s0 += np.float64(a[i]) * b[i]
    return ((s0 + s4) + (s1 + s5)) + ((s2 + s6) + (s3 + s7))


@njit(cache=True, error_model="numpy", fastmath={"reassoc"})
def _dot32(a, b, n):
    """sum a[i] * b[i] in float32, vectorised (the order is the compiled loop's, the same for
    every call: a row's score does not depend on its batch)."""
    acc = np.float32(0.0)
    for i in range(n):
        acc += a[i] * b[i]
    return acc


@njit(cache=True, error_model="numpy")
def _axpy(o, key, p, n):
    for i in range(n):
        o[i] += key[i] * p


@njit(cache=True, error_model="numpy", parallel=True)
def indexer_top_k(iq, iw, keys, positions, ratio, top_k, sel, n_sel):
    """For each row t: the entries b < (p + 1) // ratio with the top_k highest indexer scores
    (all of them when there are no more than top_k) into sel[t, :n_sel[t]]. The entries'
    scores are computed in parallel (each on its own: the same result at any thread count)."""
    n_head, di = iq.shape[1], iq.shape[2]
    for t in range(positions.shape[0]):
        n_vis = (positions[t] + 1) // ratio
        if n_vis <= top_k:
            for b in range(n_vis):
                sel[t, b] = b
            n_sel[t] = n_vis
            continue
        sc = np.empty(n_vis, np.float32)
        for b in prange(n_vis):
            tot = np.float32(0.0)
            for h in range(n_head):
                dot = _dot64(iq[t, h], keys[b], di)
                if dot > 0.0:
                    tot += np.float32(dot) * iw[t, h]
            sc[b] = tot
        order = np.argsort(-sc, kind="mergesort")  # stable: ties keep the lower entry
        for j in range(top_k):
            sel[t, j] = order[j]
        n_sel[t] = top_k


@njit(cache=True, inline="always", error_model="numpy")
def _attended_key(j, kv, ring, p0, lo, n_raw, comp, sel_t):
    """Key j of _attend_one's list: raw row lo + j (row r - p0 of kv from p0 on, ring row
    r mod cap below) for j < n_raw, then the selected compressed entries."""
    if j < n_raw:
        r = lo + j
        return kv[r - p0] if r >= p0 else ring[r % ring.shape[0]]
    return comp[sel_t[j - n_raw]]


@njit(cache=True, error_model="numpy")
def _attend_one(qh, kv, ring, p0, lo, n_raw, comp, sel_t, m, sink, scale, s, o):
    """o = the sink softmax of qh . key * scale over the raw rows lo .. lo + n_raw - 1 (row
    s - p0 of kv from p0 on, ring row s mod cap below) then comp[sel_t[:m]], applied to them."""
    d = qh.shape[0]
    mx = sink
    for j in range(n_raw + m):
        key = _attended_key(j, kv, ring, p0, lo, n_raw, comp, sel_t)
        v = _dot32(qh, key, d) * scale
        s[j] = v
        mx = max(mx, v)
    tot = np.exp(np.float64(sink - mx))
    for j in range(n_raw + m):
        e = np.exp(s[j] - mx)
        s[j] = e
        tot += e
    inv = np.float32(1.0 / tot)
    for i in range(d):
        o[i] = 0.0
    for j in range(n_raw + m):
        _axpy(o, _attended_key(j, kv, ring, p0, lo, n_raw, comp, sel_t), s[j] * inv, d)


@njit(cache=True, error_model="numpy")
def _sink_attention_serial(q, kv, ring, positions, n_swa, comp, sel, n_sel, sinks, scale, out):
    """sink_attention on one thread (a decode step's few heads: no parallel region to wake)."""
    k, n_head, d = q.shape
    p0 = positions[0]
    s = np.empty(n_swa + sel.shape[1], np.float32)
    for t in range(k):
        p = positions[t]
        lo = max(0, p - n_swa + 1)
        for h in range(n_head):
            _attend_one(q[t, h], kv, ring, p0, lo, p + 1 - lo, comp, sel[t], n_sel[t], sinks[h],
                        scale, s, out[t, h])


#: below this many multiply-adds a sink attention runs on one thread
PARALLEL_ATTENTION_MACS = 1 << 21


def sink_attention(q, kv, ring, positions, n_swa, comp, sel, n_sel, sinks, scale, out):
    """out[t, h] = softmax over the window's raw rows, the selected entries and the sink, of
    q[t, h] . key * scale, applied to the keys (the values); see _sink_attention_parallel.
    Both variants run _attend_one per (row, head): the same result either way."""
    k, n_head, d = q.shape
    if k * n_head * (n_swa + sel.shape[1]) * d < PARALLEL_ATTENTION_MACS:
        _sink_attention_serial(q, kv, ring, positions, n_swa, comp, sel, n_sel, sinks, scale, out)
    else:
        _sink_attention_parallel(q, kv, ring, positions, n_swa, comp, sel, n_sel, sinks, scale, out)


@njit(cache=True, error_model="numpy", parallel=True)
def _sink_attention_parallel(q, kv, ring, positions, n_swa, comp, sel, n_sel, sinks, scale, out):
    """out[t, h] = softmax over the window's raw rows, the selected entries and the sink, of
    q[t, h] . key * scale, applied to the keys (the values). The batch's own rows (contiguous
    positions) come from kv, the earlier ones from the layer's ring; the (row, head) pairs
    run in parallel, each on its own."""
    k, n_head, d = q.shape
    n_max = n_swa + sel.shape[1]
    p0 = positions[0]
    for th in prange(k * n_head):
        t = th // n_head
        h = th - t * n_head
        p = positions[t]
        lo = max(0, p - n_swa + 1)
        s = np.empty(n_max, np.float32)
        _attend_one(q[t, h], kv, ring, p0, lo, p + 1 - lo, comp, sel[t], n_sel[t], sinks[h],
                    scale, s, out[t, h])


@njit(cache=True, error_model="numpy", parallel=True)
def sink_attention_rows(q, kv, ring, positions, lo, hi, sinks, scale, out):
    """out[t, h] = softmax over the raw rows lo[t] <= s < hi[t] and the sink, of
    q[t, h] . row_s * scale, applied to the rows (the values): a window that may reach past
    the query (a DSpark block's rows see the whole block), hi[t] <= positions[-1] + 1."""
    k, n_head, d = q.shape
    n_max = 0
    for t in range(k):
        n_max = max(n_max, hi[t] - lo[t])
    p0 = positions[0]
    none = np.zeros(1, np.int64)
    for th in prange(k * n_head):
        t = th // n_head
        h = th - t * n_head
        s = np.empty(max(n_max, 1), np.float32)
        _attend_one(q[t, h], kv, ring, p0, lo[t], hi[t] - lo[t], ring, none, 0, sinks[h], scale,
                    s, out[t, h])
