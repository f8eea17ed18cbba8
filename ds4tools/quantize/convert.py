"""A Hugging Face LlamaForCausalLM / Qwen3ForCausalLM directory as llama.cpp's ``llama`` /
``qwen3`` GGUF layout: tensor names from gguf's name map, llama.cpp's hyperparameter keys, the
tokenizer, and for llama the q/k row order llama.cpp's rotary embedding expects.

Weights stay on disk until the quantizer asks for one tensor. NextN/MTP layers (config key
``num_nextn_predict_layers``) are left out (the MTP support GGUF carries them), unless
``keep_nextn``: then they are embedded the way llama.cpp does for GLM / DeepSeek
(``blk.L.nextn.*`` plus the block's ordinary tensors, ``{arch}.nextn_predict_layers``).

Mixture-of-experts checkpoints (DeepSeek V2/V3, GLM-4.5, GLM-5) are converted by
``ds4tools.quantize.convert_moe``, DeepSeek V4 by ``ds4tools.quantize.convert_deepseek4``;
``open_hf`` picks the converter from config.json.
"""
from __future__ import annotations

import math
import os
import re

import numpy as np
import gguf
from gguf import GGUFValueType as V

from ..checkpoint import (ARCHITECTURES, MOE_ARCHITECTURES, HFCheckpoint, HFTensor,
                          interleave_rope_rows, tokenizer_metadata)
from ..errors import InvalidContentError, about
from ..gguf_io import MetaKey
from .source import Hparams, ModelSource, SourceTensor

__all__ = ["HFSource", "NEXTN_NAMES", "llama3_rope_factors", "open_hf", "moe_family"]

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_SKIPPED_SUFFIXES = (".rotary_emb.inv_freq",)  # recomputed by llama.cpp, never stored
#: NextN-only Hugging Face names (under model.layers.L.) -> llama.cpp's blk.L.nextn.<part>
NEXTN_NAMES = {
    "eh_proj.weight": "eh_proj", "enorm.weight": "enorm", "hnorm.weight": "hnorm",
    "shared_head.norm.weight": "shared_head_norm", "shared_head.head.weight": "shared_head_head",
    "embed_tokens.weight": "embed_tokens",
}


def llama3_rope_factors(head_dim: int, theta: float, scaling: dict) -> np.ndarray:
    """Per-frequency divisors of Llama 3.1's rope scaling (llama.cpp's ``rope_freqs`` tensor):
    long wavelengths are stretched by ``factor``, short ones kept, the band between blended."""
    factor = float(scaling.get("factor", 8.0))
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = 1.0 / ((1.0 - smooth) / factor + smooth)
    out = np.where(wavelen < old_ctx / high, 1.0, np.where(wavelen > old_ctx / low, factor, blended))
    return out.astype(np.float32)


def _num(cfg: dict, key: str, where: str, default=None):
    v = cfg.get(key, default)
    if v is None:
        raise InvalidContentError(about(where, f"config.json lacks '{key}'"))
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise InvalidContentError(about(where, f"config.json '{key}' is not a number: {v!r}"))
    return v


def moe_family(cfg: dict):
    """The mixture-of-experts family of a config.json (``MOE_ARCHITECTURES``), or None."""
    for a in cfg.get("architectures") or []:
        if a in MOE_ARCHITECTURES:
            return MOE_ARCHITECTURES[a]
    return None


def open_hf(folder, report=lambda msg: None, keep_nextn: bool = False,
            nextn_part: str | None = None) -> ModelSource:
    """A Hugging Face directory as a quantizer source: dense (``HFSource``) or a mixture of
    experts (``MoEHFSource``); ``nextn_part`` ("trunk" / "mtp") is for the latter only."""
    ckpt = HFCheckpoint(folder)
    from .convert_deepseek4 import Deepseek4HFSource, is_deepseek4_config
    if is_deepseek4_config(ckpt.config):
        if nextn_part is not None:
            raise InvalidContentError(about(ckpt.folder, "a DeepSeek V4 checkpoint's MTP layer is "
                                                         "written as ds4's MTP support file"))
        return Deepseek4HFSource(ckpt, report=report, nextn="keep" if keep_nextn else "drop")
    family = moe_family(ckpt.config)
    if family is None:
        if nextn_part is not None:
            raise InvalidContentError(about(ckpt.folder, "splitting the NextN layers into an "
                                                         "MTP-only GGUF needs a mixture-of-experts "
                                                         "checkpoint"))
        return HFSource(ckpt, report=report, keep_nextn=keep_nextn)
    from .convert_moe import MoEHFSource
    mode = nextn_part or ("keep" if keep_nextn else "drop")
    return MoEHFSource(ckpt, family, report=report, nextn=mode)


