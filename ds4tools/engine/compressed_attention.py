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

``CompressedCache`` keeps, per layer and position, the raw row and both compressors' inputs
(kv, score), and the entries built from them. An entry depends only on positions below its
end, so truncating the cache to n (moving the length) leaves exactly the state a fresh prefill
of n positions builds: entries at or past n are rebuilt when their positions are decoded again.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from . import kernels


@dataclass(frozen=True)
class CacheLayout:
    """Per layer: ratio (0, 4 or 128), the widths of its rows."""
    ratios: tuple
    head_dim: int
    idx_dim: int


@dataclass(frozen=True)
class CompressedSnapshot:
    length: int
    arrays: tuple


class CompressedCache:
    """Raw rows (n_layer, n_ctx, head_dim) and, for the compressed layers, the compressors'
    inputs per position and the entries per block. ``length`` as KVCache's."""

    cache_type = "f32"

    def __init__(self, layout: CacheLayout, n_ctx: int):
        if n_ctx <= 0:
            raise ValueError("cache dimensions must be positive")
        f = np.float32
        d, di = layout.head_dim, layout.idx_dim
        self.layout = layout
        self.n_ctx = n_ctx
        self.length = 0
        n_layer = len(layout.ratios)
        self.raw = np.zeros((n_layer, n_ctx, d), f)
        self.comp_kv, self.comp_score, self.comp = [], [], []
        self.idx_kv, self.idx_score, self.idx = [], [], []
        for r in layout.ratios:
            coff = 2 if r == 4 else 1
            has = r > 0
            nb = n_ctx // r + 1 if has else 0
            self.comp_kv.append(np.zeros((n_ctx, coff * d), f) if has else None)
            self.comp_score.append(np.zeros((n_ctx, coff * d), f) if has else None)
            self.comp.append(np.zeros((nb, d), f) if has else None)
            ind = r == 4
            self.idx_kv.append(np.zeros((n_ctx, 2 * di), f) if ind else None)
            self.idx_score.append(np.zeros((n_ctx, 2 * di), f) if ind else None)
            self.idx.append(np.zeros((nb, di), f) if ind else None)

    @property
    def n_layer(self) -> int:
        return self.raw.shape[0]

    def truncate(self, n: int) -> None:
        """Forget positions n and above (O(1)); the entries they completed go with them."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {n}")
        self.length = n

    def clear(self) -> None:
        self.length = 0

    def _arrays(self):
        out = [self.raw]
        for lst in (self.comp_kv, self.comp_score, self.comp, self.idx_kv, self.idx_score, self.idx):
            out.extend(a for a in lst if a is not None)
        return out

    def snapshot(self) -> CompressedSnapshot:
        """A copy of every array (positions below the length and the entries they made)."""
        return CompressedSnapshot(self.length, tuple(a.copy() for a in self._arrays()))

    def restore(self, snap: CompressedSnapshot) -> None:
        mine = self._arrays()
        if len(mine) != len(snap.arrays) or any(a.shape != b.shape for a, b in zip(mine, snap.arrays)):
            raise ValueError("snapshot does not fit this cache")
        for a, b in zip(mine, snap.arrays):
            a[...] = b
        self.length = snap.length


# --- compression --------------------------------------------------------------------------------


@njit(cache=True, error_model="numpy")
def compress_entries(kv, score, positions, ratio, overlap, d, out):
    """Build the entries that the rows at ``positions`` complete: out[b] for every position p
    with (p + 1) % ratio == 0, b = p // ratio (see the module doc)."""
    n_src = 2 * ratio if overlap else ratio
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
                    v = score[s, c] if s >= 0 else -np.inf
                else:
                    s = start + (j - ratio if overlap else j)
                    v = score[s, c + d] if overlap else score[s, c]
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
                    v = kv[s, c] if s >= 0 else np.float32(0.0)
                else:
                    s = start + (j - ratio if overlap else j)
                    v = kv[s, c + d] if overlap else kv[s, c]
                acc += v * (w[j] * inv)
            out[b, c] = acc


def build_entries(kv_rows, score_rows, positions, ratio, norm, rms_eps, rope, n_rot, out):
    """Compress, norm and rope the entries completed at ``positions`` into out (n_block, d)."""
    d = out.shape[1]
    done = positions[(positions + 1) % ratio == 0]
    if done.size == 0:
        return
    compress_entries(kv_rows, score_rows, positions, ratio, ratio == 4, d, out)
    blocks = done // ratio
    rows = np.ascontiguousarray(out[blocks])
    kernels.rmsnorm(rows, norm, np.float32(rms_eps), rows)
    kernels.rope(rows.reshape(len(blocks), 1, d)[:, :, d - n_rot:], blocks * ratio, rope[0], rope[1],
                 False)
    out[blocks] = rows


