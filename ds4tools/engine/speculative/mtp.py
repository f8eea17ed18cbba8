"""The MTP drafter: one NextN layer run autoregressively on the target's hidden state.

For target position i the head takes the target's final normed hidden state h_i and the
embedding of token t_{i+1}, and predicts t_{i+2} (DeepSeek-V3 / GLM NextN, fed as llama.cpp,
vLLM and SGLang do):

    x_i    = eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)])       (ds4 layout: e_proj(.) + h_proj(.))
    y_i    = decoder_layer(x_i)     at rope position i, causal over the head's own rows 0..i
    logits = output(shared_head_norm(y_i))                       (the target's lm_head)

Drafting after the anchor t_P: the row for position P-1 (true h_{P-1}, the anchor) gives d_1;
then the head recurses on its own state: the row for position P-1+j takes
shared_head_norm(y) of the previous row (the analogue of a final normed hidden) and d_j, and
gives d_{j+1}. After verification the head's cache is rolled back to its true rows, and the
committed positions are re-run with the target's real hidden states the next time it drafts
(batched with that step's first row).

DeepSeek V4 (deepseek4): the hidden state is the target's hyper-connection streams before its
head, the layer runs on streams and the head collapses them (deepseek4.Deepseek4MtpHead, made by
the model's ``mtp_head(weights)``); the recursion reads the layer's output streams.

``decoder_layer`` is the target architecture's own layer, with a one-layer cache of the target's
kind (KVCache; deepseek2's LatentCache; glm-dsa's DSACache): the target model's ``load_nextn_layer(tensors,
block, int8)`` loads it and ``nextn_layer(layer_weights)`` makes it runnable (an object with
``cache`` and ``forward(x, positions, limits)``; the Transformer's is transformer.NextNLayer,
glm4moe and deepseek2 override both).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..sampling import draw
from ..weights import Linear
from .drafter import Drafter, Proposal


@dataclass
class MtpHeadWeights:
    """One MTP layer: either NextN's fused ``eh_proj`` (2H -> H over [enorm(e); hnorm(h)]) or
    ds4's split ``e_proj`` / ``h_proj`` (H -> H each, summed)."""
    enorm: np.ndarray
    hnorm: np.ndarray
    norm: np.ndarray                   # NextN's shared_head.norm
    layer: object                      # the target architecture's layer weights (LayerWeights...)
    eh_proj: Linear | None = None
    e_proj: Linear | None = None
    h_proj: Linear | None = None
    source: str = ""                   # for the load-time log line
    embed: Linear | None = None        # NextN's own embed_tokens (None: the target's)
    output: Linear | None = None       # NextN's own shared_head.head (None: the target's)
    hc_head: object = None             # DeepSeek V4: the head's own hyper-connection collapse
                                       # (ds4's mtp.0.hc_head_*; None: the target's)

    def __post_init__(self):
        if (self.eh_proj is None) == (self.e_proj is None or self.h_proj is None):
            raise ValueError("an MTP head needs either eh_proj or both e_proj and h_proj")


