"""One rank's shard of a llama / qwen3 model, and the all-gathers that join the shards.

The shard is the ordinary decoder (``transformer.layer_forward``) on narrowed weights and
hyper-parameters. Every matrix is cut by **output rows** only (a row slice of a quantized
matrix keeps whole blocks, and each output element is the same dot product as on one rank):

    q, k, v      rows of this rank's heads (column-parallel by heads); kv heads are split with
                 the query groups when there are at least as many kv heads as ranks, else every
                 rank keeps the one kv head its query heads read (replicated)
    attn_output  rows [e0, e1) of n_embd, fed by the ALL-GATHERED attention output of every
                 head; the partial outputs are all-gathered again into the full residual update
    gate, up     rows [f0, f1) of n_ff (column-parallel)
    down         rows [e0, e1) of n_embd, fed by the all-gathered SwiGLU output; all-gathered

So a layer costs four all-gathers instead of the two all-reduces of a row-parallel split. The
reason is exactness: a row-parallel attn_output / ffn_down would sum partial dot products over
the ranks' slices of the input, a float reduction order that differs from one rank's kernel and
can flip a greedy token. With all-gathers every element of every activation is computed by the
same kernel over the same full row as without tensor parallelism, so the logits are
bit-identical to a single process at any rank count, and an all-gather (a concatenation in rank
order) cannot depend on timing. Norms, the token embedding and the output matrix are kept whole
on every rank (memory-mapped: a worker never touches the output matrix's pages).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np

from ..engine.weights import LayerWeights, Linear, ModelWeights


class TPError(ValueError):
    """A model or rank count tensor parallelism cannot split."""


def split_even(n: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ranges covering 0..n, sizes differing by at most one (larger first)."""
    base, extra = divmod(n, parts)
    out, lo = [], 0
    for r in range(parts):
        hi = lo + base + (1 if r < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out


@dataclass(frozen=True)
class HeadPlan:
    q: list            # per rank: (first, end) query heads
    kv: list           # per rank: (first, end) kv heads
    replicated_kv: bool


def plan_heads(n_head: int, n_head_kv: int, ranks: int) -> HeadPlan:
    if n_head < ranks:
        raise TPError(f"{n_head} attention heads cannot be split over {ranks} ranks")
    group = n_head // n_head_kv
    if n_head_kv >= ranks:  # whole query groups per rank: each kv head lives on one rank
        kv = split_even(n_head_kv, ranks)
        return HeadPlan([(a * group, b * group) for a, b in kv], kv, False)
    q = split_even(n_head, ranks)
    kv = []
    for a, b in q:
        if a // group != (b - 1) // group:
            raise TPError(f"{n_head} query heads in {n_head_kv} kv groups cannot be split over "
                          f"{ranks} ranks (a rank's heads would span two kv heads)")
        kv.append((a // group, a // group + 1))
    return HeadPlan(q, kv, True)


class Group:
    """The ranks' communicator and the time spent in its all-gathers."""

    def __init__(self, comm):
        from mpi4py import MPI
        self.MPI = MPI
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.seconds = 0.0
        self.calls = 0
        self.bytes = 0

    def allgather_cols(self, local: np.ndarray, counts, out: np.ndarray) -> np.ndarray:
        """out (k, sum(counts)) = the ranks' local (k, counts[r]) blocks side by side, in rank
        order (float32)."""
        t0 = time.perf_counter()
        k = local.shape[0]
        sizes = [k * c for c in counts]
        flat = np.empty(sum(sizes), np.float32)
        displs = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64).tolist()
        self.comm.Allgatherv(np.ascontiguousarray(local, np.float32),
                             [flat, sizes, displs, self.MPI.FLOAT])
        col = 0
        for c, d in zip(counts, displs):
            out[:, col:col + c] = flat[d:d + k * c].reshape(k, c)
            col += c
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        self.bytes += flat.nbytes
        return out


def row_slice(lin: Linear, lo: int, hi: int) -> Linear:
    """Rows [lo, hi) of a matrix: a view of its raw blocks (no copy)."""
    part = Linear(lin.name, lin.raw[lo:hi], lin.fmt, (hi - lo, lin.n_in), int8=lin.int8)
    part.whole_n_out = lin.whole_n_out
    return part


class GatheredLinear:
    """A matrix whose input arrives split by columns over the ranks and whose output rows are
    split too: all-gather the input, multiply this rank's rows, all-gather the output.
    Stands in for a Linear in the decoder (``matmul(x, out)``)."""

    def __init__(self, full: Linear, group: Group, in_counts, out_ranges):
        lo, hi = out_ranges[group.rank]
        self.inner = row_slice(full, lo, hi)
        self.group = group
        self.in_counts = list(in_counts)
        self.out_counts = [b - a for a, b in out_ranges]
        self.name, self.fmt, self.n_out, self.n_in = full.name, full.fmt, full.n_out, full.n_in
        self._in = self._out = None

    @property
    def int8(self):
        return self.inner.int8

    @int8.setter
    def int8(self, value):
        self.inner.int8 = value

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes

    def matmul(self, x, out: np.ndarray, int8=None) -> np.ndarray:
        k = x.shape[0]
        if self._in is None or self._in.shape[0] < k:
            self._in = np.empty((k, self.n_in), np.float32)
            self._out = np.empty((k, self.inner.n_out), np.float32)
        full_in = self._in[:k]
        self.group.allgather_cols(x, self.in_counts, full_in)
        part = self._out[:k]
        self.inner.matmul(full_in, part, int8)
        return self.group.allgather_cols(part, self.out_counts, out)


@dataclass
class ShardPlan:
    ranks: int
    heads: HeadPlan
    embd: list        # per rank: output rows of attn_output / ffn_down
    ff: list          # per rank: rows of gate / up
    experts: list | None = None   # per rank: (first, end) routed experts (MoE models)

    def describe(self) -> str:
        q = "+".join(str(b - a) for a, b in self.heads.q)
        ff = "+".join(str(b - a) for a, b in self.ff)
        kv = ("replicated" if self.heads.replicated_kv
              else "split " + "+".join(str(b - a) for a, b in self.heads.kv))
        ex = ("" if self.experts is None else
              ", experts " + "+".join(str(b - a) for a, b in self.experts))
        return f"query heads {q}, kv heads {kv}, ffn rows {ff}{ex}"

    def as_dict(self) -> dict:
        return {"query_heads": [b - a for a, b in self.heads.q],
                "kv_heads": [b - a for a, b in self.heads.kv],
                "kv_replicated": self.heads.replicated_kv,
                "ffn_rows": [b - a for a, b in self.ff],
                "embd_rows": [b - a for a, b in self.embd],
                "experts": None if self.experts is None else [b - a for a, b in self.experts]}


def plan_shards(hp, ranks: int) -> ShardPlan:
    if hp.n_ff < ranks or hp.n_embd < ranks:
        raise TPError(f"the model is too small to split over {ranks} ranks")
    return ShardPlan(ranks, plan_heads(hp.n_head, hp.n_head_kv, ranks),
                     split_even(hp.n_embd, ranks), split_even(hp.n_ff, ranks))


def local_hparams(hp, plan: ShardPlan, rank: int):
    (q0, q1), (k0, k1), (f0, f1) = plan.heads.q[rank], plan.heads.kv[rank], plan.ff[rank]
    return replace(hp, n_head=q1 - q0, n_head_kv=k1 - k0, n_ff=f1 - f0)


def _cut(v, lo, hi):
    return None if v is None else np.ascontiguousarray(v[lo:hi])


def shard_layer(lw: LayerWeights, hp, plan: ShardPlan, group: Group) -> LayerWeights:
    r, d = group.rank, hp.head_dim
    (q0, q1), (k0, k1), (f0, f1) = plan.heads.q[r], plan.heads.kv[r], plan.ff[r]
    q_counts = [(b - a) * d for a, b in plan.heads.q]
    ff_counts = [b - a for a, b in plan.ff]
    return LayerWeights(
        attn_norm=lw.attn_norm,
        wq=row_slice(lw.wq, q0 * d, q1 * d),
        wk=row_slice(lw.wk, k0 * d, k1 * d),
        wv=row_slice(lw.wv, k0 * d, k1 * d),
        wo=GatheredLinear(lw.wo, group, q_counts, plan.embd),
        ffn_norm=lw.ffn_norm,
        w_gate=row_slice(lw.w_gate, f0, f1),
        w_up=row_slice(lw.w_up, f0, f1),
        w_down=GatheredLinear(lw.w_down, group, ff_counts, plan.embd),
        q_norm=lw.q_norm, k_norm=lw.k_norm,
        bq=_cut(lw.bq, q0 * d, q1 * d), bk=_cut(lw.bk, k0 * d, k1 * d),
        bv=_cut(lw.bv, k0 * d, k1 * d), bo=lw.bo)


def shard_weights(w: ModelWeights, hp, plan: ShardPlan, group: Group) -> ModelWeights:
    return ModelWeights(w.token_embd, [shard_layer(lw, hp, plan, group) for lw in w.layers],
                        w.output_norm, w.output, w.rope_freqs, w.tied_output, w.formats_used)
