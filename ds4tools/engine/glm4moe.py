"""The GLM-4.5 family decoder (llama.cpp's ``glm4moe``), top to bottom.

    x = embed(tokens)
    for each layer:
        h = rmsnorm(x) ; q, k, v = h Wq + bq, h Wk + bk, h Wv + bv
        q, k = rmsnorm per head (q_norm, k_norm: only where the file has them)
        q, k = rope(q, k)            the two halves of the first n_rot dimensions ("neox";
                                     rope.dimension_count is half the head for GLM-4.5)
        cache[positions] = k, v ; a = attention(q, cache rows [0, limit)) ; x += a Wo
        h = rmsnorm(x)               (post_attention_norm)
        the first leading_dense_block_count layers: x += (silu(h Wg) * h Wu) Wd
        the others: x += moe(h)      (sigmoid-scored routed experts + a shared expert: moe.py)
    logits = rmsnorm(x) Wout

The file may carry ``nextn_predict_layers`` NextN (MTP) layers after the decoder blocks: they
are counted in block_count and checked by name; the decoder does not run them. The MTP drafter
does (speculative/mtp.py), through ``Glm4MoeTransformer.load_nextn_layer`` / ``nextn_layer``:
this module's layer on the NextN block's weights, with a one-layer KVCache of its own.
Attention, the cache and the output are the llama / qwen3 decoder's (``Transformer``); this
module adds the layer layout, its loading and the MoE feed-forward.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from .hparams import HParams, HParamsError, decoder_hparams
from .kv_cache import KVCache
from .moe import (MOE_TENSORS, FeedForward, MoEHParams, MoEWeights, MoEWorkspace, feed_forward,
                  load_feed_forward, load_moe, moe_forward, moe_hparams_from_metadata)
from .transformer import DEFAULT_CHUNK, Transformer, Workspace, attention_block
from .weights import Linear, ModelWeights, WeightsError, _linear, _vector

ARCH = "glm4moe"


# --- hyper-parameters ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Glm4MoeHParams(HParams):
    moe: MoEHParams | None = None


def read_hparams(meta: dict, n_vocab_tensor: int | None = None) -> Glm4MoeHParams:
    """The llama-style keys plus the experts', as llama.cpp's glm4moe loader reads them."""
    base = decoder_hparams(meta, ARCH, n_vocab_tensor)
    sections = meta.get(f"{ARCH}.rope.dimension_sections")
    if isinstance(sections, list) and any(sections):
        raise HParamsError(f"{ARCH}.rope.dimension_sections is set: multimodal rope (M-RoPE, "
                           f"GLM-4.5V) is not supported")
    moe = moe_hparams_from_metadata(meta, ARCH, base.n_layer, default_gating="sigmoid")
    return Glm4MoeHParams(**{f.name: getattr(base, f.name) for f in fields(base)}, moe=moe)


# --- weights ------------------------------------------------------------------------------------


@dataclass
class Glm4MoeLayerWeights:
    attn_norm: np.ndarray
    wq: Linear
    wk: Linear
    wv: Linear
    wo: Linear
    post_attention_norm: np.ndarray
    dense: FeedForward | None           # the leading dense layers
    moe: MoEWeights | None              # the others
    bq: np.ndarray | None = None
    bk: np.ndarray | None = None
    bv: np.ndarray | None = None
    q_norm: np.ndarray | None = None    # GLM-4.5 (355B) has them, GLM-4.5-Air not
    k_norm: np.ndarray | None = None
    bo: np.ndarray | None = None        # none in GLM-4.5 (attention_block reads it)

    def linears(self) -> list:
        ffn = self.dense.linears() if self.dense is not None else self.moe.linears()
        return [self.wq, self.wk, self.wv, self.wo] + ffn


def load_layer(tensors: dict, il: int, hp: Glm4MoeHParams, int8: str) -> Glm4MoeLayerWeights:
    p = f"blk.{il}."
    H, Q, KV = hp.n_embd, hp.n_q, hp.n_kv
    moe_layer = hp.moe.is_moe_layer(il)
    return Glm4MoeLayerWeights(
        attn_norm=_vector(tensors, p + "attn_norm.weight", H),
        wq=_linear(tensors, p + "attn_q.weight", Q, H, int8),
        wk=_linear(tensors, p + "attn_k.weight", KV, H, int8),
        wv=_linear(tensors, p + "attn_v.weight", KV, H, int8),
        wo=_linear(tensors, p + "attn_output.weight", H, Q, int8),
        post_attention_norm=_vector(tensors, p + "post_attention_norm.weight", H),
        dense=None if moe_layer else load_feed_forward(tensors, p, "", H, hp.n_ff, int8),
        # llama.cpp requires the selection bias in glm4moe files
        moe=load_moe(tensors, p, hp.moe, H, ARCH, int8, selection_bias_required=True)
        if moe_layer else None,
        bq=_vector(tensors, p + "attn_q.bias", Q, required=False),
        bk=_vector(tensors, p + "attn_k.bias", KV, required=False),
        bv=_vector(tensors, p + "attn_v.bias", KV, required=False),
        q_norm=_vector(tensors, p + "attn_q_norm.weight", hp.head_dim, required=False),
        k_norm=_vector(tensors, p + "attn_k_norm.weight", hp.head_dim, required=False),
    )


def load_weights(tensors: dict, hp: Glm4MoeHParams, *, int8: str = "default") -> ModelWeights:
    """The decoder's weights (the NextN layers' tensors are checked by name, not loaded)."""
    H = hp.n_embd
    layers = [load_layer(tensors, il, hp, int8) for il in range(hp.n_layer)]
    token_embd = _linear(tensors, "token_embd.weight", hp.n_vocab, H, "none")
    tied = "output.weight" not in tensors
    if tied:  # the same bytes, as a separate Linear so its matmul path can differ
        output = _linear(tensors, "token_embd.weight", hp.n_vocab, H, int8)
    else:
        output = _linear(tensors, "output.weight", hp.n_vocab, H, int8)
    expected = _expected_names(hp)
    unknown = [n for n in tensors if n not in expected]
    if unknown:
        raise WeightsError(f"unexpected tensor {unknown[0]} for a {ARCH} model"
                           + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""))
    used: dict[str, int] = {}
    weights = ModelWeights(token_embd, layers, _vector(tensors, "output_norm.weight", H), output,
                           None, tied, used)
    for lin in [token_embd] + weights.linears()[:-1] + ([] if tied else [output]):
        used[lin.fmt.name] = used.get(lin.fmt.name, 0) + 1
    return weights


_LAYER_TENSORS = ("attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
                  "attn_output.weight", "attn_q.bias", "attn_k.bias", "attn_v.bias",
                  "attn_q_norm.weight", "attn_k_norm.weight", "post_attention_norm.weight",
                  "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight") + MOE_TENSORS
_NEXTN_TENSORS = ("eh_proj", "enorm", "hnorm", "embed_tokens", "shared_head_head", "shared_head_norm")


def _expected_names(hp: Glm4MoeHParams) -> set[str]:
    names = {"token_embd.weight", "output_norm.weight", "output.weight"}
    for i in range(hp.n_layer + hp.n_nextn):
        names.update(f"blk.{i}.{t}" for t in _LAYER_TENSORS)
    for i in range(hp.n_layer, hp.n_layer + hp.n_nextn):
        names.update(f"blk.{i}.nextn.{t}.weight" for t in _NEXTN_TENSORS)
    return names


# --- the decoder --------------------------------------------------------------------------------


def layer_forward(x: np.ndarray, lw: Glm4MoeLayerWeights, hp: Glm4MoeHParams, cache: KVCache,
                  layer: int, positions: np.ndarray, limits: np.ndarray, rope: tuple,
                  ws: Workspace, moe_ws: MoEWorkspace) -> None:
    """One decoder layer on x (k, n_embd), in place (see transformer.layer_forward for
    ``positions`` and ``limits``)."""
    attention_block(x, lw, hp, cache, layer, positions, limits, rope, ws)
    ops = ws.ops
    k = x.shape[0]
    h = ws.norm[:k]
    o = ws.proj[:k]
    ops.rmsnorm(x, lw.post_attention_norm, hp.rms_eps, h)
    if lw.moe is not None:
        moe_forward(h, lw.moe, hp.moe, moe_ws, o)
    else:
        feed_forward(h, lw.dense, ws.gate[:k], ws.up[:k], o, ops)
    ops.add_into(x, o)


class Glm4MoeNextN:
    """A NextN (MTP) layer as the MTP drafter runs it: this module's decoder layer on the NextN
    block's weights, at slot 0 of a one-layer KVCache, with workspaces of its own."""

    def __init__(self, model: "Glm4MoeTransformer", layer: Glm4MoeLayerWeights):
        self.model = model
        self.layer = layer
        self.cache = model.new_cache(n_layer=1)
        self.ws = Workspace(model.hp, model.chunk, model.ops)
        self.moe_ws = MoEWorkspace(model.hp.moe, model.hp.n_embd, self.ws.rows, model.ops)

    def forward(self, x: np.ndarray, positions: np.ndarray, limits: np.ndarray) -> None:
        """x (k <= chunk rows, n_embd) through the layer, in place; writes the cache rows at
        ``positions`` (checked by the caller: MtpHead runs positions 0.. in order)."""
        m = self.model
        positions, limits = m.ops.asarray(positions), m.ops.asarray(limits)
        layer_forward(x, self.layer, m.hp, self.cache, 0, positions, limits, m.rope, self.ws,
                      self.moe_ws)


