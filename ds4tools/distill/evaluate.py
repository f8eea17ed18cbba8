"""Measure a written draft with the engine: its own drafters (``DSparkDrafter``, ``MtpHead``)
loaded from the GGUF as ``ds4tools run`` loads them, against prompt lookup. Torch-free.

- ``heldout_dspark``: the demo's protocol on held-out text (ds4tools/data/demo/README.md): anchors
  every few tokens of held-out segments; at each, the draft's greedy block (Markov chain, no
  confidence cut; and the cut at 0.5 from the same confidences) and prompt lookup's block
  against the target's own greedy continuation from the anchor (a rollout); tau = 1 + the
  accepted prefix.
- ``heldout_mtp``: two-ahead agreement, teacher-forced on held-out segments: the head's top-1
  for row i (h_i, t_(i+1)) against the target's greedy token after t_(i+1), and prompt
  lookup's first draft against the same token.
- ``prompts``: speculative decoding of prompts (greedy and T = 1) with the draft and with prompt
  lookup: tau from the loop's statistics, and whether the greedy output equals plain decoding.
"""
from __future__ import annotations

import sys

import numpy as np
from tqdm import tqdm

__all__ = ["tau_stats", "heldout_segments", "heldout_dspark", "heldout_mtp", "prompts_eval",
           "load_drafter", "CONF_CUT"]

CONF_CUT = 0.5


def tau_stats(accepted, block: int) -> dict:
    accepted = np.asarray(accepted, np.int64)
    n = len(accepted)
    if n == 0:
        return {"n": 0, "tau": None}
    at_least = [float((accepted >= k).mean()) for k in range(1, block + 1)]
    return {
        "n": int(n),
        "tau": round(float(1 + accepted.mean()), 4),
        "tau_stderr": round(float(accepted.std(ddof=1) / np.sqrt(n)), 4) if n > 1 else None,
        "p_accepted_at_least": [round(v, 4) for v in at_least],
        "histogram": np.bincount(accepted, minlength=block + 1).tolist(),
    }


def heldout_segments(heldout: np.ndarray, seq_len: int, min_len: int = 16) -> list[np.ndarray]:
    segs = [heldout[s:s + seq_len] for s in range(0, len(heldout), seq_len)]
    return [np.asarray(s, np.int64) for s in segs if len(s) >= min_len]


def load_drafter(target, path: str, kind: str, depth: int = 3):
    """The engine's drafter for the support file ``path`` (validated against the target as
    ``ds4tools run`` validates it)."""
    from ..engine.speculative.dspark import DSparkDrafter
    from ..engine.speculative.load import open_support_for
    from ..engine.speculative.mtp import MtpDrafter
    eng = target.engine
    int8 = "none" if eng.exact else eng.int8_mode
    got, weights = open_support_for(path, target.path, eng.hparams, int8)
    if got != kind:
        raise RuntimeError(f"{path} loads as {got}, not {kind}")
    if kind == "dspark":
        return DSparkDrafter(eng.model, weights)
    return MtpDrafter(eng.model, weights, depth)


def _greedy():
    from ..engine.sampling import Sampler
    return Sampler(0.0, 0, 1.0, 0.0)


def _prefix(a, b) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if int(a[i]) != int(b[i]):
            return i
    return n


