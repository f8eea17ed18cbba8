"""A DeepSeek V4 Hugging Face checkpoint (``DeepseekV4ForCausalLM``) as llama.cpp's ``deepseek4``
GGUF layout: the names, shapes and keys llama.cpp's converter writes and its loader reads.

DeepSeek's storage, decoded to float32 one tensor (one expert) at a time:

- dense matrices as FP8 E4M3 (``X.weight``) with one E8M0 scale per 128 x 128 block
  (``X.scale``);
- routed experts ``layers.L.ffn.experts.E.w1 / w3 / w2`` (gate, up, down) as packed FP4 E2M1
  (``I8`` / ``U8``, two values per byte, low nibble first) with one E8M0 scale per 32 inputs,
  stacked into ``blk.L.ffn_{gate,up,down}_exps``;
- everything else (norms, hyper-connection mixes, sinks, router, position embeddings) as
  F32 / BF16 / F16; the hash-routed layers' token -> experts table (``ffn.gate.tid2eid``, I64)
  as the I32 tensor ``blk.L.ffn_gate_tid2eid``. The hash layers' ``ffn.gate.bias`` is not
  used by them and is left out, as llama.cpp does.

The MTP layer (``mtp.0.*``) is not part of llama.cpp's model file: it is left out (a note
says so) and ``--mtp-out`` writes it as ds4's MTP support file (``ds4tools.support``).
Vision tensors (``aligner.*``, ``image_*``) are left out too.
"""
from __future__ import annotations

import os
import re
from collections import defaultdict

import numpy as np
from gguf import GGUFValueType as V

from ..checkpoint import HFCheckpoint, HFTensor, tokenizer_metadata
from ..errors import InvalidContentError, about
from ..gguf_io import MetaKey
from .source import Hparams, ModelSource, SourceTensor

__all__ = ["Deepseek4HFSource", "is_deepseek4_config", "HF_ROOT_NAMES", "HF_LAYER_NAMES"]

ARCH = "deepseek4"
ARCHITECTURES = ("DeepseekV4ForCausalLM",)
SQRT_SOFTPLUS = 4  # llama.cpp's expert_gating_func for scoring_func "sqrtsoftplus"
_GATING = {"softmax": 1, "sigmoid": 2, "sqrtsoftplus": SQRT_SOFTPLUS}

#: checkpoint name -> GGUF name, outside the layers
HF_ROOT_NAMES = {
    "embed.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
    "head.weight": "output.weight", "hc_head_fn": "output_hc_fn.weight",
    "hc_head_base": "output_hc_base.weight", "hc_head_scale": "output_hc_scale.weight",
}
#: checkpoint name under ``layers.L.`` -> GGUF name under ``blk.L.``
HF_LAYER_NAMES = {
    "hc_attn_fn": "hc_attn_fn.weight", "hc_attn_base": "hc_attn_base.weight",
    "hc_attn_scale": "hc_attn_scale.weight", "hc_ffn_fn": "hc_ffn_fn.weight",
    "hc_ffn_base": "hc_ffn_base.weight", "hc_ffn_scale": "hc_ffn_scale.weight",
    "attn_norm.weight": "attn_norm.weight", "ffn_norm.weight": "ffn_norm.weight",
    "attn.attn_sink": "attn_sinks.weight", "attn.wq_a.weight": "attn_q_a.weight",
    "attn.q_norm.weight": "attn_q_a_norm.weight", "attn.wq_b.weight": "attn_q_b.weight",
    "attn.wkv.weight": "attn_kv.weight", "attn.kv_norm.weight": "attn_kv_a_norm.weight",
    "attn.wo_a.weight": "attn_output_a.weight", "attn.wo_b.weight": "attn_output_b.weight",
    "attn.compressor.ape": "attn_compressor_ape.weight",
    "attn.compressor.wkv.weight": "attn_compressor_kv.weight",
    "attn.compressor.wgate.weight": "attn_compressor_gate.weight",
    "attn.compressor.norm.weight": "attn_compressor_norm.weight",
    "attn.indexer.wq_b.weight": "indexer.attn_q_b.weight",
    "attn.indexer.weights_proj.weight": "indexer.proj.weight",
    "attn.indexer.compressor.ape": "indexer_compressor_ape.weight",
    "attn.indexer.compressor.wkv.weight": "indexer_compressor_kv.weight",
    "attn.indexer.compressor.wgate.weight": "indexer_compressor_gate.weight",
    "attn.indexer.compressor.norm.weight": "indexer_compressor_norm.weight",
    "ffn.gate.weight": "ffn_gate_inp.weight", "ffn.gate.bias": "exp_probs_b.bias",
    "ffn.gate.bias_vl": "exp_probs_b_vl.bias", "ffn.gate.tid2eid": "ffn_gate_tid2eid.weight",
    "ffn.shared_experts.w1.weight": "ffn_gate_shexp.weight",
    "ffn.shared_experts.w3.weight": "ffn_up_shexp.weight",
    "ffn.shared_experts.w2.weight": "ffn_down_shexp.weight",
}
_EXPERT_PROJ = {"w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^ffn\.experts\.(\d+)\.(w[123])\.weight$")
_SKIPPED_PREFIXES = ("aligner.", "image_")
_FLOATS = ("F32", "F16", "BF16", "F64")
_PACKED = ("I8", "U8")
_INTS = ("I64", "I32")


