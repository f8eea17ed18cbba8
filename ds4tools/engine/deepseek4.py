"""DeepSeek V4 Flash (llama.cpp's ``deepseek4``), top to bottom.

    X = hc copies of embed(token)                 the hyper-connection streams (k, hc, n_embd)
    for each layer:
        h, post, comb = hc_pre(X, hc_attn_*)      hyper_connections.py
        h = rmsnorm(h)                            attn_norm
        X = hc_post(attention(h), X, post, comb)
        h, post, comb = hc_pre(X, hc_ffn_*)
        h = rmsnorm(h)                            ffn_norm
        X = hc_post(moe(h) + shared(h), X, post, comb)
    logits = Wout rmsnorm(hc_head(X))             output_hc_*, output_norm

attention(h), one shared KV head of width d whose last n_rot dimensions are rotated:
    qr = rmsnorm(Wq_a h)                          attn_q_a_norm
    q  = per-head rmsnorm(Wq_b qr) (no weight), roped at p
    kv = rmsnorm(Wkv h) (attn_kv_a_norm), roped at p: the raw row; keys and values both
    o  = sink attention over the window and the compressed entries (compressed_attention.py)
    o  = o with the rope undone at p (rotated back on the last n_rot dims)
    out = Wo_b [Wo_a[g] o_g for each of the output_group_count head groups]
Layers with compress ratio 0 rope with rope.freq_base and no scaling; the compressed ones
(ratio 4: with the indexer's top-k; ratio 128: every entry) with
attention.compress_rope_freq_base and the file's rope scaling (YaRN: ramp as ggml, and no
net magnitude scaling: llama.cpp passes 1 / (1 + 0.1 ln s) as the attention factor).

moe(h): scores sqrt(softplus(Wrouter h)); experts: the top expert_used_count of scores +
exp_probs_b, or, on the first hash_layer_count layers, the token id's row of ffn_gate_tid2eid;
weights: the chosen scores (normalised, scaled); each expert and the shared one run SwiGLU
with the clamp: silu(min(g, L)) * clamp(u, -L, L), L = swiglu_clamp_exp (the shared one:
swiglu_clamp_shexp, else the same), no clamp where L is 0.

Files that carry the MTP block (nextn_predict_layers, after the decoder blocks) load: its
tensors are checked by name; the MTP drafter runs it (--glm-mtp), or ds4's MTP support file
(--mtp FILE, mtp.0.*), through Deepseek4MtpHead. ``final_hidden`` of a forward is the streams
before the head (k, hc * n_embd): what the MTP layer reads, as llama.cpp's h_nextn. ds4's DSpark
file (deepseek4-dspark: three DeepSeek V4 stages) runs through Deepseek4DSpark, fed with the
streams' mean of the chosen layers' outputs (a forward's ``hidden``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields

import numpy as np
from numba import njit

from ..errors import UsageError
from . import kernels
from .compressed_attention import (CacheLayout, CompressedCache, build_entries, indexer_top_k,
                                   sink_attention, sink_attention_rows, store_ring)
from .hparams import HParams, HParamsError, _get, _positive, decoder_hparams
from .hyper_connections import HyperConnection, hc_head, hc_post, hc_pre
from .moe import MoEHParams, MoEWeights, load_moe, weighted_sum
from .transformer import DEFAULT_CHUNK, ForwardResult, Transformer
from .weights import Linear, ModelWeights, SharedInput, WeightsError, _linear, _tensor, _vector

ARCH = "deepseek4"
RATIOS = (0, 4, 128)
SQRT_SOFTPLUS = 4  # llama.cpp's expert_gating_func value


# --- hyper-parameters ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Deepseek4HParams(HParams):
    n_lora_q: int = 0
    n_swa: int = 0
    compress_ratios: tuple = ()
    compress_rope_base: float = 10000.0
    o_groups: int = 1
    o_lora_rank: int = 0
    idx_head: int = 0
    idx_dim: int = 0
    idx_top_k: int = 0
    hc: int = 4
    hc_iters: int = 1
    hc_eps: float = 0.0
    n_hash_layers: int = 0
    clamp_exp: tuple = ()
    clamp_shexp: tuple = ()
    moe: MoEHParams | None = None
    rope_ext_factor: float = 0.0        # of the compressed layers' rope
    rope_attn_factor: float = 1.0


def _per_layer(meta: dict, key: str, n: int, *, required: bool = True) -> tuple | None:
    """A float key that is one number or an array of at least n (llama.cpp's get_key_or_arr)."""
    if key not in meta:
        if required:
            raise HParamsError(f"missing metadata key {key}")
        return None
    v = meta[key]
    if isinstance(v, list):
        if len(v) < n:
            raise HParamsError(f"metadata key {key} has {len(v)} entries, fewer than the "
                               f"{n} blocks")
        if not all(isinstance(e, (int, float)) and not isinstance(e, bool) for e in v):
            raise HParamsError(f"metadata key {key} must hold numbers")
        return tuple(float(e) for e in v[:n])
    return (_get(meta, key, float),) * n


def read_hparams(meta: dict, n_vocab_tensor: int | None = None) -> Deepseek4HParams:
    a = ARCH
    k = lambda name: f"{a}.{name}"  # noqa: E731
    meta = dict(meta)
    if k("feed_forward_length") not in meta and k("expert_feed_forward_length") in meta:
        meta[k("feed_forward_length")] = meta[k("expert_feed_forward_length")]  # not read here
    base = decoder_hparams(meta, a, n_vocab_tensor)
    n_all = base.n_layer + base.n_nextn
    if base.n_head_kv != 1:
        raise HParamsError(f"{k('attention.head_count_kv')} is {base.n_head_kv}: {a} has one "
                           f"shared KV head")
    gating = _get(meta, k("expert_gating_func"), int)
    if gating != SQRT_SOFTPLUS:
        raise HParamsError(f"{k('expert_gating_func')} is {gating}: {a} scores experts with "
                           f"sqrt(softplus) ({SQRT_SOFTPLUS})")
    ratios = meta.get(k("attention.compress_ratios"))
    if ratios is None:
        raise HParamsError(f"missing metadata key {k('attention.compress_ratios')}")
    if not isinstance(ratios, list) or len(ratios) < n_all:
        raise HParamsError(f"{k('attention.compress_ratios')} must be an array of at least "
                           f"{k('block_count')} ({n_all}) entries")
    ratios = tuple(int(r) for r in ratios[:n_all])
    bad = [r for r in ratios if r not in RATIOS]
    if bad:
        raise HParamsError(f"{k('attention.compress_ratios')} holds {bad[0]}: supported "
                           f"ratios are 0, 4 and 128")
    n_lora_q = _positive(k("attention.q_lora_rank"), _get(meta, k("attention.q_lora_rank"), int))
    n_swa = _positive(k("attention.sliding_window"), _get(meta, k("attention.sliding_window"), int))
    o_groups = _positive(k("attention.output_group_count"),
                         _get(meta, k("attention.output_group_count"), int))
    if base.n_head % o_groups:
        raise HParamsError(f"{k('attention.head_count')} ({base.n_head}) is not a multiple of "
                           f"{k('attention.output_group_count')} ({o_groups})")
    o_rank = _positive(k("attention.output_lora_rank"), _get(meta, k("attention.output_lora_rank"), int))
    idx_head = _positive(k("attention.indexer.head_count"),
                         _get(meta, k("attention.indexer.head_count"), int))
    idx_dim = _positive(k("attention.indexer.key_length"),
                        _get(meta, k("attention.indexer.key_length"), int))
    idx_top_k = _positive(k("attention.indexer.top_k"), _get(meta, k("attention.indexer.top_k"), int))
    if idx_dim < base.n_rot:
        raise HParamsError(f"{k('attention.indexer.key_length')} ({idx_dim}) is below "
                           f"{k('rope.dimension_count')} ({base.n_rot})")
    c_base = _get(meta, k("attention.compress_rope_freq_base"), float)
    if not c_base > 0:
        raise HParamsError(f"metadata key {k('attention.compress_rope_freq_base')} must be positive")
    hc = _positive(k("hyper_connection.count"), _get(meta, k("hyper_connection.count"), int))
    iters = _positive(k("hyper_connection.sinkhorn_iterations"),
                      _get(meta, k("hyper_connection.sinkhorn_iterations"), int))
    hc_eps = _get(meta, k("hyper_connection.epsilon"), float)
    n_hash = _get(meta, k("hash_layer_count"), int)
    if not 0 <= n_hash <= base.n_layer:
        raise HParamsError(f"{k('hash_layer_count')} ({n_hash}) must lie in [0, {base.n_layer}]")
    clamp_exp = _per_layer(meta, k("swiglu_clamp_exp"), n_all)
    clamp_shexp = _per_layer(meta, k("swiglu_clamp_shexp"), n_all, required=False) or clamp_exp
    n_expert = _positive(k("expert_count"), _get(meta, k("expert_count"), int))
    n_used = _positive(k("expert_used_count"), _get(meta, k("expert_used_count"), int))
    if n_used > n_expert:
        raise HParamsError(f"{k('expert_used_count')} ({n_used}) exceeds {k('expert_count')} "
                           f"({n_expert})")
    n_ff_exp = _positive(k("expert_feed_forward_length"), _get(meta, k("expert_feed_forward_length"), int))
    n_shared = _get(meta, k("expert_shared_count"), int)
    if n_shared < 0:
        raise HParamsError(f"metadata key {k('expert_shared_count')} must not be negative")
    norm_w = meta.get(k("expert_weights_norm"))
    if not isinstance(norm_w, bool):
        raise HParamsError(f"metadata key {k('expert_weights_norm')} must be a bool")
    w_scale = _get(meta, k("expert_weights_scale"), float)
    moe = MoEHParams(n_expert=n_expert, n_expert_used=n_used, n_ff_exp=n_ff_exp,
                     n_expert_shared=n_shared, gating="softmax", normalize_weights=norm_w,
                     weights_scale=w_scale)  # gating: unused (routing is this module's)

    # the compressed layers' rope, as llama.cpp computes it (float32): YaRN extrapolates with
    # ext_factor 1 and beta 32 / 1; the attention factor cancels YaRN's magnitude scaling
    f32 = np.float32
    ext = 1.0 if base.rope_scaling == "yarn" else 0.0
    attn = 1.0
    if ext:
        attn = float(f32(1.0) / (f32(1.0) + f32(0.1) * f32(np.log(f32(1.0) / f32(base.rope_freq_scale)))))
    hp = dataclasses.replace(base, n_ff=n_ff_exp)
    return Deepseek4HParams(
        **{f.name: getattr(hp, f.name) for f in fields(hp)}, n_lora_q=n_lora_q, n_swa=n_swa,
        compress_ratios=ratios, compress_rope_base=c_base, o_groups=o_groups, o_lora_rank=o_rank,
        idx_head=idx_head, idx_dim=idx_dim, idx_top_k=idx_top_k, hc=hc, hc_iters=iters,
        hc_eps=hc_eps, n_hash_layers=n_hash, clamp_exp=clamp_exp, clamp_shexp=clamp_shexp,
        moe=moe, rope_ext_factor=ext, rope_attn_factor=attn)


# --- weights ------------------------------------------------------------------------------------


#: matrices are fused only while their concatenation stays below this: the call overhead it
#: saves matters for small matrices, and the concatenation is a copy of the mapped weights
FUSE_MAX_BYTES = 8 << 20


class Fused:
    """Matrices that read the same input, concatenated (by format, int8 path and width) at
    load: one matmul per group instead of one per matrix (groups over FUSE_MAX_BYTES stay
    apart). Each output is a dot product of its own row with the input, so the values are the
    separate matmuls' to the bit."""

    def __init__(self, parts: dict):
        groups: dict = {}
        for key, lin in parts.items():
            if lin is not None:
                groups.setdefault((lin.fmt.name, lin.int8, lin.n_in), []).append((key, lin))
        self.groups = []
        for (fmt, int8, n_in), items in groups.items():
            if len(items) > 1 and sum(l.raw.nbytes for _, l in items) > FUSE_MAX_BYTES:
                self.groups += [(l, [(k, l.n_out)]) for k, l in items]
                continue
            if len(items) == 1:
                lin = items[0][1]
            else:
                lin = Linear("+".join(l.name for _, l in items),
                             np.concatenate([l.raw for _, l in items]), fmt,
                             (sum(l.n_out for _, l in items), n_in), int8=int8)
            self.groups.append((lin, [(k, l.n_out) for k, l in items]))

    def __call__(self, x) -> dict:
        """{name: (k, n_out) float32 C-contiguous} for input x (an array or a SharedInput)."""
        k = (x.x if isinstance(x, SharedInput) else x).shape[0]
        out = {}
        for lin, parts in self.groups:
            y = np.empty((k, lin.n_out), np.float32)
            lin.matmul(x, y)
            if len(parts) == 1:
                out[parts[0][0]] = y
                continue
            c = 0
            for key, n in parts:
                out[key] = np.ascontiguousarray(y[:, c:c + n])
                c += n
        return out


@dataclass
class Compressor:
    wkv: Linear
    wgate: Linear
    ape: np.ndarray        # (ratio, coff * d)
    norm: np.ndarray

    def linears(self) -> list:
        return [self.wkv, self.wgate]


@dataclass
class Deepseek4Layer:
    attn_norm: np.ndarray
    sinks: np.ndarray
    wq_a: Linear
    q_a_norm: np.ndarray
    wq_b: Linear
    wkv: Linear
    kv_norm: np.ndarray
    wo_a: list                       # one Linear (o_lora_rank, group width) per head group
    wo_b: Linear
    hc_attn: HyperConnection
    hc_ffn: HyperConnection
    ffn_norm: np.ndarray
    moe: MoEWeights
    ratio: int = 0
    comp: Compressor | None = None
    idx_comp: Compressor | None = None
    idx_q_b: Linear | None = None
    idx_proj: Linear | None = None
    tid2eid: np.ndarray | None = None  # (n_vocab, n_expert_used) int64 on hash-routed layers
    on_h: Fused | None = None          # the matrices reading the attention input (fuse())
    on_qr: Fused | None = None         # those reading the normed q latent
    on_ffn: Fused | None = None        # the shared expert's gate and up

    def fuse(self) -> "Deepseek4Layer":
        """Build the fused groups (after loading; again after replacing a matrix)."""
        c, ic = self.comp, self.idx_comp
        self.on_h = Fused({"q_a": self.wq_a, "kv": self.wkv,
                           "c_kv": c and c.wkv, "c_gate": c and c.wgate,
                           "i_kv": ic and ic.wkv, "i_gate": ic and ic.wgate,
                           "i_w": self.idx_proj})
        self.on_qr = Fused({"q_b": self.wq_b, "i_q": self.idx_q_b})
        sh = self.moe.shared
        self.on_ffn = Fused({"g": sh.w_gate, "u": sh.w_up}) if sh is not None else None
        return self

    def linears(self) -> list:
        out = [self.wq_a, self.wq_b, self.wkv] + self.wo_a + [self.wo_b, self.hc_attn.fn,
                                                              self.hc_ffn.fn]
        for c in (self.comp, self.idx_comp):
            if c is not None:
                out += c.linears()
        out += [lin for lin in (self.idx_q_b, self.idx_proj) if lin is not None]
        return out + self.moe.linears()


@dataclass
class Deepseek4Weights(ModelWeights):
    hc_head: HyperConnection | None = None


def _matrix(tensors: dict, name: str, shape: tuple) -> np.ndarray:
    t = _tensor(tensors, name, shape)
    return np.ascontiguousarray(np.asarray(t.to_float32(), np.float32).reshape(shape))


def _hc(tensors: dict, prefix: str, n_mix: int, n_scale: int,
        hp: Deepseek4HParams) -> HyperConnection:
    # kept on the float32 path: these mixes feed sigmoids and the Sinkhorn normalisation
    fn = _linear(tensors, prefix + "fn.weight", n_mix, hp.hc * hp.n_embd, "none")
    return HyperConnection(fn, _vector(tensors, prefix + "scale.weight", n_scale),
                           _vector(tensors, prefix + "base.weight", n_mix))


def _compressor(tensors, prefix, ratio, width, hp, int8) -> Compressor:
    coff = 2 if ratio == 4 else 1
    H = hp.n_embd
    return Compressor(_linear(tensors, prefix + "kv.weight", coff * width, H, int8),
                      _linear(tensors, prefix + "gate.weight", coff * width, H, int8),
                      _matrix(tensors, prefix + "ape.weight", (ratio, coff * width)),
                      _vector(tensors, prefix + "norm.weight", width))


def _hash_table(tensors: dict, name: str, hp: Deepseek4HParams) -> np.ndarray:
    t = tensors.get(name)
    if t is None:
        raise WeightsError(f"missing tensor {name}")
    shape = (hp.n_vocab, hp.moe.n_expert_used)
    if tuple(int(s) for s in t.shape) != shape:
        raise WeightsError(f"tensor {name} has shape {tuple(t.shape)} (numpy order), expected {shape}")
    if t.type_name != "I32":
        raise WeightsError(f"tensor {name} has type {t.type_name}, expected I32")
    table = np.asarray(t.raw()).view(np.int32).reshape(shape).astype(np.int64)
    if table.size and (table.min() < 0 or table.max() >= hp.moe.n_expert):
        raise WeightsError(f"tensor {name} names an expert outside 0..{hp.moe.n_expert - 1}")
    return table


def load_layer(tensors: dict, il: int, hp: Deepseek4HParams, int8: str, *,
               prefix: str | None = None, ratio: int | None = None,
               hashed: bool | None = None) -> Deepseek4Layer:
    """Decoder block ``il`` (``blk.{il}.*``); an MTP block passes its ``prefix`` (ds4's
    ``mtp.0.``), ``ratio`` 0 and ``hashed`` False."""
    p = f"blk.{il}." if prefix is None else prefix
    H, NH, D = hp.n_embd, hp.n_head, hp.head_dim
    mix = (2 + hp.hc) * hp.hc
    ratio = hp.compress_ratios[il] if ratio is None else ratio
    gdim = NH * D // hp.o_groups
    R = hp.o_lora_rank
    wo_a = _linear(tensors, p + "attn_output_a.weight", hp.o_groups * R, gdim, int8)
    groups = [Linear(wo_a.name, wo_a.raw[g * R:(g + 1) * R], wo_a.fmt, (R, gdim), int8=wo_a.int8)
              for g in range(hp.o_groups)]
    hashed = il < hp.n_hash_layers if hashed is None else hashed
    layer = Deepseek4Layer(
        attn_norm=_vector(tensors, p + "attn_norm.weight", H),
        sinks=_vector(tensors, p + "attn_sinks.weight", NH),
        wq_a=_linear(tensors, p + "attn_q_a.weight", hp.n_lora_q, H, int8),
        q_a_norm=_vector(tensors, p + "attn_q_a_norm.weight", hp.n_lora_q),
        wq_b=_linear(tensors, p + "attn_q_b.weight", NH * D, hp.n_lora_q, int8),
        wkv=_linear(tensors, p + "attn_kv.weight", D, H, int8),
        kv_norm=_vector(tensors, p + "attn_kv_a_norm.weight", D),
        wo_a=groups,
        wo_b=_linear(tensors, p + "attn_output_b.weight", H, hp.o_groups * R, int8),
        hc_attn=_hc(tensors, p + "hc_attn_", mix, 3, hp),
        hc_ffn=_hc(tensors, p + "hc_ffn_", mix, 3, hp),
        ffn_norm=_vector(tensors, p + "ffn_norm.weight", H),
        moe=load_moe(tensors, p, hp.moe, H, ARCH, int8, selection_bias_required=not hashed),
        ratio=ratio,
        tid2eid=_hash_table(tensors, p + "ffn_gate_tid2eid.weight", hp) if hashed else None,
    )
    if ratio:
        layer.comp = _compressor(tensors, p + "attn_compressor_", ratio, D, hp, int8)
    if ratio == 4:
        layer.idx_comp = _compressor(tensors, p + "indexer_compressor_", ratio, hp.idx_dim, hp, int8)
        layer.idx_q_b = _linear(tensors, p + "indexer.attn_q_b.weight", hp.idx_head * hp.idx_dim,
                                hp.n_lora_q, int8)
        layer.idx_proj = _linear(tensors, p + "indexer.proj.weight", hp.idx_head, H, int8)
    return layer.fuse()


_ATTN = ("attn_norm.weight", "attn_sinks.weight", "attn_q_a.weight", "attn_q_a_norm.weight",
         "attn_q_b.weight", "attn_kv.weight", "attn_kv_a_norm.weight", "attn_output_a.weight",
         "attn_output_b.weight", "ffn_norm.weight", "ffn_gate_inp.weight", "ffn_gate_exps.weight",
         "ffn_up_exps.weight", "ffn_down_exps.weight", "ffn_gate_shexp.weight",
         "ffn_up_shexp.weight", "ffn_down_shexp.weight", "exp_probs_b.bias",
         "ffn_gate_tid2eid.weight", "exp_probs_b_vl.bias") + tuple(
    f"hc_{b}_{t}.weight" for b in ("attn", "ffn") for t in ("fn", "base", "scale"))
_COMP = tuple(f"{c}_compressor_{t}.weight" for c in ("attn", "indexer")
              for t in ("kv", "gate", "ape", "norm")) + ("indexer.proj.weight",
                                                         "indexer.attn_q_b.weight")
_NEXTN = ("eh_proj", "enorm", "hnorm", "embed_tokens", "shared_head_head", "shared_head_norm")


def _expected_names(hp: Deepseek4HParams) -> set[str]:
    names = {"token_embd.weight", "output_norm.weight", "output.weight", "output_hc_fn.weight",
             "output_hc_base.weight", "output_hc_scale.weight"}
    for i in range(hp.n_layer + hp.n_nextn):
        names.update(f"blk.{i}.{t}" for t in _ATTN + _COMP)
    for i in range(hp.n_layer, hp.n_layer + hp.n_nextn):
        names.update(f"blk.{i}.nextn.{t}.weight" for t in _NEXTN)
    return names


def load_weights(tensors: dict, hp: Deepseek4HParams, *, int8: str = "default") -> Deepseek4Weights:
    """The decoder's weights (the MTP block's tensors are checked by name, not loaded)."""
    H = hp.n_embd
    expected = _expected_names(hp)
    unknown = [n for n in tensors if n not in expected]
    if unknown:
        raise WeightsError(f"unexpected tensor {unknown[0]} for a {ARCH} model"
                           + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""))
    for i in range(hp.n_layer):
        stray = [t for t in _COMP if f"blk.{i}.{t}" in tensors
                 and (hp.compress_ratios[i] == 0
                      or (hp.compress_ratios[i] == 128 and not t.startswith("attn_")))]
        if stray:
            raise WeightsError(f"unexpected tensor blk.{i}.{stray[0]}: layer {i} has compress "
                               f"ratio {hp.compress_ratios[i]}")
    layers = [load_layer(tensors, il, hp, int8) for il in range(hp.n_layer)]
    token_embd = _linear(tensors, "token_embd.weight", hp.n_vocab, H, "none")
    output = _linear(tensors, "output.weight", hp.n_vocab, H, int8)
    head = HyperConnection(_linear(tensors, "output_hc_fn.weight", hp.hc, hp.hc * H, "none"),
                           _vector(tensors, "output_hc_scale.weight", 1),
                           _vector(tensors, "output_hc_base.weight", hp.hc))
    used: dict[str, int] = {}
    weights = Deepseek4Weights(token_embd, layers, _vector(tensors, "output_norm.weight", H),
                               output, None, False, used, hc_head=head)
    for lin in [token_embd] + weights.linears():
        used[lin.fmt.name] = used.get(lin.fmt.name, 0) + 1
    return weights


