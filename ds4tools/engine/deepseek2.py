"""The DeepSeek V2/V3 decoder (llama.cpp's ``deepseek2``, which also runs Kimi K2), top to bottom.

    x = embed(tokens)
    for each layer:
        x += mla(rmsnorm(x))         multi-head latent attention (mla.py): the low-rank q path
                                     (or one q matrix: V2-Lite), the compressed kv latent, rope
                                     on n_rot dimensions by adjacent pairs; the cache holds the
                                     latent [c | k_pe] per position, not keys and values
        h = rmsnorm(x)               (ffn_norm)
        the first leading_dense_block_count layers: x += (silu(h Wg) * h Wu) Wd
        the others: x += moe(h)      (routed experts scored by softmax or sigmoid, optional
                                     selection bias and expert groups, shared experts: moe.py)
    logits = rmsnorm(x) Wout

Attention scale, as llama.cpp's graph computes it (YaRN's attention factor folded in):
    rope tables are scaled by attn_factor (* (1 + 0.1 ln s) where YaRN extrapolates), s the
    rope scaling factor; kq_scale = mscale^2 / sqrt(n_nope + n_rot) with
    mscale = attn_factor (1 + 0.1 ln s) (1 + 0.1 m ln s), m = rope.scaling.yarn_log_multiplier
    / 0.1 (the converter writes 0.1 * mscale_all_dim).

Files with ``nextn_predict_layers`` NextN (MTP) layers after the decoder blocks load: those
layers are checked by name and the decoder does not run them. The MTP drafter does
(speculative/mtp.py), through ``Deepseek2Transformer.load_nextn_layer`` / ``nextn_layer``:
this module's layer on the NextN block's weights, with a one-layer LatentCache of its own.
Only the absorbed MLA layout (attn_k_b / attn_v_b, the ``attention.key_length_mla`` key: what
current converters write) is supported; the legacy attn_kv_b layout is refused with a one-line
error.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields

import numpy as np

from . import kernels
from .hparams import HParams, HParamsError, _get, _positive, decoder_hparams
from .mla import (MLA_TENSORS, LatentCache, MLAShape, MLAWeights, MLAWorkspace, load_mla,
                  mla_attention_block)
from .moe import (MOE_TENSORS, FeedForward, MoEHParams, MoEWeights, MoEWorkspace, feed_forward,
                  load_feed_forward, load_moe, moe_forward, moe_hparams_from_metadata)
from .transformer import DEFAULT_CHUNK, Transformer, Workspace
from .weights import ModelWeights, WeightsError, _linear, _vector

ARCH = "deepseek2"


# --- hyper-parameters ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Deepseek2HParams(HParams):
    mla: MLAShape | None = None
    moe: MoEHParams | None = None
    kq_scale: float = 1.0           # the attention scale, YaRN's mscale included
    rope_yarn_log_mul: float = 0.0


def read_hparams(meta: dict, n_vocab_tensor: int | None = None) -> Deepseek2HParams:
    """The llama-style keys, MLA's and the experts', as llama.cpp's deepseek2 loader reads them."""
    a = ARCH
    k = lambda name: f"{a}.{name}"  # noqa: E731
    # the value length is the latent's here (not the key's): checked below, not by the common reader
    base = decoder_hparams({n: v for n, v in meta.items() if n != k("attention.value_length")},
                           a, n_vocab_tensor)
    if k("attention.key_length_mla") not in meta and k("attention.value_length_mla") not in meta:
        raise HParamsError(f"no {k('attention.key_length_mla')}: the legacy MLA layout (one "
                           f"attn_kv_b per layer) is not supported; convert the model again with a "
                           f"current llama.cpp (attn_k_b / attn_v_b)")
    n_k = _positive(k("attention.key_length_mla"), _get(meta, k("attention.key_length_mla"), int))
    n_v = _positive(k("attention.value_length_mla"), _get(meta, k("attention.value_length_mla"), int))
    n_lora_kv = _positive(k("attention.kv_lora_rank"), _get(meta, k("attention.kv_lora_rank"), int))
    n_lora_q = _get(meta, k("attention.q_lora_rank"), int, default=0, required=False)
    if n_lora_q < 0:
        raise HParamsError(f"metadata key {k('attention.q_lora_rank')} must not be negative")
    n_rot = base.n_rot
    if n_rot >= n_k:
        raise HParamsError(f"{k('rope.dimension_count')} ({n_rot}) must be smaller than "
                           f"{k('attention.key_length_mla')} ({n_k})")
    # the cache row llama.cpp allocates: key = [latent | rope part], value = the latent
    if base.head_dim != n_lora_kv + n_rot:
        raise HParamsError(f"{k('attention.key_length')} ({base.head_dim}) is not "
                           f"{k('attention.kv_lora_rank')} + {k('rope.dimension_count')} "
                           f"({n_lora_kv} + {n_rot})")
    n_v_latent = _get(meta, k("attention.value_length"), int, default=base.head_dim, required=False)
    if n_v_latent != n_lora_kv:
        raise HParamsError(f"{k('attention.value_length')} ({n_v_latent}) is not "
                           f"{k('attention.kv_lora_rank')} ({n_lora_kv})")
    if base.n_head_kv != 1:
        raise HParamsError(f"{k('attention.head_count_kv')} is {base.n_head_kv}: MLA files have 1")
    if _get(meta, k("attention.temperature_scale"), float, default=0.0, required=False) != 0.0:
        raise HParamsError(f"{k('attention.temperature_scale')} is set: attention temperature "
                           f"tuning is not supported")
    if k("expert_shared_count") not in meta:  # llama.cpp requires it for deepseek2
        raise HParamsError(f"missing metadata key {k('expert_shared_count')}")
    # no scoring named: softmax (DeepSeek V2), except llama.cpp's GLM-4.7-Lite special case
    n_vocab = base.n_vocab
    sigmoid_default = base.n_layer in (47, 48) and n_vocab == 154880
    moe = moe_hparams_from_metadata(meta, a, base.n_layer,
                                    default_gating="sigmoid" if sigmoid_default else "softmax")

    # YaRN as llama.cpp's context and graph compute it (float32). This llama.cpp reads neither
    # the yarn_ext_factor / yarn_attn_factor nor the beta keys from the file: ext_factor is 1
    # under YaRN (0 otherwise), beta_fast 32, beta_slow 1.
    f32 = np.float32
    freq_scale = f32(base.rope_freq_scale)
    log_mul = f32(_get(meta, k("rope.scaling.yarn_log_multiplier"), float, default=0.0,
                       required=False)) / f32(0.1)
    ext_factor = 1.0 if base.rope_scaling == "yarn" else 0.0
    attn_factor = f32(1.0)
    if ext_factor:
        factor = f32(1.0) / freq_scale

        def get_mscale(scale, m):
            return f32(1.0) if scale <= 1 else f32(0.1) * m * f32(np.log(scale)) + f32(1.0)

        if log_mul != 0:
            mscale = log_mul if log_mul != 1 else f32(1.0)  # llama.cpp's deepseek2 special case
            attn_factor = get_mscale(factor, mscale) / get_mscale(factor, log_mul)
        else:
            attn_factor = get_mscale(factor, f32(1.0))
        attn_factor = attn_factor * (f32(1.0) / (f32(1.0) + f32(0.1) * f32(np.log(factor))))
    attn_factor = attn_factor * f32(_get(meta, k("rope.scaling.attn_factor"), float, default=1.0,
                                         required=False))
    ln_s = f32(np.log(f32(1.0) / freq_scale))
    attn_factor_org = attn_factor * (f32(1.0) + f32(0.1) * ln_s)
    mscale = attn_factor_org * (f32(1.0) + f32(0.1) * log_mul * ln_s)
    kq_scale = f32(1.0) * mscale * mscale / f32(np.sqrt(f32(n_k)))

    mla = MLAShape(n_head=base.n_head, n_lora_q=n_lora_q, n_lora_kv=n_lora_kv, n_nope=n_k - n_rot,
                   n_rot=n_rot, n_v=n_v)
    hp = dataclasses.replace(base, head_dim=n_k, head_dim_v=n_v, yarn_ext_factor=ext_factor,
                             yarn_attn_factor=float(attn_factor), yarn_beta_fast=32.0,
                             yarn_beta_slow=1.0)
    return Deepseek2HParams(**{f.name: getattr(hp, f.name) for f in fields(hp)}, mla=mla, moe=moe,
                            kq_scale=float(kq_scale), rope_yarn_log_mul=float(log_mul))


