"""The mixture-of-experts feed-forward block, as llama.cpp's build_moe_ffn computes it.

    logits = h Wrouter                       (k, n_expert)
    probs  = softmax(logits) or sigmoid(logits)
    choose = probs + selection_bias          (DeepSeek V3 / GLM: the bias only picks experts)
    groups: keep the n_group_used groups with the largest sum of their top-2 ``choose``
    ids    = top n_used experts by ``choose``; weights = probs[ids]
             (/ their sum when normalised; * weights_scale)
    out    = sum_j weights[j] * down_j(silu(gate_j h) * up_j h)   over the chosen experts
           + the shared experts (a plain SwiGLU FFN every row goes through)

GGUF keeps each projection of all experts in one 3-D tensor, read only for the experts some
row chose, once per forward (unused experts' pages of the memory-mapped file stay on disk).
With K-quant experts on the int8 path (the Q*_K mixes) the whole routed part is one compiled
call (``routed_experts_kq``): the (row, slot) pairs sorted by expert, two parallel kernels
(gate + up of every used expert and of the shared FFN; then every down), no Python per expert.
Other formats go through ``ExpertMatrices.matmul`` -> ``formats.grouped_matmul`` per projection.

A row's result depends only on that row: routing is per row, grouped_matmul gives a row the
bits a plain matmul of that row would give, and the weighted sum adds the experts in the row's
own rank order. So a token's output does not depend on the batch it shares.

Shared by the architectures that use this block (glm4moe now; deepseek2 and glm-dsa later):
their hyper-parameters come from the same ``<arch>.expert_*`` keys.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from .. import formats
from ..formats._numeric import FP16_TO_FP32
from ..formats.activations import quantize_q8_k_rows
from ..formats.grouped import (LEGACY_F32_KIND, grouped_kq_act, grouped_kq_f32, grouped_kq_shared,
                               grouped_legacy_f32, grouped_matmul, kq_kind, prepared_rows,
                               sort_pairs)
from . import kernels
from .backends.cpu import CPU
from .kernels import weighted_sum  # noqa: F401  (this block's slot sum: deepseek4 and tp use it)
from .hparams import HParamsError, _get, _positive
from .weights import Linear, SharedInput, WeightsError, _linear, _tensor, _vector, int8_for

#: llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE values (0 means "the architecture's default")
GATING_FUNCS = {1: "softmax", 2: "sigmoid"}

#: ggml clamps the sum of the chosen weights to the smallest normal fp16 before dividing by it
_MIN_WEIGHT_SUM = np.float32(6.103515625e-5)


# --- hyper-parameters ---------------------------------------------------------------------------


@dataclass(frozen=True)
class MoEHParams:
    n_expert: int
    n_expert_used: int          # top-k
    n_ff_exp: int               # hidden width of one routed expert
    n_expert_shared: int = 0    # shared experts, stored as one FFN n_ff_exp * n_expert_shared wide
    gating: str = "softmax"     # "softmax" | "sigmoid"
    normalize_weights: bool = False
    weights_scale: float = 1.0
    n_group: int = 0            # expert groups (0 or 1: none)
    n_group_used: int = 0
    n_dense_lead: int = 0       # the first layers use a dense FFN instead

    @property
    def n_ff_shexp(self) -> int:
        return self.n_ff_exp * self.n_expert_shared

    def is_moe_layer(self, il: int) -> bool:
        return il >= self.n_dense_lead


def moe_hparams_from_metadata(meta: dict, arch: str, n_layer: int, *,
                              default_gating: str) -> MoEHParams:
    """The ``<arch>.expert_*`` keys, checked as llama.cpp's loader asserts them (one-line
    HParamsError naming the key). ``default_gating``: the scoring when the file names none
    (llama.cpp's per-architecture default: sigmoid for glm4moe)."""
    k = lambda name: f"{arch}.{name}"  # noqa: E731
    n_expert = _positive(k("expert_count"), _get(meta, k("expert_count"), int))
    n_used = _positive(k("expert_used_count"), _get(meta, k("expert_used_count"), int))
    if n_used > n_expert:
        raise HParamsError(f"{k('expert_used_count')} ({n_used}) is larger than "
                           f"{k('expert_count')} ({n_expert})")
    n_ff_exp = _positive(k("expert_feed_forward_length"), _get(meta, k("expert_feed_forward_length"), int))
    n_shared = _get(meta, k("expert_shared_count"), int, default=0, required=False)
    if n_shared < 0:
        raise HParamsError(f"metadata key {k('expert_shared_count')} must not be negative")
    func = _get(meta, k("expert_gating_func"), int, default=0, required=False)
    if func == 0:
        gating = default_gating
    elif func in GATING_FUNCS:
        gating = GATING_FUNCS[func]
    else:
        raise HParamsError(f"unsupported {k('expert_gating_func')} {func} (the engine runs "
                           f"{', '.join(f'{v} ({n})' for n, v in GATING_FUNCS.items())})")
    scale = _get(meta, k("expert_weights_scale"), float, default=0.0, required=False)
    norm = meta.get(k("expert_weights_norm"), False)
    if not isinstance(norm, (bool, np.bool_)):
        raise HParamsError(f"metadata key {k('expert_weights_norm')} must be a boolean")
    n_group = _get(meta, k("expert_group_count"), int, default=0, required=False)
    n_group_used = _get(meta, k("expert_group_used_count"), int, default=0, required=False)
    if n_group > 1:
        if n_group >= n_expert or n_expert % n_group:
            raise HParamsError(f"{k('expert_group_count')} ({n_group}) must divide "
                               f"{k('expert_count')} ({n_expert}) and be smaller")
        if not 0 < n_group_used < n_group:
            raise HParamsError(f"{k('expert_group_used_count')} ({n_group_used}) must be in "
                               f"1..{n_group - 1}")
        if n_used > n_group_used * (n_expert // n_group):
            raise HParamsError(f"{k('expert_used_count')} ({n_used}) is more than the "
                               f"{n_group_used} chosen groups hold")
    elif n_group < 0:
        raise HParamsError(f"metadata key {k('expert_group_count')} must not be negative")
    n_dense = _get(meta, k("leading_dense_block_count"), int, default=0, required=False)
    if not 0 <= n_dense <= n_layer:
        raise HParamsError(f"{k('leading_dense_block_count')} is {n_dense}: must be in 0..{n_layer}")
    return MoEHParams(n_expert=n_expert, n_expert_used=n_used, n_ff_exp=n_ff_exp,
                      n_expert_shared=n_shared, gating=gating, normalize_weights=bool(norm),
                      weights_scale=1.0 if scale == 0.0 else scale,  # 0: not set (llama.cpp)
                      n_group=n_group if n_group > 1 else 0,
                      n_group_used=n_group_used if n_group > 1 else 0, n_dense_lead=n_dense)


# --- weights ------------------------------------------------------------------------------------


class ExpertMatrices:
    """The n_expert matrices (n_out, n_in) of one projection, kept as the 3-D tensor's raw
    GGUF blocks (a view of the memory map: no copy, unused experts never read).

    Every multiply records how many distinct experts it read, by the number of rows of the
    call (``reads``: rows -> [calls, experts read]; ``last_read``: the last call's), so a
    benchmark can count the bytes a forward really streams (``expert_nbytes`` each)."""

    __slots__ = ("name", "raw", "fmt", "n_expert", "n_out", "n_in", "int8", "n_used", "reads",
                 "last_read", "kq_kind", "legacy_kind")

    def __init__(self, name: str, raw: np.ndarray, fmt, n_expert: int, n_out: int, n_in: int,
                 *, int8: bool = False, n_used: int | None = None):
        self.name = name
        self.fmt = formats.get_format(fmt)
        self.n_expert, self.n_out, self.n_in = int(n_expert), int(n_out), int(n_in)
        raw = np.asarray(raw)
        shape3 = (self.n_expert, self.n_out, self.fmt.row_bytes(self.n_in))
        if raw.flags.c_contiguous and raw.size == int(np.prod(shape3)):
            raw = raw.reshape(shape3)  # a view: the grouped kernels index experts directly
        self.raw = raw
        #: whether matmul takes ggml's int8-activation path (same rule as Linear)
        self.int8 = bool(int8 and self.fmt.has_int8_matmul)
        #: experts one row uses (the routing's top-k), or None where every expert is read
        self.n_used = n_used
        self.reads: dict[int, list[int]] = {}
        self.last_read = 0
        #: the K-quant kind when the one-call grouped kernel runs this tensor (int8 path)
        self.kq_kind = kq_kind(self.fmt) if self.int8 and raw.ndim == 3 else None
        #: the 32-block format's kind when its one-call float32 kernel runs this tensor
        self.legacy_kind = (LEGACY_F32_KIND.get(self.fmt.name)
                            if not self.int8 and raw.ndim == 3 else None)

    @property
    def nbytes(self) -> int:
        return self.raw.nbytes

    @property
    def expert_nbytes(self) -> int:
        """Bytes of one expert's matrix."""
        return self.raw.nbytes // self.n_expert

    def record(self, rows: int, n_read: int) -> None:
        """Count one multiply of ``rows`` rows that read ``n_read`` distinct experts."""
        r = self.reads.get(rows)
        if r is None:
            self.reads[rows] = [1, n_read]
        else:
            r[0] += 1
            r[1] += n_read
        self.last_read = n_read

    def reset_reads(self) -> None:
        self.reads.clear()
        self.last_read = 0

    def bytes_per_call(self, rows: int = 1) -> float:
        """Average bytes a multiply of ``rows`` rows read, over the calls recorded since
        reset_reads; without any: the top-k's experts for one row, else the whole tensor."""
        r = self.reads.get(rows)
        if r is not None and r[0]:
            return r[1] / r[0] * self.expert_nbytes
        if rows == 1 and self.n_used is not None:
            return min(self.n_used, self.n_expert) * self.expert_nbytes
        return float(self.nbytes)

    def matmul(self, x, expert_ids: np.ndarray, out: np.ndarray, *, record: bool = True,
               device_ids=None) -> np.ndarray:
        """out[t, j] = x[t] @ W[expert_ids[t, j]].T; x float32 (k, n_in) or a SharedInput.
        ``record``: count the experts read under the call's row count (see ``reads``).
        ``device_ids``: the same ids already on the device (fixed ids, such as MLA's per-head
        ones, uploaded once; a device backend's matmul reads them; here they are the host's)."""
        shared = x if isinstance(x, SharedInput) else None
        rows = shared.x if shared is not None else x
        if ((self.kq_kind is not None or self.legacy_kind is not None)
                and out.flags.c_contiguous and rows.dtype == np.float32):
            # one compiled call (the decoder's own buffers: no checks but the ids')
            ids = expert_ids
            flat = out.reshape(ids.shape[0] * ids.shape[1], self.n_out)
            if self.kq_kind is None:
                n_read = grouped_legacy_f32(self.legacy_kind, self.raw, FP16_TO_FP32, rows, ids, flat)
            elif shared is not None:
                act = shared.quantized("Q8_K")
                n_read = grouped_kq_act(self.kq_kind, self.raw, act.q, act.d, act.sums, ids, flat)
            else:
                n_read = grouped_kq_f32(self.kq_kind, self.raw, rows, ids, flat)
            if record:
                self.record(ids.shape[0], n_read)
            return out
        act = shared.quantized(self.fmt.act_type) if shared is not None and self.int8 else None
        if record:
            ids = np.asarray(expert_ids)
            self.record(ids.shape[0], _distinct(ids))
        return grouped_matmul(self.raw, self.fmt, self.n_out, self.n_in, rows, expert_ids, out,
                              int8=self.int8, act=act)

    def __repr__(self) -> str:
        return (f"<ExpertMatrices {self.name} {self.fmt.name} {self.n_expert}x{self.n_out}x{self.n_in}"
                f"{' int8' if self.int8 else ''}>")


def _distinct(ids: np.ndarray) -> int:
    return int(np.unique(ids).size) if ids.size > 1 else int(ids.size)


@dataclass
class FeedForward:
    """A SwiGLU FFN (a dense layer's, or the shared experts')."""
    w_gate: Linear
    w_up: Linear
    w_down: Linear

    def linears(self) -> list:
        return [self.w_gate, self.w_up, self.w_down]


@dataclass
class MoEWeights:
    router: Linear                       # ffn_gate_inp (n_expert, n_embd)
    selection_bias: np.ndarray | None    # exp_probs_b (n_expert,), or None
    gate_exps: ExpertMatrices
    up_exps: ExpertMatrices
    down_exps: ExpertMatrices
    shared: FeedForward | None = None

    def linears(self) -> list:
        return ([self.router, self.gate_exps, self.up_exps, self.down_exps]
                + (self.shared.linears() if self.shared is not None else []))


def load_feed_forward(tensors: dict, prefix: str, suffix: str, n_embd: int, n_ff: int,
                      int8: str) -> FeedForward:
    """``<prefix>ffn_{gate,up,down}<suffix>.weight`` (suffix "" for a dense FFN, "_shexp")."""
    p = prefix
    return FeedForward(_linear(tensors, f"{p}ffn_gate{suffix}.weight", n_ff, n_embd, int8),
                       _linear(tensors, f"{p}ffn_up{suffix}.weight", n_ff, n_embd, int8),
                       _linear(tensors, f"{p}ffn_down{suffix}.weight", n_embd, n_ff, int8))


def _experts(tensors: dict, name: str, hp: MoEHParams, count_key: str, n_out: int, n_in: int,
             int8: str) -> ExpertMatrices:
    t = tensors.get(name)
    if t is None:
        raise WeightsError(f"missing tensor {name}")
    shape = tuple(int(s) for s in t.shape)
    if len(shape) == 3 and shape[0] != hp.n_expert and shape[1:] == (n_out, n_in):
        raise WeightsError(f"tensor {name} holds {shape[0]} experts but {count_key} is {hp.n_expert}")
    t = _tensor(tensors, name, (hp.n_expert, n_out, n_in))
    fmt = formats.format_for_type(t.ggml_type)
    if n_in % fmt.block_size:
        raise WeightsError(f"tensor {name}: row length {n_in} is not a multiple of "
                           f"{fmt.name}'s block size {fmt.block_size}")
    return ExpertMatrices(name, np.asarray(t.raw()), fmt, hp.n_expert, n_out, n_in,
                          int8=int8_for(fmt, int8, n_in), n_used=hp.n_expert_used)


def load_moe(tensors: dict, prefix: str, hp: MoEHParams, n_embd: int, arch: str, int8: str, *,
             selection_bias_required: bool) -> MoEWeights:
    """One layer's MoE block from llama.cpp's tensor names under ``prefix`` (``blk.N.``)."""
    p, H, F = prefix, n_embd, hp.n_ff_exp
    key = f"{arch}.expert_count"
    return MoEWeights(
        router=_linear(tensors, p + "ffn_gate_inp.weight", hp.n_expert, H, int8),
        selection_bias=_vector(tensors, p + "exp_probs_b.bias", hp.n_expert,
                               required=selection_bias_required),
        gate_exps=_experts(tensors, p + "ffn_gate_exps.weight", hp, key, F, H, int8),
        up_exps=_experts(tensors, p + "ffn_up_exps.weight", hp, key, F, H, int8),
        down_exps=_experts(tensors, p + "ffn_down_exps.weight", hp, key, H, F, int8),
        shared=(load_feed_forward(tensors, p, "_shexp", H, hp.n_ff_shexp, int8)
                if hp.n_expert_shared else None))


MOE_TENSORS = ("ffn_gate_inp.weight", "exp_probs_b.bias", "ffn_gate_exps.weight",
               "ffn_up_exps.weight", "ffn_down_exps.weight", "ffn_gate_shexp.weight",
               "ffn_up_shexp.weight", "ffn_down_shexp.weight")


# --- the forward --------------------------------------------------------------------------------


class MoEWorkspace:
    """The block's activation buffers for up to ``rows`` rows on the device of backend ``ops``
    (see transformer.Workspace); the routing (ids, weights) is worked out on the host."""

    def __init__(self, hp: MoEHParams, n_embd: int, rows: int, ops=CPU):
        f = np.float32
        self.ops = ops
        self.logits = ops.empty((rows, hp.n_expert))
        self.ids = np.empty((rows, hp.n_expert_used), np.int64)
        self.weights = np.empty((rows, hp.n_expert_used), f)
        self.gate = ops.empty((rows, hp.n_expert_used, hp.n_ff_exp))
        self.up = ops.empty((rows, hp.n_expert_used, hp.n_ff_exp))
        self.down = ops.empty((rows, hp.n_expert_used, n_embd))
        self.shared_gate = ops.empty((rows, hp.n_ff_shexp))
        self.shared_up = ops.empty((rows, hp.n_ff_shexp))
        self.shared_out = ops.empty((rows, n_embd))
        self.no_bias = np.zeros(0, f)
        # the one-call path: the (row, slot) pairs sorted by expert (see formats.grouped)
        self.order = np.empty(rows * hp.n_expert_used, np.int64)
        self.starts = np.empty(hp.n_expert + 1, np.int64)
        self.experts = np.empty(hp.n_expert, np.int64)
        self.pos = np.empty((rows, hp.n_expert_used), np.int64)


@njit(cache=True, error_model="numpy")
def select_experts(logits, selection_bias, sigmoid, n_group, n_group_used, normalize, scale,
                   ids, weights):
    """Route every row: ids (k, n_used) the chosen experts, best first; weights (k, n_used)
    their unbiased scores, normalised and scaled as asked. ``selection_bias`` (n_expert,) or
    empty; ``n_group`` > 1 restricts each row to its n_group_used best groups."""
    k, n_expert = logits.shape
    n_used = ids.shape[1]
    probs = np.empty(n_expert, np.float32)
    choose = np.empty(n_expert, np.float32)
    taken = np.empty(n_expert, np.bool_)
    per_group = n_expert // n_group if n_group > 1 else n_expert
    group_score = np.empty(max(n_group, 1), np.float32)
    group_taken = np.empty(max(n_group, 1), np.bool_)
    for t in range(k):
        row = logits[t]
        if sigmoid:
            for e in range(n_expert):
                probs[e] = np.float32(1.0) / (np.float32(1.0) + kernels.exp_f32(-row[e]))
        else:  # as ggml_soft_max: max subtracted, the sum in double, one reciprocal
            m = row[0]
            for e in range(1, n_expert):
                m = max(m, row[e])
            s = 0.0
            for e in range(n_expert):
                probs[e] = kernels.exp_f32(row[e] - m)
                s += np.float64(probs[e])
            inv = np.float32(1.0 / s)
            for e in range(n_expert):
                probs[e] *= inv
        for e in range(n_expert):
            choose[e] = probs[e] + selection_bias[e] if selection_bias.shape[0] else probs[e]
            taken[e] = False
        if n_group > 1:
            # a group's score is the sum of its two best; experts outside the best groups
            # cannot be chosen (marked taken)
            for g in range(n_group):
                b1 = -np.inf
                b2 = -np.inf
                for e in range(g * per_group, (g + 1) * per_group):
                    v = choose[e]
                    if v > b1:
                        b2 = b1
                        b1 = v
                    elif v > b2:
                        b2 = v
                group_score[g] = b1 + b2 if per_group > 1 else b1
                group_taken[g] = False
            for _ in range(n_group_used):
                best = -1
                for g in range(n_group):
                    if not group_taken[g] and (best < 0 or group_score[g] > group_score[best]):
                        best = g
                group_taken[best] = True
            for g in range(n_group):
                if not group_taken[g]:
                    for e in range(g * per_group, (g + 1) * per_group):
                        taken[e] = True
        total = np.float32(0.0)
        for j in range(n_used):  # top-k by repeated maximum: n_used is small
            best = -1
            for e in range(n_expert):
                if not taken[e] and (best < 0 or choose[e] > choose[best]):
                    best = e
            taken[best] = True
            ids[t, j] = best
            weights[t, j] = probs[best]
            total += probs[best]
        if normalize:
            total = max(total, _MIN_WEIGHT_SUM)
            for j in range(n_used):
                weights[t, j] = weights[t, j] / total
        if scale != np.float32(1.0):
            for j in range(n_used):
                weights[t, j] = weights[t, j] * scale


def feed_forward(h, ffn: FeedForward, gate, up, out, ops=CPU) -> None:
    """out = (silu(h Wg) * h Wu) Wd for h (k, n_embd) float32 or a SharedInput, on backend
    ``ops``'s arrays."""
    hs = h if isinstance(h, SharedInput) else SharedInput(h)  # quantized once for gate and up
    ffn.w_gate.matmul(hs, gate)
    ffn.w_up.matmul(hs, up)
    ops.swiglu(gate, up, gate)
    ffn.w_down.matmul(gate, out)


def _fast_path(w: MoEWeights) -> bool:
    """Whether the routed experts run through the one-call grouped kernels: the K-quants on
    the int8 path, gate and up of one format."""
    g, u, d = w.gate_exps, w.up_exps, w.down_exps
    return (g.kq_kind is not None and d.kq_kind is not None and u.kq_kind == g.kq_kind
            and g.fmt.act_type == "Q8_K" and d.fmt.act_type == "Q8_K")


@njit(cache=True, error_model="numpy")
def weighted_sum_sorted(down, pos, weights, out):
    """weighted_sum with the (row, slot) results at down[pos[t, j]] (sorted by expert): the same
    products and the same order of additions, so the same bits."""
    k, n_used = pos.shape
    n = down.shape[1]
    for t in range(k):
        w0 = weights[t, 0]
        r0 = down[pos[t, 0]]
        for i in range(n):
            out[t, i] = r0[i] * w0
        for j in range(1, n_used):
            w = weights[t, j]
            r = down[pos[t, j]]
            for i in range(n):
                out[t, i] = out[t, i] + r[i] * w


def _shared_fast(w: MoEWeights):
    """The shared FFN's K-quant kinds (gate / up, down) when it can join the grouped calls."""
    sh = w.shared
    if sh is None or not (sh.w_gate.int8 and sh.w_up.int8 and sh.w_down.int8):
        return None
    kg, ku, kd = (kq_kind(m.fmt) for m in sh.linears())
    if kg is None or kg != ku or kd is None:
        return None
    return kg, kd


@njit(cache=True)
def _swiglu_rows(gate, up):
    if gate.shape[0] >= 64:
        kernels._swiglu_parallel(gate, up, gate)
    else:
        tmp = np.empty(256, np.float32)
        for t in range(gate.shape[0]):
            kernels._swiglu_row(gate[t], up[t], gate[t], tmp)


@njit(cache=True)
def routed_experts_kq(x, ids, weights, n_expert, g_kind, g_raw, u_raw, d_kind, d_raw,
                      s_on, sg_kind, sg_raw, su_raw, sd_kind, sd_raw,
                      order, starts, experts, pos, gate, up, down, s_gate, s_up, s_out, out):
    """The routed experts of rows x (k, n_embd), K-quant weights on the int8 path, in one
    compiled call: the (row, slot) pairs sorted by expert, x quantized once (Q8_K) and laid out
    for the kernels, one parallel call for gate + up of every used expert (+ the shared FFN's
    when ``s_on``), SwiGLU, one parallel call for down; out = the weighted sum (slots in rank
    order) + the shared FFN's output (left in s_out). Returns the number of experts used."""
    k = x.shape[0]
    n_used = ids.shape[1]
    P = k * n_used
    n = sort_pairs(ids, n_expert, order, starts, experts)
    rows = np.empty(P, np.int64)
    for p in range(P):
        o = order[p]
        t = o // n_used
        rows[p] = t
        pos[t, o - t * n_used] = p
    max_count = 1
    for i in range(n):
        max_count = max(max_count, starts[i + 1] - starts[i])
    q, d, sums = quantize_q8_k_rows(x)
    xq_f, xq_t, dx, dxs = prepared_rows(g_kind, q, d, sums, rows, max_count)
    all_rows = np.arange(k)
    if s_on:
        sxq_f, sxq_t, sdx, sdxs = prepared_rows(sg_kind, q, d, sums, all_rows, k)
        grouped_kq_shared(g_kind, g_raw, u_raw, 2, xq_f, xq_t, dx, dxs, starts, experts, n,
                          gate, up, sg_kind, sg_raw, su_raw, sxq_f, sxq_t, sdx, sdxs, k,
                          s_gate, s_up)
        _swiglu_rows(s_gate, s_up)
    else:
        grouped_kq_shared(g_kind, g_raw, u_raw, 2, xq_f, xq_t, dx, dxs, starts, experts, n,
                          gate, up, sg_kind, sg_raw, su_raw, xq_f, xq_t, dx, dxs, 0,
                          s_gate, s_up)
    _swiglu_rows(gate, up)
    q, d, sums = quantize_q8_k_rows(gate)
    xq_f, xq_t, dx, dxs = prepared_rows(d_kind, q, d, sums, np.arange(P), max_count)
    if s_on:
        q, d, sums = quantize_q8_k_rows(s_gate)
        sxq_f, sxq_t, sdx, sdxs = prepared_rows(sd_kind, q, d, sums, all_rows, k)
        grouped_kq_shared(d_kind, d_raw, d_raw, 1, xq_f, xq_t, dx, dxs, starts, experts, n,
                          down, down, sd_kind, sd_raw, sd_raw, sxq_f, sxq_t, sdx, sdxs, k,
                          s_out, s_out)
    else:
        grouped_kq_shared(d_kind, d_raw, d_raw, 1, xq_f, xq_t, dx, dxs, starts, experts, n,
                          down, down, sd_kind, sd_raw, sd_raw, xq_f, xq_t, dx, dxs, 0,
                          s_out, s_out)
    weighted_sum_sorted(down, pos, weights, out)
    if s_on:
        kernels.add_into(out, s_out)
    return n


_NO_RAW = np.zeros((1, 1), np.uint8)


def _routed_experts_fast(h: np.ndarray, w: MoEWeights, hp: MoEHParams, ws: MoEWorkspace,
                         ids: np.ndarray, weights: np.ndarray, out: np.ndarray) -> bool:
    """The routed experts (and, where it can, the shared FFN: then added to out here) in one
    compiled call (routed_experts_kq). Returns whether the shared FFN was done."""
    k, n_embd = h.shape
    n_used, F = hp.n_expert_used, hp.n_ff_exp
    P = k * n_used
    g, u, d = w.gate_exps, w.up_exps, w.down_exps
    shared = _shared_fast(w)
    if shared is not None:
        sh = w.shared
        s_args = (True, shared[0], sh.w_gate.raw, sh.w_up.raw, shared[1], sh.w_down.raw)
    else:
        s_args = (False, 0, _NO_RAW, _NO_RAW, 0, _NO_RAW)
    n = routed_experts_kq(h, ids, weights, hp.n_expert, g.kq_kind, g.raw, u.raw, d.kq_kind, d.raw,
                          *s_args, ws.order[:P], ws.starts, ws.experts, ws.pos[:k],
                          ws.gate.reshape(-1, F)[:P], ws.up.reshape(-1, F)[:P],
                          ws.down.reshape(-1, n_embd)[:P], ws.shared_gate[:k], ws.shared_up[:k],
                          ws.shared_out[:k], out)
    g.record(k, n)
    u.record(k, n)
    d.record(k, n)
    return shared is not None


def moe_forward(h: np.ndarray, w: MoEWeights, hp: MoEHParams, ws: MoEWorkspace,
                out: np.ndarray) -> None:
    """out (k, n_embd) = the routed experts' weighted sum (+ the shared experts) of h."""
    k, n_embd = h.shape
    n_used, F = hp.n_expert_used, hp.n_ff_exp
    ops = ws.ops
    hs = SharedInput(h)  # quantized once for the router, the experts' gate and up, the shared FFN
    logits = ws.logits[:k]
    w.router.matmul(hs, logits)
    ids, weights = ws.ids[:k], ws.weights[:k]
    # routing on the host (a GPU sends back k x n_expert logits): the experts to read are
    # known before any expert matrix is touched
    select_experts(ops.to_host(logits),
                   ws.no_bias if w.selection_bias is None else ops.to_host(w.selection_bias),
                   hp.gating == "sigmoid", hp.n_group, hp.n_group_used, hp.normalize_weights,
                   np.float32(hp.weights_scale), ids, weights)
    if _fast_path(w):
        if _routed_experts_fast(h, w, hp, ws, ids, weights, out):
            return  # the shared FFN too
    else:
        n_read = _distinct(ids)
        for m in (w.gate_exps, w.up_exps, w.down_exps):
            m.record(k, n_read)
        gate, up = ws.gate[:k], ws.up[:k]
        w.gate_exps.matmul(hs, ids, gate, record=False)
        w.up_exps.matmul(hs, ids, up, record=False)
        act = gate.reshape(k * n_used, F)
        ops.swiglu(act, up.reshape(k * n_used, F), act)
        # each (row, slot) has its own input for the down projection: one row per pair
        down = ws.down[:k]
        w.down_exps.matmul(act, ids.reshape(k * n_used, 1), down.reshape(k * n_used, 1, n_embd),
                           record=False)
        ops.weighted_sum(down, ops.asarray(weights), out)
    if w.shared is not None:
        shared = ws.shared_out[:k]
        feed_forward(hs, w.shared, ws.shared_gate[:k], ws.shared_up[:k], shared, ops)
        ops.add_into(out, shared)  # routed + shared, then the caller adds the residual
