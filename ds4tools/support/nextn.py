"""Embedded NextN layers: the MTP layers kept *inside* a model GGUF, as llama.cpp writes them for
GLM and DeepSeek: ``{arch}.nextn_predict_layers`` = n, ``{arch}.block_count`` counting them,
and for each NextN block N (the last n blocks) ``blk.N.nextn.{eh_proj, enorm, hnorm,
shared_head_norm}`` (optionally ``embed_tokens``, ``shared_head_head``) plus the block's
ordinary ``blk.N.*`` tensors.

``find`` reads them, ``validate`` checks them, and ``mtp_tensors`` extracts one into the ds4 MTP
layout (``eh_proj`` split into ``e_proj`` / ``h_proj``, the embedding half first; the bytes of
every other tensor copied as stored).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from . import meta
from .layout import ANY_WEIGHT, DS4_MTP, F32, Problems, TensorSpec, check_tensor
from .mtp import PREFIX
from .write import OutTensor

__all__ = ["EmbeddedNextN", "find", "validate", "is_trunk_only", "mtp_tensors", "gguf_nextn_name"]

#: llama.cpp block tensor -> ds4 MTP name part (the same names under mtp.0.)
BLOCK_PARTS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm",
               "attn_k_norm", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")


def gguf_nextn_name(block: int, part: str) -> str:
    return f"blk.{block}.nextn.{part}.weight"


@dataclass(frozen=True)
class EmbeddedNextN:
    arch: str
    n_nextn: int
    block_count: int

    @property
    def blocks(self) -> list[int]:
        return list(range(self.block_count - self.n_nextn, self.block_count))

    @property
    def n_main_layers(self) -> int:
        return self.block_count - self.n_nextn


def find(f) -> EmbeddedNextN | None:
    arch = f.architecture or ""
    n = meta.integer(f, f"{arch}.nextn_predict_layers")
    blocks = meta.integer(f, f"{arch}.block_count")
    if not n or blocks is None:
        return None
    return EmbeddedNextN(arch, int(n), int(blocks))


def is_trunk_only(f) -> bool:
    """llama.cpp's trunk-only file: ``nextn_predict_layers`` declared, no NextN tensor present
    (the MTP-only file split from the same checkpoint carries them; llama.cpp loads either)."""
    e = find(f)
    if e is None or not 0 < e.n_nextn < e.block_count or e.n_nextn > len(f.tensors):
        return False  # an impossible count: validate() reports it
    first = e.block_count - e.n_nextn
    for name in f.tensors:
        m = re.match(r"blk\.(\d+)\.", name)
        if m and int(m.group(1)) >= first:
            return False
    return True


def _specs(e: EmbeddedNextN, block: int, n_embd, n_vocab) -> list[TensorSpec]:
    two = None if n_embd is None else 2 * n_embd
    p = f"blk.{block}.nextn."
    return [
        TensorSpec(p + "eh_proj.weight", "eh_proj", ANY_WEIGHT, (two, n_embd)),
        TensorSpec(p + "enorm.weight", "enorm", F32, (n_embd,)),
        TensorSpec(p + "hnorm.weight", "hnorm", F32, (n_embd,)),
        TensorSpec(p + "shared_head_norm.weight", "shared_head_norm", F32, (n_embd,)),
        TensorSpec(p + "embed_tokens.weight", "embed_tokens", ANY_WEIGHT, (n_embd, n_vocab), required=False),
        TensorSpec(p + "shared_head_head.weight", "shared_head_head", ANY_WEIGHT, (n_embd, n_vocab),
                   required=False),
    ]


def validate(f) -> Problems:
    """The NextN tensors of a model with ``{arch}.nextn_predict_layers`` (ds4's wording)."""
    out = Problems()
    e = find(f)
    if e is None:
        return out
    if e.n_nextn >= e.block_count or e.n_nextn > len(f.tensors):
        out.error(f"{e.arch}.nextn_predict_layers is {e.n_nextn}: more than the model's "
                  f"{e.block_count} blocks / {len(f.tensors)} tensors can hold")
        return out
    n_embd = meta.integer(f, f"{e.arch}.embedding_length")
    tokens = f.metadata.get("tokenizer.ggml.tokens")
    n_vocab = len(tokens) if isinstance(tokens, list) else meta.integer(f, f"{e.arch}.vocab_size")
    for block in e.blocks:
        for spec in _specs(e, block, n_embd, n_vocab):
            for msg in check_tensor(spec, f.tensors.get(spec.name), DS4_MTP):
                out.error(msg)
    return out


def _row_slice(ref, first: bool, n_embd: int):
    """The first / second half of each row of ``eh_proj`` ({2E, E}): byte slices when E is a
    whole number of the type's blocks (lossless), else decoded values."""
    qtype = GGMLQuantizationType(ref.ggml_type)
    blk, size = GGML_QUANT_SIZES[qtype]
    if n_embd % blk == 0:
        half = n_embd // blk * size

        def raw():
            r = ref.raw()
            return np.ascontiguousarray(r[:, :half] if first else r[:, half:2 * half])
        return raw, None

    def load():
        w = ref.to_float32()
        return np.ascontiguousarray(w[:, :n_embd] if first else w[:, n_embd:])
    return None, load


def mtp_tensors(f, block: int, n_embd: int, source_path: str) -> tuple[list[OutTensor], list[str]]:
    """The ds4 MTP layout's tensors for NextN block ``block`` of ``f`` (stored types kept)."""
    notes = []
    out: list[OutTensor] = []
    eh = f.tensors[gguf_nextn_name(block, "eh_proj")]
    type_name = eh.type_name
    for first, role in ((True, "e_proj"), (False, "h_proj")):
        raw, load = _row_slice(eh, first, n_embd)
        t = type_name if raw is not None else "F16"  # a half-row that is no whole block
        out.append(OutTensor(PREFIX + f"{role}.weight", (n_embd, n_embd), t, load=load, raw=raw,
                             src_type=type_name, src_bytes=eh.n_bytes // 2))

    def copy(ref, name):
        out.append(OutTensor(name, ref.shape, ref.type_name, raw=ref.raw, src_type=ref.type_name,
                             src_bytes=ref.n_bytes))
    for part, dst in (("enorm", "enorm"), ("hnorm", "hnorm"), ("shared_head_norm", "norm")):
        copy(f.tensors[gguf_nextn_name(block, part)], PREFIX + f"{dst}.weight")
    for part in BLOCK_PARTS:
        ref = f.tensors.get(f"blk.{block}.{part}.weight")
        if ref is not None:
            copy(ref, PREFIX + f"{part}.weight")
    for part in ("embed_tokens", "shared_head_head"):
        if gguf_nextn_name(block, part) in f.tensors:
            notes.append(f"note: {source_path}: {gguf_nextn_name(block, part)} left out (the MTP "
                         f"support file uses the target's)")
    return out, notes