# --- the experts' routing and SwiGLU ------------------------------------------------------------


@njit(cache=True, error_model="numpy")
def route(logits, bias, has_bias, table, tokens, hashed, normalize, scale, ids, weights):
    """Scores sqrt(softplus(logits)); ids: the token's table row (hashed) or the top n_used of
    scores + bias, best first; weights: the chosen scores, normalised / scaled as asked."""
    k, n_expert = logits.shape
    n_used = ids.shape[1]
    probs = np.empty(n_expert, np.float32)
    choose = np.empty(n_expert, np.float32)
    for t in range(k):
        for e in range(n_expert):
            x = logits[t, e]
            sp = x if x > np.float32(20.0) else np.float32(np.log(np.float32(1.0) + np.exp(x)))
            probs[e] = np.sqrt(sp)
            choose[e] = probs[e] + bias[e] if has_bias else probs[e]
        if hashed:
            for j in range(n_used):
                ids[t, j] = table[tokens[t], j]
        else:
            order = np.argsort(-choose, kind="mergesort")
            for j in range(n_used):
                ids[t, j] = order[j]
        tot = 0.0
        for j in range(n_used):
            weights[t, j] = probs[ids[t, j]]
            tot += weights[t, j]
        if normalize:
            s = max(np.float32(tot), np.float32(6.103515625e-5))
            for j in range(n_used):
                weights[t, j] = weights[t, j] / s
        if scale != 0.0 and scale != 1.0:
            for j in range(n_used):
                weights[t, j] = weights[t, j] * scale


