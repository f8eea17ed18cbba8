"""The target's features for every training window, from the engine's own forward: the raw
outputs of the layers a DSpark draft reads (``Transformer.forward(hidden_layers=...)``, -1 the
embedding) and the final normed hidden state (``want_final_hidden``), whose logits through the
target's head are the distributions a draft learns. These are the numbers the drafters read at
inference (the same kernels, the same weights), so a draft is trained on what it will see.

DSpark rollouts (``--rollouts K``): at K anchors of each text window, the target's own greedy
continuation of ``block`` tokens and its final hidden state along it, from the engine
(``target_rollouts``): the tokens a draft must propose there and the distributions it learns
them from (self-distilled data), through the engine's forward.

Stored on disk in the run directory as float16 ``.npy`` memory maps (float32 when a value does
not fit float16), filled window by window so an interrupted run continues. Torch-free.
"""
from __future__ import annotations

import os

import numpy as np

from ..errors import InvalidContentError, about

__all__ = ["FeatureStore", "target_features", "target_rollouts", "rollout_anchors"]

F16_LIMIT = 60000.0
#: the first position a block may be anchored at (it needs some context before it)
MIN_ANCHOR = 4


def target_features(target, tokens: np.ndarray, layers, logits: bool = False):
    """(features (T, len(layers) * H) or None without layers, final hidden (T, H)[, logits])
    of one window, from one engine forward."""
    engine = target.engine
    hidden = tuple(sorted({int(l) for l in layers if l >= 0}))
    res = engine.forward(np.asarray(tokens, np.int64), 0, hidden_layers=hidden,
                         want_final_hidden=True, logits="all" if logits else "none")
    feats = None
    if layers:
        parts = [engine.model.embed(np.asarray(tokens, np.int64)) if l < 0 else res.hidden[l]
                 for l in layers]
        feats = np.concatenate(parts, axis=1)
    return (feats, res.final_hidden, res.logits) if logits else (feats, res.final_hidden)


def rollout_anchors(seq_len: int, count: int, seed: int, window: int) -> np.ndarray:
    """``count`` sorted anchor positions of window ``window``, fixed by the seed."""
    rng = np.random.default_rng([seed, 4, window])
    hi = seq_len - 1
    count = min(count, hi - MIN_ANCHOR)
    return np.sort(rng.choice(np.arange(MIN_ANCHOR, hi), size=count, replace=False))


def target_rollouts(target, final: np.ndarray, logits: np.ndarray, anchors, block: int):
    """The target's greedy continuation of ``block`` tokens from each anchor of the window whose
    forward is in the engine's cache (``final``, ``logits``: that forward's rows): tokens
    (K, block) and the final hidden state that predicted each (K, block, H) (row 0: the
    window's own at the anchor). Anchors are taken from the last: a continuation only writes
    cache rows after its anchor, which the earlier anchors do not read."""
    model = target.engine.model
    k_count = len(anchors)
    tokens = np.empty((k_count, block), np.int32)
    hidden = np.empty((k_count, block, final.shape[1]), np.float32)
    for j in range(k_count - 1, -1, -1):
        a = int(anchors[j])
        tok = int(np.argmax(logits[a]))
        tokens[j, 0], hidden[j, 0] = tok, final[a]
        for k in range(1, block):
            r = model.forward([tok], a + k, want_final_hidden=True, logits="last")
            tok = int(np.argmax(r.logits[-1]))
            tokens[j, k], hidden[j, k] = tok, r.final_hidden[0]
    return tokens, hidden


class FeatureStore:
    """tokens [N, T] int32, features [N, T, F] and final [N, T, H] (float16 or float32) as .npy
    memory maps in ``folder``."""

    def __init__(self, folder: str, n: int, seq_len: int, n_feat: int, n_embd: int, dtype: str,
                 create: bool, rollouts: int = 0, n_rollout_windows: int = 0, block: int = 0):
        """``rollouts`` anchors with a greedy rollout of ``block`` tokens in each of the first
        ``n_rollout_windows`` windows (the text windows)."""
        self.folder = folder
        mode = "w+" if create else "r+"
        open_ = np.lib.format.open_memmap
        self.tokens = open_(os.path.join(folder, "tokens.npy"), mode, np.int32, (n, seq_len))
        self.final = open_(os.path.join(folder, "final.npy"), mode, dtype, (n, seq_len, n_embd))
        self.feats = None
        if n_feat:
            self.feats = open_(os.path.join(folder, "features.npy"), mode, dtype, (n, seq_len, n_feat))
        self.dtype = np.dtype(dtype)
        self.roll_anchors = self.roll_tokens = self.roll_hidden = None
        self.n_rollout_windows = n_rollout_windows if rollouts else 0
        self.block = block
        if rollouts and n_rollout_windows:
            k = min(rollouts, seq_len - 1 - MIN_ANCHOR)
            shape = (n_rollout_windows, k)
            self.roll_anchors = open_(os.path.join(folder, "rollout_anchors.npy"), mode, np.int32, shape)
            self.roll_tokens = open_(os.path.join(folder, "rollout_tokens.npy"), mode, np.int32,
                                     shape + (block,))
            self.roll_hidden = open_(os.path.join(folder, "rollout_hidden.npy"), mode, dtype,
                                     shape + (block, n_embd))

    def _check(self, target, i, name, a) -> None:
        if not np.isfinite(a).all():
            raise InvalidContentError(about(target.path, f"the target's {name} hold NaN or "
                                                         f"infinite values (window {i})"))
        if self.dtype == np.float16 and float(np.abs(a).max()) > F16_LIMIT:
            raise InvalidContentError(about(target.path, f"the target's {name} exceed float16 "
                                                         f"range; rerun in a new run directory"))

    def fill(self, target, i: int, layers, seed: int = 0) -> None:
        rolls = self.roll_anchors is not None and i < self.n_rollout_windows
        got = target_features(target, self.tokens[i], layers, logits=rolls)
        feats, final = got[0], got[1]
        for name, a in (("final hidden", final), ("layer outputs", feats)):
            if a is not None:
                self._check(target, i, name, a)
        self.final[i] = final
        if self.feats is not None:
            self.feats[i] = feats
        if rolls:
            anchors = rollout_anchors(self.tokens.shape[1], self.roll_anchors.shape[1], seed, i)
            toks, hid = target_rollouts(target, final, got[2], anchors, self.block)
            self._check(target, i, "final hidden", hid)
            self.roll_anchors[i], self.roll_tokens[i], self.roll_hidden[i] = anchors, toks, hid

    def flush(self) -> None:
        for a in (self.tokens, self.final, self.feats, self.roll_anchors, self.roll_tokens,
                  self.roll_hidden):
            if a is not None:
                a.flush()


def choose_dtype(target, sample_tokens: np.ndarray, layers) -> str:
    """float16 unless the target's values in a sample window come near its range."""
    feats, final = target_features(target, sample_tokens, layers)
    peak = max(float(np.abs(final).max()), float(np.abs(feats).max()) if feats is not None else 0.0)
    return "float16" if peak < F16_LIMIT / 4 else "float32"
