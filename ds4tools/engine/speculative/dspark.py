"""The DSpark drafter: a whole block of drafts from one forward pass (DeepSpec's Qwen3 DSpark).

Context: for every committed position t, ctx(t) = hidden_norm(fc([h_l(t) for l in
target_layers])) from the RAW outputs of the chosen target layers. Each draft layer turns it
into context keys and values with its own projections, k_norm(k_proj(ctx)) (roped at t) and
v_proj(ctx), kept in the drafter's cache for the whole generation.

Block: the anchor a (the last committed token, not yet run by the target) and B-1 mask tokens,
embedded with the target's embedding at positions a..a+B-1, go through the draft layers; block
queries see every context row before a and all B block rows (bidirectional). Slot k's
normed output h_k gives base logits U_k through the target's lm_head, and slot k proposes the
token at a+k+1. A low-rank Markov head then runs left to right:

    z_k = U_k + W2 . W1[x_{k-1}]                 (x_{-1} = the anchor)
    c_k = sigmoid(w . [h_k; W1[x_{k-1}]] + b)    (the chance that draft k survives)

Drafting stops at the first k with c_k below the confidence threshold (decided before the target
sees anything, so it is lossless); otherwise x_k is argmax z_k (greedy) or a draw from the
sampler's distribution of z_k, which is also the q the verifier uses. The block's K/V rows are
dropped after each round; the committed tokens' context rows are added from the verify pass.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .. import kernels
from ..sampling import draw
from ..transformer import Workspace, layer_forward
from ..weights import LayerWeights, Linear
from .drafter import Drafter, Proposal


@dataclass
class DSparkWeights:
    fc: Linear                       # (H, n_targets * H)
    hidden_norm: np.ndarray          # (H,)
    layers: list[LayerWeights]
    norm: np.ndarray                 # the final norm (H,)
    markov_w1: Linear                # rows: (n_vocab, rank) embedding of the previous token
    markov_w2: Linear                # (n_vocab, rank): the bias W2 . W1[prev]
    conf_w: np.ndarray | None        # (H + rank,) confidence projection, or None without a head
    conf_b: float
    hparams: object                  # the draft layers' HParams (heads, head dim, ffn, rope, eps)
    block_size: int
    markov_rank: int
    mask_token_id: int
    target_layers: tuple[int, ...]   # DeepSpec numbering: raw output of layer l; -1 = embedding
    source: str = ""
    #: an architecture whose draft is not dense llama/qwen3 layers (deepseek4: DeepSeek V4
    #: stages) brings its own: backbone(target, weights) -> an object with ``add_context(feats,
    #: start)``, ``clear()``, ``block(anchor)`` -> (confidence input, normed) or None, ``cache``
    backbone: object = None
    hc_head: object = None           # deepseek4: the final stage's hyper-connection head


#: largest (V x V) float32 Markov table kept in memory (vocabularies up to 4096 tokens)
MARKOV_TABLE_BYTES = 64 << 20


def _sigmoid(v: float) -> float:
    return 1.0 / (1.0 + np.exp(-v)) if v >= 0 else np.exp(v) / (1.0 + np.exp(v))


class DSparkDrafter(Drafter):
    name = "dspark"

    def __init__(self, target, weights: DSparkWeights, block_size: int | None = None,
                 confidence: float = 0.0):
        B = weights.block_size
        block = B if block_size is None else int(block_size)
        if not 1 <= block <= B:
            raise ValueError(f"--dspark-block-size {block}: must be in 1..{B} (the trained block)")
        if not 0.0 <= confidence <= 1.0:
            raise ValueError(f"--dspark-confidence {confidence}: must be in 0..1")
        if confidence > 0 and weights.conf_w is None:
            raise ValueError("--dspark-confidence needs a confidence head, and this draft has none")
        self.t = target
        self.w = weights
        # the block (fc, its layers, norms) runs on the target's device; the Markov and
        # confidence heads, a row per draft, on the host from ``w``
        ops = self.ops = target.ops
        self.dev = replace(weights, fc=ops.place_weights(weights.fc),
                           hidden_norm=ops.place_weights(weights.hidden_norm),
                           layers=ops.place_weights(weights.layers),
                           norm=ops.place_weights(weights.norm))
        self.hp = weights.hparams
        self.block = block
        self.threshold = float(confidence)
        self.hidden_layers = tuple(sorted({l for l in weights.target_layers if l >= 0}))
        self.bb = None if weights.backbone is None else weights.backbone(target, weights)
        V = target.hp.n_vocab
        self.markov_table = None
        if V * V * 4 <= MARKOV_TABLE_BYTES:
            w1 = weights.markov_w1.dequantize()                      # (V, rank)
            w2 = weights.markov_w2.dequantize()                      # (V, rank)
            self.markov_table = np.ascontiguousarray(w1 @ w2.T, np.float32)  # [prev, token]
        if self.bb is not None:
            self.cache = self.bb.cache
            return
        hp = self.hp
        self.cache = target.new_cache(n_layer=len(weights.layers))
        cos, sin = kernels.rope_tables(target.n_ctx, hp.n_rot, hp.rope_freq_base,
                                       freq_scale=hp.rope_freq_scale, yarn=hp.yarn)
        self.rope = (ops.asarray(cos), ops.asarray(sin))
        self.rows = max(B, target.chunk)
        self.ws = Workspace(hp, self.rows, ops)
        self.n_ctx_rows = 0
        # (the Markov table above: the bias W2 . W1[prev] depends only on the previous token,
        # so for a small vocabulary the whole (V, V) table (the demo's: 16 MB) is kept and its
        # rows looked up, instead of a (V x rank) matrix-vector product per drafted position)

    # --- context rows ---------------------------------------------------------------------------

    def _features(self, hidden: dict, tokens, rows: int) -> np.ndarray:
        """The draft's input features for the first ``rows`` rows of a target forward (numpy)."""
        parts = []
        for l in self.w.target_layers:
            parts.append(self.ops.to_host(self.t.embed(np.asarray(tokens[:rows], np.int64)))
                         if l < 0 else hidden[l][:rows])
        return np.ascontiguousarray(np.concatenate(parts, axis=1), np.float32)

    def _add_context(self, feats: np.ndarray, start: int) -> None:
        """Context K/V rows for positions start.. from target features (k, n_targets * H)."""
        hp, w, ops = self.hp, self.dev, self.ops
        for c0 in range(0, feats.shape[0], self.rows):
            f = ops.asarray(feats[c0:c0 + self.rows])
            n = f.shape[0]
            ctx = ops.empty((n, hp.n_embd))
            w.fc.matmul(f, ctx)
            ops.rmsnorm(ctx, w.hidden_norm, hp.rms_eps, ctx)
            positions = ops.asarray(np.arange(start + c0, start + c0 + n, dtype=np.int64))
            k = self.ws.k[:n]
            v = self.ws.v[:n]
            for j, lw in enumerate(w.layers):
                lw.wk.matmul(ctx, k.reshape(n, hp.n_kv))
                lw.wv.matmul(ctx, v.reshape(n, hp.n_kv))
                if lw.bk is not None:
                    ops.add_bias(k.reshape(n, hp.n_kv), lw.bk)
                if lw.bv is not None:
                    ops.add_bias(v.reshape(n, hp.n_kv), lw.bv)
                if lw.k_norm is not None:
                    k2 = k.reshape(n * hp.n_head_kv, hp.head_dim)
                    ops.rmsnorm(k2, lw.k_norm, hp.rms_eps, k2)
                ops.rope(k, positions, self.rope[0], self.rope[1], hp.rope_type == "neox")
                self.cache.store(j, k, v, positions)
        self.n_ctx_rows = start + feats.shape[0]
        self.cache.length = self.n_ctx_rows

    def start(self, prompt, prefill) -> None:
        if self.bb is not None:
            self.bb.clear()
            self.bb.add_context(self._features(prefill.hidden, prompt, len(prompt)), 0)
            return
        self.cache.clear()
        self._add_context(self._features(prefill.hidden, prompt, len(prompt)), 0)

    def commit(self, anchor, proposal, n_accepted, verify) -> None:
        tokens = [int(anchor)] + [int(t) for t in proposal.tokens[:n_accepted]]
        if self.bb is not None:
            self.bb.add_context(self._features(verify.hidden, tokens, n_accepted + 1),
                                self.bb.n_ctx_rows)
            return
        self._add_context(self._features(verify.hidden, tokens, n_accepted + 1), self.n_ctx_rows)

    # --- the block ------------------------------------------------------------------------------

    def _block(self, anchor: int):
        """Normed slot outputs h (B, H) for [anchor, mask x (B-1)], on the target's device."""
        hp, w, ops, B = self.hp, self.dev, self.ops, self.w.block_size
        a = self.n_ctx_rows
        if a + B > self.cache.n_ctx:
            return None
        x = self.t.embed(np.asarray([anchor] + [w.mask_token_id] * (B - 1), np.int64))
        positions = ops.asarray(np.arange(a, a + B, dtype=np.int64))
        limits = ops.asarray(np.full(B, a + B, np.int64))  # every context row before a, the whole block
        for j, lw in enumerate(w.layers):
            layer_forward(x, lw, hp, self.cache, j, positions, limits, self.rope, self.ws)
        self.cache.length = a  # drop the block's rows: only context rows persist
        h = ops.empty(x.shape)
        ops.rmsnorm(x, w.norm, hp.rms_eps, h)
        return h

    def _base_logits(self, h) -> np.ndarray:
        """U (n, V), numpy: the target's lm_head on the slot outputs that may be proposed."""
        logits = self.ops.empty((h.shape[0], self.t.hp.n_vocab))
        self.t.weights.output.matmul(h, logits)
        return self.ops.to_host(logits)

    def propose(self, anchor, max_tokens, sampler, rng) -> Proposal:
        n = min(self.block, max_tokens)
        if self.bb is not None:
            out = self.bb.block(int(anchor))
            h, h_out = (None, None) if out is None else out  # confidence input, normed rows
        else:
            h = h_out = self._block(int(anchor))
        if h is None:  # no room in the context for a block: decode without drafts
            return Proposal()
        if self.w.conf_w is not None:
            h = self.ops.to_host(h)  # the confidence head's input, on the host
        # The lm_head is the draft's largest matrix: it runs once, on the n slots that can be
        # proposed (not the whole block), and not at all when the first slot is cut.
        U = None
        w = self.w
        prev = int(anchor)
        drafts, qs, confs, cut = [], [], [], False
        bias = np.empty((1, self.t.hp.n_vocab), np.float32)
        for k in range(n):
            m = w.markov_w1.rows(np.array([prev], np.int64))       # (1, rank)
            if w.conf_w is not None:
                feat = np.concatenate([h[k], m[0]]).astype(np.float64)
                c = _sigmoid(float(feat @ w.conf_w) + w.conf_b)
                confs.append(c)
                if self.threshold > 0 and c < self.threshold:
                    cut = True
                    break
            if U is None:
                U = self._base_logits(self.ops.asarray(h_out[:n]))
            if self.markov_table is not None:
                z = U[k] + self.markov_table[prev]
            else:
                w.markov_w2.matmul(m, bias)
                z = U[k] + bias[0]
            if sampler.greedy:
                d = int(np.argmax(z))
            else:
                q = sampler.distribution(z)
                d = draw(q, rng)
                qs.append(q)
            drafts.append(d)
            prev = d
        return Proposal(drafts, np.stack(qs) if qs else None,
                        np.asarray(confs) if confs else None, cut)

    def describe(self) -> str:
        w = self.w
        layers = ",".join(str(l) for l in w.target_layers)
        return (f"mtp/dspark: stages={len(w.layers)} block={w.block_size} "
                f"markov_rank={w.markov_rank} noise_token={w.mask_token_id} "
                f"target_layers={layers}" + (f" ({w.source})" if w.source else "")
                + (f"; proposing up to {self.block}" if self.block != w.block_size else "")
                + (f", confidence cut {self.threshold:g}" if self.threshold > 0 else ""))