@njit(cache=True, error_model="numpy")
def swiglu_clamped(gate, up, limit, out):
    """out = silu(min(g, L)) * clamp(u, -L, L) (no clamp when L <= 1e-6), element-wise."""
    g = gate.reshape(-1)
    u = up.reshape(-1)
    o = out.reshape(-1)
    clamp = limit > 1e-6
    lim = np.float32(limit)
    for i in range(g.shape[0]):
        a = g[i]
        b = u[i]
        if clamp:
            a = min(a, lim)
            b = min(max(b, -lim), lim)
        o[i] = a / (np.float32(1.0) + np.exp(-a)) * b


def moe_block(h: np.ndarray, tokens: np.ndarray, lw: Deepseek4Layer, hp: Deepseek4HParams,
              il: int) -> np.ndarray:
    """The routed experts' weighted sum plus the shared experts, (k, n_embd)."""
    k, H = h.shape
    m, w = hp.moe, lw.moe
    f = np.float32
    hs = SharedInput(h)
    logits = np.empty((k, m.n_expert), f)
    w.router.matmul(hs, logits)
    ids = np.empty((k, m.n_expert_used), np.int64)
    weights = np.empty((k, m.n_expert_used), f)
    hashed = lw.tid2eid is not None
    bias = w.selection_bias if w.selection_bias is not None else np.zeros(m.n_expert, f)
    table = lw.tid2eid if hashed else np.zeros((1, m.n_expert_used), np.int64)
    route(logits, bias, w.selection_bias is not None, table, tokens, hashed, m.normalize_weights,
          f(m.weights_scale), ids, weights)
    F = m.n_ff_exp
    gate = np.empty((k, m.n_expert_used, F), f)
    up = np.empty_like(gate)
    w.gate_exps.matmul(hs, ids, gate)
    w.up_exps.matmul(hs, ids, up)
    act = np.empty_like(gate)
    swiglu_clamped(gate, up, hp.clamp_exp[il], act)
    down = np.empty((k, m.n_expert_used, H), f)
    w.down_exps.matmul(act.reshape(k * m.n_expert_used, F), ids.reshape(-1, 1),
                       down.reshape(k * m.n_expert_used, 1, H))
    out = np.empty((k, H), f)
    weighted_sum(down, weights, out)
    if w.shared is not None:
        gu = lw.on_ffn(hs)
        g, u = gu["g"], gu["u"]
        swiglu_clamped(g, u, hp.clamp_shexp[il], g)
        sh = np.empty((k, H), f)
        w.shared.w_down.matmul(g, sh)
        kernels.add_into(out, sh)
    return out


