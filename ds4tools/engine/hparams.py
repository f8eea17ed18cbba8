"""Model hyper-parameters read from GGUF metadata, as llama.cpp's llama and qwen3 loaders do.

Keys are ``<arch>.<name>`` (``llama.block_count``...). Everything the decoder needs is checked
here, once, with a one-line message naming the key, so the kernels never see a bad shape.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

#: the dense decoders of transformer.py (also what distillation can target); every
#: architecture the Engine runs is listed in architectures.ARCHITECTURES
SUPPORTED_ARCHITECTURES = ("llama", "qwen3")

#: llama.cpp's rope type per architecture: llama rotates adjacent pairs ("norm"; its converter
#: permutes the HF q/k rows to match), qwen3 and glm4moe rotate the two halves ("neox"),
#: deepseek2 and glm-dsa adjacent pairs of their rope dimensions.
ROPE_TYPE = {"llama": "norm", "qwen3": "neox", "glm4moe": "neox", "deepseek2": "norm",
             "glm-dsa": "norm", "deepseek4": "norm"}

ROPE_SCALING = ("none", "linear", "yarn")


class HParamsError(ValueError):
    """A metadata problem; the caller adds the file name."""


@dataclass(frozen=True)
class HParams:
    arch: str
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int           # key length
    head_dim_v: int         # value length
    n_ff: int
    n_ctx_train: int
    rms_eps: float
    rope_type: str          # "norm" | "neox"
    n_rot: int              # rotated dimensions per head
    rope_freq_base: float
    rope_scaling: str = "none"
    rope_freq_scale: float = 1.0
    rope_n_ctx_orig: int = 0
    yarn_ext_factor: float = 1.0
    yarn_attn_factor: float = 1.0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    n_nextn: int = 0        # NextN layers stored after the n_layer decoder blocks (not run)
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def n_q(self) -> int:
        """Width of the query projection (n_head * head_dim)."""
        return self.n_head * self.head_dim

    @property
    def n_kv(self) -> int:
        """Width of the key projection (n_head_kv * head_dim)."""
        return self.n_head_kv * self.head_dim

    @property
    def attention_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    @property
    def yarn(self):
        """The YaRN parameters for kernels.rope_tables, or None."""
        if self.rope_scaling != "yarn":
            return None
        return (self.rope_n_ctx_orig, self.yarn_beta_fast, self.yarn_beta_slow,
                self.yarn_ext_factor, self.yarn_attn_factor)


def _get(meta: dict, key: str, kind, *, default=None, required=True):
    if key not in meta:
        if required:
            raise HParamsError(f"missing metadata key {key}")
        return default
    v = meta[key]
    if kind is int:
        if isinstance(v, bool) or not (isinstance(v, int) or _is_np_int(v)):
            raise HParamsError(f"metadata key {key} must be an integer, got {_kind(v)}")
        return int(v)
    if kind is float:
        if isinstance(v, bool) or not (isinstance(v, (int, float)) or _is_np_num(v)):
            raise HParamsError(f"metadata key {key} must be a number, got {_kind(v)}")
        v = float(v)
        if not math.isfinite(v):
            raise HParamsError(f"metadata key {key} must be finite, got {v}")
        return v
    if kind is str:
        if not isinstance(v, str):
            raise HParamsError(f"metadata key {key} must be a string, got {_kind(v)}")
        return v
    raise TypeError(kind)


def _is_np_int(v) -> bool:
    return isinstance(v, np.integer)


def _is_np_num(v) -> bool:
    return isinstance(v, (np.integer, np.floating))


def _kind(v) -> str:
    if isinstance(v, list):
        return "an array"
    return type(v).__name__


def _positive(key: str, v: int) -> int:
    if v <= 0:
        raise HParamsError(f"metadata key {key} must be positive, got {v}")
    return v


def hparams_from_metadata(meta: dict, n_vocab_tensor: int | None = None) -> HParams:
    """HParams of a llama / qwen3 GGUF from its metadata dict (strings decoded, arrays as
    lists). ``n_vocab_tensor``: the token embedding's row count, used when the file has no
    ``<arch>.vocab_size`` (llama.cpp takes the vocabulary size from the tokenizer)."""
    arch = _get(meta, "general.architecture", str)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise HParamsError(
            f"unsupported architecture {arch!r} (the engine runs: {', '.join(SUPPORTED_ARCHITECTURES)})")
    return decoder_hparams(meta, arch, n_vocab_tensor)


def decoder_hparams(meta: dict, arch: str, n_vocab_tensor: int | None = None) -> HParams:
    """The keys every decoder of the engine reads the same way (sizes, attention, rope), for
    ``arch`` (one of ROPE_TYPE); an architecture with more (experts...) reads those itself."""
    if arch not in ROPE_TYPE:
        raise HParamsError(f"unsupported architecture {arch!r}")
    k = lambda name: f"{arch}.{name}"  # noqa: E731

    n_embd = _positive(k("embedding_length"), _get(meta, k("embedding_length"), int))
    n_layer = _positive(k("block_count"), _get(meta, k("block_count"), int))
    # NextN/MTP layers embedded as llama.cpp does for GLM / DeepSeek are the LAST blocks and are
    # counted in block_count; the decoder runs the others (--glm-mtp drafts with those)
    n_nextn = _get(meta, k("nextn_predict_layers"), int, default=0, required=False)
    if not 0 <= n_nextn < n_layer:
        raise HParamsError(f"{k('nextn_predict_layers')} is {n_nextn}: must be below "
                           f"{k('block_count')} ({n_layer})")
    n_layer -= n_nextn
    n_ff = _positive(k("feed_forward_length"), _get(meta, k("feed_forward_length"), int))
    n_head = _positive(k("attention.head_count"), _get(meta, k("attention.head_count"), int))
    n_head_kv = _positive(k("attention.head_count_kv"),
                          _get(meta, k("attention.head_count_kv"), int, default=n_head, required=False))
    if n_head % n_head_kv:
        raise HParamsError(f"{k('attention.head_count')} ({n_head}) is not a multiple of "
                           f"{k('attention.head_count_kv')} ({n_head_kv})")
    if n_embd % n_head and k("attention.key_length") not in meta:
        raise HParamsError(f"{k('embedding_length')} ({n_embd}) is not a multiple of "
                           f"{k('attention.head_count')} ({n_head}) and there is no "
                           f"{k('attention.key_length')}")
    head_dim = _positive(k("attention.key_length"),
                         _get(meta, k("attention.key_length"), int, default=n_embd // n_head, required=False))
    head_dim_v = _positive(k("attention.value_length"),
                           _get(meta, k("attention.value_length"), int, default=head_dim, required=False))
    if head_dim_v != head_dim:
        raise HParamsError(f"{k('attention.value_length')} ({head_dim_v}) differs from "
                           f"{k('attention.key_length')} ({head_dim}); the engine needs them equal")
    n_ctx_train = _positive(k("context_length"), _get(meta, k("context_length"), int))
    rms_eps = _get(meta, k("attention.layer_norm_rms_epsilon"), float)
    if not rms_eps > 0:
        raise HParamsError(f"metadata key {k('attention.layer_norm_rms_epsilon')} must be positive")

    n_vocab = _get(meta, k("vocab_size"), int, required=False)
    if n_vocab is None:
        tokens = meta.get("tokenizer.ggml.tokens")
        n_vocab = len(tokens) if isinstance(tokens, list) else n_vocab_tensor
    if n_vocab is None:
        raise HParamsError(f"missing metadata key {k('vocab_size')} (and no tokenizer.ggml.tokens)")
    _positive(k("vocab_size"), n_vocab)

    n_rot = _get(meta, k("rope.dimension_count"), int, default=head_dim, required=False)
    if n_rot <= 0 or n_rot > head_dim or n_rot % 2:
        raise HParamsError(f"metadata key {k('rope.dimension_count')} must be even and in "
                           f"[2, {head_dim}], got {n_rot}")
    freq_base = _get(meta, k("rope.freq_base"), float, default=10000.0, required=False)
    if not freq_base > 0:
        raise HParamsError(f"metadata key {k('rope.freq_base')} must be positive, got {freq_base}")

    scaling = _get(meta, k("rope.scaling.type"), str, default="none", required=False)
    factor = _get(meta, k("rope.scaling.factor"), float, default=0.0, required=False)
    if k("rope.scale_linear") in meta and factor == 0.0:  # older files
        factor = _get(meta, k("rope.scale_linear"), float)
        if k("rope.scaling.type") not in meta:
            scaling = "linear"
    if scaling not in ROPE_SCALING:
        raise HParamsError(f"unsupported {k('rope.scaling.type')} {scaling!r} "
                           f"(known: {', '.join(ROPE_SCALING)})")
    if factor < 0:
        raise HParamsError(f"metadata key {k('rope.scaling.factor')} must not be negative")
    freq_scale = 1.0 if scaling == "none" or factor == 0.0 else 1.0 / factor
    n_ctx_orig = _get(meta, k("rope.scaling.original_context_length"), int,
                      default=n_ctx_train, required=False)
    return HParams(
        arch=arch, n_vocab=n_vocab, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
        n_head_kv=n_head_kv, head_dim=head_dim, head_dim_v=head_dim_v, n_ff=n_ff,
        n_ctx_train=n_ctx_train, rms_eps=rms_eps, rope_type=ROPE_TYPE[arch], n_rot=n_rot,
        rope_freq_base=freq_base, rope_scaling=scaling, rope_freq_scale=freq_scale,
        rope_n_ctx_orig=n_ctx_orig,
        yarn_ext_factor=_get(meta, k("rope.scaling.yarn_ext_factor"), float, default=1.0, required=False),
        yarn_attn_factor=_get(meta, k("rope.scaling.yarn_attn_factor"), float, default=1.0, required=False),
        yarn_beta_fast=_get(meta, k("rope.scaling.yarn_beta_fast"), float, default=32.0, required=False),
        yarn_beta_slow=_get(meta, k("rope.scaling.yarn_beta_slow"), float, default=1.0, required=False),
        n_nextn=n_nextn,
    )