def heldout_dspark(target, draft_path: str, segments, block: int, max_anchors: int,
                   progress=None) -> dict:
    from ..engine.speculative.drafter import Proposal
    from ..engine.speculative.lookup import PromptLookupDrafter
    model = target.engine.model
    drafter = load_drafter(target, draft_path, "dspark")
    lookup = PromptLookupDrafter(block)
    greedy, rng = _greedy(), np.random.default_rng(0)
    layers = drafter.hidden_layers
    plans = []
    for seg in segments:
        a0 = max(1, min(32, len(seg) // 4))
        plans.append((seg, a0, len(seg) - a0))
    total = sum(p[2] for p in plans)
    stride = max(1, -(-total // max_anchors))
    out = {"draft": [], "draft_cut": [], "lookup": [], "proposed_cut": []}
    match = np.zeros(block)
    n_anchor = sum(len(range(a0, len(seg), stride)) for seg, a0, _ in plans)
    bar = tqdm(total=n_anchor, desc="evaluate held-out", unit="anchor", file=sys.stderr,
               disable=None if progress is None else not progress, leave=False)
    with model.threads():
        for seg, a0, _ in plans:
            anchors = list(range(a0, len(seg), stride))
            if not anchors or anchors[-1] + block + 1 > model.n_ctx:
                anchors = [a for a in anchors if a + block + 1 <= model.n_ctx]
                if not anchors:
                    continue
            pre = model.forward(seg[:anchors[0]], 0, hidden_layers=layers, logits="none")
            drafter.start([int(t) for t in seg[:anchors[0]]], pre)
            lookup.start([int(t) for t in seg[:anchors[0]]], None)
            for j, a in enumerate(anchors):
                anchor = int(seg[a])
                prop = drafter.propose(anchor, block, greedy, rng)
                lk = lookup.propose(anchor, block, greedy, rng)
                ref, tok = [], anchor
                for k in range(block):  # the target's greedy continuation from the anchor
                    lg = model.forward([tok], a + k, logits="last").logits[-1]
                    tok = int(np.argmax(lg))
                    ref.append(tok)
                acc = _prefix(prop.tokens, ref)
                conf = prop.confidence if prop.confidence is not None else np.ones(len(prop.tokens))
                low = np.flatnonzero(np.asarray(conf) < CONF_CUT)
                n_cut = int(low[0]) if len(low) else len(prop.tokens)
                out["draft"].append(acc)
                out["draft_cut"].append(min(acc, n_cut))
                out["proposed_cut"].append(n_cut)
                out["lookup"].append(_prefix(lk.tokens, ref))
                d = np.asarray(prop.tokens[:block] + [-1] * (block - len(prop.tokens)))
                match += d == np.asarray(ref)
                if j + 1 < len(anchors):
                    nxt = anchors[j + 1]
                    res = model.forward(seg[a:nxt], a, hidden_layers=layers, logits="none")
                    between = Proposal([int(t) for t in seg[a + 1:nxt]])
                    drafter.commit(anchor, between, nxt - a - 1, res)
                    lookup.commit(anchor, between, nxt - a - 1, None)
                bar.update(1)
    bar.close()
    n = len(out["draft"])
    return {
        "protocol": (f"held-out text, {len(plans)} segments, an anchor every {stride} tokens from "
                     f"position min(32, len/4); reference: the target's greedy {block} tokens "
                     f"from the anchor"),
        "block": block,
        "dspark": tau_stats(out["draft"], block),
        f"dspark_conf_cut_{CONF_CUT}": tau_stats(out["draft_cut"], block),
        f"mean_proposal_conf_cut_{CONF_CUT}": round(float(np.mean(out["proposed_cut"])), 3) if n else None,
        "prompt_lookup": tau_stats(out["lookup"], block),
        "dspark_raw_match_per_position": [round(float(v) / max(1, n), 4) for v in match],
    }


def heldout_mtp(target, head_path: str, segments, progress=None) -> dict:
    from ..engine.speculative.drafter import Proposal
    from ..engine.speculative.lookup import PromptLookupDrafter
    from ..engine.speculative.mtp import MtpHead
    model = target.engine.model
    drafter = load_drafter(target, head_path, "mtp")
    head = MtpHead(model, drafter.mtp.w)
    greedy, rng = _greedy(), np.random.default_rng(0)
    agree = rows = lk_agree = real = 0
    with model.threads():
        for seg in tqdm(segments, desc="evaluate held-out", unit="segment", file=sys.stderr,
                        disable=None if progress is None else not progress, leave=False):
            t = len(seg)
            res = model.forward(seg, 0, want_final_hidden=True, logits="all")
            top = np.argmax(res.logits, axis=1)
            head.cache.clear()
            y = head.run(res.final_hidden[:-1], seg[1:], 0)
            _, lg = head.head(y)
            mtp_top = np.argmax(lg, axis=1)              # row i predicts t_(i+2)
            agree += int((mtp_top == top[1:]).sum())
            real += int((mtp_top[:t - 2] == seg[2:]).sum())
            rows += t - 1
            lookup = PromptLookupDrafter(1)
            lookup.start([int(seg[0])], None)
            for i in range(t - 1):                       # anchor t_(i+1), context t_0..t_i
                anchor = int(seg[i + 1])
                d = lookup.propose(anchor, 1, greedy, rng).tokens
                lk_agree += int(bool(d) and d[0] == int(top[i + 1]))
                lookup.commit(anchor, Proposal([]), 0, None)
    return {
        "protocol": f"held-out text, {len(segments)} segments, every row, teacher-forced",
        "rows": rows,
        "mtp_two_ahead_agreement": round(agree / max(1, rows), 4),
        "prompt_lookup_first_draft_agreement": round(lk_agree / max(1, rows), 4),
        "mtp_top1_vs_real_token_two_ahead": round(real / max(1, rows - len(segments)), 4),
    }


def prompts_eval(target, draft_path: str, kind: str, prompts, n_tokens: int, block: int,
                 seed: int, progress=None) -> dict:
    """Speculative decoding of ``prompts`` (token id lists) with the draft and with prompt
    lookup, greedy and at T = 1 (no top-k/p, min-p)."""
    from ..engine.generate import decode
    from ..engine.sampling import Sampler
    from ..engine.speculative import SpecStats, speculative_decode
    from ..engine.speculative.lookup import PromptLookupDrafter
    model = target.engine.model
    eog = target.tokenizer.eog_ids
    depth = block if kind == "dspark" else 3
    result = {"prompts": len(prompts), "tokens_per_prompt": n_tokens,
              "draft": kind + (f" block {block}" if kind == "dspark" else f", draft depth {depth}"),
              "prompt_lookup": f"up to {depth} tokens"}
    identical = True
    drafters = {"draft": load_drafter(target, draft_path, kind, depth),
                "lookup": PromptLookupDrafter(depth)}
    bar = tqdm(total=len(prompts) * 5, desc="evaluate prompts", unit="run", file=sys.stderr,
               disable=None if progress is None else not progress, leave=False)
    for temp in (0.0, 1.0):
        sampler = Sampler(temp, 0, 1.0, 0.0)
        stats = {"draft": SpecStats(method=kind), "lookup": SpecStats(method="lookup")}
        for i, prompt in enumerate(prompts):
            prompt = [int(t) for t in prompt][: max(1, model.n_ctx - n_tokens - 1)]
            plain = None
            if temp == 0.0:
                plain = list(decode(model, prompt, n_tokens, sampler, np.random.default_rng(0), eog))
                bar.update(1)
            for name in ("draft", "lookup"):
                spec = SpecStats(method=name)
                toks = list(speculative_decode(model, drafters[name], prompt, n_tokens, sampler,
                                               np.random.default_rng([seed, 9, i]), eog,
                                               spec=spec, calibrate=False))
                stats[name].merge(spec)
                if plain is not None and toks != plain:
                    identical = False
                bar.update(1)
        key = "greedy" if temp == 0.0 else "t1"
        result[key] = {name: {"tau": round(s.tau, 4), "steps": s.steps, "accepted": s.accepted,
                              "drafted": s.drafted} for name, s in stats.items()}
    bar.close()
    result["greedy_identical_to_plain"] = identical
    return result