# --- attention ----------------------------------------------------------------------------------


def _rope_tail(x: np.ndarray, positions: np.ndarray, tables: tuple, n_rot: int) -> None:
    """Rotate the last n_rot dims of x (k, heads, width) in place ("norm" pairs)."""
    kernels.rope(x[:, :, x.shape[2] - n_rot:], positions, tables[0], tables[1], False)


def _rmsnorm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    out = np.empty_like(x)
    kernels.rmsnorm(x, weight, np.float32(eps), out)
    return out


def attention(h: np.ndarray, lw: Deepseek4Layer, hp: Deepseek4HParams, cache: CompressedCache,
              slot: int, positions: np.ndarray, ropes: dict, hi: np.ndarray | None = None) -> np.ndarray:
    """The attention block's output (k, n_embd) for input rows h at ``positions``; writes the
    layer's rows (cache layer ``slot``) and the entries they complete."""
    k = h.shape[0]
    f = np.float32
    NH, D, R = hp.n_head, hp.head_dim, hp.n_rot
    ratio = lw.ratio
    kind = "compressed" if ratio else "plain"
    rope = ropes[kind]
    on_h = lw.on_h(SharedInput(h))  # q_a, kv and the compressors' / indexer's projections
    qr = _rmsnorm(on_h["q_a"], lw.q_a_norm, hp.rms_eps)
    on_qr = lw.on_qr(SharedInput(qr))
    q = _rmsnorm(on_qr["q_b"].reshape(k * NH, D), np.ones(D, f), hp.rms_eps).reshape(k, NH, D)
    _rope_tail(q, positions, rope, R)
    kv = _rmsnorm(on_h["kv"], lw.kv_norm, hp.rms_eps)
    _rope_tail(kv.reshape(k, 1, D), positions, rope, R)

    sel = np.zeros((k, max(hp.idx_top_k, 1)), np.int64)
    n_sel = np.zeros(k, np.int64)
    comp = np.zeros((1, D), f)
    if ratio:
        _compress(on_h["c_kv"], on_h["c_gate"], lw.comp, ratio, positions, cache.comp_kv[slot],
                  cache.comp_score[slot], cache.comp[slot], hp, rope)
        comp = cache.comp[slot]
        if ratio == 4:
            _compress(on_h["i_kv"], on_h["i_gate"], lw.idx_comp, ratio, positions,
                      cache.idx_kv[slot], cache.idx_score[slot], cache.idx[slot], hp, rope)
            I, IH = hp.idx_dim, hp.idx_head
            iq = on_qr["i_q"].reshape(k, IH, I)
            _rope_tail(iq, positions, rope, R)
            iw = on_h["i_w"]
            iw *= f(1.0) / f(np.sqrt(f(I * IH)))
            indexer_top_k(iq, iw, cache.idx[slot], positions, ratio, hp.idx_top_k, sel, n_sel)
        else:
            n_vis = (positions + 1) // ratio
            sel = np.zeros((k, max(int(n_vis.max()), 1)), np.int64)
            for t in range(k):
                sel[t, :n_vis[t]] = np.arange(n_vis[t])
            n_sel = n_vis.astype(np.int64)
    o = np.empty((k, NH, D), f)
    ring = cache.raw[slot]
    if hi is None:
        sink_attention(q, kv, ring, positions, hp.n_swa, comp, sel, n_sel, lw.sinks,
                       f(1.0 / np.sqrt(f(D))), o)
    else:  # a ratio-0 layer whose rows see raw rows up to hi (a DSpark block: bidirectional)
        lo = np.maximum(positions - hp.n_swa + 1, 0).astype(np.int64)
        sink_attention_rows(q, kv, ring, positions, lo, np.ascontiguousarray(hi, np.int64),
                            lw.sinks, f(1.0 / np.sqrt(f(D))), o)
    cache.store_raw(slot, positions, kv)  # after the attention: the batch may outgrow the ring
    _rope_tail(o, positions, ropes[kind + "_inverse"], R)  # undo the rope of the values
    G = hp.o_groups
    gdim = NH * D // G
    og = o.reshape(k, G, gdim)
    oa = np.empty((k, G, hp.o_lora_rank), f)
    for g in range(G):
        part = np.ascontiguousarray(og[:, g])
        lw.wo_a[g].matmul(part, oa[:, g])
    out = np.empty((k, hp.n_embd), f)
    lw.wo_b.matmul(oa.reshape(k, G * hp.o_lora_rank), out)
    return out


