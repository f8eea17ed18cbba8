"""The Hugging Face architectures that convert to llama.cpp's layouts, and the one weight
transform their layout needs: llama's q/k rows reordered for llama.cpp's rotary embedding.

Shared by the model converter (``ds4tools.quantize.convert``) and the MTP support builder
(``ds4tools.support.build``), which both read a checkpoint's attention weights.
"""
from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np

__all__ = ["ARCHITECTURES", "MOE_ARCHITECTURES", "MoEFamily", "interleave_rope_rows"]

#: HF architecture -> (llama.cpp architecture, gguf MODEL_ARCH, whether q/k rows are reordered)
ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", gguf.MODEL_ARCH.LLAMA, True),
    "Qwen3ForCausalLM": ("qwen3", gguf.MODEL_ARCH.QWEN3, False),
}


@dataclass(frozen=True)
class MoEFamily:
    """How one mixture-of-experts family converts (``ds4tools.quantize.convert_moe``)."""
    arch: str  # llama.cpp's architecture name
    model_arch: gguf.MODEL_ARCH
    mla: bool  # DeepSeek's multi-head latent attention (else GQA with partial rotary)
    indexer: bool  # GLM-5's DSA lightning indexer


#: HF architecture -> family
MOE_ARCHITECTURES = {
    "DeepseekV2ForCausalLM": MoEFamily("deepseek2", gguf.MODEL_ARCH.DEEPSEEK2, True, False),
    "DeepseekV3ForCausalLM": MoEFamily("deepseek2", gguf.MODEL_ARCH.DEEPSEEK2, True, False),
    "Glm4MoeForCausalLM": MoEFamily("glm4moe", gguf.MODEL_ARCH.GLM4_MOE, False, False),
    "GlmMoeDsaForCausalLM": MoEFamily("glm-dsa", gguf.MODEL_ARCH.GLM_DSA, True, True),
}


def interleave_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Reorder a q/k projection's output rows from HF's rotate-half rotary layout (pairs are
    (i, i + d/2) within a head) to llama.cpp's adjacent pairs (2i, 2i + 1)."""
    rows = w.shape[0]
    if rows % n_heads or (rows // n_heads) % 2:
        raise ValueError(f"{rows} rows do not split into {n_heads} heads of even size")
    half = rows // n_heads // 2
    return np.ascontiguousarray(
        w.reshape(n_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))
