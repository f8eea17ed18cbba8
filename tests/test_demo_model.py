"""The bundled demo model (ds4tools/data/demo), checked without torch.

Files, size budget, configs, tensor names/shapes/dtypes, tokenizer, prompts and card; then a plain
numpy implementation of the card's "Architecture" section (target, NextN/MTP layer, DSpark block)
is checked against the torch reference outputs shipped in reference.json.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file
from tokenizers import Tokenizer

import ds4tools

DEMO = Path(ds4tools.__file__).parent / "data" / "demo"
BUDGET_BYTES = 12_000_000
EXPECTED_FILES = {
    "README.md", "metrics.json", "reference.json", "heldout_files.txt", "prompts.json",
    "target/config.json", "target/generation_config.json", "target/model.safetensors",
    "target/tokenizer.json", "target/tokenizer_config.json",
    "dspark/config.json", "dspark/model.safetensors",
}


def _json(rel: str):
    return json.loads((DEMO / rel).read_text())


@pytest.fixture(scope="module")
def tcfg():
    return _json("target/config.json")


@pytest.fixture(scope="module")
def dcfg():
    return _json("dspark/config.json")


@pytest.fixture(scope="module")
def tw():
    return load_file(str(DEMO / "target" / "model.safetensors"))


@pytest.fixture(scope="module")
def dw():
    return load_file(str(DEMO / "dspark" / "model.safetensors"))


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_file(str(DEMO / "target" / "tokenizer.json"))


@pytest.fixture(scope="module")
def reference():
    return _json("reference.json")


def test_directory_holds_exactly_the_demo_files_within_budget():
    files = {p.relative_to(DEMO).as_posix() for p in DEMO.rglob("*") if p.is_file()}
    assert files == EXPECTED_FILES
    total = sum((DEMO / f).stat().st_size for f in files)
    assert total <= BUDGET_BYTES, f"demo directory is {total:,} bytes"


# ---------------------------------------------------------------------------------------------
# configs and tensors


def _layer_shapes(prefix: str, c: dict) -> dict:
    h, d, f = c["hidden_size"], c["head_dim"], c["intermediate_size"]
    nq, nkv = c["num_attention_heads"], c["num_key_value_heads"]
    return {
        f"{prefix}.self_attn.q_proj.weight": (nq * d, h),
        f"{prefix}.self_attn.k_proj.weight": (nkv * d, h),
        f"{prefix}.self_attn.v_proj.weight": (nkv * d, h),
        f"{prefix}.self_attn.o_proj.weight": (h, nq * d),
        f"{prefix}.self_attn.q_norm.weight": (d,),
        f"{prefix}.self_attn.k_norm.weight": (d,),
        f"{prefix}.mlp.gate_proj.weight": (f, h),
        f"{prefix}.mlp.up_proj.weight": (f, h),
        f"{prefix}.mlp.down_proj.weight": (h, f),
        f"{prefix}.input_layernorm.weight": (h,),
        f"{prefix}.post_attention_layernorm.weight": (h,),
    }


def _target_shapes(c: dict) -> dict:
    h, v, n = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"]
    out = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    for i in range(n + c["num_nextn_predict_layers"]):
        out.update(_layer_shapes(f"model.layers.{i}", c))
    for i in range(n, n + c["num_nextn_predict_layers"]):
        out.update({
            f"model.layers.{i}.enorm.weight": (h,),
            f"model.layers.{i}.hnorm.weight": (h,),
            f"model.layers.{i}.eh_proj.weight": (h, 2 * h),
            f"model.layers.{i}.shared_head.norm.weight": (h,),
        })
    return out


def _dspark_shapes(c: dict) -> dict:
    h, v, r = c["hidden_size"], c["vocab_size"], c["markov_rank"]
    out = {
        "fc.weight": (h, len(c["target_layer_ids"]) * h),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
        "markov_head.markov_w1.weight": (v, r),
        "markov_head.markov_w2.weight": (v, r),
        "confidence_head.proj.weight": (1, h + r),
        "confidence_head.proj.bias": (1,),
    }
    for i in range(c["num_hidden_layers"]):
        out.update(_layer_shapes(f"layers.{i}", c))
    return out


def test_target_config_is_a_qwen3_with_one_nextn_layer(tcfg):
    assert tcfg["architectures"] == ["Qwen3ForCausalLM"] and tcfg["model_type"] == "qwen3"
    assert tcfg["num_nextn_predict_layers"] == 1
    assert 192 <= tcfg["hidden_size"] <= 256 and 4 <= tcfg["num_hidden_layers"] <= 6
    assert tcfg["head_dim"] == 64
    assert tcfg["num_key_value_heads"] < tcfg["num_attention_heads"]  # GQA
    assert tcfg["num_attention_heads"] % tcfg["num_key_value_heads"] == 0
    assert tcfg["hidden_act"] == "silu" and tcfg["attention_bias"] is False
    assert tcfg["rope_theta"] == 10000 and tcfg["rope_scaling"] is None
    assert tcfg["tie_word_embeddings"] is False
    assert tcfg["max_position_embeddings"] >= 1024
    assert tcfg["vocab_size"] == 2048 and tcfg["rms_norm_eps"] == 1e-6


def test_target_tensors_match_the_config(tcfg, tw):
    expected = _target_shapes(tcfg)
    assert set(tw) == set(expected)
    for name, shape in expected.items():
        assert tw[name].shape == shape, name
        assert tw[name].dtype == np.float16, name
        assert np.isfinite(tw[name]).all(), name
    params = sum(int(np.prod(s)) for s in expected.values())
    assert 2_000_000 <= params <= 6_000_000
    # trained, not freshly initialised: norms moved away from 1, the MTP layer differs from its source
    n = tcfg["num_hidden_layers"]
    assert not np.all(tw["model.norm.weight"] == 1)
    assert not np.array_equal(tw[f"model.layers.{n}.mlp.up_proj.weight"],
                              tw[f"model.layers.{n - 1}.mlp.up_proj.weight"])


def test_dspark_config_follows_deepspec(dcfg, tcfg, tok):
    assert dcfg["architectures"] == ["Qwen3DSparkModel"]
    assert dcfg["block_size"] == 8
    assert dcfg["num_hidden_layers"] == 2 and dcfg["layer_types"] == ["full_attention"] * 2
    assert dcfg["num_target_layers"] == tcfg["num_hidden_layers"]
    ids = dcfg["target_layer_ids"]
    assert len(ids) == 3 and ids == sorted(set(ids))
    # raw layer outputs llama.cpp can hand a draft: the inputs of layers 0..n-1, so never the
    # last layer's output (ds4tools distill's default on 6 layers: 1, 3, 4)
    assert all(0 <= i <= tcfg["num_hidden_layers"] - 2 for i in ids)
    assert ids == [1, 3, 4]
    assert dcfg["mask_token_id"] == tok.token_to_id("<|mask|>")
    assert dcfg["markov_rank"] == 64 and dcfg["markov_head_type"] == "vanilla"
    assert dcfg["enable_confidence_head"] is True and dcfg["confidence_head_with_markov"] is True
    assert dcfg["tie_word_embeddings"] is False and dcfg["num_anchors"] > 0
    for key in ("hidden_size", "head_dim", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "rms_norm_eps", "rope_theta", "vocab_size"):
        assert dcfg[key] == tcfg[key], key


def test_dspark_tensors_match_the_config_and_share_embedding_and_head(dcfg, dw):
    expected = _dspark_shapes(dcfg)
    assert set(dw) == set(expected)  # no embed_tokens / lm_head: those are the target's
    for name, shape in expected.items():
        assert dw[name].shape == shape, name
        assert dw[name].dtype == np.float16, name
        assert np.isfinite(dw[name]).all(), name
    assert np.abs(dw["markov_head.markov_w2.weight"]).max() > 0  # trained from its zero init


def test_tokenizer_and_its_config(tok):
    assert tok.get_vocab_size() == 2048
    assert tok.token_to_id("<|endoftext|>") == 0 and tok.token_to_id("<|mask|>") == 1
    text = "    def __init__(self, name):\n        self.name = name  # é\n"
    ids = tok.encode(text, add_special_tokens=False).ids
    assert tok.decode(ids) == text and len(ids) < len(text.encode()) // 2
    cfg = _json("target/tokenizer_config.json")
    assert cfg["eos_token"] == "<|endoftext|>" and cfg["mask_token"] == "<|mask|>"
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"


def test_prompts_come_from_heldout_files(tok):
    heldout = (DEMO / "heldout_files.txt").read_text().splitlines()
    assert heldout and heldout == sorted(set(heldout))
    assert all(f.endswith(".py") and not f.startswith("/") for f in heldout)
    prompts = _json("prompts.json")
    assert len(prompts) >= 32
    assert len({(p["file"], p["line"]) for p in prompts}) == len(prompts)
    for p in prompts:
        assert p["file"] in heldout
        assert re.match(r"\s*(async\s+)?def\s", p["text"])
        n = len(tok.encode(p["text"], add_special_tokens=False).ids)
        assert n == p["n_tokens"] and 48 <= n <= 96


def test_card_reports_the_measured_figures():
    card = (DEMO / "README.md").read_text()
    m = _json("metrics.json")
    ev = m["eval"]
    for figure in (
        f"{ev['heldout_text']['dspark']['tau']:.3f}",
        f"{ev['heldout_text']['prompt_lookup']['tau']:.3f}",
        f"{ev['generated_t1']['dspark']['tau']:.3f}",
        f"{ev['generated_greedy']['prompt_lookup']['tau']:.3f}",
        f"{ev['mtp_heldout']['agreement_with_target_two_ahead']:.4f}",
        f"{ev['target_heldout_loss']:.4f}",
        m["corpus"]["file_list_sha256"],
    ):
        assert figure in card, figure
    assert "## Architecture" in card and "eh_proj" in card and "markov_w1" in card
    assert m["sizes"]["total_bytes"] <= BUDGET_BYTES


# ---------------------------------------------------------------------------------------------
# numpy re-implementation of the card's Architecture section


class Numpy:
    def __init__(self, tw: dict, dw: dict, tcfg: dict, dcfg: dict):
        self.w = {k: v.astype(np.float32) for k, v in tw.items()}
        self.w.update({"draft." + k: v.astype(np.float32) for k, v in dw.items()})
        self.c, self.dc = tcfg, dcfg

    def rms(self, x, name):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + self.c["rms_norm_eps"]) * self.w[name]

    def rope(self, x, pos):  # x [T, heads, d]
        d = x.shape[-1]
        half = d // 2
        inv = self.c["rope_theta"] ** (-np.arange(half, dtype=np.float64) * 2 / d)
        ang = np.asarray(pos, dtype=np.float64)[:, None] * inv[None]
        cos, sin = np.cos(ang).astype(np.float32)[:, None], np.sin(ang).astype(np.float32)[:, None]
        a, b = x[..., :half], x[..., half:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)

    def attention(self, p, uq, pos_q, ukv, pos_kv, allowed):
        c = self.c
        nq, nkv, d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        q = self.rope(self.rms((uq @ self.w[p + "self_attn.q_proj.weight"].T).reshape(len(uq), nq, d),
                               p + "self_attn.q_norm.weight"), pos_q)
        k = self.rope(self.rms((ukv @ self.w[p + "self_attn.k_proj.weight"].T).reshape(len(ukv), nkv, d),
                               p + "self_attn.k_norm.weight"), pos_kv)
        v = (ukv @ self.w[p + "self_attn.v_proj.weight"].T).reshape(len(ukv), nkv, d)
        heads = []
        for hd in range(nq):
            g = hd // (nq // nkv)
            s = q[:, hd] @ k[:, g].T / np.sqrt(d)
            s = np.where(allowed, s, -np.inf)
            e = np.exp(s - s.max(-1, keepdims=True))
            heads.append((e / e.sum(-1, keepdims=True)) @ v[:, g])
        return np.concatenate(heads, axis=-1) @ self.w[p + "self_attn.o_proj.weight"].T

    def mlp(self, p, x):
        u = self.rms(x, p + "post_attention_layernorm.weight")
        gate = u @ self.w[p + "mlp.gate_proj.weight"].T
        up = u @ self.w[p + "mlp.up_proj.weight"].T
        return (gate / (1 + np.exp(-gate)) * up) @ self.w[p + "mlp.down_proj.weight"].T

    def causal_layer(self, p, x):
        n = len(x)
        u = self.rms(x, p + "input_layernorm.weight")
        x = x + self.attention(p, u, np.arange(n), u, np.arange(n), np.tri(n, dtype=bool))
        return x + self.mlp(p, x)

    def target(self, ids):
        x = self.w["model.embed_tokens.weight"][ids]
        raw = []
        for i in range(self.c["num_hidden_layers"]):
            x = self.causal_layer(f"model.layers.{i}.", x)
            raw.append(x)
        return self.rms(x, "model.norm.weight"), raw

    def logits(self, h):
        return h @ self.w["lm_head.weight"].T

    def mtp(self, h, ids):
        p = f"model.layers.{self.c['num_hidden_layers']}."
        e = self.rms(self.w["model.embed_tokens.weight"][ids[1:]], p + "enorm.weight")
        m = np.concatenate([e, self.rms(h[:-1], p + "hnorm.weight")], -1) @ self.w[p + "eh_proj.weight"].T
        return self.rms(self.causal_layer(p, m), p + "shared_head.norm.weight")

    def dspark_block(self, raw, anchor_pos, anchor_tok):
        dc, a = self.dc, anchor_pos
        bs = dc["block_size"]
        feats = np.concatenate([raw[i][:a] for i in dc["target_layer_ids"]], -1)
        ctx = self.rms(feats @ self.w["draft.fc.weight"].T, "draft.hidden_norm.weight")
        x = self.w["model.embed_tokens.weight"][[anchor_tok] + [dc["mask_token_id"]] * (bs - 1)]
        pos_b = a + np.arange(bs)
        allowed = np.ones((bs, a + bs), dtype=bool)  # every context row is < a; block bidirectional
        for i in range(dc["num_hidden_layers"]):
            p = f"draft.layers.{i}."
            u = self.rms(x, p + "input_layernorm.weight")
            kv_rows = np.concatenate([ctx, u])  # context rows enter without input_layernorm
            x = x + self.attention(p, u, pos_b, kv_rows, np.concatenate([np.arange(a), pos_b]), allowed)
            x = x + self.mlp(p, x)
        hid = self.rms(x, "draft.norm.weight")
        base = self.logits(hid)
        w1, w2 = self.w["draft.markov_head.markov_w1.weight"], self.w["draft.markov_head.markov_w2.weight"]
        cw, cb = self.w["draft.confidence_head.proj.weight"][0], self.w["draft.confidence_head.proj.bias"][0]
        prev, drafts, confs = anchor_tok, [], []
        for k in range(bs):
            z = base[k] + w2 @ w1[prev]
            confs.append(1 / (1 + np.exp(-(cw @ np.concatenate([hid[k], w1[prev]]) + cb))))
            prev = int(z.argmax())
            drafts.append(prev)
        return base, drafts, confs


@pytest.fixture(scope="module")
def npm(tw, dw, tcfg, dcfg):
    return Numpy(tw, dw, tcfg, dcfg)


@pytest.fixture(scope="module")
def ref_prompts(reference, tok):
    prompts = _json("prompts.json")
    out = []
    for r in reference["prompts"]:
        ids = np.array(tok.encode(prompts[r["prompt_index"]]["text"], add_special_tokens=False).ids)
        assert len(ids) == r["n_tokens"]
        out.append((r, ids))
    return out


NEAR_TIE = 1e-2  # logit margins below this may legitimately flip between fp32 implementations


def test_numpy_target_matches_reference(npm, ref_prompts):
    compared = 0
    for r, ids in ref_prompts:
        h, _ = npm.target(ids)
        logits = npm.logits(h)
        lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
        nll = float(np.mean(lse[:-1] - logits[np.arange(len(ids) - 1), ids[1:]]))
        assert nll == pytest.approx(r["mean_nll"], abs=2e-3)
        np.testing.assert_allclose(logits[-1][r["last_logits_top8_ids"]], r["last_logits_top8_values"], atol=5e-3)
        seq = list(ids)
        for tok_ref, margin in zip(r["greedy_tokens"], r["greedy_margins"]):
            hh, _ = npm.target(np.array(seq))
            nxt = int(npm.logits(hh[-1]).argmax())
            if margin < NEAR_TIE:
                break
            assert nxt == tok_ref
            compared += 1
            seq.append(nxt)
    assert compared >= 16  # the check is not vacuous


def test_numpy_mtp_matches_reference(npm, ref_prompts):
    compared = 0
    for r, ids in ref_prompts:
        h, _ = npm.target(ids)
        top = npm.logits(npm.mtp(h, ids)).argmax(-1)
        assert len(top) == len(r["mtp_top1"]) == len(ids) - 1
        for got, want, margin in zip(top, r["mtp_top1"], r["mtp_margins"]):
            if margin >= NEAR_TIE:
                assert got == want
                compared += 1
    assert compared >= 100


def test_numpy_dspark_block_matches_reference(npm, ref_prompts):
    for r, ids in ref_prompts:
        assert r["dspark_anchor_token"] == r["greedy_tokens"][0]
        _, raw = npm.target(ids)  # context rows 0..P-1; the anchor sits at P
        base, drafts, confs = npm.dspark_block(raw, r["dspark_anchor_position"], r["dspark_anchor_token"])
        np.testing.assert_allclose(base[0][r["dspark_base_logits_slot0_top4_ids"]],
                                   r["dspark_base_logits_slot0_top4_values"], atol=5e-3)
        for k, (got, want, margin) in enumerate(zip(drafts, r["dspark_draft_tokens"], r["dspark_margins"])):
            if margin < NEAR_TIE:
                break  # later slots depend on this token through the Markov head
            assert got == want, k
            assert confs[k] == pytest.approx(r["dspark_confidence"][k], abs=1e-3)
