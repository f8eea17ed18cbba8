"""Read a DeepSeek V4 Hugging Face checkpoint (its MTP layer ``mtp.0.*``, or a DSpark draft's
three stages ``mtp.0..2.*``), decoding DeepSeek's storage to float32:

- dense weights stored as FP8 E4M3 (``X.weight``) with E8M0 scales per 128 x 128 block
  (``X.scale``);
- routed experts ``ffn.experts.E.w1/w2/w3`` (gate, down, up) stored as packed FP4 (``I8`` /
  ``U8``, two E2M1 values per byte, low nibble first) with an E8M0 scale per 32 inputs; they are
  stacked into one [n_expert, out, in] tensor per projection;
- everything else (norms, hyper-connection weights, router, sinks) as F32 / BF16 / F16.

Config keys (``text_config`` merged in, as V4.1 nests them): hidden_size, num_attention_heads,
head_dim, q_lora_rank, o_lora_rank, o_groups, n_routed_experts, num_experts_per_tok,
moe_intermediate_size, n_shared_experts, hc_mult, vocab_size, num_hidden_layers, rms_norm_eps,
rope_theta; a DSpark draft adds dspark_block_size, dspark_noise_token_id,
dspark_target_layer_ids (and V4.1's dspark_n_routed_experts / dspark_num_experts_per_tok).
"""
from __future__ import annotations

import numpy as np

from ..checkpoint import HFCheckpoint, HFTensor
from ..errors import InvalidContentError, about
from . import fp8
from .dsv4_block import HF_BLOCK_NAMES, HF_EXPERT_PROJ
from .target import Dims, hf_config, hf_dims

__all__ = ["DSV4Checkpoint", "is_dsv4_config"]

_FLOATS = ("F32", "F16", "BF16", "F64")
_PACKED = ("I8", "U8")


def is_dsv4_config(cfg: dict) -> bool:
    archs = [str(a) for a in cfg.get("architectures") or []]
    return any(a.startswith("DeepseekV4") or a.startswith("DeepseekV41") for a in archs) or \
        str(cfg.get("model_type", "")).startswith("deepseek_v4")