def is_deepseek4_config(cfg: dict) -> bool:
    return any(a in ARCHITECTURES for a in cfg.get("architectures") or [])


class _Config:
    """config.json's numbers, checked (each problem one line naming config.json)."""

    def __init__(self, cfg: dict, where: str):
        self.cfg, self.where = cfg, where
        i = self.int
        self.n_layer, self.n_embd, self.n_head = i("num_hidden_layers"), i("hidden_size"), \
            i("num_attention_heads")
        self.n_head_kv = i("num_key_value_heads", 1)
        self.n_vocab, self.head_dim, self.n_rot = i("vocab_size"), i("head_dim"), i("qk_rope_head_dim")
        self.q_lora, self.o_lora, self.o_groups = i("q_lora_rank"), i("o_lora_rank"), i("o_groups")
        self.n_swa = i("sliding_window")
        self.n_expert, self.n_used = i("n_routed_experts"), i("num_experts_per_tok")
        self.n_shared, self.n_ff_exp = i("n_shared_experts", 0), i("moe_intermediate_size")
        self.idx_heads, self.idx_dim, self.idx_topk = i("index_n_heads"), i("index_head_dim"), \
            i("index_topk")
        self.hc, self.hc_iters = i("hc_mult"), i("hc_sinkhorn_iters")
        self.n_hash = i("num_hash_layers", 0)
        self.n_nextn = i("num_nextn_predict_layers", 0)
        self.tied = bool(cfg.get("tie_word_embeddings", False))
        for key in ("hc_eps", "compress_rope_theta", "swiglu_limit", "routed_scaling_factor"):
            self.float(key)
        for key, v in (("num_hidden_layers", self.n_layer), ("hidden_size", self.n_embd),
                       ("num_attention_heads", self.n_head), ("vocab_size", self.n_vocab),
                       ("head_dim", self.head_dim), ("q_lora_rank", self.q_lora),
                       ("o_lora_rank", self.o_lora), ("o_groups", self.o_groups),
                       ("n_routed_experts", self.n_expert), ("num_experts_per_tok", self.n_used),
                       ("moe_intermediate_size", self.n_ff_exp), ("hc_mult", self.hc),
                       ("index_topk", self.idx_topk), ("index_n_heads", self.idx_heads),
                       ("index_head_dim", self.idx_dim)):
            if v < 1:
                self.fail(f"config.json '{key}' is {v}; it must be positive")
        if self.n_head_kv != 1:
            self.fail(f"num_key_value_heads is {self.n_head_kv}; DeepSeek V4 has one shared KV head")
        if self.n_used > self.n_expert:
            self.fail(f"num_experts_per_tok ({self.n_used}) is larger than the expert count "
                      f"n_routed_experts ({self.n_expert})")
        if self.n_head % self.o_groups:
            self.fail(f"num_attention_heads ({self.n_head}) is not a multiple of o_groups "
                      f"({self.o_groups})")
        if not 0 < self.n_rot <= self.head_dim or self.n_rot % 2:
            self.fail(f"qk_rope_head_dim ({self.n_rot}) must be even and within head_dim "
                      f"({self.head_dim})")
        if not 0 <= self.n_hash <= self.n_layer:
            self.fail(f"num_hash_layers ({self.n_hash}) is outside 0..num_hidden_layers "
                      f"({self.n_layer})")
        ratios = cfg.get("compress_ratios")
        if (not isinstance(ratios, list) or len(ratios) < self.n_layer
                or not all(isinstance(r, int) and not isinstance(r, bool) for r in ratios)):
            self.fail(f"config.json 'compress_ratios' must list an integer per layer "
                      f"({self.n_layer})")
        bad = [r for r in ratios if r not in (0, 4, 128)]
        if bad:
            self.fail(f"compress_ratios holds {bad[0]}; DeepSeek V4 compresses by 0, 4 or 128")
        self.ratios = [int(r) for r in ratios]
        func = str(cfg.get("scoring_func") or "sqrtsoftplus")
        if func not in _GATING:
            self.fail(f"scoring_func {func!r} is not supported ({', '.join(_GATING)})")
        self.gating = _GATING[func]

    def fail(self, problem: str):
        raise InvalidContentError(about(self.where, problem))

    def int(self, key: str, default=None) -> int:
        v = self.cfg.get(key, default)
        if v is None:
            self.fail(f"config.json lacks '{key}'")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v:
            self.fail(f"config.json '{key}' is not an integer: {v!r}")
        return int(v)

    def float(self, key: str, default=None) -> float:
        v = self.cfg.get(key, default)
        if v is None:
            self.fail(f"config.json lacks '{key}'")
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            self.fail(f"config.json '{key}' is not a number: {v!r}")
        return float(v)


