"""The target a draft is distilled from, as the engine runs it: its GGUF checked (a model of an
architecture the engine runs, not a support file), an ``Engine`` on it (features, generation,
evaluation), and its frozen pieces in float32 numpy (the embedding, the output head and norm,
the decoder layers a draft starts from), dequantized from the GGUF's own blocks. Torch-free.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from ..errors import Ds4Error, UsageError, about
from ..engine.hparams import SUPPORTED_ARCHITECTURES, HParams

__all__ = ["FrozenTarget", "open_frozen_target", "default_target_layers", "check_target_layers",
           "mask_token"]


@dataclass
class FrozenTarget:
    path: str
    engine: object          # ds4tools.engine.Engine
    hp: HParams

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def embedding(self) -> np.ndarray:
        """The token embedding (V, H) float32."""
        return self.engine.weights.token_embd.dequantize()

    def lm_head(self) -> np.ndarray:
        """The output head (V, H) float32 (the embedding when tied)."""
        return self.engine.weights.output.dequantize()

    def output_norm(self) -> np.ndarray:
        return np.array(self.engine.weights.output_norm, np.float32)

    def layer(self, i: int) -> dict:
        """Decoder layer ``i`` as float32 arrays in numpy order (GGUF conventions: q/k rows as
        the engine ropes them): attn_norm, attn_q/k/v/output, attn_q_norm/k_norm (None without),
        ffn_norm, ffn_gate/up/down."""
        lw = self.engine.weights.layers[i]
        return {
            "attn_norm": np.array(lw.attn_norm, np.float32), "attn_q": lw.wq.dequantize(),
            "attn_k": lw.wk.dequantize(), "attn_v": lw.wv.dequantize(),
            "attn_output": lw.wo.dequantize(),
            "attn_q_norm": None if lw.q_norm is None else np.array(lw.q_norm, np.float32),
            "attn_k_norm": None if lw.k_norm is None else np.array(lw.k_norm, np.float32),
            "ffn_norm": np.array(lw.ffn_norm, np.float32), "ffn_gate": lw.w_gate.dequantize(),
            "ffn_up": lw.w_up.dequantize(), "ffn_down": lw.w_down.dequantize(),
        }

    def rope_tables(self) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin (n_ctx, n_rot / 2): the tables the engine ropes with."""
        return self.engine.model.rope

    def close(self) -> None:
        self.engine.close()


def open_frozen_target(path, *, n_ctx: int | None = None, threads: int | None = None) -> FrozenTarget:
    """The target model at ``path``, checked for distilling: a GGUF model the engine runs.
    A support GGUF, another kind of GGUF or an unsupported architecture is a usage error (the
    command was given the wrong file), exit 2."""
    from ..engine import Engine
    from ..gguf_io import open_gguf
    from ..inspect.kinds import detect_kind
    path = os.fspath(path)
    if os.path.isdir(path):
        raise UsageError(about(path, "is a directory; distill takes the target as a GGUF "
                                     "(convert it with `ds4tools quantize DIR -o MODEL.gguf --type Q8_0`)"))
    if not os.path.exists(path):
        raise UsageError(about(path, "no such file"))
    try:
        f = open_gguf(path)
    except Ds4Error as e:
        raise UsageError(str(e)) from None
    try:
        kind = detect_kind(f)
        arch = f.architecture
    finally:
        f.close()
    if kind != "model":
        what = "a support GGUF" if "support" in kind or kind == "dspark-draft" else "not a model"
        raise UsageError(about(path, f"is {what} (kind '{kind}'), not a target model: pass the "
                                     f"model the draft is for"))
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UsageError(about(path, f"architecture {arch!r} is not supported for distilling "
                                     f"(the engine runs: {', '.join(SUPPORTED_ARCHITECTURES)})"))
    engine = Engine(path, n_ctx=n_ctx, threads=threads)
    return FrozenTarget(path, engine, engine.hparams)


def default_target_layers(n_layer: int, count: int = 3) -> list[int]:
    """Target layers spread over the depth, DeepSpec style (its Qwen3 drafts read layers 1 to
    n-3 in even steps), but never the last layer, whose output llama.cpp cannot capture: from
    layer 1 (0 on a 2-layer target) to layer n-2."""
    hi = n_layer - 2
    if hi < 0:
        return [-1]  # a one-layer target: only the embedding is readable
    lo = min(1, hi)
    count = max(1, min(count, hi - lo + 1))
    if count == 1:
        return [hi]
    ids = [int(np.floor(lo + (hi - lo) * k / (count - 1) + 0.5)) for k in range(count)]
    return sorted(set(ids))


def check_target_layers(layers, hp: HParams, path: str) -> None:
    """--target-layers against the target: in -1..n-2 (the last layer's output is refused:
    llama.cpp's llama / qwen3 graphs cannot capture it)."""
    from ..support.dspark_llamacpp import uncapturable_message
    n = hp.n_layer
    for x in layers:
        if x == n - 1:
            raise UsageError(f"--target-layers {x}: " + uncapturable_message(x, hp.arch, n, path))
        if not -1 <= x < n - 1:
            raise UsageError(f"--target-layers {x}: {path} has {n} layers (ids 0..{n - 1}; -1 is "
                             f"the embedding; the last layer's output cannot be read by llama.cpp)")


_MASK_NAMES = ("<|mask|>", "<mask>", "[MASK]", "<|MASK|>")


def mask_token(meta: dict, tokenizer) -> int:
    """The DSpark mask token: the vocabulary's (tokenizer.ggml.mask_token_id, or a token named
    like one), else the last token id (rarely seen in text; the draft learns what it means)."""
    v = meta.get("tokenizer.ggml.mask_token_id")
    if isinstance(v, int) and 0 <= v < tokenizer.n_vocab:
        return int(v)
    for name in _MASK_NAMES:
        if name in tokenizer.tokens:
            return tokenizer.tokens.index(name)
    return tokenizer.n_vocab - 1