def _supported() -> str:
    return ", ".join([*ARCHITECTURES, *MOE_ARCHITECTURES, "DeepseekV4ForCausalLM"])


class HFSource(ModelSource):
    def __init__(self, folder, report=lambda msg: None, keep_nextn: bool = False):
        ckpt = folder if isinstance(folder, HFCheckpoint) else HFCheckpoint(folder)
        cfg, where = ckpt.config, ckpt.file("config.json")
        archs = cfg.get("architectures") or []
        known = [a for a in archs if a in ARCHITECTURES]
        if not known:
            raise InvalidContentError(about(
                ckpt.folder, f"unsupported architecture {', '.join(map(str, archs)) or '(none)'} "
                             f"(supported: {_supported()})"))
        arch, model_arch, permute = ARCHITECTURES[known[0]]
        n_layer = int(_num(cfg, "num_hidden_layers", where))
        n_embd = int(_num(cfg, "hidden_size", where))
        n_head = int(_num(cfg, "num_attention_heads", where))
        n_head_kv = int(_num(cfg, "num_key_value_heads", where, n_head))
        head_dim = int(cfg.get("head_dim") or n_embd // n_head)
        n_vocab = int(_num(cfg, "vocab_size", where))
        n_nextn = int(cfg.get("num_nextn_predict_layers") or 0)
        tied = bool(cfg.get("tie_word_embeddings", False))

        if keep_nextn and not n_nextn:
            raise InvalidContentError(about(where, "--keep-nextn: the checkpoint has no NextN layer "
                                                   "(no num_nextn_predict_layers)"))
        n_blocks = n_layer + n_nextn if keep_nextn else n_layer
        name_map = gguf.get_tensor_name_map(model_arch, n_blocks)
        tensors, skipped_nextn = [], []
        for hf_name, t in ckpt.tensors.items():
            if hf_name.endswith(_SKIPPED_SUFFIXES):
                continue
            m = _LAYER.match(hf_name)
            if m and int(m.group(1)) >= n_layer:
                if int(m.group(1)) >= n_layer + n_nextn:
                    raise InvalidContentError(about(
                        t.path, f"tensor '{hf_name}' is in layer {m.group(1)}, but config.json has "
                                f"{n_layer} layers and {n_nextn} NextN layers"))
                if not keep_nextn:
                    skipped_nextn.append(hf_name)
                    continue
                part = NEXTN_NAMES.get(hf_name[m.end():])
                if part is not None:  # llama.cpp's embedded NextN naming
                    tensors.append(SourceTensor(f"blk.{m.group(1)}.nextn.{part}.weight", t.shape,
                                                t.dtype, t.n_bytes, t.load_float32))
                    continue
                # the NextN block's ordinary tensors keep their blk.L.* names (mapped below)
            if hf_name == "lm_head.weight" and tied:
                continue  # tied to the embedding: llama.cpp reuses token_embd
            name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
            if name is None:
                raise InvalidContentError(about(
                    t.path, f"tensor '{hf_name}' has no llama.cpp name for architecture {arch}"))
            tensors.append(self._tensor(name, t, hf_name, permute, n_head, n_head_kv))
        if skipped_nextn:
            layers = f"layer {n_layer}" if n_nextn == 1 else f"layers {n_layer}..{n_layer + n_nextn - 1}"
            report(f"note: {ckpt.folder}: left out {len(skipped_nextn)} NextN/MTP tensors ({layers}); "
                   f"the MTP support GGUF carries them")

        theta = float(cfg.get("rope_theta") or 10000.0)
        keys = self._hparam_keys(cfg, where, os.path.basename(ckpt.folder), arch, n_blocks,
                                 n_embd, n_head, n_head_kv, head_dim, n_vocab, theta)
        if keep_nextn:
            keys.append(MetaKey(f"{arch}.nextn_predict_layers", n_nextn, V.UINT32))
        scaling = cfg.get("rope_scaling") or {}
        kind = (scaling.get("rope_type") or scaling.get("type") or "").lower() if scaling else ""
        if kind == "llama3":
            factors = llama3_rope_factors(head_dim, theta, scaling)
            tensors.append(SourceTensor("rope_freqs.weight", factors.shape, "F32", factors.nbytes,
                                        lambda f=factors: f))
        keys += tokenizer_metadata(ckpt.folder, cfg, n_vocab, report)

        self._check_embedding(tensors, n_vocab, n_embd, ckpt.folder)
        tensors.sort(key=_layout_order)
        super().__init__(path=ckpt.folder, kind="hf", arch=arch, metadata=keys, tensors=tensors,
                         hparams=Hparams(n_blocks, n_head, n_head_kv, 0), paths=ckpt.paths)
        self.checkpoint = ckpt

    @staticmethod
    def _tensor(name, t: HFTensor, hf_name, permute, n_head, n_head_kv) -> SourceTensor:
        load = t.load_float32
        if permute and re.search(r"self_attn\.(q|k)_proj\.(weight|bias)$", hf_name):
            heads = n_head if ".q_proj." in hf_name else n_head_kv

            def load(t=t, heads=heads):
                return interleave_rope_rows(t.load_float32(), heads)
        return SourceTensor(name, t.shape, t.dtype, t.n_bytes, load)

    @staticmethod
    def _hparam_keys(cfg, where, model_name, arch, n_layer, n_embd, n_head, n_head_kv,
                     head_dim, n_vocab, theta) -> list[MetaKey]:
        def k(key, value, vtype):
            return MetaKey(key.format(arch=arch), value, vtype)

        K, A, R = gguf.Keys.LLM, gguf.Keys.Attention, gguf.Keys.Rope
        keys = [
            MetaKey("general.type", "model", V.STRING),
            MetaKey("general.name", model_name, V.STRING),
            k(K.BLOCK_COUNT, n_layer, V.UINT32),
            k(K.CONTEXT_LENGTH, int(_num(cfg, "max_position_embeddings", where, 2048)), V.UINT32),
            k(K.EMBEDDING_LENGTH, n_embd, V.UINT32),
            k(K.FEED_FORWARD_LENGTH, int(_num(cfg, "intermediate_size", where)), V.UINT32),
            k(A.HEAD_COUNT, n_head, V.UINT32),
            k(A.HEAD_COUNT_KV, n_head_kv, V.UINT32),
            k(R.FREQ_BASE, theta, V.FLOAT32),
            k(A.LAYERNORM_RMS_EPS, float(_num(cfg, "rms_norm_eps", where, 1e-6)), V.FLOAT32),
            k(A.KEY_LENGTH, head_dim, V.UINT32),
            k(A.VALUE_LENGTH, head_dim, V.UINT32),
            k(R.DIMENSION_COUNT, head_dim, V.UINT32),
            k(K.VOCAB_SIZE, n_vocab, V.UINT32),
        ]
        scaling = cfg.get("rope_scaling") or {}
        kind = (scaling.get("rope_type") or scaling.get("type") or "").lower() if scaling else ""
        if kind in ("", "default", "llama3"):
            pass  # llama3's scaling travels as the rope_freqs tensor
        elif kind == "linear":
            keys += [k(R.SCALING_TYPE, "linear", V.STRING),
                     k(R.SCALING_FACTOR, float(scaling["factor"]), V.FLOAT32)]
        elif kind == "yarn":
            keys += [k(R.SCALING_TYPE, "yarn", V.STRING),
                     k(R.SCALING_FACTOR, float(scaling["factor"]), V.FLOAT32)]
            if "original_max_position_embeddings" in scaling:
                keys.append(k(R.SCALING_ORIG_CTX_LEN,
                              int(scaling["original_max_position_embeddings"]), V.UINT32))
        else:
            raise InvalidContentError(about(where, f"rope scaling type {kind!r} is not supported "
                                                   f"(linear, yarn and llama3 are)"))
        return keys

    @staticmethod
    def _check_embedding(tensors, n_vocab, n_embd, folder) -> None:
        by_name = {t.name: t for t in tensors}
        emb = by_name.get("token_embd.weight")
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
