"""The GLM-5 family decoder (llama.cpp's ``glm-dsa``), top to bottom.

    x = embed(tokens)
    for each layer:
        h = rmsnorm(x)
        q_a = rmsnorm(h Wq_a)                      the low-rank query (always: glm-dsa has q_lora)
        full indexer layers: the lightning indexer (dsa.py) scores every visible position from
            h and q_a, stores its own key, and keeps the top_k positions per row;
        shared layers: the positions of the last full layer
        x += mla(h, q_a) over those positions only  (mla.py: the latent cache, absorbed form)
        h = rmsnorm(x)                             (ffn_norm)
        the first leading_dense_block_count layers: x += (silu(h Wg) * h Wu) Wd
        the others: x += moe(h)                    (sigmoid-scored by default, a shared expert)
    logits = rmsnorm(x) Wout

What llama.cpp (b10309) does, and so this module:
  * the indexer runs at every length: below top_k visible positions it keeps them all (dense),
    above it the attention is sparse;
  * the indexer's key norm is a LayerNorm with epsilon 0 (llama.cpp's glm-dsa never reads a
    layer_norm_epsilon key), its weights are scaled by 1 / sqrt(key_length * head_count);
  * ``attention.indexer.types`` (per layer: full or shared) when the file has it; otherwise
    every layer is full below a 2^20 training context (GLM-5, 5.1) and GLM-5.2's pattern above;
  * YaRN's attention factor as deepseek2's, but ``rope.scaling.yarn_log_multiplier`` is not
    read (this llama.cpp's glm-dsa leaves it at 0).

NextN (MTP) layers after the decoder blocks are checked by name and the decoder does not run
them. The MTP drafter does (speculative/mtp.py), through ``GlmDsaTransformer.load_nextn_layer``
/ ``nextn_layer``: this module's layer (MLA + MoE) on the NextN block's weights, with a
one-layer cache of its own. How that layer attends:

  * GLM-5's NextN block carries its own indexer tensors (``blk.L.indexer.*``: the Hugging Face
    checkpoint's MTP layer is a full decoder layer, DSA included, and the converters keep them).
    The reference serving code (vLLM / SGLang's DeepSeek-V3.2 / GLM-5 MTP layer) runs that
    indexer: the head attends sparsely, to the top_k of its own rows, as it was trained. So does
    this module: the head's layer is a full indexer layer (whatever ``indexer.types`` says of
    the trunk) with a one-layer DSACache (latent rows + indexer keys, one length: truncate rolls
    both back);
  * llama.cpp (b10309)'s MTP graph loads those tensors and does not use them: its MTP layer
    attends densely over all of its rows. The two agree while the head has at most top_k rows
    (GLM-5: 2048 positions) and differ after that; drafts are only proposals, so the output is
    lossless either way, only the acceptance can differ;
  * a NextN block without indexer tensors (llama.cpp loads them as optional) attends densely,
    as llama.cpp's MTP graph does, with a one-layer LatentCache.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields

import numpy as np

from . import kernels
from .dsa import (INDEXER_TENSORS, DSACache, IndexerShape, IndexerWeights, IndexerWorkspace,
                  indexer_select, load_indexer)
from .hparams import HParams, HParamsError, _get, _positive, decoder_hparams
from .mla import MLA_TENSORS, LatentCache, MLAShape, MLAWeights, MLAWorkspace, load_mla, mla_attention_block
from .moe import (MOE_TENSORS, FeedForward, MoEHParams, MoEWeights, MoEWorkspace, feed_forward,
                  load_feed_forward, load_moe, moe_forward, moe_hparams_from_metadata)
from .transformer import DEFAULT_CHUNK, Transformer, Workspace
from .weights import ModelWeights, WeightsError, _linear, _vector

ARCH = "glm-dsa"

#: llama.cpp's indexer types when the file names none and its training context is 2^20 or
#: more (GLM-5.2): layers 0 and 1 full, then every fourth from layer 2, the rest shared
_GLM_5_2_TABLE_LAYERS = 78


def _glm_5_2_default(il: int) -> bool:
    return il < 2 or (il < _GLM_5_2_TABLE_LAYERS and (il - 2) % 4 == 0)


# --- hyper-parameters ---------------------------------------------------------------------------


@dataclass(frozen=True)
class GlmDsaHParams(HParams):
    mla: MLAShape | None = None
    moe: MoEHParams | None = None
    indexer: IndexerShape | None = None
    #: per decoder layer: True where the layer runs its own indexer ("full")
    indexer_full: tuple = ()
    kq_scale: float = 1.0

    @property
    def indexer_layers(self) -> tuple:
        return tuple(i for i, full in enumerate(self.indexer_full) if full)


def _indexer_types(meta: dict, n_layer: int, n_ctx_train: int) -> tuple:
    key = f"{ARCH}.attention.indexer.types"
    if key not in meta:
        if n_ctx_train < 1048576:
            return (True,) * n_layer
        return tuple(_glm_5_2_default(il) for il in range(n_layer))
    v = meta[key]
    if isinstance(v, (list, tuple, np.ndarray)):
        if len(v) != n_layer:
            raise HParamsError(f"{key} has {len(v)} entries, expected one per decoder layer ({n_layer})")
        values = list(v)
    else:
        values = [v] * n_layer
    for x in values:
        if not isinstance(x, (bool, int, np.bool_, np.integer)):
            raise HParamsError(f"metadata key {key} must hold booleans or integers")
    return tuple(bool(x) for x in values)


def read_hparams(meta: dict, n_vocab_tensor: int | None = None) -> GlmDsaHParams:
    """The llama-style keys, MLA's, the indexer's and the experts', as llama.cpp's glm-dsa
    loader reads them (one-line HParamsError naming the key)."""
    a = ARCH
    k = lambda name: f"{a}.{name}"  # noqa: E731
    # the value length is the latent's here (not the key's): checked below
    base = decoder_hparams({n: v for n, v in meta.items() if n != k("attention.value_length")},
                           a, n_vocab_tensor)
    if k("rope.dimension_sections") in meta:
        raise HParamsError(f"{k('rope.dimension_sections')} is set: M-RoPE is not supported")
    n_k = _positive(k("attention.key_length_mla"), _get(meta, k("attention.key_length_mla"), int))
    n_v = _positive(k("attention.value_length_mla"), _get(meta, k("attention.value_length_mla"), int))
    n_lora_kv = _positive(k("attention.kv_lora_rank"), _get(meta, k("attention.kv_lora_rank"), int))
    n_lora_q = _positive(k("attention.q_lora_rank"), _get(meta, k("attention.q_lora_rank"), int))
    n_rot = base.n_rot
    if n_rot >= n_k:
        raise HParamsError(f"{k('rope.dimension_count')} ({n_rot}) must be smaller than "
                           f"{k('attention.key_length_mla')} ({n_k})")
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
    if k("expert_shared_count") not in meta:  # llama.cpp requires it
        raise HParamsError(f"missing metadata key {k('expert_shared_count')}")
    moe = moe_hparams_from_metadata(meta, a, base.n_layer, default_gating="sigmoid")

    ik = lambda name: k(f"attention.indexer.{name}")  # noqa: E731
    idx_head = _positive(ik("head_count"), _get(meta, ik("head_count"), int))
    idx_dim = _positive(ik("key_length"), _get(meta, ik("key_length"), int))
    top_k = _get(meta, ik("top_k"), int)
    if top_k < 1:
        raise HParamsError(f"metadata key {ik('top_k')} is {top_k}: the indexer must keep at "
                           f"least one position")
    if idx_dim & (idx_dim - 1):
        raise HParamsError(f"{ik('key_length')} ({idx_dim}) is not a power of two (the size of "
                           f"the indexer's Hadamard rotation)")
    if n_rot > idx_dim:
        raise HParamsError(f"{k('rope.dimension_count')} ({n_rot}) is larger than "
                           f"{ik('key_length')} ({idx_dim})")
    full = _indexer_types(meta, base.n_layer, base.n_ctx_train)
    if not full[0]:
        raise HParamsError(f"{ik('types')}: layer 0 is a shared indexer layer, but a shared layer "
                           f"takes its positions from a full layer before it")

    # YaRN as llama.cpp's context and glm-dsa graph compute it (float32): deepseek2's formula
    # with the log multiplier left at 0 (ext_factor 1 under YaRN, beta_fast 32, beta_slow 1)
    f32 = np.float32
    freq_scale = f32(base.rope_freq_scale)
    ext_factor = 1.0 if base.rope_scaling == "yarn" else 0.0
    attn_factor = f32(1.0)
    if ext_factor:
        factor = f32(1.0) / freq_scale
        attn_factor = f32(1.0) if factor <= 1 else f32(0.1) * f32(np.log(factor)) + f32(1.0)
        attn_factor = attn_factor * (f32(1.0) / (f32(1.0) + f32(0.1) * f32(np.log(factor))))
    attn_factor = attn_factor * f32(_get(meta, k("rope.scaling.attn_factor"), float, default=1.0,
                                         required=False))
    ln_s = f32(np.log(f32(1.0) / freq_scale))
    mscale = attn_factor * (f32(1.0) + f32(0.1) * ln_s)
    kq_scale = f32(1.0) * mscale * mscale / f32(np.sqrt(f32(n_k)))

    mla = MLAShape(n_head=base.n_head, n_lora_q=n_lora_q, n_lora_kv=n_lora_kv, n_nope=n_k - n_rot,
                   n_rot=n_rot, n_v=n_v)
    hp = dataclasses.replace(base, head_dim=n_k, head_dim_v=n_v, yarn_ext_factor=ext_factor,
                             yarn_attn_factor=float(attn_factor), yarn_beta_fast=32.0,
                             yarn_beta_slow=1.0)
    return GlmDsaHParams(**{f.name: getattr(hp, f.name) for f in fields(hp)}, mla=mla, moe=moe,
                         indexer=IndexerShape(idx_head, idx_dim, top_k, n_rot), indexer_full=full,
                         kq_scale=float(kq_scale))


# --- weights ------------------------------------------------------------------------------------


@dataclass
class GlmDsaLayerWeights:
    attn: MLAWeights
    indexer: IndexerWeights | None      # full indexer layers only
    ffn_norm: np.ndarray
    dense: FeedForward | None           # the leading dense layers
    moe: MoEWeights | None              # the others

    def linears(self) -> list:
        ffn = self.dense.linears() if self.dense is not None else self.moe.linears()
        idx = self.indexer.linears() if self.indexer is not None else []
        return self.attn.linears() + idx + ffn


def load_layer(tensors: dict, il: int, hp: GlmDsaHParams, int8: str,
               indexer: bool | None = None) -> GlmDsaLayerWeights:
    """Block ``il``'s weights; its indexer where ``indexer`` (None: where ``indexer.types`` makes
    the decoder layer a full one; a NextN block has none unless asked for)."""
    p = f"blk.{il}."
    H = hp.n_embd
    moe_layer = hp.moe.is_moe_layer(il)
    full = (il < hp.n_layer and hp.indexer_full[il]) if indexer is None else indexer
    return GlmDsaLayerWeights(
        attn=load_mla(tensors, p, hp.mla, H, int8),
        indexer=load_indexer(tensors, p, hp.indexer, hp.mla.n_lora_q, H, int8) if full else None,
        ffn_norm=_vector(tensors, p + "ffn_norm.weight", H),
        dense=None if moe_layer else load_feed_forward(tensors, p, "", H, hp.n_ff, int8),
        moe=load_moe(tensors, p, hp.moe, H, ARCH, int8, selection_bias_required=False)
        if moe_layer else None,
    )


_LAYER_TENSORS = (MLA_TENSORS + INDEXER_TENSORS
                  + ("ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")
                  + MOE_TENSORS)
_NEXTN_TENSORS = ("eh_proj", "enorm", "hnorm", "embed_tokens", "shared_head_head", "shared_head_norm")


def _expected_names(hp: GlmDsaHParams) -> set[str]:
    names = {"token_embd.weight", "output_norm.weight", "output.weight"}
    for i in range(hp.n_layer + hp.n_nextn):
        names.update(f"blk.{i}.{t}" for t in _LAYER_TENSORS)
    for i in range(hp.n_layer, hp.n_layer + hp.n_nextn):
        names.update(f"blk.{i}.nextn.{t}.weight" for t in _NEXTN_TENSORS)
    return names


def load_weights(tensors: dict, hp: GlmDsaHParams, *, int8: str = "default") -> ModelWeights:
    """The decoder's weights (a shared indexer layer's indexer tensors and the NextN layers'
    are checked by name, not loaded)."""
    H = hp.n_embd
    unknown = [n for n in tensors if n not in _expected_names(hp)]
    layers = [load_layer(tensors, il, hp, int8) for il in range(hp.n_layer)]
    token_embd = _linear(tensors, "token_embd.weight", hp.n_vocab, H, "none")
    tied = "output.weight" not in tensors
    output = _linear(tensors, "token_embd.weight" if tied else "output.weight", hp.n_vocab, H, int8)
    if unknown:
        raise WeightsError(f"unexpected tensor {unknown[0]} for a {ARCH} model"
                           + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""))
    used: dict[str, int] = {}
    weights = ModelWeights(token_embd, layers, _vector(tensors, "output_norm.weight", H), output,
                           None, tied, used)
    for lin in [token_embd] + weights.linears()[:-1] + ([] if tied else [output]):
        used[lin.fmt.name] = used.get(lin.fmt.name, 0) + 1
    return weights


# --- the decoder --------------------------------------------------------------------------------


class Selection:
    """The positions the last full indexer layer chose, for the shared layers after it."""

    __slots__ = ("value",)

    def __init__(self):
        self.value = None


def layer_forward(x, lw: GlmDsaLayerWeights, hp: GlmDsaHParams, cache: LatentCache, layer: int,
                  positions, limits, rope: tuple, ws: Workspace, mla_ws: MLAWorkspace,
                  moe_ws: MoEWorkspace, idx_ws: IndexerWorkspace | None,
                  selection: Selection | None) -> None:
    """One decoder layer on x (k, n_embd), in place (see transformer.layer_forward for
    ``positions`` and ``limits``). ``selection`` carries a full layer's choice to the shared
    layers after it within one pass over the layers; None for a layer that runs alone (a NextN
    layer): with an indexer it selects for itself, without one it attends densely over a
    LatentCache. ``cache`` is a DSACache wherever an indexer runs. Arrays are on the device of
    ``ws.ops``."""

    def select(hs, qa):
        if lw.indexer is not None:
            chosen = indexer_select(hs, qa, lw.indexer, hp.indexer, cache, layer, positions,
                                    limits, rope, idx_ws)
            if selection is not None:
                selection.value = chosen
            return chosen
        if selection is None or selection.value is None:
            raise ValueError(f"layer {layer} shares the indexer of an earlier layer, which did "
                             f"not run in this pass")
        return selection.value

    dense = lw.indexer is None and selection is None
    mla_attention_block(x, lw.attn, hp.mla, hp.rms_eps, hp.kq_scale, cache, layer, positions,
                        limits, rope, mla_ws, None if dense else select)
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


class GlmDsaNextN:
    """A NextN (MTP) layer as the MTP drafter runs it: this module's decoder layer on the NextN
    block's weights at slot 0 of a one-layer cache, with workspaces of its own. With the block's
    indexer (GLM-5's checkpoints have one) the layer selects its own top_k positions over a
    one-layer DSACache; without one it attends densely over a LatentCache (llama.cpp's MTP
    graph, which attends densely in either case: see the module's docstring)."""

    def __init__(self, model: "GlmDsaTransformer", layer: GlmDsaLayerWeights):
        hp = model.hp
        self.model = model
        self.layer = layer
        self.cache = model.new_cache(n_layer=1, index_layers=(0,) if layer.indexer is not None else ())
        ops = model.ops
        self.ws = Workspace(hp, model.chunk, ops)
        self.mla_ws = MLAWorkspace(hp.mla, hp.n_embd, self.ws.rows, ops)
        self.moe_ws = MoEWorkspace(hp.moe, hp.n_embd, self.ws.rows, ops)
        self.idx_ws = (IndexerWorkspace(hp.indexer, self.ws.rows, ops) if layer.indexer is not None
                       else None)

    def forward(self, x, positions: np.ndarray, limits: np.ndarray) -> None:
        """x (k <= chunk rows, n_embd) through the layer, in place; writes the latent rows (and
        the indexer keys) at ``positions`` (checked by the caller: MtpHead runs positions 0.. in
        order)."""
        m = self.model
        positions, limits = m.ops.asarray(positions), m.ops.asarray(limits)
        layer_forward(x, self.layer, m.hp, self.cache, 0, positions, limits, m.rope, self.ws,
                      self.mla_ws, self.moe_ws, self.idx_ws, None)


class GlmDsaTransformer(Transformer):
    """A glm-dsa model: the Transformer's forward loop and output, with a DSACache (the latent
    rows and the indexer's keys), rope tables over the rope dimensions (YaRN as llama.cpp
    applies it) and this module's layers."""

    dense_mtp_heads = False  # its NextN layer is this module's (MLA, the indexer, experts)

    def __init__(self, hp: GlmDsaHParams, weights: ModelWeights, *, n_ctx: int,
                 cache_type: str = "f32", chunk: int = DEFAULT_CHUNK, device: str = "cpu"):
        super().__init__(hp, weights, n_ctx=n_ctx, cache_type=cache_type, chunk=chunk,
                         device=device)
        cos, sin = kernels.rope_tables(
            n_ctx, hp.n_rot, hp.rope_freq_base, freq_scale=hp.rope_freq_scale,
            yarn=(hp.rope_n_ctx_orig, hp.yarn_beta_fast, hp.yarn_beta_slow, hp.yarn_ext_factor,
                  hp.yarn_attn_factor))
        self.rope = (self.ops.asarray(cos), self.ops.asarray(sin))
        self.mla_ws = MLAWorkspace(hp.mla, hp.n_embd, self.ws.rows, self.ops)
        self.moe_ws = MoEWorkspace(hp.moe, hp.n_embd, self.ws.rows, self.ops)
        self.idx_ws = IndexerWorkspace(hp.indexer, self.ws.rows, self.ops)

    def new_cache(self, n_ctx: int | None = None, n_layer: int | None = None,
                  index_layers: tuple | None = None) -> LatentCache:
        """The model's DSACache. With ``n_layer`` (a drafter's own layers) the indexer keys are
        kept for ``index_layers`` only: a DSACache when there are any, else a plain LatentCache
        (layers that attend densely)."""
        hp = self.hp
        n_ctx = n_ctx or self.n_ctx
        if n_ctx > self.n_ctx:
            raise ValueError(f"a cache of {n_ctx} positions exceeds the model's context of {self.n_ctx}")
        if n_layer is None:
            n_layer, index_layers = hp.n_layer, hp.indexer_layers
        return self.ops.latent_cache(n_layer, n_ctx, hp.mla.n_lora_kv, hp.mla.n_rot,
                                     self.cache_type, index_layers or (), hp.indexer.head_dim)

    def run_layers(self, x, positions: np.ndarray, limits: np.ndarray,
                   cache: DSACache, hidden: dict | None = None, layers=None) -> None:
        # The kernels do not check bounds: everything they index is checked here, once.
        hp = self.hp
        positions = np.ascontiguousarray(positions, np.int64)
        limits = np.ascontiguousarray(limits, np.int64)
        k = x.shape[0]
        if k > self.ws.rows:
            raise ValueError(f"{k} rows exceed the workspace of {self.ws.rows}")
        if x.shape != (k, hp.n_embd) or x.dtype != np.float32 or not self.ops.is_c_contiguous(x):
            raise ValueError(f"x must be C-contiguous float32 of shape (k, {hp.n_embd})")
        if positions.shape != (k,) or limits.shape != (k,):
            raise ValueError("positions and limits need one entry per row")
        if (not isinstance(cache, DSACache) or cache.rows.shape[2] != hp.mla.n_latent
                or cache.index_layers != hp.indexer_layers
                or cache.index_rows.shape[2] != hp.indexer.head_dim):
            raise ValueError("the cache does not fit this model's latent attention and indexer")
        if k and (positions.min() < 0 or positions.max() >= min(cache.n_ctx, self.rope[0].shape[0])
                  or limits.min() < 1 or limits.max() > cache.n_ctx):
            raise ValueError(f"positions must lie in [0, {cache.n_ctx}) and limits in [1, {cache.n_ctx}]")
        layers = range(hp.n_layer) if layers is None else tuple(layers)
        for il in layers:
            if not 0 <= il < cache.n_layer:
                raise ValueError(f"layer {il} has no slot in a cache of {cache.n_layer} layers")
        positions, limits = self.ops.asarray(positions), self.ops.asarray(limits)
        selection = Selection()
        for il in layers:
            layer_forward(x, self.weights.layers[il], hp, cache, il, positions, limits, self.rope,
                          self.ws, self.mla_ws, self.moe_ws, self.idx_ws, selection)
            if hidden is not None and il in hidden:
                hidden[il].append(self.ops.host_copy(x))

    # --- the NextN (MTP) layer, for the MTP drafter ------------------------------------------

    def load_nextn_layer(self, tensors: dict, block: int, int8: str) -> GlmDsaLayerWeights:
        """The decoder-layer weights of NextN block ``block`` (``blk.{block}.*``), its indexer
        when the block has any indexer tensor (then the required ones must all be there);
        raises WeightsError."""
        p = f"blk.{block}."
        has_indexer = any(p + t in tensors for t in INDEXER_TENSORS)
        return load_layer(tensors, block, self.hp, int8, indexer=has_indexer)

    def nextn_layer(self, layer: GlmDsaLayerWeights) -> GlmDsaNextN:
        return GlmDsaNextN(self, layer)