def _compress(kv, sc, c: Compressor, ratio, positions, kv_rows, score_rows, entries, hp, rope):
    """The compressor's rows (kv, score before ape) at ``positions``: the entries they complete,
    then the rings."""
    sc += c.ape[positions % ratio]
    build_entries(kv, sc, positions, ratio, kv_rows, score_rows, c.norm, hp.rms_eps, rope, hp.n_rot,
                  entries)
    store_ring(kv_rows, positions, kv)  # the rings keep the open blocks' inputs
    store_ring(score_rows, positions, sc)


# --- the decoder --------------------------------------------------------------------------------


def layer_forward(x: np.ndarray, tokens: np.ndarray, lw: Deepseek4Layer, hp: Deepseek4HParams,
                  cache: CompressedCache, il: int, slot: int, positions: np.ndarray,
                  ropes: dict, hi: np.ndarray | None = None) -> np.ndarray:
    """One layer on the streams x (k, hc * n_embd); returns the new streams. ``hi`` (ratio-0
    layers): each row sees the raw rows of its window up to hi[t] (exclusive) instead of up to
    its own position."""
    H, hc = hp.n_embd, hp.hc
    cur, post, comb = hc_pre(x, lw.hc_attn, hc, H, hp.rms_eps, hp.hc_eps, hp.hc_iters)
    a = attention(_rmsnorm(cur, lw.attn_norm, hp.rms_eps), lw, hp, cache, slot, positions, ropes,
                  hi)
    x = hc_post(a, x, post, comb, hc, H)
    cur, post, comb = hc_pre(x, lw.hc_ffn, hc, H, hp.rms_eps, hp.hc_eps, hp.hc_iters)
    ff = moe_block(_rmsnorm(cur, lw.ffn_norm, hp.rms_eps), tokens, lw, hp, il)
    return hc_post(ff, x, post, comb, hc, H)