# --- weights ------------------------------------------------------------------------------------


@dataclass
class Deepseek2LayerWeights:
    attn: MLAWeights
    ffn_norm: np.ndarray
    dense: FeedForward | None           # the leading dense layers
    moe: MoEWeights | None              # the others

    def linears(self) -> list:
        ffn = self.dense.linears() if self.dense is not None else self.moe.linears()
        return self.attn.linears() + ffn


def load_layer(tensors: dict, il: int, hp: Deepseek2HParams, int8: str) -> Deepseek2LayerWeights:
    p = f"blk.{il}."
    H = hp.n_embd
    moe_layer = hp.moe.is_moe_layer(il)
    return Deepseek2LayerWeights(
        attn=load_mla(tensors, p, hp.mla, H, int8),
        ffn_norm=_vector(tensors, p + "ffn_norm.weight", H),
        dense=None if moe_layer else load_feed_forward(tensors, p, "", H, hp.n_ff, int8),
        moe=load_moe(tensors, p, hp.moe, H, ARCH, int8, selection_bias_required=False)
        if moe_layer else None,
    )


def load_weights(tensors: dict, hp: Deepseek2HParams, *, int8: str = "default") -> ModelWeights:
    """The decoder's weights (the NextN layers' tensors are checked by name, not loaded)."""
    H = hp.n_embd
    expected = _expected_names(hp)
    unknown = [n for n in tensors if n not in expected]
    if any(n.endswith(".attn_kv_b.weight") for n in unknown):
        raise WeightsError("the legacy MLA tensor attn_kv_b is not supported: convert the model "
                           "again with a current llama.cpp (attn_k_b / attn_v_b)")
    if any(n.endswith(".ffn_gate_up_exps.weight") for n in unknown):
        raise WeightsError("fused ffn_gate_up_exps expert tensors are not supported yet")
    layers = [load_layer(tensors, il, hp, int8) for il in range(hp.n_layer)]
    token_embd = _linear(tensors, "token_embd.weight", hp.n_vocab, H, "none")
    tied = "output.weight" not in tensors
    if tied:  # the same bytes, as a separate Linear so its matmul path can differ
        output = _linear(tensors, "token_embd.weight", hp.n_vocab, H, int8)
    else:
        output = _linear(tensors, "output.weight", hp.n_vocab, H, int8)
    if unknown:
        raise WeightsError(f"unexpected tensor {unknown[0]} for a {ARCH} model"
                           + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""))
    used: dict[str, int] = {}
    weights = ModelWeights(token_embd, layers, _vector(tensors, "output_norm.weight", H), output,
                           None, tied, used)
    for lin in [token_embd] + weights.linears()[:-1] + ([] if tied else [output]):
        used[lin.fmt.name] = used.get(lin.fmt.name, 0) + 1
    return weights