def _scale_of(ckpt: HFCheckpoint, t: HFTensor) -> HFTensor:
    name = t.name[:-len(".weight")] + ".scale" if t.name.endswith(".weight") else t.name + ".scale"
    s = ckpt.tensors.get(name)
    if s is None:
        raise InvalidContentError(about(t.path, f"tensor '{t.name}' is stored as {t.dtype} but "
                                                f"its block scales '{name}' are missing"))
    return s


def _loader(ckpt: HFCheckpoint, t: HFTensor, shape: tuple):
    """float32 values [rows, cols] of a checkpoint matrix or vector, FP8 / FP4 decoded (the
    storage and its scales' shape checked now, from the headers)."""
    from ..support import fp8
    if t.dtype in _FLOATS:
        return t.load_float32
    if t.dtype not in ("F8_E4M3",) + _PACKED or len(t.shape) != 2:
        raise InvalidContentError(about(t.path, f"tensor '{t.name}' has dtype {t.dtype} and "
                                                f"{len(t.shape)} dimensions, which is not a "
                                                f"DeepSeek V4 weight storage"))
    scale = _scale_of(ckpt, t)
    if t.dtype == "F8_E4M3":
        want = fp8.fp8_scale_shape(t.shape)
        what = f"{fp8.FP8_BLOCK} x {fp8.FP8_BLOCK} blocks of its {list(t.shape)}"
    else:
        want = fp8.fp4_scale_shape(shape)
        what = f"one per {fp8.FP4_GROUP} inputs of its {list(shape)}"
    if tuple(scale.shape) != tuple(want):
        kind = "FP8" if t.dtype == "F8_E4M3" else "FP4"
        raise InvalidContentError(about(scale.path, f"tensor '{t.name}': {kind} scale "
                                                    f"'{scale.name}' has shape {list(scale.shape)}, "
                                                    f"expected {list(want)} ({what})"))

    def load():
        try:
            if t.dtype == "F8_E4M3":
                return fp8.dequantize_fp8(t.load_raw(), scale.load_raw())
            return fp8.dequantize_fp4(t.load_raw(), scale.load_raw(), n_inputs=shape[-1])
        except ValueError as e:
            raise InvalidContentError(about(t.path, f"tensor '{t.name}': {e}")) from None
    return load


def _logical_shape(t: HFTensor) -> tuple:
    """The [rows, cols] a tensor decodes to (packed FP4 holds two values per byte)."""
    if t.dtype in _PACKED and len(t.shape) == 2:
        return (t.shape[0], 2 * t.shape[1])
    return tuple(t.shape)


