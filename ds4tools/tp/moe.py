"""glm4moe under tensor parallelism: attention and the leading dense FFNs split as for llama /
qwen3 (shard.py), the routed experts distributed over the ranks (expert parallelism).

Per MoE layer, with the post-attention norm's output h whole on every rank:

    ids, weights = the router's choice (the router is kept whole: every rank routes every row
                   the same way, no communication)
    rank r runs the (row, slot) pairs whose expert lies in its range [x0, x1): gate, up,
                   SwiGLU and down of those pairs only, one output row per pair
    all-gather the pairs' output rows (each pair computed on exactly one rank, in a
                   placement every rank knows from ids)
    out = the weighted sum of the slots in rank order (moe.weighted_sum) + the shared experts
                   (kept whole and run on every rank)

A pair's output row is the bits moe_forward computes for it (grouped_matmul gives a row the
bits a plain matmul of it gives), and the weighted sum is the one-process code on the same
inputs: the layer's output is bit-identical to one process.
"""
from __future__ import annotations

import numpy as np

from ..engine import kernels
from ..engine.glm4moe import Glm4MoeLayerWeights, Glm4MoeTransformer
from ..engine.moe import (ExpertMatrices, FeedForward, MoEWeights, feed_forward, select_experts,
                          weighted_sum)
from ..engine.transformer import Transformer, attention_block
from ..engine.weights import ModelWeights, SharedInput
from .shard import GatheredLinear, Group, ShardPlan, _cut, row_slice, split_even


def expert_slice(m: ExpertMatrices, lo: int, hi: int) -> ExpertMatrices:
    """Experts [lo, hi) of a 3-D expert tensor (a view of their blocks)."""
    return ExpertMatrices(m.name, m.raw[lo:hi], m.fmt, hi - lo, m.n_out, m.n_in, int8=m.int8,
                          n_used=m.n_used)


def shard_glm4moe_weights(w: ModelWeights, hp, plan: ShardPlan, group: Group, experts) -> ModelWeights:
    r, d = group.rank, hp.head_dim
    (q0, q1), (k0, k1), (f0, f1) = plan.heads.q[r], plan.heads.kv[r], plan.ff[r]
    x0, x1 = experts[r]
    q_counts = [(b - a) * d for a, b in plan.heads.q]
    ff_counts = [b - a for a, b in plan.ff]
    layers = []
    for lw in w.layers:
        dense = moe = None
        if lw.dense is not None:
            dense = FeedForward(row_slice(lw.dense.w_gate, f0, f1), row_slice(lw.dense.w_up, f0, f1),
                                GatheredLinear(lw.dense.w_down, group, ff_counts, plan.embd))
        if lw.moe is not None:
            m = lw.moe
            moe = MoEWeights(m.router, m.selection_bias, expert_slice(m.gate_exps, x0, x1),
                             expert_slice(m.up_exps, x0, x1), expert_slice(m.down_exps, x0, x1),
                             m.shared)
        layers.append(Glm4MoeLayerWeights(
            attn_norm=lw.attn_norm, wq=row_slice(lw.wq, q0 * d, q1 * d),
            wk=row_slice(lw.wk, k0 * d, k1 * d), wv=row_slice(lw.wv, k0 * d, k1 * d),
            wo=GatheredLinear(lw.wo, group, q_counts, plan.embd),
            post_attention_norm=lw.post_attention_norm, dense=dense, moe=moe,
            bq=_cut(lw.bq, q0 * d, q1 * d), bk=_cut(lw.bk, k0 * d, k1 * d),
            bv=_cut(lw.bv, k0 * d, k1 * d), q_norm=lw.q_norm, k_norm=lw.k_norm, bo=lw.bo))
    return ModelWeights(w.token_embd, layers, w.output_norm, w.output, w.rope_freqs,
                        w.tied_output, w.formats_used)