_LAYER_TENSORS = MLA_TENSORS + ("ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight",
                                "ffn_down.weight") + MOE_TENSORS
_NEXTN_TENSORS = ("eh_proj", "enorm", "hnorm", "embed_tokens", "shared_head_head", "shared_head_norm")


def _expected_names(hp: Deepseek2HParams) -> set[str]:
    names = {"token_embd.weight", "output_norm.weight", "output.weight"}
    for i in range(hp.n_layer + hp.n_nextn):
        names.update(f"blk.{i}.{t}" for t in _LAYER_TENSORS)
    for i in range(hp.n_layer, hp.n_layer + hp.n_nextn):
        names.update(f"blk.{i}.nextn.{t}.weight" for t in _NEXTN_TENSORS)
    return names


# --- the decoder --------------------------------------------------------------------------------


def layer_forward(x, lw: Deepseek2LayerWeights, hp: Deepseek2HParams, cache: LatentCache,
                  layer: int, positions, limits, rope: tuple, ws: Workspace,
                  mla_ws: MLAWorkspace, moe_ws: MoEWorkspace) -> None:
    """One decoder layer on x (k, n_embd), in place (see transformer.layer_forward for
    ``positions`` and ``limits``), on the device of ``ws.ops``."""
    mla_attention_block(x, lw.attn, hp.mla, hp.rms_eps, hp.kq_scale, cache, layer, positions,
                        limits, rope, mla_ws)
    ops = ws.ops
    k = x.shape[0]
    h = ws.norm[:k]
    o = ws.proj[:k]
    ops.rmsnorm(x, lw.ffn_norm, hp.rms_eps, h)
    if lw.moe is not None:
        moe_forward(h, lw.moe, hp.moe, moe_ws, o)
    else:
        feed_forward(h, lw.dense, ws.gate[:k], ws.up[:k], o, ops)
    ops.add_into(x, o)


class Deepseek2NextN:
    """A NextN (MTP) layer as the MTP drafter runs it: this module's decoder layer on the NextN
    block's weights, at slot 0 of a one-layer LatentCache, with workspaces of its own."""

    def __init__(self, model: "Deepseek2Transformer", layer: Deepseek2LayerWeights):
        hp = model.hp
        self.model = model
        self.layer = layer
        self.cache = model.new_cache(n_layer=1)
        self.ws = Workspace(hp, model.chunk, model.ops)
        self.mla_ws = MLAWorkspace(hp.mla, hp.n_embd, self.ws.rows, model.ops)
        self.moe_ws = MoEWorkspace(hp.moe, hp.n_embd, self.ws.rows, model.ops)

    def forward(self, x, positions: np.ndarray, limits: np.ndarray) -> None:
        """x (k <= chunk rows, n_embd) through the layer, in place; writes the latent rows at
        ``positions`` (checked by the caller: MtpHead runs positions 0.. in order)."""
        m = self.model
        positions, limits = m.ops.asarray(positions), m.ops.asarray(limits)
        layer_forward(x, self.layer, m.hp, self.cache, 0, positions, limits, m.rope, self.ws,
                      self.mla_ws, self.moe_ws)