class Deepseek4HFSource(ModelSource):
    def __init__(self, ckpt: HFCheckpoint, report=lambda msg: None, nextn: str = "drop"):
        cfg, where = ckpt.config, ckpt.file("config.json")
        if nextn != "drop":
            raise InvalidContentError(about(
                ckpt.folder, "llama.cpp's deepseek4 model file does not embed the MTP layer "
                             "(--keep-nextn); --mtp-out writes it as ds4's MTP support file"))
        c = _Config(cfg, where)
        self.c = c
        tensors: list[SourceTensor] = []
        experts: dict[int, dict[str, dict[int, HFTensor]]] = defaultdict(lambda: defaultdict(dict))
        left_out = 0
        for hf_name, t in ckpt.tensors.items():
            if hf_name.startswith(_SKIPPED_PREFIXES):
                continue
            if hf_name.startswith("mtp."):
                left_out += 1
                continue
            if hf_name.endswith(".scale"):
                base = hf_name[:-len(".scale")]
                if base + ".weight" in ckpt.tensors:
                    continue  # read with its weight
                raise InvalidContentError(about(t.path, f"tensor '{hf_name}' holds block scales "
                                                        f"but '{base}.weight' is missing"))
            if hf_name in HF_ROOT_NAMES:
                if hf_name == "head.weight" and c.tied:
                    continue
                tensors.append(self._plain(ckpt, t, HF_ROOT_NAMES[hf_name]))
                continue
            m = _LAYER.match(hf_name)
            if m is None:
                raise InvalidContentError(about(t.path, f"tensor '{hf_name}' has no llama.cpp "
                                                        f"name for architecture {ARCH}"))
            L, rest = int(m.group(1)), m.group(2)
            if L >= c.n_layer:
                raise InvalidContentError(about(
                    t.path, f"tensor '{hf_name}' is in layer {L}, but config.json has "
                            f"{c.n_layer} layers (the MTP layer is stored as mtp.*)"))
            e = _EXPERT.match(rest)
            if e:
                x = int(e.group(1))
                if x >= c.n_expert:
                    raise InvalidContentError(about(
                        t.path, f"tensor '{hf_name}' is expert {x}, but config.json has "
                                f"n_routed_experts = {c.n_expert}"))
                experts[L][e.group(2)][x] = t
                continue
            gname = HF_LAYER_NAMES.get(rest)
            if gname is None:
                raise InvalidContentError(about(t.path, f"tensor '{hf_name}' has no llama.cpp "
                                                        f"name for architecture {ARCH}"))
            if rest == "ffn.gate.bias" and L < c.n_hash:
                continue  # the hash-routed layers choose by token id: llama.cpp drops it
            if rest == "ffn.gate.tid2eid":
                tensors.append(self._hash_table(t, f"blk.{L}.{gname}"))
                continue
            tensors.append(self._plain(ckpt, t, f"blk.{L}.{gname}"))
        tensors += self._stack_experts(ckpt, experts)
        self._check(tensors, ckpt)
        keys = self._keys(os.path.basename(ckpt.folder))
        keys += tokenizer_metadata(ckpt.folder, cfg, c.n_vocab, report)
        if left_out:
            report(f"note: {ckpt.folder}: left out {left_out} MTP tensors (mtp.*); --mtp-out "
                   f"writes them as ds4's MTP support file")
        tensors.sort(key=_layout_order)
        super().__init__(path=ckpt.folder, kind="hf", arch=ARCH, metadata=keys, tensors=tensors,
                         hparams=Hparams(c.n_layer, c.n_head, c.n_head_kv, c.n_expert),
                         paths=ckpt.paths)
        self.checkpoint = ckpt

    # --- tensors ----------------------------------------------------------------------------

    @staticmethod
    def _plain(ckpt, t: HFTensor, name: str) -> SourceTensor:
        shape = _logical_shape(t)
        load = _loader(ckpt, t, shape)
        n_bytes = t.n_bytes
        if t.dtype not in _FLOATS:
            n_bytes += _scale_of(ckpt, t).n_bytes
        return SourceTensor(name, shape, t.dtype, n_bytes, load)

    def _hash_table(self, t: HFTensor, name: str) -> SourceTensor:
        c = self.c
        want = (c.n_vocab, c.n_used)
        if t.dtype not in _INTS:
            raise InvalidContentError(about(t.path, f"tensor '{t.name}' has dtype {t.dtype}; the "
                                                    f"token -> experts table is an integer tensor"))
        if tuple(t.shape) != want:
            raise InvalidContentError(about(t.path, f"tensor '{t.name}' has shape {list(t.shape)}, "
                                                    f"expected {list(want)} (vocab_size x "
                                                    f"num_experts_per_tok)"))

        def raw(t=t):
            table = np.asarray(t.load_raw())
            if table.size and (table.min() < 0 or table.max() >= c.n_expert):
                raise InvalidContentError(about(t.path, f"tensor '{t.name}' names an expert "
                                                        f"outside 0..{c.n_expert - 1}"))
            return np.ascontiguousarray(table, np.int32)
        return SourceTensor(name, want, "I32", int(np.prod(want)) * 4,
                            lambda: raw().astype(np.float32), raw=raw)

    def _stack_experts(self, ckpt, experts) -> list[SourceTensor]:
        c = self.c
        out = []
        for L in sorted(experts):
            for proj, gname in _EXPERT_PROJ.items():
                have = experts[L][proj]
                want = (c.n_embd, c.n_ff_exp) if proj == "w2" else (c.n_ff_exp, c.n_embd)
                for x in range(c.n_expert):
                    if x not in have:
                        raise InvalidContentError(about(
                            ckpt.folder, f"expert tensor 'layers.{L}.ffn.experts.{x}.{proj}.weight' "
                                         f"is missing (config.json: n_routed_experts = {c.n_expert})"))
                parts = [have[x] for x in range(c.n_expert)]
                for p in parts:
                    if _logical_shape(p) != want:
                        raise InvalidContentError(about(
                            p.path, f"tensor '{p.name}' has shape {list(_logical_shape(p))}, "
                                    f"expected {list(want)} (moe_intermediate_size {c.n_ff_exp}, "
                                    f"hidden_size {c.n_embd})"))
                loaders = [_loader(ckpt, p, want) for p in parts]
                n_bytes = sum(p.n_bytes + (_scale_of(ckpt, p).n_bytes if p.dtype not in _FLOATS
                                           else 0) for p in parts)

                def load_all(loaders=loaders, want=want):
                    stacked = np.empty((len(loaders),) + want, np.float32)
                    for i, f in enumerate(loaders):
                        stacked[i] = f()
                    return stacked
                out.append(SourceTensor(f"blk.{L}.{gname}.weight", (c.n_expert,) + want,
                                        parts[0].dtype, n_bytes, load_all,
                                        load_part=lambda i, loaders=loaders: loaders[i]()))
        return out

    def _expected(self) -> dict[str, tuple]:
        """GGUF name -> numpy shape of every tensor the model needs."""
        c = self.c
        E, NH, D, HC = c.n_embd, c.n_head, c.head_dim, c.hc
        mix = (2 + HC) * HC
        out = {"token_embd.weight": (c.n_vocab, E), "output_norm.weight": (E,),
               "output_hc_fn.weight": (HC, HC * E), "output_hc_base.weight": (HC,),
               "output_hc_scale.weight": (1,)}
        if not c.tied:
            out["output.weight"] = (c.n_vocab, E)
        R, G = c.o_lora, c.o_groups
        for L in range(c.n_layer):
            b = f"blk.{L}."
            out.update({
                b + "attn_norm.weight": (E,), b + "ffn_norm.weight": (E,),
                b + "attn_sinks.weight": (NH,), b + "attn_q_a.weight": (c.q_lora, E),
                b + "attn_q_a_norm.weight": (c.q_lora,), b + "attn_q_b.weight": (NH * D, c.q_lora),
                b + "attn_kv.weight": (D, E), b + "attn_kv_a_norm.weight": (D,),
                b + "attn_output_a.weight": (G * R, NH * D // G),
                b + "attn_output_b.weight": (E, G * R),
                b + "ffn_gate_inp.weight": (c.n_expert, E),
                b + "ffn_gate_exps.weight": (c.n_expert, c.n_ff_exp, E),
                b + "ffn_up_exps.weight": (c.n_expert, c.n_ff_exp, E),
                b + "ffn_down_exps.weight": (c.n_expert, E, c.n_ff_exp),
            })
            for kind in ("attn", "ffn"):
                out.update({b + f"hc_{kind}_fn.weight": (mix, HC * E),
                            b + f"hc_{kind}_base.weight": (mix,),
                            b + f"hc_{kind}_scale.weight": (3,)})
            if L < c.n_hash:
                out[b + "ffn_gate_tid2eid.weight"] = (c.n_vocab, c.n_used)
            else:
                out[b + "exp_probs_b.bias"] = (c.n_expert,)
            if c.n_shared:
                S = c.n_ff_exp * c.n_shared
                out.update({b + "ffn_gate_shexp.weight": (S, E), b + "ffn_up_shexp.weight": (S, E),
                            b + "ffn_down_shexp.weight": (E, S)})
            ratio = c.ratios[L]
            if ratio:
                coff = 2 if ratio == 4 else 1
                out.update({b + "attn_compressor_kv.weight": (coff * D, E),
                            b + "attn_compressor_gate.weight": (coff * D, E),
                            b + "attn_compressor_ape.weight": (ratio, coff * D),
                            b + "attn_compressor_norm.weight": (D,)})
            if ratio == 4:
                I, IH = c.idx_dim, c.idx_heads
                out.update({b + "indexer.proj.weight": (IH, E),
                            b + "indexer.attn_q_b.weight": (IH * I, c.q_lora),
                            b + "indexer_compressor_kv.weight": (2 * I, E),
                            b + "indexer_compressor_gate.weight": (2 * I, E),
                            b + "indexer_compressor_ape.weight": (ratio, 2 * I),
                            b + "indexer_compressor_norm.weight": (I,)})
        return out

    def _check(self, tensors, ckpt) -> None:
        """Every tensor the model needs is there, with its shape (named by its checkpoint name)."""
        back = {v: k for k, v in HF_ROOT_NAMES.items()}
        back_layer = {v: k for k, v in HF_LAYER_NAMES.items()}

        back_exps = {v + ".weight": k for k, v in _EXPERT_PROJ.items()}

        def hf_name(gname):
            if gname in back:
                return back[gname]
            m = re.match(r"blk\.(\d+)\.(.+)$", gname)
            if m.group(2) in back_exps:
                return f"layers.{m.group(1)}.ffn.experts.0.{back_exps[m.group(2)]}.weight"
            return f"layers.{m.group(1)}.{back_layer.get(m.group(2), m.group(2))}"
        have = {t.name: t for t in tensors}
        expected = self._expected()
        for gname, shape in expected.items():
            t = have.get(gname)
            if t is None:
                raise InvalidContentError(about(ckpt.folder, f"tensor '{hf_name(gname)}' is missing "
                                                             f"from the checkpoint"))
            if tuple(t.shape) != tuple(shape):
                raise InvalidContentError(about(
                    ckpt.folder, f"tensor '{hf_name(gname)}' has shape {list(t.shape)}, expected "
                                 f"{list(shape)} from config.json"))
        for gname in have:
            if gname not in expected and not gname.endswith("exp_probs_b_vl.bias"):
                raise InvalidContentError(about(
                    ckpt.folder, f"tensor '{hf_name(gname)}' is not used by this configuration "
                                 f"(compress_ratios / num_hash_layers / n_shared_experts)"))

    # --- keys -------------------------------------------------------------------------------

    def _keys(self, model_name: str) -> list[MetaKey]:
        c, cfg = self.c, self.c.cfg
        a = ARCH

        def k(key, value, vtype, sub=None):
            return MetaKey(f"{a}.{key}", value, vtype, sub)
        keys = [MetaKey("general.type", "model", V.STRING),
                MetaKey("general.name", model_name, V.STRING),
                k("block_count", c.n_layer, V.UINT32)]
        if cfg.get("max_position_embeddings") is not None:
            keys.append(k("context_length", c.int("max_position_embeddings"), V.UINT32))
        keys.append(k("embedding_length", c.n_embd, V.UINT32))
        if cfg.get("intermediate_size") is not None:
            keys.append(k("feed_forward_length", c.int("intermediate_size"), V.UINT32))
        keys += [k("attention.head_count", c.n_head, V.UINT32),
                 k("attention.head_count_kv", c.n_head_kv, V.UINT32)]
        keys += self._rope_scaling_keys(k)
        keys += [k("rope.freq_base", c.float("rope_theta", 10000.0), V.FLOAT32),
                 k("attention.layer_norm_rms_epsilon", c.float("rms_norm_eps", 1e-6), V.FLOAT32),
                 k("expert_count", c.n_expert, V.UINT32),
                 k("expert_used_count", c.n_used, V.UINT32)]
        if cfg.get("n_group") is not None:
            keys.append(k("expert_group_count", c.int("n_group"), V.UINT32))
        if cfg.get("topk_group") is not None:
            keys.append(k("expert_group_used_count", c.int("topk_group"), V.UINT32))
        keys += [k("expert_gating_func", c.gating, V.UINT32),
                 k("attention.key_length", c.head_dim, V.UINT32),
                 k("attention.value_length", c.head_dim, V.UINT32),
                 k("rope.dimension_count", c.n_rot, V.UINT32),
                 k("attention.q_lora_rank", c.q_lora, V.UINT32),
                 k("attention.sliding_window", c.n_swa, V.UINT32),
                 k("expert_feed_forward_length", c.n_ff_exp, V.UINT32),
                 k("expert_shared_count", c.n_shared, V.UINT32),
                 k("expert_weights_scale", c.float("routed_scaling_factor"), V.FLOAT32),
                 k("expert_weights_norm", bool(cfg.get("norm_topk_prob", False)), V.BOOL)]
        limit = c.float("swiglu_limit")
        keys += [k("swiglu_clamp_exp", [limit] * c.n_layer, V.ARRAY, V.FLOAT32),
                 k("swiglu_clamp_shexp", [limit] * c.n_layer, V.ARRAY, V.FLOAT32),
                 k("attention.indexer.head_count", c.idx_heads, V.UINT32),
                 k("attention.indexer.key_length", c.idx_dim, V.UINT32),
                 k("attention.indexer.top_k", c.idx_topk, V.UINT32),
                 k("attention.output_group_count", c.o_groups, V.UINT32),
                 k("attention.output_lora_rank", c.o_lora, V.UINT32),
                 k("attention.compress_ratios", list(c.ratios), V.ARRAY, V.INT32),
                 k("attention.compress_rope_freq_base", c.float("compress_rope_theta"), V.FLOAT32),
                 k("hyper_connection.count", c.hc, V.UINT32),
                 k("hyper_connection.sinkhorn_iterations", c.hc_iters, V.UINT32),
                 k("hyper_connection.epsilon", c.float("hc_eps"), V.FLOAT32),
                 k("hash_layer_count", c.n_hash, V.UINT32),
                 k("embedding_length_out", c.n_embd * c.hc, V.UINT32)]
        return keys

    def _rope_scaling_keys(self, k) -> list[MetaKey]:
        c = self.c
        p = {**(c.cfg.get("rope_scaling") or {}), **(c.cfg.get("rope_parameters") or {})}
        kind = str(p.get("rope_type") or p.get("type") or "").lower()
        if kind in ("", "default"):
            return []
        if kind == "linear" and p.get("factor") is not None:
            return [k("rope.scaling.type", "linear", V.STRING),
                    k("rope.scaling.factor", float(p["factor"]), V.FLOAT32)]
        if kind != "yarn":
            c.fail(f"rope scaling type {kind!r} is not supported (linear, yarn are)")
        if p.get("factor") is None or p.get("original_max_position_embeddings") is None:
            c.fail("yarn rope scaling needs 'factor' and 'original_max_position_embeddings'")
        out = [k("rope.scaling.type", "yarn", V.STRING),
               k("rope.scaling.factor", float(p["factor"]), V.FLOAT32),
               k("rope.scaling.original_context_length", int(p["original_max_position_embeddings"]),
                 V.UINT32)]
        for src, key in (("extrapolation_factor", "rope.scaling.yarn_ext_factor"),
                         ("attention_factor", "rope.scaling.yarn_attn_factor"),
                         ("beta_fast", "rope.scaling.yarn_beta_fast"),
                         ("beta_slow", "rope.scaling.yarn_beta_slow")):
            v = p.get(src, p.get("attn_factor") if src == "attention_factor" else None)
            if v is not None:
                out.append(k(key, float(v), V.FLOAT32))
        return out


def _layout_order(t: SourceTensor):
    m = re.match(r"blk\.(\d+)\.", t.name)
    if m:
        return (1, int(m.group(1)))
    if t.name == "token_embd.weight":
        return (0, 0)
    return (2, 0)