# --- the MTP layer, for the MTP drafter (speculative/mtp.py) -------------------------------------


def _mtp_hparams(hp: Deepseek4HParams) -> tuple[Deepseek4HParams, int]:
    """(hparams, index) the MTP block runs with: its clamps are the file's entry after the
    decoder blocks when there is one (llama.cpp's block_count counts it), else the last
    block's (ds4's file carries no metadata; its clamp is one constant)."""
    il = hp.n_layer
    if len(hp.clamp_exp) > il and len(hp.clamp_shexp) > il:
        return hp, il
    return dataclasses.replace(hp, clamp_exp=hp.clamp_exp[:il] + (hp.clamp_exp[il - 1],),
                               clamp_shexp=hp.clamp_shexp[:il] + (hp.clamp_shexp[il - 1],)), il


class Deepseek4MtpHead:
    """DeepSeek V4's MTP layer as the MTP drafter runs it (ds4's ``mtp.0.*`` head, or llama.cpp's
    NextN block embedded in the model file). Per row, with h the target's hyper-connection
    streams (hc, n_embd) before its head and t the next token:

        e = e_proj(enorm(embed(t)))                     the same for every stream
        x = e + h_proj(hnorm(h[s])) for each stream s   (llama.cpp: eh_proj over [e; h[s]])
        y = this module's decoder layer on x            compress ratio 0: the raw sliding window
                                                        with sinks, plain rope (rope.freq_base),
                                                        the experts by score + bias (no hash)
        logits = output(norm(hc_head(y)))               ds4: the head's own mtp.0.hc_head_* and
                                                        mtp.0.norm; llama.cpp: the model's
                                                        output_hc_* and nextn.shared_head_norm

    y (the streams) is what the next recursive draft reads as h. The layer's cache is a
    one-layer CompressedCache of raw rows: truncating it is the exact rollback."""

    def __init__(self, model: "Deepseek4Transformer", weights):
        self.t = model
        self.w = weights
        self.hp, self.il = _mtp_hparams(model.hp)
        self.cache = model.new_cache(n_layer=1)
        self.rows = model.chunk
        self.hc_head = weights.hc_head if weights.hc_head is not None else model.weights.hc_head
        self.hidden_width = model.hp.hc * model.hp.n_embd

    def run(self, hidden: np.ndarray, tokens, start_pos: int) -> np.ndarray:
        """Layer outputs (k, hc * n_embd) for rows at positions start_pos.. from the target-side
        streams ``hidden`` (k, hc * n_embd) and the next tokens (k,); writes the cache rows."""
        hp, w = self.hp, self.w
        H, hc = hp.n_embd, hp.hc
        f = np.float32
        k = len(tokens)
        out = np.empty((k, hc * H), f)
        for c0 in range(0, k, self.rows):
            c1 = min(k, c0 + self.rows)
            n = c1 - c0
            ids = np.ascontiguousarray(np.asarray(tokens[c0:c1], np.int64))
            e = self.t.weights.token_embd.rows(ids) if w.embed is None else w.embed.rows(ids)
            e = _rmsnorm(np.ascontiguousarray(e, f), w.enorm, hp.rms_eps)
            h = np.ascontiguousarray(hidden[c0:c1], f).reshape(n * hc, H)
            h = _rmsnorm(h, w.hnorm, hp.rms_eps)
            x = np.empty((n * hc, H), f)
            if w.eh_proj is not None:
                w.eh_proj.matmul(np.ascontiguousarray(np.concatenate([np.repeat(e, hc, axis=0), h],
                                                                     axis=1)), x)
            else:
                w.h_proj.matmul(h, x)
                ep = np.empty((n, H), f)
                w.e_proj.matmul(e, ep)
                x += np.repeat(ep, hc, axis=0)
            positions = np.arange(start_pos + c0, start_pos + c1, dtype=np.int64)
            y = layer_forward(x.reshape(n, hc * H), ids, w.layer, hp, self.cache, self.il, 0,
                              positions, self.t.ropes)
            self.cache.length = start_pos + c1
            out[c0:c1] = y
        return out

    def head(self, y: np.ndarray):
        """(y, logits): the streams themselves (the next draft's h) and the target's logits."""
        hp = self.hp
        z = hc_head(np.ascontiguousarray(y), self.hc_head, hp.hc, hp.n_embd, hp.rms_eps, hp.hc_eps)
        normed = _rmsnorm(z, self.w.norm, hp.rms_eps)
        logits = np.empty((y.shape[0], hp.n_vocab), np.float32)
        (self.t.weights.output if self.w.output is None else self.w.output).matmul(normed, logits)
        return y, logits


# --- DSpark stages, for the DSpark drafter (speculative/dspark.py) -------------------------------