class MtpHead:
    """The head's forward over a batch of rows, with its own one-layer cache (of the target's
    kind)."""

    def __init__(self, target, weights: MtpHeadWeights):
        self.t = target
        self.ops = target.ops
        self.w = weights = target.ops.place_weights(weights)  # on the target's device
        hp = target.hp
        self.hp = hp
        self.layer = target.nextn_layer(weights.layer)
        self.cache = self.layer.cache
        self.rows = target.chunk
        self.hidden_width = hp.n_embd  # the target-side hidden rows it reads

    def run(self, hidden, tokens, start_pos: int):
        """Head rows for positions start_pos.. from target-side hidden states (k, H: numpy, or
        the head's own normed rows on the device) and the next tokens (k,); returns the layer
        outputs y (k, H) on the target's device. Writes the head's cache rows."""
        hp, w, ops = self.hp, self.w, self.ops
        k = len(tokens)
        out = ops.empty((k, hp.n_embd))
        for c0 in range(0, k, self.rows):
            c1 = min(k, c0 + self.rows)
            n = c1 - c0
            ids = np.asarray(tokens[c0:c1], np.int64)
            e = self.t.embed(ids) if w.embed is None else w.embed.rows(ids)
            ops.rmsnorm(e, w.enorm, hp.rms_eps, e)
            h = ops.empty((n, hp.n_embd))
            ops.rmsnorm(ops.asarray(hidden[c0:c1]), w.hnorm, hp.rms_eps, h)
            x = ops.empty((n, hp.n_embd))
            if w.eh_proj is not None:
                eh = ops.empty((n, 2 * hp.n_embd))
                ops.concat_columns(e, h, eh)
                w.eh_proj.matmul(eh, x)
            else:
                w.e_proj.matmul(e, x)
                hx = ops.empty((n, hp.n_embd))
                w.h_proj.matmul(h, hx)
                ops.add_into(x, hx)
            positions = np.arange(start_pos + c0, start_pos + c1, dtype=np.int64)
            self.layer.forward(x, positions, positions + 1)
            self.cache.length = start_pos + c1
            ops.copy_into(out[c0:c1], x)
        return out

    def head(self, y):
        """shared_head_norm(y) (on the device) and the target's logits (numpy) for rows y
        (k, H)."""
        ops = self.ops
        normed = ops.empty(y.shape)
        ops.rmsnorm(y, self.w.norm, self.hp.rms_eps, normed)
        logits = ops.empty((y.shape[0], self.hp.n_vocab))
        (self.t.weights.output if self.w.output is None else self.w.output).matmul(normed, logits)
        return normed, ops.to_host(logits)


class MtpDrafter(Drafter):
    name = "mtp"
    wants_final_hidden = True

    def __init__(self, target, weights: MtpHeadWeights, max_draft: int = 3, margin: float = 0.0):
        if not 1 <= max_draft <= 16:
            raise ValueError(f"--mtp-draft {max_draft}: must be in 1..16")
        if not margin >= 0:
            raise ValueError(f"--mtp-margin {margin}: must not be negative")
        self.mtp = target.mtp_head(weights)
        self.max_draft = max_draft
        self.margin = float(margin)
        self._pend_h = np.zeros((0, self.mtp.hidden_width), np.float32)
        self._pend_tokens: list[int] = []
        self._pos = 0  # head rows [0, _pos) are computed from the target's true hidden states

    def start(self, prompt, prefill) -> None:
        self.mtp.cache.clear()
        self._pos = 0
        # rows 0..P-1; row P-1 pairs with the anchor, known at the first propose()
        self._pend_h = prefill.final_hidden
        self._pend_tokens = list(prompt[1:])

    def propose(self, anchor, max_tokens, sampler, rng) -> Proposal:
        n = min(self.max_draft, max_tokens)
        tokens = self._pend_tokens + [int(anchor)]
        y = self.mtp.run(self._pend_h, tokens, self._pos)[-1:]
        self._pos += len(tokens)
        self._pend_tokens = []
        drafts, qs, cut = [], [], False
        for j in range(n):
            normed, logits = self.mtp.head(y)
            row = logits[0]
            if self.margin > 0:
                top2 = np.partition(row, -2)[-2:]
                if float(top2[1] - top2[0]) < self.margin:
                    cut = True
                    break
            if sampler.greedy:
                d = int(np.argmax(row))
            else:
                q = sampler.distribution(row)
                d = draw(q, rng)
                qs.append(q)
            drafts.append(d)
            if j + 1 < n:
                y = self.mtp.run(normed, [d], self._pos + j)
        return Proposal(drafts, np.stack(qs) if qs else None, cut=cut)

    def commit(self, anchor, proposal, n_accepted, verify) -> None:
        # rows from the recursion used the head's own state: drop them, then queue the
        # committed positions with the target's real hidden states
        self.mtp.cache.truncate(self._pos)
        self._pend_h = verify.final_hidden[: n_accepted + 1]
        self._pend_tokens = [int(t) for t in proposal.tokens[:n_accepted]]

    def describe(self) -> str:
        src = self.mtp.w.source or "MTP head"
        m = f", margin {self.margin:g}" if self.margin > 0 else ""
        return f"mtp: {src}, draft depth {self.max_draft}{m}"