# --- the indexer and the attention ------------------------------------------------------------


@njit(cache=True, error_model="numpy")
def indexer_top_k(iq, iw, keys, positions, ratio, top_k, sel, n_sel):
    """For each row t: the entries b < (p + 1) // ratio with the top_k highest indexer scores
    (all of them when there are no more than top_k) into sel[t, :n_sel[t]]."""
    n_head, di = iq.shape[1], iq.shape[2]
    for t in range(positions.shape[0]):
        n_vis = (positions[t] + 1) // ratio
        if n_vis <= top_k:
            for b in range(n_vis):
                sel[t, b] = b
            n_sel[t] = n_vis
            continue
        sc = np.empty(n_vis, np.float32)
        for b in range(n_vis):
            tot = np.float32(0.0)
            for h in range(n_head):
                dot = 0.0
                for i in range(di):
                    dot += np.float64(iq[t, h, i]) * keys[b, i]
                if dot > 0.0:
                    tot += np.float32(dot) * iw[t, h]
            sc[b] = tot
        order = np.argsort(-sc, kind="mergesort")  # stable: ties keep the lower entry
        for j in range(top_k):
            sel[t, j] = order[j]
        n_sel[t] = top_k


@njit(cache=True, error_model="numpy")
def sink_attention(q, raw, positions, n_swa, comp, sel, n_sel, sinks, scale, out):
    """out[t, h] = softmax over the window's raw rows, the selected entries and the sink, of
    q[t, h] . key * scale, applied to the keys (the values)."""
    k, n_head, d = q.shape
    n_max = n_swa + sel.shape[1]
    s = np.empty(n_max, np.float32)
    for t in range(k):
        p = positions[t]
        lo = max(0, p - n_swa + 1)
        n_raw = p + 1 - lo
        m = n_sel[t]
        for h in range(n_head):
            qh = q[t, h]
            mx = sinks[h]
            for j in range(n_raw + m):
                key = raw[lo + j] if j < n_raw else comp[sel[t, j - n_raw]]
                dot = 0.0
                for i in range(d):
                    dot += np.float64(qh[i]) * key[i]
                v = np.float32(dot) * scale
                s[j] = v
                mx = max(mx, v)
            tot = np.exp(np.float64(sinks[h] - mx))
            for j in range(n_raw + m):
                e = np.exp(s[j] - mx)
                s[j] = e
                tot += e
            inv = np.float32(1.0 / tot)
            o = out[t, h]
            for i in range(d):
                o[i] = 0.0
            for j in range(n_raw + m):
                key = raw[lo + j] if j < n_raw else comp[sel[t, j - n_raw]]
                pj = s[j] * inv
                for i in range(d):
                    o[i] += key[i] * pj


@njit(cache=True, error_model="numpy")
def sink_attention_rows(q, raw, lo, hi, sinks, scale, out):
    """out[t, h] = softmax over the raw rows lo[t] <= s < hi[t] and the sink, of
    q[t, h] . raw[s] * scale, applied to the rows (the values): a window that may reach past
    the query (a DSpark block's rows see the whole block)."""
    k, n_head, d = q.shape
    n_max = 0
    for t in range(k):
        n_max = max(n_max, hi[t] - lo[t])
    s = np.empty(max(n_max, 1), np.float32)
    for t in range(k):
        n = hi[t] - lo[t]
        for h in range(n_head):
            qh = q[t, h]
            mx = sinks[h]
            for j in range(n):
                key = raw[lo[t] + j]
                dot = 0.0
                for i in range(d):
                    dot += np.float64(qh[i]) * key[i]
                v = np.float32(dot) * scale
                s[j] = v
                mx = max(mx, v)
            tot = np.exp(np.float64(sinks[h] - mx))
            for j in range(n):
                e = np.exp(s[j] - mx)
                s[j] = e
                tot += e
            inv = np.float32(1.0 / tot)
            o = out[t, h]
            for i in range(d):
                o[i] = 0.0
            for j in range(n):
                key = raw[lo[t] + j]
                pj = s[j] * inv
                for i in range(d):
                    o[i] += key[i] * pj
