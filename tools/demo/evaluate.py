"""Stage 6: measure the shipped (f16-rounded) weights in fp32: losses, MTP agreement, DSpark tau.

tau is the mean number of tokens one verify step commits: accepted drafts + 1 (the bonus or
correction token). Acceptance is greedy: a draft token is accepted while it equals the target's
greedy token at that position.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .common import Log, Plan, Timer, adapt_threads, write_json
from .model import DraftShape, DSparkDraft, Qwen3Target, TargetShape
from .rollout import pick, rollout
from .dspark_draft import block_forward, propose
from .train_target import sequence_loss

CONF_CUT = 0.5
LOOKUP_NGRAMS = (3, 2, 1)


def lookup_propose(seq: np.ndarray, block: int) -> np.ndarray:
    """Prompt lookup: copy what followed the last earlier match of the final 3-, 2- or 1-gram.

    The copy may run into the tokens it proposes (as an LZ77 match does), so a loop of period p < block
    still yields a full block.
    """
    for n in LOOKUP_NGRAMS:
        if len(seq) <= n:
            continue
        windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)  # ends at 0..len-2
        hits = np.flatnonzero((windows == seq[-n:]).all(axis=1))
        if len(hits):
            end = hits[-1] + n  # index just past the match, <= len(seq) - 1
            ext = list(seq)
            for j in range(block):
                ext.append(ext[end + j])
            return np.array(ext[len(seq):], dtype=seq.dtype)
    return seq[:0]


def prefix_match(proposal: np.ndarray, reference: np.ndarray) -> int:
    n = min(len(proposal), len(reference))
    neq = np.flatnonzero(proposal[:n] != reference[:n])
    return int(neq[0]) if len(neq) else n


def tau_stats(accepted: np.ndarray, block: int) -> dict:
    accepted = np.asarray(accepted)
    at_least = [float((accepted >= k).mean()) for k in range(1, block + 1)]
    conditional = []
    for k in range(1, block + 1):
        reached = (accepted >= k - 1).sum()
        conditional.append(float((accepted >= k).sum() / reached) if reached else None)
    return {
        "n": int(len(accepted)),
        "tau": round(float(1 + accepted.mean()), 4),
        "tau_stderr": round(float(accepted.std(ddof=1) / np.sqrt(len(accepted))), 4) if len(accepted) > 1 else None,
        "p_accepted_at_least": [round(v, 4) for v in at_least],
        "conditional_acceptance": [None if v is None else round(v, 4) for v in conditional],
        "histogram": np.bincount(accepted, minlength=block + 1).tolist(),
    }


@torch.no_grad()
def measure_blocks(target, draft, ids: torch.Tensor, anchors: torch.Tensor, block: int) -> dict:
    """Draft (no cut / cut), prompt-lookup and raw per-position match for anchors in one sequence."""
    ro = rollout(target, ids, anchors, block, torch.zeros(anchors.shape, dtype=torch.float32),
                 capture=tuple(draft.dshape.target_layer_ids))
    feats = torch.cat([ro.features[i] for i in draft.dshape.target_layer_ids], dim=-1)
    hid, anchor_tok = block_forward(draft, target, feats, ids, anchors)
    drafts, confs = propose(draft, target, hid, anchor_tok)
    ref = ro.tokens[0].numpy()
    drafts, confs = drafts[0].numpy(), confs[0].numpy()
    seq = ids[0].numpy()
    out = {"draft": [], "draft_cut": [], "lookup": [], "raw_match": [], "proposal_cut": []}
    for r, a in enumerate(anchors[0].tolist()):
        acc = prefix_match(drafts[r], ref[r])
        low = np.flatnonzero(confs[r] < CONF_CUT)
        n_prop = int(low[0]) if len(low) else block
        out["draft"].append(acc)
        out["draft_cut"].append(min(acc, n_prop))
        out["proposal_cut"].append(n_prop)
        out["lookup"].append(prefix_match(lookup_propose(seq[:a + 1], block), ref[r]))
        out["raw_match"].append(drafts[r] == ref[r])
    return out


def merge(parts: list[dict]) -> dict:
    return {k: [x for p in parts for x in p[k]] for k in parts[0]}


def summarize(m: dict, block: int) -> dict:
    return {
        "dspark": tau_stats(np.array(m["draft"]), block),
        "dspark_conf_cut_0.5": tau_stats(np.array(m["draft_cut"]), block),
        "mean_proposal_len_conf_cut_0.5": round(float(np.mean(m["proposal_cut"])), 3),
        "prompt_lookup": tau_stats(np.array(m["lookup"]), block),
        "dspark_raw_match_per_position": [round(float(v), 4) for v in np.mean(m["raw_match"], axis=0)],
    }


@torch.no_grad()
def mtp_agreement(target: Qwen3Target, seq: np.ndarray, first_row: int) -> tuple[int, int, int]:
    """MTP row i (h_i, t_{i+1}) argmax vs the target's argmax at i+1, rows i >= first_row.

    Returns (agreements, rows, matches of the real token t_{i+2})."""
    ids = torch.from_numpy(seq.astype(np.int64))[None]
    h, _ = target(ids)
    mtp_top = target.lm_head(target.mtp_hidden(h, ids)).argmax(-1)[0]  # rows 0..T-2
    target_next = target.lm_head(h[:, 1:]).argmax(-1)[0]
    rows = slice(first_row, ids.shape[1] - 1)
    agree = int((mtp_top[rows] == target_next[rows]).sum())
    real = int((mtp_top[first_row:ids.shape[1] - 2] == ids[0, first_row + 2:]).sum())
    return agree, max(0, ids.shape[1] - 1 - first_row), real


@torch.no_grad()
def generate(target: Qwen3Target, prompt: np.ndarray, n: int, temperature: float, generator) -> np.ndarray:
    ids = torch.from_numpy(prompt.astype(np.int64))[None]
    h, _, kvs = target.prefill_kv(ids)
    caches = [list(kv) for kv in kvs]
    temp = torch.tensor([temperature])
    out = list(prompt)
    tok = pick(target.lm_head(h[:, -1]), temp, generator)
    for _ in range(n):
        out.append(int(tok))
        if len(out) >= target.shape.max_position_embeddings:
            break
        pos = torch.tensor([[len(out) - 1]])
        h, _, new_kv = target.forward_cached(tok.view(1, 1), pos, [tuple(c) for c in caches], None)
        for layer, (k, v) in enumerate(new_kv):
            caches[layer][0] = torch.cat([caches[layer][0], k], 2)
            caches[layer][1] = torch.cat([caches[layer][1], v], 2)
        tok = pick(target.lm_head(h[:, -1]), temp, generator)
    return np.array(out, dtype=np.int64)


def load_shipped(work: Path):
    target = Qwen3Target(TargetShape())
    target.load_state_dict(torch.load(work / "target_shipped.pt"))
    target.eval()
    draft = DSparkDraft(TargetShape(), DraftShape())
    draft.load_state_dict(torch.load(work / "dspark_shipped.pt"))
    draft.eval()
    return target, draft


def evaluate(plan: Plan, work: Path, log: Log, prompts: list[np.ndarray]) -> dict:
    timer = Timer()
    target, draft = load_shipped(work)
    block = draft.dshape.block_size
    heldout = list(np.load(work / "heldout_tokens.npz").values())
    results: dict = {}

    loss, count = sequence_loss(target, heldout, 512)
    results["target_heldout_loss"] = round(loss, 4)
    results["target_heldout_tokens"] = count
    log(f"eval: held-out loss {loss:.4f} (shipped f16 weights)")

    # MTP on held-out text (teacher-forced).
    agree = rows = real = 0
    for arr in heldout:
        for s in range(0, len(arr) - 2, plan.eval_segment):
            seg = arr[s:s + plan.eval_segment + 1]
            if len(seg) < 3:
                continue
            a_, r_, x_ = mtp_agreement(target, seg, 0)
            agree, rows, real = agree + a_, rows + r_, real + x_
    results["mtp_heldout"] = {"agreement_with_target_two_ahead": round(agree / rows, 4), "rows": rows,
                              "top1_vs_real_token_two_ahead": round(real / max(1, rows - 1), 4)}
    log(f"eval: MTP two-ahead agreement on held-out text {agree / rows:.4f} over {rows} rows")

    # DSpark on held-out text, anchors every eval_anchor_stride positions from position 32.
    parts = []
    for arr in heldout:
        for s in range(0, len(arr), plan.eval_segment):
            seg = arr[s:s + plan.eval_segment]
            anchors = np.arange(min(32, plan.eval_segment // 4), len(seg), plan.eval_anchor_stride)
            if len(anchors) == 0:
                continue
            ids = torch.from_numpy(seg.astype(np.int64))[None]
            adapt_threads()
            parts.append(measure_blocks(target, draft, ids, torch.from_numpy(anchors)[None], block))
    results["heldout_text"] = summarize(merge(parts), block)
    log(f"eval: held-out text tau dspark {results['heldout_text']['dspark']['tau']:.3f} "
        f"(cut {results['heldout_text']['dspark_conf_cut_0.5']['tau']:.3f}) "
        f"lookup {results['heldout_text']['prompt_lookup']['tau']:.3f} "
        f"n={results['heldout_text']['dspark']['n']}")

    # The target's own generations from the held-out prompts.
    gen = torch.Generator().manual_seed(plan.seed + 5)
    for name, temperature in (("generated_greedy", 0.0), ("generated_t1", 1.0)):
        parts, agree = [], [0, 0]
        for prompt in prompts:
            adapt_threads()
            seq = generate(target, prompt, plan.eval_gen_tokens, temperature, gen)
            anchors = np.arange(len(prompt) - 1, len(seq))
            ids = torch.from_numpy(seq)[None]
            parts.append(measure_blocks(target, draft, ids, torch.from_numpy(anchors)[None], block))
            a_, r_, _ = mtp_agreement(target, seq, len(prompt) - 1)
            agree[0] += a_
            agree[1] += r_
        results[name] = summarize(merge(parts), block)
        results[name]["mtp_agreement_two_ahead"] = round(agree[0] / agree[1], 4)
        log(f"eval: {name} tau dspark {results[name]['dspark']['tau']:.3f} "
            f"(cut {results[name]['dspark_conf_cut_0.5']['tau']:.3f}) "
            f"lookup {results[name]['prompt_lookup']['tau']:.3f} mtp {agree[0] / agree[1]:.3f}")
    results["wall_s"] = round(timer.lap(), 1)
    write_json(work / "eval_metrics.json", results)
    return results