class Deepseek4DSpark:
    """ds4's DeepSeek V4 DSpark draft (``deepseek4-dspark``: stages ``mtp.0.`` .. ``mtp.S-1.``) as
    the DSpark drafter runs it, as llama.cpp's DeepSeek V4 DSpark graph computes it:

        ctx(t)   = main_norm(main_proj([mean over streams of target layer l's output at t]))
        stage j's context row at t: rope(kv_norm_j(wkv_j(ctx(t))))      (plain rope, raw cache)
        block    = hc copies of embed([anchor, noise x (B - 1)]) at positions a .. a + B - 1
        each stage: this module's decoder layer (ratio 0), its rows seeing the context rows of
                    their window before a and the whole block (bidirectional)
        z        = hc_head(streams) (the final stage's hc_head_*): the confidence head's input
        logits   = output(norm(z))

    Context rows persist; the block's rows are dropped after each round (the cache length
    stays at the context)."""

    def __init__(self, model: "Deepseek4Transformer", w):
        hp = model.hp
        self.t = model
        self.w = w
        S = len(w.layers)
        last = hp.n_layer - 1  # the stages' clamps: the target's last block's
        self.hp = dataclasses.replace(hp, clamp_exp=(hp.clamp_exp[last],) * S,
                             clamp_shexp=(hp.clamp_shexp[last],) * S)
        self.cache = model.new_cache(n_layer=S)
        self.n_ctx_rows = 0

    def add_context(self, feats: np.ndarray, start: int) -> None:
        hp, w = self.hp, self.w
        n = feats.shape[0]
        ctx = np.empty((n, hp.n_embd), np.float32)
        w.fc.matmul(np.ascontiguousarray(feats, np.float32), ctx)
        ctx = _rmsnorm(ctx, w.hidden_norm, hp.rms_eps)
        positions = np.arange(start, start + n, dtype=np.int64)
        if n and positions[-1] >= self.cache.n_ctx:
            raise ValueError("the DSpark context exceeds the cache")
        for j, lw in enumerate(w.layers):
            kv = np.empty((n, hp.head_dim), np.float32)
            lw.wkv.matmul(ctx, kv)
            kv = _rmsnorm(kv, lw.kv_norm, hp.rms_eps)
            _rope_tail(kv.reshape(n, 1, hp.head_dim), positions, self.t.ropes["plain"], hp.n_rot)
            self.cache.store_raw(j, positions, kv)
        self.n_ctx_rows = start + n
        self.cache.length = self.n_ctx_rows

    def clear(self) -> None:
        self.cache.clear()
        self.n_ctx_rows = 0

    def block(self, anchor: int):
        """(z, normed), each (B, n_embd), for [anchor, noise x (B-1)]; None without room."""
        hp, w = self.hp, self.w
        B = w.block_size
        a = self.n_ctx_rows
        if a + B > self.cache.n_ctx:
            return None
        ids = np.asarray([anchor] + [w.mask_token_id] * (B - 1), np.int64)
        x = self.t.embed(ids)
        positions = np.arange(a, a + B, dtype=np.int64)
        hi = np.full(B, a + B, np.int64)
        for j, lw in enumerate(w.layers):
            x = layer_forward(x, ids, lw, self.hp, self.cache, j, j, positions, self.t.ropes, hi)
        self.cache.length = a + B
        self.cache.truncate(a)  # the block's rows are dropped
        z = hc_head(x, w.hc_head, hp.hc, hp.n_embd, hp.rms_eps, hp.hc_eps)
        return z, _rmsnorm(z, w.norm, hp.rms_eps)