class Glm4MoeTransformer(Transformer):
    """A glm4moe model: the Transformer's cache, rope, output and forward loop, with this
    module's layers."""

    dense_mtp_heads = False  # its NextN layer is this module's (attention + experts)

    def __init__(self, hp: Glm4MoeHParams, weights: ModelWeights, *, n_ctx: int,
                 cache_type: str = "f32", chunk: int = DEFAULT_CHUNK, device: str = "cpu"):
        super().__init__(hp, weights, n_ctx=n_ctx, cache_type=cache_type, chunk=chunk,
                         device=device)
        self.moe_ws = MoEWorkspace(hp.moe, hp.n_embd, self.ws.rows, self.ops)

    def run_layers(self, x: np.ndarray, positions: np.ndarray, limits: np.ndarray,
                   cache: KVCache, hidden: dict | None = None, layers=None) -> None:
        # The base class checks everything the kernels index (an empty layer list runs none).
        super().run_layers(x, positions, limits, cache, None, layers=())
        layers = range(self.hp.n_layer) if layers is None else tuple(layers)
        for il in layers:
            if not 0 <= il < cache.n_layer:
                raise ValueError(f"layer {il} has no slot in a cache of {cache.n_layer} layers")
        positions = self.ops.asarray(np.ascontiguousarray(positions, np.int64))
        limits = self.ops.asarray(np.ascontiguousarray(limits, np.int64))
        for il in layers:
            layer_forward(x, self.weights.layers[il], self.hp, cache, il, positions, limits,
                          self.rope, self.ws, self.moe_ws)
            if hidden is not None and il in hidden:
                hidden[il].append(self.ops.host_copy(x))

    # --- the NextN (MTP) layer, for the MTP drafter ------------------------------------------

    def load_nextn_layer(self, tensors: dict, block: int, int8: str) -> Glm4MoeLayerWeights:
        """The decoder-layer weights of NextN block ``block`` (``blk.{block}.*``); raises
        WeightsError."""
        return load_layer(tensors, block, self.hp, int8)

    def nextn_layer(self, layer: Glm4MoeLayerWeights) -> Glm4MoeNextN:
        return Glm4MoeNextN(self, layer)
