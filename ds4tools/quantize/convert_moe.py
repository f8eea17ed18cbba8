"""Hugging Face mixture-of-experts checkpoints as llama.cpp's GGUF layouts:

- ``DeepseekV2ForCausalLM`` / ``DeepseekV3ForCausalLM`` -> ``deepseek2``: multi-head latent
  attention (the low-rank q path, the compressed kv with its rotary part), ``kv_b_proj`` split
  into ``attn_k_b`` (transposed per head) and ``attn_v_b``, YaRN keys, leading dense layers,
  routed + shared experts, the router's selection bias, expert groups;
- ``Glm4MoeForCausalLM`` -> ``glm4moe``: GQA with q/k/v biases, optional q/k norms, partial
  rotary, sigmoid-scored experts;
- ``GlmMoeDsaForCausalLM`` (GLM-5) -> ``glm-dsa``: DeepSeek's attention plus the DSA lightning
  indexer (``indexer.{attn_q_b, attn_k, k_norm, proj}``) and its keys.

Routed experts (``mlp.experts.X.{gate,up,down}_proj``) become one 3-D tensor per projection
(``ffn_{gate,up,down}_exps``), loaded and quantized one expert at a time. FP8 weights with
128 x 128 ``weight_scale_inv`` blocks (DeepSeek V3, GLM FP8 releases) are decoded to float
first. Every key and tensor follows llama.cpp's own converter and loader.

NextN layers (``num_nextn_predict_layers``, the blocks past ``num_hidden_layers``) are handled
by ``nextn``:

- ``"drop"`` (the default): left out, as llama.cpp's converter does with ``--no-mtp``;
- ``"keep"``: embedded (``blk.L.nextn.*`` plus the block's ordinary tensors, block_count
  counting them, ``{arch}.nextn_predict_layers``);
- ``"trunk"``: the keys of ``"keep"`` without the NextN tensors (llama.cpp's trunk-only file);
- ``"mtp"``: only the NextN blocks, the embedding, the output norm and head (llama.cpp's
  MTP-only file, as its converter writes with ``--mtp``).
"""
from __future__ import annotations

import os
import re
from collections import defaultdict

import gguf
import numpy as np
from gguf import GGUFValueType as V

from ..checkpoint import HFCheckpoint, HFTensor, MoEFamily, tokenizer_metadata
from ..errors import InvalidContentError, about
from ..gguf_io import MetaKey
from .source import Hparams, ModelSource, SourceTensor

__all__ = ["MoEHFSource", "NEXTN_MODES", "decode_fp8_block_scaled"]

NEXTN_MODES = ("drop", "keep", "trunk", "mtp")

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_SKIPPED_SUFFIXES = (".rotary_emb.inv_freq", ".weight_scale_inv", ".activation_scale",
                     ".input_scale")
#: NextN-only names (under model.layers.L.) -> llama.cpp's blk.L.nextn.<part>
NEXTN_PARTS = {
    "eh_proj.weight": "eh_proj", "enorm.weight": "enorm", "hnorm.weight": "hnorm",
    "shared_head.norm.weight": "shared_head_norm", "shared_head.head.weight": "shared_head_head",
    "embed_tokens.weight": "embed_tokens",
}
#: what an MTP-only file keeps besides the NextN blocks
_MTP_SHARED = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
_FP8 = ("F8_E4M3",)