def moe_forward_tp(h, w: MoEWeights, hp, ws, out, group: Group, experts) -> None:
    """moe.moe_forward with this rank's experts only (module docstring)."""
    k, n_embd = h.shape
    n_used, F = hp.n_expert_used, hp.n_ff_exp
    hs = SharedInput(h)
    logits = ws.logits[:k]
    w.router.matmul(hs, logits)
    ids, weights = ws.ids[:k], ws.weights[:k]
    select_experts(logits, ws.no_bias if w.selection_bias is None else w.selection_bias,
                   hp.gating == "sigmoid", hp.n_group, hp.n_group_used, hp.normalize_weights,
                   np.float32(hp.weights_scale), ids, weights)
    flat = ids.reshape(-1)
    owner = np.searchsorted(np.array([b for _, b in experts]), flat, side="right")
    x0, x1 = experts[group.rank]
    mine = np.nonzero(owner == group.rank)[0]
    m = mine.shape[0]
    part = np.empty((m, n_embd), np.float32)
    if m:
        rows = np.ascontiguousarray(h[mine // n_used])
        eids = (flat[mine] - x0).reshape(m, 1)
        gate = np.empty((m, 1, F), np.float32)
        up = np.empty((m, 1, F), np.float32)
        rs = SharedInput(rows)
        w.gate_exps.matmul(rs, eids, gate)
        w.up_exps.matmul(rs, eids, up)
        act = gate.reshape(m, F)
        kernels.swiglu(act, up.reshape(m, F), act)
        w.down_exps.matmul(act, eids, part.reshape(m, 1, n_embd))
    counts = [int(np.count_nonzero(owner == r)) for r in range(group.size)]
    gathered = np.empty((1, sum(counts) * n_embd), np.float32)
    group.allgather_cols(part.reshape(1, -1), [c * n_embd for c in counts], gathered)
    order = np.concatenate([np.nonzero(owner == r)[0] for r in range(group.size)])
    down = ws.down[:k].reshape(k * n_used, n_embd)
    down[order] = gathered.reshape(-1, n_embd)
    weighted_sum(ws.down[:k], weights, out)
    if w.shared is not None:
        shared = ws.shared_out[:k]
        feed_forward(hs, w.shared, ws.shared_gate[:k], ws.shared_up[:k], shared)
        kernels.add_into(out, shared)


def layer_forward_tp(x, lw, hp, cache, layer, positions, limits, rope, ws, moe_ws, group, experts):
    """glm4moe.layer_forward with the experts distributed."""
    attention_block(x, lw, hp, cache, layer, positions, limits, rope, ws)
    k = x.shape[0]
    h = ws.norm[:k]
    o = ws.proj[:k]
    kernels.rmsnorm(x, lw.post_attention_norm, hp.rms_eps, h)
    if lw.moe is not None:
        moe_forward_tp(h, lw.moe, hp.moe, moe_ws, o, group, experts)
    else:
        feed_forward(h, lw.dense, ws.gate[:k], ws.up[:k], o)
    kernels.add_into(x, o)


def plan_experts(n_expert: int, ranks: int):
    if n_expert < ranks:
        raise ValueError(f"{n_expert} experts cannot be distributed over {ranks} ranks")
    return split_even(n_expert, ranks)


class Glm4MoeShardMixin:
    """run_layers of a glm4moe shard (the mixin goes before Glm4MoeTransformer)."""

    def run_layers(self, x, positions, limits, cache, hidden=None, layers=None):
        Transformer.run_layers(self, x, positions, limits, cache, None, layers=())  # the checks
        positions = np.ascontiguousarray(positions, np.int64)
        limits = np.ascontiguousarray(limits, np.int64)
        hp = self.layer_hp
        for il in (range(self.hp.n_layer) if layers is None else layers):
            if not 0 <= il < cache.n_layer:
                raise ValueError(f"layer {il} has no slot in a cache of {cache.n_layer} layers")
            layer_forward_tp(x, self.weights.layers[il], hp, cache, il, positions, limits,
                             self.rope, self.ws, self.moe_ws, self.group, self.experts)
            if hidden is not None and il in hidden:
                hidden[il].append(x.copy())


__all__ = ["Glm4MoeShardMixin", "Glm4MoeTransformer", "plan_experts", "shard_glm4moe_weights"]