class Deepseek4Transformer(Transformer):
    """A deepseek4 model: hyper-connection streams through this module's layers, over a
    CompressedCache; the Transformer's forward checks, thread policy and result."""

    dense_mtp_heads = False

    # --- the MTP layer, for the MTP drafter ----------------------------------------------------

    def mtp_head(self, weights) -> Deepseek4MtpHead:
        """The runnable MTP head (``cache``, ``run``, ``head``) over ``weights``
        (speculative.mtp.MtpHeadWeights with this module's layer)."""
        return Deepseek4MtpHead(self, weights)

    def load_nextn_layer(self, tensors: dict, block: int, int8: str) -> Deepseek4Layer:
        """The MTP block ``blk.{block}.*`` of llama.cpp's layout (compress ratio 0, experts by
        score: llama.cpp asserts both); raises WeightsError."""
        ratios = self.hp.compress_ratios
        if block < len(ratios) and ratios[block] != 0:
            raise WeightsError(f"{ARCH}.attention.compress_ratios gives the MTP block {block} "
                               f"ratio {ratios[block]}; the MTP layer attends over its raw "
                               f"window only (ratio 0)")
        return load_layer(tensors, block, self.hp, int8, ratio=0, hashed=False)

    def load_ds4_dspark(self, sf, int8: str):
        """ds4's DSpark support file (``deepseek4-dspark``) as DSparkWeights whose ``backbone``
        runs its stages (Deepseek4DSpark); the file was validated against this model."""
        from ..errors import about
        from .speculative.dspark import DSparkWeights
        hp_s = sf.hparams
        if sf.architecture != "deepseek4-dspark":
            raise UsageError(about(sf.path, f"is a {sf.architecture} DSpark draft; a {ARCH} model "
                                            f"drafts with deepseek4-dspark files"))
        t = sf.gguf.tensors
        hp = self.hp
        H, V, r = hp.n_embd, hp.n_vocab, hp_s.markov_rank
        S = hp_s.n_layer
        last = f"mtp.{S - 1}."
        n_t = len(hp_s.target_layers)
        head = HyperConnection(_linear(t, last + "hc_head_fn.weight", hp.hc, hp.hc * H, "none"),
                               _vector(t, last + "hc_head_scale.weight", 1),
                               _vector(t, last + "hc_head_base.weight", hp.hc))
        conf = _linear(t, last + "confidence_head.proj.weight", 1, H + r, "none")
        w = DSparkWeights(
            fc=_linear(t, "mtp.0.main_proj.weight", H, n_t * H, int8),
            hidden_norm=_vector(t, "mtp.0.main_norm.weight", H),
            layers=[load_layer(t, hp.n_layer, hp, int8, prefix=f"mtp.{j}.", ratio=0, hashed=False)
                    for j in range(S)],
            norm=_vector(t, last + "norm.weight", H),
            markov_w1=_linear(t, last + "markov_head.markov_w1.weight", V, r, "none"),
            markov_w2=_linear(t, last + "markov_head.markov_w2.weight", V, r, int8),
            conf_w=conf.dequantize()[0].astype(np.float64), conf_b=0.0, hparams=hp,
            block_size=hp_s.block_size, markov_rank=r, mask_token_id=hp_s.mask_token_id,
            target_layers=tuple(hp_s.target_layers),
            source=f"{sf.path}, ds4 layout: {S} DeepSeek V4 stages", backbone=Deepseek4DSpark,
            hc_head=head)
        return w

    def load_ds4_mtp_head(self, sf, int8: str):
        """ds4's MTP support file (``mtp.0.*``: e_proj / h_proj, the block, its own hc_head) as
        MtpHeadWeights; the file was validated against this model. Raises WeightsError."""
        from ..errors import about
        from .speculative.mtp import MtpHeadWeights
        t = sf.gguf.tensors
        p = "mtp.0."
        hp = self.hp
        H = hp.n_embd
        if (p + "hc_head_fn.weight") not in t:
            raise UsageError(about(sf.path, f"is an MTP head in ds4's dense layout (a llama/qwen3 "
                                            f"layer); a {ARCH} model drafts with DeepSeek V4's "
                                            f"MTP layer (mtp.0 with hyper-connections and "
                                            f"experts)"))
        head = HyperConnection(_linear(t, p + "hc_head_fn.weight", hp.hc, hp.hc * H, "none"),
                               _vector(t, p + "hc_head_scale.weight", 1),
                               _vector(t, p + "hc_head_base.weight", hp.hc))
        return MtpHeadWeights(
            enorm=_vector(t, p + "enorm.weight", H), hnorm=_vector(t, p + "hnorm.weight", H),
            norm=_vector(t, p + "norm.weight", H),
            layer=load_layer(t, hp.n_layer, hp, int8, prefix=p, ratio=0, hashed=False),
            e_proj=_linear(t, p + "e_proj.weight", H, H, int8),
            h_proj=_linear(t, p + "h_proj.weight", H, H, int8), hc_head=head,
            source=f"MTP support model loaded: {sf.path} (ds4 layout: DeepSeek V4 MTP layer "
                   f"mtp.0 with its own hyper-connection head)")

    def __init__(self, hp: Deepseek4HParams, weights: Deepseek4Weights, *, n_ctx: int,
                 cache_type: str = "f32", chunk: int = DEFAULT_CHUNK):
        if cache_type != "f32":
            raise UsageError(f"--cache-type {cache_type}: {ARCH} keeps its caches in float32")
        super().__init__(hp, weights, n_ctx=n_ctx, cache_type=cache_type, chunk=chunk)
        plain = kernels.rope_tables(n_ctx, hp.n_rot, hp.rope_freq_base)
        comp = kernels.rope_tables(
            n_ctx, hp.n_rot, hp.compress_rope_base, freq_scale=hp.rope_freq_scale,
            yarn=(hp.rope_n_ctx_orig, 32.0, 1.0, hp.rope_ext_factor, hp.rope_attn_factor))
        # the inverse tables rotate back: cos, -sin
        self.ropes = {"plain": plain, "compressed": comp,
                      "plain_inverse": (plain[0], np.ascontiguousarray(-plain[1])),
                      "compressed_inverse": (comp[0], np.ascontiguousarray(-comp[1]))}
        self.rope = plain

    def new_cache(self, n_ctx: int | None = None, n_layer: int | None = None) -> CompressedCache:
        hp = self.hp
        n_ctx = n_ctx or self.n_ctx
        if n_ctx > self.n_ctx:
            raise ValueError(f"a cache of {n_ctx} positions exceeds the model's context of {self.n_ctx}")
        ratios = hp.compress_ratios[:hp.n_layer] if n_layer is None else (0,) * n_layer
        return CompressedCache(CacheLayout(tuple(ratios), hp.head_dim, hp.idx_dim, hp.n_swa), n_ctx)

    def embed(self, tokens) -> np.ndarray:
        """The hc streams of the tokens (k, hc * n_embd): each a copy of the embedding."""
        e = self.weights.token_embd.rows(tokens)
        return np.ascontiguousarray(np.tile(e, (1, self.hp.hc)))

    def _head(self, x: np.ndarray) -> np.ndarray:
        hp = self.hp
        y = hc_head(x, self.weights.hc_head, hp.hc, hp.n_embd, hp.rms_eps, hp.hc_eps)
        return _rmsnorm(y, self.weights.output_norm, hp.rms_eps)

    def _norm(self, x: np.ndarray) -> np.ndarray:
        return self._head(x)

    def output(self, x: np.ndarray, out: np.ndarray | None = None):
        normed = self._head(x)
        if out is None:
            out = np.empty((x.shape[0], self.hp.n_vocab), np.float32)
        self.weights.output.matmul(normed, out)
        if not np.isfinite(out).all():
            from .transformer import NonFiniteLogits
            raise NonFiniteLogits("the forward produced non-finite logits (NaN or Inf): the "
                                  "weights are corrupt or overflow float32")
        return normed, out

    def _forward(self, tokens, start_pos, hidden_layers, want_final_hidden, logits, cache):
        k = tokens.shape[0]
        hidden = {i: [] for i in hidden_layers}
        finals, logit_rows = [], []
        cache.truncate(start_pos)  # rows at and above start_pos are rewritten now
        for c0 in range(0, k, self.chunk):
            c1 = min(k, c0 + self.chunk)
            toks = tokens[c0:c1]
            x = self.embed(toks)
            positions = np.arange(start_pos + c0, start_pos + c1, dtype=np.int64)
            x = self.run_layers(x, positions, positions + 1, cache, hidden, tokens=toks)
            cache.length = start_pos + c1
            if logits == "all":
                logit_rows.append(self.output(x)[1])
            if want_final_hidden:  # the streams before the head: what the MTP layer reads
                finals.append(x)
            if logits == "last" and c1 == k:
                logit_rows.append(self.output(x[-1:])[1])
        result = ForwardResult(None, {i: np.concatenate(v) for i, v in hidden.items()})
        if logit_rows:
            result.logits = logit_rows[0] if len(logit_rows) == 1 else np.concatenate(logit_rows)
        if want_final_hidden:
            result.final_hidden = finals[0] if len(finals) == 1 else np.concatenate(finals)
        return result

    def run_layers(self, x: np.ndarray, positions: np.ndarray, limits: np.ndarray,
                   cache: CompressedCache, hidden: dict | None = None, layers=None, *,
                   tokens=None) -> np.ndarray:
        """The layers on the streams x (k, hc * n_embd) at ``positions`` (causal: limits must be
        positions + 1); ``tokens`` (the rows' ids) route the hash layers. Returns the new
        streams; ``hidden`` gets each listed layer's output averaged over the streams."""
        hp = self.hp
        positions = np.ascontiguousarray(positions, np.int64)
        limits = np.ascontiguousarray(limits, np.int64)
        k = x.shape[0]
        if tokens is None or len(tokens) != k:
            raise ValueError(f"{ARCH} needs the rows' token ids (hash-routed layers)")
        tokens = np.ascontiguousarray(tokens, np.int64)
        if x.shape != (k, hp.hc * hp.n_embd) or x.dtype != np.float32:
            raise ValueError(f"x must be float32 of shape (k, {hp.hc * hp.n_embd})")
        if positions.shape != (k,) or not np.array_equal(limits, positions + 1):
            raise ValueError(f"{ARCH} runs causal rows only (limits = positions + 1)")
        if not isinstance(cache, CompressedCache):
            raise ValueError("the cache does not fit this model's compressed attention")
        if k and (positions.min() < 0 or positions.max() >= cache.n_ctx):
            raise ValueError(f"positions must lie in [0, {cache.n_ctx})")
        if k and not np.array_equal(positions, positions[0] + np.arange(k)):
            raise ValueError(f"{ARCH} runs consecutive positions")
        for il in (range(hp.n_layer) if layers is None else layers):
            if not 0 <= il < cache.n_layer:
                raise ValueError(f"layer {il} has no slot in a cache of {cache.n_layer} layers")
            x = layer_forward(x, tokens, self.weights.layers[il], hp, cache, il, il, positions,
                              self.ropes)
            if hidden is not None and il in hidden:
                hidden[il].append(x.reshape(k, hp.hc, hp.n_embd).mean(axis=1))
        return x