def decode_fp8_block_scaled(codes: np.ndarray, scale: np.ndarray, block=(128, 128)) -> np.ndarray:
    """An FP8 E4M3 [out, in] matrix times its float block scales (``weight_scale_inv``: one per
    ``block`` of rows x columns, the last blocks possibly partial), as float32."""
    from ..support.fp8 import E4M3_VALUES
    w = np.asarray(codes)
    if w.ndim != 2:
        raise ValueError(f"FP8 weight must be 2-D, got shape {list(w.shape)}")
    br, bc = (int(b) for b in block)
    rows, cols = w.shape
    want = (-(-rows // br), -(-cols // bc))
    s = np.asarray(scale, np.float32)
    if s.shape != want:
        raise ValueError(f"FP8 scale has shape {list(s.shape)}, expected {list(want)} for a "
                         f"{list(w.shape)} weight in {br} x {bc} blocks")
    out = E4M3_VALUES[w.view(np.uint8)]
    col_scale = np.repeat(s, bc, axis=1)[:, :cols]
    for b in range(want[0]):  # one band of rows at a time: no full-size scale temporary
        out[b * br:(b + 1) * br] *= col_scale[b]
    return out


class _Config:
    """config.json's numbers, checked (each problem one line naming config.json)."""

    def __init__(self, cfg: dict, where: str, family: MoEFamily):
        self.cfg, self.where = cfg, where
        self.n_layer = self.int("num_hidden_layers")
        self.n_embd = self.int("hidden_size")
        self.n_head = self.int("num_attention_heads")
        self.n_vocab = self.int("vocab_size")
        self.n_ff = self.int("intermediate_size")
        self.n_nextn = self.int("num_nextn_predict_layers", 0)
        self.tied = bool(cfg.get("tie_word_embeddings", False))
        self.n_expert = self.int("n_routed_experts")
        self.n_used = self.int("num_experts_per_tok")
        self.n_shared = self.int("n_shared_experts", 0)
        self.n_ff_exp = self.int("moe_intermediate_size")
        self.n_dense = self.int("first_k_dense_replace", 0)
        self.n_group = self.int("n_group", None, optional=True)
        self.topk_group = self.int("topk_group", None, optional=True)
        if self.n_expert < 1:
            self.fail(f"n_routed_experts is {self.n_expert}; a mixture of experts needs at least one")
        if self.n_used < 1:
            self.fail(f"num_experts_per_tok is {self.n_used}; at least one expert must be used")
        if self.n_used > self.n_expert:
            self.fail(f"num_experts_per_tok ({self.n_used}) is larger than the expert count "
                      f"n_routed_experts ({self.n_expert})")
        if self.n_group is not None and self.n_group > 0:
            if self.n_expert % self.n_group:
                self.fail(f"n_routed_experts ({self.n_expert}) is not a multiple of n_group "
                          f"({self.n_group})")
            if self.topk_group is not None and not 0 < self.topk_group <= self.n_group:
                self.fail(f"topk_group ({self.topk_group}) must be between 1 and n_group "
                          f"({self.n_group})")
        if not 0 <= self.n_dense <= self.n_layer:
            self.fail(f"first_k_dense_replace ({self.n_dense}) is outside 0..num_hidden_layers "
                      f"({self.n_layer})")
        self.gating = self._gating(family)
        rope = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
        self.rope = rope
        self.theta = float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0)
        self.partial_rotary = float(cfg.get("partial_rotary_factor")
                                    or rope.get("partial_rotary_factor")
                                    or (1.0 if family.mla else 0.5))
        if family.mla:
            self.q_lora = self.int("q_lora_rank", None, optional=True)
            self.kv_lora = self.int("kv_lora_rank")
            self.nope = self.int("qk_nope_head_dim")
            self.rope_dim = self.int("qk_rope_head_dim")
            self.v_dim = self.int("v_head_dim")
            self.n_head_kv = 1  # MLA runs as MQA over the latent
            if self.nope < 1 or self.rope_dim < 2 or self.rope_dim % 2:
                self.fail(f"qk_nope_head_dim {self.nope} / qk_rope_head_dim {self.rope_dim}: "
                          f"llama.cpp needs a positive non-rotary part and an even rotary part")
        else:
            self.n_head_kv = self.int("num_key_value_heads", self.n_head)
            self.head_dim = int(cfg.get("head_dim") or self.n_embd // self.n_head)
            self.rope_dim = int(self.head_dim * self.partial_rotary)
            if self.n_head % max(1, self.n_head_kv):
                self.fail(f"num_attention_heads ({self.n_head}) is not a multiple of "
                          f"num_key_value_heads ({self.n_head_kv})")
        if family.indexer:
            self.idx_heads = self.int("index_n_heads")
            self.idx_dim = self.int("index_head_dim")
            self.idx_topk = self.int("index_topk")
            if self.idx_topk < 1:
                self.fail(f"index_topk is {self.idx_topk}; the DSA indexer must select at least "
                          f"one position")
            if self.idx_heads < 1 or self.idx_dim < 1:
                self.fail(f"index_n_heads {self.idx_heads} / index_head_dim {self.idx_dim} must "
                          f"be positive")
            types = cfg.get("indexer_types")
            if types is not None and (not isinstance(types, list) or len(types) != self.n_layer):
                self.fail(f"indexer_types must list one entry per layer ({self.n_layer})")
            self.idx_types = types

    def _gating(self, family: MoEFamily) -> int:
        """expert_gating_func: sigmoid for GLM-4.5 (as llama.cpp's converter writes it), else
        config.json's scoring_func (DeepSeek V2: softmax; V3, GLM-5: sigmoid)."""
        if family.arch == "glm4moe":
            return int(gguf.ExpertGatingFuncType.SIGMOID)
        func = self.cfg.get("scoring_func") or ("sigmoid" if family.indexer else "softmax")
        funcs = {"softmax": gguf.ExpertGatingFuncType.SOFTMAX,
                 "sigmoid": gguf.ExpertGatingFuncType.SIGMOID}
        if func not in funcs:
            self.fail(f"scoring_func {func!r} is not supported (softmax, sigmoid)")
        return int(funcs[func])

    def fail(self, problem: str):
        raise InvalidContentError(about(self.where, problem))

    def int(self, key: str, default=0, optional: bool = False):
        v = self.cfg.get(key, default)
        if v is None:
            if optional:
                return None
            raise InvalidContentError(about(self.where, f"config.json lacks '{key}'"))
        if isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v:
            raise InvalidContentError(about(self.where, f"config.json '{key}' is not an integer: {v!r}"))
        return int(v)


def _hf_loader(ckpt: HFCheckpoint, t: HFTensor, block):
    """float32 values of a checkpoint tensor: FP8 ones decoded with their weight_scale_inv."""
    if t.dtype not in _FP8:
        return t.load_float32
    scale = ckpt.tensors.get(t.name + "_scale_inv")
    if scale is None:
        raise InvalidContentError(about(t.path, f"FP8 tensor '{t.name}' has no '{t.name}_scale_inv' "
                                                f"block scales"))

    def load():
        try:
            return decode_fp8_block_scaled(t.load_raw(), scale.load_float32(), block)
        except ValueError as e:
            raise InvalidContentError(about(t.path, f"tensor '{t.name}': {e}")) from None
    return load


class MoEHFSource(ModelSource):
    def __init__(self, ckpt: HFCheckpoint, family: MoEFamily, report=lambda msg: None,
                 nextn: str = "drop"):
        if nextn not in NEXTN_MODES:
            raise ValueError(f"nextn must be one of {NEXTN_MODES}")
        cfg, where = ckpt.config, ckpt.file("config.json")
        c = _Config(cfg, where, family)
        self.family, self.c = family, c
        if nextn != "drop" and not c.n_nextn:
            raise InvalidContentError(about(where, "the checkpoint has no NextN layer (no "
                                                   "num_nextn_predict_layers) to embed or split"))
        embedded = nextn != "drop" and c.n_nextn > 0
        n_blocks = c.n_layer + c.n_nextn if embedded else c.n_layer
        qc = cfg.get("quantization_config") or {}
        block = tuple(qc.get("weight_block_size") or (128, 128))
        name_map = gguf.get_tensor_name_map(family.model_arch, c.n_layer + c.n_nextn)

        tensors: list[SourceTensor] = []
        experts: dict[int, dict[str, dict[int, HFTensor]]] = defaultdict(lambda: defaultdict(dict))
        left_out = 0
        for hf_name, t in ckpt.tensors.items():
            if hf_name.endswith(_SKIPPED_SUFFIXES):
                continue
            m = _LAYER.match(hf_name)
            layer = int(m.group(1)) if m else None
            if layer is not None and layer >= c.n_layer + c.n_nextn:
                raise InvalidContentError(about(
                    t.path, f"tensor '{hf_name}' is in layer {layer}, but config.json has "
                            f"{c.n_layer} layers and {c.n_nextn} NextN layers"))
            is_nextn = layer is not None and layer >= c.n_layer
            if is_nextn and nextn in ("drop", "trunk"):
                left_out += 1
                continue
            if nextn == "mtp" and not is_nextn and hf_name not in _MTP_SHARED:
                continue
            if hf_name == "lm_head.weight" and c.tied:
                continue  # llama.cpp reuses token_embd
            e = _EXPERT.match(hf_name)
            if e:
                L, x, proj = int(e.group(1)), int(e.group(2)), e.group(3)
                if x >= c.n_expert:
                    raise InvalidContentError(about(
                        t.path, f"tensor '{hf_name}' is expert {x}, but config.json has "
                                f"n_routed_experts = {c.n_expert}"))
                experts[L][proj][x] = t
                continue
            load = _hf_loader(ckpt, t, block)
            if is_nextn and hf_name[m.end():] in NEXTN_PARTS:
                part = NEXTN_PARTS[hf_name[m.end():]]
                tensors.append(SourceTensor(f"blk.{layer}.nextn.{part}.weight", t.shape, t.dtype,
                                            t.n_bytes, load))
                continue
            if family.mla and hf_name.endswith(".self_attn.kv_b_proj.weight"):
                tensors += self._split_kv_b(layer, t, load)
                continue
            mapped = hf_name.replace("e_score_correction_bias", "e_score_correction.bias")
            name = name_map.get_name(mapped, try_suffixes=(".weight", ".bias"))
            if name is None:
                raise InvalidContentError(about(
                    t.path, f"tensor '{hf_name}' has no llama.cpp name for architecture {family.arch}"))
            tensors.append(SourceTensor(name, t.shape, t.dtype, t.n_bytes, load))
        tensors += self._stack_experts(ckpt, experts, block, nextn)
        self._check_routers(tensors, ckpt.folder, nextn)
        if family.indexer and c.idx_dim != 2 * c.rope_dim:
            report(f"warning: {where}: index_head_dim {c.idx_dim} is not twice the rotary "
                   f"dimensions ({c.rope_dim}); llama.cpp's glm-dsa (b10309) asserts on such files")
        keys = self._keys(os.path.basename(ckpt.folder), n_blocks, embedded)
        keys += tokenizer_metadata(ckpt.folder, cfg, c.n_vocab, report)
        _check_embedding(tensors, c.n_vocab, c.n_embd, ckpt.folder)
        if left_out and nextn == "drop":
            report(f"note: {ckpt.folder}: left out {left_out} NextN/MTP tensors (layer "
                   f"{c.n_layer}{'' if c.n_nextn == 1 else f'..{c.n_layer + c.n_nextn - 1}'}); "
                   f"--keep-nextn embeds them, --mtp-out writes them to an MTP file")
        tensors.sort(key=_layout_order)
        super().__init__(path=ckpt.folder, kind="hf", arch=family.arch, metadata=keys,
                         tensors=tensors, hparams=Hparams(n_blocks, c.n_head, c.n_head_kv, c.n_expert),
                         paths=ckpt.paths)
        self.checkpoint = ckpt

    # --- tensors ----------------------------------------------------------------------------

    def _split_kv_b(self, layer: int, t: HFTensor, load) -> list[SourceTensor]:
        """kv_b_proj [H * (nope + v), kv_lora] -> attn_k_b [H, kv_lora, nope] (each head's key
        part transposed) and attn_v_b [H, v, kv_lora], as llama.cpp's MLA expects them."""
        c = self.c
        H, nope, v, r = c.n_head, c.nope, c.v_dim, c.kv_lora
        if tuple(t.shape) != (H * (nope + v), r):
            raise InvalidContentError(about(
                t.path, f"tensor '{t.name}' has shape {list(t.shape)}, expected "
                        f"[{H * (nope + v)}, {r}] (heads x (qk_nope_head_dim + v_head_dim), kv_lora_rank)"))

        def k_b():
            w = load().reshape(H, nope + v, r)
            return np.ascontiguousarray(w[:, :nope, :].transpose(0, 2, 1))

        def v_b():
            return np.ascontiguousarray(load().reshape(H, nope + v, r)[:, nope:, :])
        half = t.n_bytes // 2
        return [SourceTensor(f"blk.{layer}.attn_k_b.weight", (H, r, nope), t.dtype, half, k_b),
                SourceTensor(f"blk.{layer}.attn_v_b.weight", (H, v, r), t.dtype, half, v_b)]

    def _stack_experts(self, ckpt, experts, block, nextn) -> list[SourceTensor]:
        c, out = self.c, []
        layers = range(c.n_layer + c.n_nextn)
        for L in layers:
            is_nextn = L >= c.n_layer
            kept = (is_nextn and nextn in ("keep", "mtp")) or (not is_nextn and nextn != "mtp")
            if not kept:
                continue
            found = experts.get(L)
            if L < c.n_dense:
                if found:
                    raise InvalidContentError(about(ckpt.folder, f"layer {L} is dense "
                                                                 f"(first_k_dense_replace = {c.n_dense}) "
                                                                 f"but has expert tensors"))
                continue
            found = found or {}
            for proj, gguf_name in (("gate", "ffn_gate_exps"), ("up", "ffn_up_exps"),
                                    ("down", "ffn_down_exps")):
                have = found.get(proj, {})
                for x in range(c.n_expert):
                    if x not in have:
                        name = f"model.layers.{L}.mlp.experts.{x}.{proj}_proj.weight"
                        raise InvalidContentError(about(
                            ckpt.folder, f"expert tensor '{name}' is missing (config.json: "
                                         f"n_routed_experts = {c.n_expert})"))
                parts = [have[x] for x in range(c.n_expert)]
                want = (c.n_embd, c.n_ff_exp) if proj == "down" else (c.n_ff_exp, c.n_embd)
                for p in parts:
                    if tuple(p.shape) != want:
                        raise InvalidContentError(about(
                            p.path, f"tensor '{p.name}' has shape {list(p.shape)}, expected "
                                    f"{list(want)} (moe_intermediate_size {c.n_ff_exp}, "
                                    f"hidden_size {c.n_embd})"))
                loaders = [_hf_loader(ckpt, p, block) for p in parts]

                def load_all(loaders=loaders, want=want):
                    stacked = np.empty((len(loaders),) + want, np.float32)
                    for i, f in enumerate(loaders):
                        stacked[i] = f()
                    return stacked
                out.append(SourceTensor(f"blk.{L}.{gguf_name}.weight", (c.n_expert,) + want,
                                        parts[0].dtype, sum(p.n_bytes for p in parts), load_all,
                                        load_part=lambda i, loaders=loaders: loaders[i]()))
        return out

    def _check_routers(self, tensors, folder, nextn) -> None:
        c = self.c
        for t in tensors:
            m = re.match(r"blk\.(\d+)\.(ffn_gate_inp\.weight|exp_probs_b\.bias)$", t.name)
            if m and t.shape[0] != c.n_expert:
                raise InvalidContentError(about(
                    folder, f"layer {m.group(1)}: the router has {t.shape[0]} experts, but "
                            f"config.json has n_routed_experts = {c.n_expert}"))
        names = {t.name for t in tensors}
        for L in range(c.n_dense, c.n_layer + c.n_nextn):
            is_nextn = L >= c.n_layer
            kept = (is_nextn and nextn in ("keep", "mtp")) or (not is_nextn and nextn != "mtp")
            if kept and f"blk.{L}.ffn_gate_inp.weight" not in names:
                raise InvalidContentError(about(
                    folder, f"layer {L} has experts but no router 'model.layers.{L}.mlp.gate.weight'"))

    # --- keys -------------------------------------------------------------------------------

    def _keys(self, model_name: str, n_blocks: int, embedded: bool) -> list[MetaKey]:
        c, fam = self.c, self.family
        arch = fam.arch
        K, A, R = gguf.Keys.LLM, gguf.Keys.Attention, gguf.Keys.Rope

        def k(key, value, vtype):
            return MetaKey(key.format(arch=arch), value, vtype)

        keys = [
            MetaKey("general.type", "model", V.STRING),
            MetaKey("general.name", model_name, V.STRING),
            k(K.BLOCK_COUNT, n_blocks, V.UINT32),
            k(K.CONTEXT_LENGTH, c.int("max_position_embeddings", 4096), V.UINT32),
            k(K.EMBEDDING_LENGTH, c.n_embd, V.UINT32),
            k(K.FEED_FORWARD_LENGTH, c.n_ff, V.UINT32),
            k(A.HEAD_COUNT, c.n_head, V.UINT32),
            k(A.HEAD_COUNT_KV, c.n_head_kv, V.UINT32),
            k(R.FREQ_BASE, c.theta, V.FLOAT32),
            k(A.LAYERNORM_RMS_EPS, float(c.cfg.get("rms_norm_eps") or 1e-6), V.FLOAT32),
            k(K.EXPERT_COUNT, c.n_expert, V.UINT32),
            k(K.EXPERT_USED_COUNT, c.n_used, V.UINT32),
        ]
        if c.n_group is not None:
            keys.append(k(K.EXPERT_GROUP_COUNT, c.n_group, V.UINT32))
        if c.topk_group is not None:
            keys.append(k(K.EXPERT_GROUP_USED_COUNT, c.topk_group, V.UINT32))
        keys.append(k(K.EXPERT_GATING_FUNC, c.gating, V.UINT32))
        keys.append(k(K.VOCAB_SIZE, c.n_vocab, V.UINT32))
        keys.append(k(K.LEADING_DENSE_BLOCK_COUNT, c.n_dense, V.UINT32))
        keys.append(k(K.EXPERT_FEED_FORWARD_LENGTH, c.n_ff_exp, V.UINT32))
        keys.append(k(K.EXPERT_SHARED_COUNT, c.n_shared, V.UINT32))
        scale = c.cfg.get("routed_scaling_factor")
        if scale is not None:
            keys.append(k(K.EXPERT_WEIGHTS_SCALE, float(scale), V.FLOAT32))
        norm = c.cfg.get("norm_topk_prob")
        if norm is not None and (norm or not fam.mla):  # deepseek2 writes it only when true
            keys.append(k(K.EXPERT_WEIGHTS_NORM, bool(norm), V.BOOL))
        if fam.mla:
            if c.q_lora:
                keys.append(k(A.Q_LORA_RANK, c.q_lora, V.UINT32))
            keys += [
                k(A.KV_LORA_RANK, c.kv_lora, V.UINT32),
                k(A.KEY_LENGTH, c.kv_lora + c.rope_dim, V.UINT32),
                k(A.VALUE_LENGTH, c.kv_lora, V.UINT32),
                k(A.KEY_LENGTH_MLA, c.nope + c.rope_dim, V.UINT32),
                k(A.VALUE_LENGTH_MLA, c.v_dim, V.UINT32),
                k(R.DIMENSION_COUNT, int(c.rope_dim * (c.partial_rotary if fam.indexer else 1.0)), V.UINT32),
            ]
        else:
            keys += [k(A.KEY_LENGTH, c.head_dim, V.UINT32), k(A.VALUE_LENGTH, c.head_dim, V.UINT32),
                     k(R.DIMENSION_COUNT, c.rope_dim, V.UINT32)]
        keys += self._rope_scaling_keys(k)
        if embedded:
            keys.append(k(K.NEXTN_PREDICT_LAYERS, c.n_nextn, V.UINT32))
        if fam.indexer:
            I = A.Indexer
            keys += [k(I.HEAD_COUNT, c.idx_heads, V.UINT32), k(I.KEY_LENGTH, c.idx_dim, V.UINT32),
                     k(I.TOP_K, c.idx_topk, V.UINT32)]
            if c.idx_types is not None:  # written by name: the gguf package lacks this key
                keys.append(MetaKey(f"{arch}.attention.indexer.types",
                                    [t == "full" for t in c.idx_types], V.ARRAY, V.BOOL))
        return keys

    def _rope_scaling_keys(self, k) -> list[MetaKey]:
        c, R = self.c, gguf.Keys.Rope
        p = c.rope
        kind = str(p.get("rope_type") or p.get("type") or "").lower()
        if kind in ("", "default"):
            return []
        if kind == "linear" and p.get("factor") is not None:
            return [k(R.SCALING_TYPE, "linear", V.STRING), k(R.SCALING_FACTOR, float(p["factor"]), V.FLOAT32)]
        if kind != "yarn":
            c.fail(f"rope scaling type {kind!r} is not supported (linear, yarn are)")
        if p.get("factor") is None or p.get("original_max_position_embeddings") is None:
            c.fail("yarn rope scaling needs 'factor' and 'original_max_position_embeddings'")
        out = [k(R.SCALING_TYPE, "yarn", V.STRING), k(R.SCALING_FACTOR, float(p["factor"]), V.FLOAT32),
               k(R.SCALING_ORIG_CTX_LEN, int(p["original_max_position_embeddings"]), V.UINT32)]
        for src, key in (("extrapolation_factor", R.SCALING_YARN_EXT_FACTOR),
                         ("beta_fast", R.SCALING_YARN_BETA_FAST), ("beta_slow", R.SCALING_YARN_BETA_SLOW)):
            if p.get(src) is not None:
                out.append(k(key, float(p[src]), V.FLOAT32))
        attn = p.get("attention_factor", p.get("attn_factor"))
        if attn is not None:
            out.append(k(R.SCALING_YARN_ATTN_FACTOR, float(attn), V.FLOAT32))
        if self.family.mla and p.get("mscale_all_dim") is not None:
            # llama.cpp's deepseek2 loader divides this key by 0.1 (its converter's convention)
            out.append(k(R.SCALING_YARN_LOG_MUL, 0.1 * float(p["mscale_all_dim"]), V.FLOAT32))
        return out


def _check_embedding(tensors, n_vocab, n_embd, folder) -> None:
    emb = next((t for t in tensors if t.name == "token_embd.weight"), None)
    if emb is None:
        raise InvalidContentError(about(folder, "the checkpoint has no token embedding"))
    if tuple(emb.shape) != (n_vocab, n_embd):
        raise InvalidContentError(about(
            folder, f"token embedding has shape {list(emb.shape)}, config.json says "
                    f"vocab_size {n_vocab} x hidden_size {n_embd}"))


def _layout_order(t: SourceTensor):
    m = re.match(r"blk\.(\d+)\.", t.name)
    if m:
        return (1, int(m.group(1)))
    if t.name in ("token_embd.weight", "rope_freqs.weight"):
        return (0, 0)
    return (2, 0)