class Deepseek2Transformer(Transformer):
    """A deepseek2 model: the Transformer's forward loop and output, with a latent cache, rope
    tables over the rope dimensions (YaRN as llama.cpp applies it) and this module's layers."""

    dense_mtp_heads = False  # its NextN layer is this module's (attention + experts)

    def __init__(self, hp: Deepseek2HParams, weights: ModelWeights, *, n_ctx: int,
                 cache_type: str = "f32", chunk: int = DEFAULT_CHUNK, device: str = "cpu"):
        super().__init__(hp, weights, n_ctx=n_ctx, cache_type=cache_type, chunk=chunk,
                         device=device)
        # always through the YaRN formula: with ext_factor 0 it is plain (linear) scaling with
        # the tables multiplied by attn_factor, which is what llama.cpp's rope does
        cos, sin = kernels.rope_tables(
            n_ctx, hp.n_rot, hp.rope_freq_base, freq_scale=hp.rope_freq_scale,
            yarn=(hp.rope_n_ctx_orig, hp.yarn_beta_fast, hp.yarn_beta_slow, hp.yarn_ext_factor,
                  hp.yarn_attn_factor))
        self.rope = (self.ops.asarray(cos), self.ops.asarray(sin))
        self.mla_ws = MLAWorkspace(hp.mla, hp.n_embd, self.ws.rows, self.ops)
        self.moe_ws = MoEWorkspace(hp.moe, hp.n_embd, self.ws.rows, self.ops)

    def new_cache(self, n_ctx: int | None = None, n_layer: int | None = None) -> LatentCache:
        hp = self.hp
        n_ctx = n_ctx or self.n_ctx
        if n_ctx > self.n_ctx:
            raise ValueError(f"a cache of {n_ctx} positions exceeds the model's context of {self.n_ctx}")
        return self.ops.latent_cache(n_layer or hp.n_layer, n_ctx, hp.mla.n_lora_kv,
                                     hp.mla.n_rot, self.cache_type)

    def run_layers(self, x, positions: np.ndarray, limits: np.ndarray,
                   cache: LatentCache, hidden: dict | None = None, layers=None) -> None:
        # The kernels do not check bounds: everything they index is checked here, once.
        positions = np.ascontiguousarray(positions, np.int64)
        limits = np.ascontiguousarray(limits, np.int64)
        k = x.shape[0]
        if k > self.ws.rows:
            raise ValueError(f"{k} rows exceed the workspace of {self.ws.rows}")
        if (x.shape != (k, self.hp.n_embd) or x.dtype != np.float32
                or not self.ops.is_c_contiguous(x)):
            raise ValueError(f"x must be C-contiguous float32 of shape (k, {self.hp.n_embd})")
        if positions.shape != (k,) or limits.shape != (k,):
            raise ValueError("positions and limits need one entry per row")
        if not isinstance(cache, LatentCache) or cache.rows.shape[2] != self.hp.mla.n_latent:
            raise ValueError("the cache does not fit this model's latent attention")
        if k and (positions.min() < 0 or positions.max() >= min(cache.n_ctx, self.rope[0].shape[0])
                  or limits.min() < 1 or limits.max() > cache.n_ctx):
            raise ValueError(f"positions must lie in [0, {cache.n_ctx}) and limits in [1, {cache.n_ctx}]")
        layers = range(self.hp.n_layer) if layers is None else tuple(layers)
        for il in layers:
            if not 0 <= il < cache.n_layer:
                raise ValueError(f"layer {il} has no slot in a cache of {cache.n_layer} layers")
        positions, limits = self.ops.asarray(positions), self.ops.asarray(limits)
        for il in layers:
            layer_forward(x, self.weights.layers[il], self.hp, cache, il, positions, limits,
                          self.rope, self.ws, self.mla_ws, self.moe_ws)
            if hidden is not None and il in hidden:
                hidden[il].append(self.ops.host_copy(x))

    # --- the NextN (MTP) layer, for the MTP drafter ------------------------------------------

    def load_nextn_layer(self, tensors: dict, block: int, int8: str) -> Deepseek2LayerWeights:
        """The decoder-layer weights of NextN block ``block`` (``blk.{block}.*``); raises
        WeightsError."""
        return load_layer(tensors, block, self.hp, int8)

    def nextn_layer(self, layer: Deepseek2LayerWeights) -> Deepseek2NextN:
        return Deepseek2NextN(self, layer)