class DSV4Checkpoint:
    def __init__(self, folder):
        self.ckpt = HFCheckpoint(folder)
        self.folder = self.ckpt.folder
        self.config = hf_config(self.folder)
        self.tensors: dict[str, HFTensor] = self.ckpt.tensors
        cfg = self.config
        d = hf_dims(cfg)
        if d.n_head_kv is None or "num_key_value_heads" not in cfg:
            d = Dims(**{**d.known(), "n_head_kv": 1})  # one shared KV head (MQA)
        if cfg.get("dspark_n_routed_experts"):
            d = Dims(**{**d.known(), "n_expert": int(cfg["dspark_n_routed_experts"])})
        if cfg.get("dspark_num_experts_per_tok"):
            d = Dims(**{**d.known(), "n_expert_used": int(cfg["dspark_num_experts_per_tok"])})
        if d.n_shared is None:
            d = Dims(**{**d.known(), "n_shared": 1})
        self.dims = d

    @property
    def paths(self) -> list[str]:
        return self.ckpt.paths

    def has(self, name: str) -> bool:
        return name in self.tensors

    def stage_prefixes(self) -> list[int]:
        stages = set()
        for n in self.tensors:
            parts = n.split(".")
            if len(parts) > 2 and parts[0] == "mtp" and parts[1].isdigit():
                stages.add(int(parts[1]))
        return sorted(stages)

    def _get(self, name: str) -> HFTensor:
        t = self.tensors.get(name)
        if t is None:
            raise InvalidContentError(about(self.folder, f"tensor '{name}' is missing from the checkpoint"))
        return t

    def shape(self, name: str) -> tuple:
        return self._get(name).shape

    def nbytes(self, name: str) -> int:
        t = self._get(name)
        scale = self.tensors.get(_scale_name(name))
        return t.n_bytes + (scale.n_bytes if scale is not None else 0)

    def dtype(self, name: str) -> str:
        return self._get(name).dtype

    def load(self, name: str) -> np.ndarray:
        """A tensor as float32 (FP8 weights decoded with their block scales)."""
        t = self._get(name)
        if t.dtype in _FLOATS:
            return t.load_float32()
        if t.dtype == "F8_E4M3":
            scale = self.tensors.get(_scale_name(name))
            if scale is None:
                raise InvalidContentError(about(t.path, f"FP8 tensor '{name}' has no "
                                                        f"'{_scale_name(name)}' block scales"))
            try:
                return fp8.dequantize_fp8(t.load_raw(), scale.load_raw())
            except ValueError as e:
                raise InvalidContentError(about(t.path, f"tensor '{name}': {e}")) from None
        raise InvalidContentError(about(t.path, f"tensor '{name}' has dtype {t.dtype}, which "
                                                f"is not a DeepSeek V4 weight storage"))

    def expert_names(self, prefix: str, role: str) -> list[str]:
        proj = HF_EXPERT_PROJ[role]
        n = self.dims.n_expert or 0
        return [f"{prefix}ffn.experts.{e}.{proj}.weight" for e in range(n)]

    def expert_shape(self, prefix: str, role: str) -> tuple:
        """[n_expert, out, in] of a routed projection, from the first expert's storage."""
        names = self.expert_names(prefix, role)
        if not names:
            raise InvalidContentError(about(self.folder, "config.json gives no routed expert count"))
        for n in names:  # every expert must be there before anything is allocated
            self._get(n)
        t = self._get(names[0])
        rows, cols = t.shape
        if t.dtype in _PACKED:
            cols *= 2
        return (len(names), rows, cols)

    def load_expert(self, prefix: str, role: str, e: int) -> np.ndarray:
        """Routed expert ``e`` of projection ``role`` as float32 [out, in]."""
        name = self.expert_names(prefix, role)[e]
        shape = self.expert_shape(prefix, role)
        t = self._get(name)
        if t.dtype in _PACKED:
            scale = self.tensors.get(_scale_name(name))
            if scale is None:
                raise InvalidContentError(about(t.path, f"FP4 expert '{name}' has no scales"))
            try:
                w = fp8.dequantize_fp4(t.load_raw(), scale.load_raw(), n_inputs=shape[2])
            except ValueError as err:
                raise InvalidContentError(about(t.path, f"tensor '{name}': {err}")) from None
        else:
            w = self.load(name)
        if w.shape != shape[1:]:
            raise InvalidContentError(about(t.path, f"expert tensor '{name}' has shape "
                                                    f"{list(w.shape)}, expected {list(shape[1:])}"))
        return w

    def load_experts(self, prefix: str, role: str) -> np.ndarray:
        """All routed experts of ``role`` as float32 [n_expert, out, in] (tests; the writer
        takes them one at a time)."""
        shape = self.expert_shape(prefix, role)
        out = np.empty(shape, np.float32)
        for e in range(shape[0]):
            out[e] = self.load_expert(prefix, role, e)
        return out

    def experts_nbytes(self, prefix: str, role: str) -> int:
        return sum(self.nbytes(n) for n in self.expert_names(prefix, role))

    def block_source(self, prefix: str, role: str):
        """(loader, numpy shape, source dtype, source bytes) of block tensor ``role``; the
        routed experts' loader takes the expert index."""
        if role in HF_EXPERT_PROJ:
            names = self.expert_names(prefix, role)
            return (lambda e: self.load_expert(prefix, role, e), self.expert_shape(prefix, role),
                    self.dtype(names[0]) if names else "?", self.experts_nbytes(prefix, role))
        name = prefix + HF_BLOCK_NAMES[role]
        return (lambda: self.load(name), self.shape(name), self.dtype(name), self.nbytes(name))

    def named_source(self, name: str):
        return (lambda: self.load(name), self.shape(name), self.dtype(name), self.nbytes(name))


def _scale_name(weight_name: str) -> str:
    base = weight_name[:-len(".weight")] if weight_name.endswith(".weight") else weight_name
    return base + ".scale"
