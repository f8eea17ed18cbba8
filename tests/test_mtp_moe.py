"""MTP drafting with the NextN layer on the mixture-of-experts architectures (glm4moe, deepseek2,
glm-dsa).

The head runs the target architecture's own decoder layer (GQA + MoE for glm4moe, latent
attention + MoE for deepseek2, latent attention restricted by the NextN block's own DSA indexer
+ MoE for glm-dsa) on the NextN block's weights, with a one-layer cache of the target's kind
(KVCache / LatentCache / DSACache; a glm-dsa NextN block without indexer tensors attends densely
over a LatentCache). Checked here on tiny synthetic files (random weights, so acceptance is about
0: these are identity and exactness tests, not speed):

- greedy speculative output equals plain greedy decoding for N = 1..3 (and with a margin);
- the head's draft logits (and its greedy drafts, recursion included) against a float64 numpy
  reference of the NextN forward written from the equations (llama.cpp b10309 has no MTP
  drafting for glm4moe and runs deepseek2's only inside its server: this is the oracle; for
  glm-dsa the reference selects each row's positions with a float64 indexer, and a dense
  reference is far off, so the sparse selection is pinned);
- rolling the head back (truncate + re-run, and a partial accept) equals a fresh head bit for bit;
- ``--mtp FILE`` with llama.cpp's MTP-only file (``quantize --mtp-out`` on the synthetic Hugging
  Face checkpoints) drafts exactly as ``--glm-mtp`` on the file with the layer embedded;
- bad inputs: one line naming the file, exit codes as docs/speculative.md says.
"""
import dataclasses

import numpy as np
import pytest
from click.testing import CliRunner

from ds4tools.cli import main
from ds4tools.engine import Engine
from ds4tools.engine.dsa import INDEXER_TENSORS, DSACache
from ds4tools.engine.generate import decode
from ds4tools.engine.kv_cache import KVCache
from ds4tools.engine.latent_cache import LatentCache
from ds4tools.engine.sampling import Sampler
from ds4tools.engine.speculative import SpecStats, speculative_decode
from ds4tools.engine.speculative.config import SpecConfig
from ds4tools.engine.speculative.load import mtp_from_nextn
from ds4tools.engine.speculative.mtp import MtpDrafter, MtpHead
from ds4tools.errors import UsageError
from ds4tools.quantize import QuantizeOptions, quantize_model
from tests import deepseek2_model, glm4moe_model, glm_dsa_model
from tests.fixtures import hf_moe_models

GREEDY = Sampler(temperature=0.0)
SEED = 3

#: name -> (module, config, weight type); every config has one NextN layer after 3 blocks
CASES = {
    "glm4moe-f32": (glm4moe_model, glm4moe_model.Glm4MoeConfig(), "F32"),
    "glm4moe-q8_0-qknorm": (glm4moe_model, glm4moe_model.Glm4MoeConfig(qk_norm=True), "Q8_0"),
    "deepseek2-f32": (deepseek2_model, deepseek2_model.Deepseek2Config(n_nextn=1), "F32"),
    # one q matrix, softmax routing without bias, YaRN: the head uses the target's rope tables
    "deepseek2-q8_0-lite-yarn": (deepseek2_model, dataclasses.replace(deepseek2_model.LITE, n_nextn=1),
                                 "Q8_0"),
    # the NextN block's own indexer keeps top_k 6 of up to 12 head rows: the head attends sparsely
    "glm-dsa-f32": (glm_dsa_model, glm_dsa_model.GlmDsaConfig(n_nextn=1), "F32"),
    # layer 1 a shared indexer layer, YaRN: indexer.types covers the decoder layers only, the
    # NextN layer still runs its own indexer
    "glm-dsa-q8_0-shared-yarn": (glm_dsa_model, dataclasses.replace(glm_dsa_model.SHARED, n_nextn=1),
                                 "Q8_0"),
}
#: a glm-dsa NextN block without indexer tensors (llama.cpp loads them as optional): dense
GLM_DSA_DENSE_DROP = [f"blk.3.{t}" for t in INDEXER_TENSORS]
PROMPT = [5, 17, 250, 3, 99, 17, 250, 3, 42]


def _own_tensors(cfg):
    """NextN's optional own embedding and output matrix (llama.cpp: nextn.embed_tokens,
    nextn.shared_head_head), different from the model's so that using them shows."""
    rng = np.random.default_rng(11)
    p = f"blk.{cfg.n_layer}.nextn."
    return {p + "embed_tokens.weight": rng.standard_normal((cfg.n_vocab, cfg.n_embd)).astype(np.float32),
            p + "shared_head_head.weight": (rng.standard_normal((cfg.n_vocab, cfg.n_embd))
                                            * (2 / np.sqrt(cfg.n_embd))).astype(np.float32)}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("mtp-moe")
    out = {}
    for name, (mod, cfg, wtype) in CASES.items():
        out[name] = d / f"{name}.gguf"
        mod.write_model(out[name], cfg, wtype, SEED)
    # the same glm4moe model without its NextN tensors (llama.cpp's trunk-only layout)
    mod, cfg, _ = CASES["glm4moe-f32"]
    names = mod.random_weights(cfg, np.random.default_rng(0))
    nextn = [n for n in names if n.startswith(f"blk.{cfg.n_layer}.")]
    out["glm4moe-trunk"] = d / "glm4moe-trunk.gguf"
    mod.write_model(out["glm4moe-trunk"], cfg, "F32", SEED, drop=nextn)
    out["glm4moe-own-head"] = d / "glm4moe-own-head.gguf"
    mod.write_model(out["glm4moe-own-head"], cfg, "F32", SEED, override=_own_tensors(cfg))
    mod, cfg, _ = CASES["glm-dsa-f32"]
    out["glm-dsa-dense-nextn"] = d / "glm-dsa-dense-nextn.gguf"
    mod.write_model(out["glm-dsa-dense-nextn"], cfg, "F32", SEED, drop=GLM_DSA_DENSE_DROP)
    return out


_engines = {}


def engine_for(files, name):
    if name not in _engines:
        wtype = CASES[name][2] if name in CASES else "F32"
        kw = dict(exact=True) if wtype == "F32" else dict(int8="all")
        _engines[name] = Engine(files[name], n_ctx=128, **kw)
    return _engines[name]


def drafter_for(eng, n_draft=3, margin=0.0):
    int8 = "none" if eng.exact else eng.int8_mode
    return MtpDrafter(eng.model, mtp_from_nextn(eng.gguf, eng.hparams, int8, eng.model), n_draft, margin)


def _check_rollback(eng, seq):
    """The target's cache holds a prefix of the emitted sequence; the next logits equal a fresh
    prefill's bit for bit."""
    n = eng.cache.length
    assert n <= len(seq) - 1
    tail = eng.forward(seq[n:], n, logits="last").logits[-1].copy()
    fresh = eng.forward(seq, 0, logits="last").logits[-1]
    np.testing.assert_array_equal(tail.view(np.uint32), fresh.view(np.uint32))


# --- greedy identity ----------------------------------------------------------------------------


def _cache_kind(name):
    if name.startswith("glm-dsa"):
        return LatentCache if name == "glm-dsa-dense-nextn" else DSACache
    return LatentCache if name.startswith("deepseek2") else KVCache


@pytest.mark.parametrize("name", list(CASES) + ["glm-dsa-dense-nextn"])
def test_greedy_speculative_output_equals_plain(files, name):
    eng = engine_for(files, name)
    plain = list(decode(eng.model, PROMPT, 20, GREEDY, np.random.default_rng(0), frozenset()))
    head = mtp_from_nextn(eng.gguf, eng.hparams, "none" if eng.exact else eng.int8_mode, eng.model)
    for n_draft, margin in ((1, 0.0), (2, 0.0), (3, 0.0), (3, 0.5)):
        drafter = MtpDrafter(eng.model, head, n_draft, margin)
        assert type(drafter.mtp.cache) is _cache_kind(name) and drafter.mtp.cache.n_layer == 1
        st = SpecStats(method="mtp")
        got = list(speculative_decode(eng.model, drafter, PROMPT, 20, GREEDY, np.random.default_rng(0),
                                      frozenset(), spec=st, calibrate=False))
        assert got == plain, (n_draft, margin)
        assert st.drafted > 0 and st.steps > 0
        _check_rollback(eng, PROMPT + got)


def test_sampled_drafting_gives_its_distributions_and_is_reproducible(files):
    # the loop's rejection sampling is exact when q is the distribution each draft was drawn from
    eng = engine_for(files, "deepseek2-f32")
    sampler = Sampler(temperature=0.9)
    pre = eng.forward(PROMPT, 0, want_final_hidden=True, logits="last")
    drafter = drafter_for(eng)
    drafter.start(PROMPT, pre)
    prop = drafter.propose(7, 3, sampler, np.random.default_rng(0))
    assert prop.q.shape == (3, eng.hparams.n_vocab)
    np.testing.assert_allclose(prop.q.sum(1), 1.0, rtol=1e-9)
    assert all(prop.q[i, d] > 0 for i, d in enumerate(prop.tokens))
    head = MtpHead(eng.model, drafter.mtp.w)
    _, logits = head.head(head.run(pre.final_hidden, PROMPT[1:] + [7], 0)[-1:])
    np.testing.assert_array_equal(prop.q[0], sampler.distribution(logits[0]))

    def run():
        e = Engine(files["deepseek2-f32"], spec=SpecConfig(glm_mtp=True, mtp_draft=2))
        return [t.id for t in e.generate("the model reads", 12, temperature=0.9, seed=7)]
    a = run()
    assert a == run() and len(a) == 12


# --- the head against a float64 reference ------------------------------------------------------


def _rms(x, g, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * g


def _silu(x):
    return x / (1 + np.exp(-x))


def _rope(x, pos, base, n_rot, neox):
    """Rotate the first n_rot entries of the last axis of x (T, heads, d): halves ("neox") or
    adjacent pairs ("norm")."""
    inv = base ** (-np.arange(0, n_rot, 2) / n_rot)
    ang = np.asarray(pos, np.float64)[:, None] * inv[None, :]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    out = x.copy()
    if neox:
        half = n_rot // 2
        a, b = x[..., :half], x[..., half:n_rot]
        out[..., :half], out[..., half:n_rot] = a * c - b * s, a * s + b * c
    else:
        a, b = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
        out[..., 0:n_rot:2], out[..., 1:n_rot:2] = a * c - b * s, a * s + b * c
    return out


def _attend(q, k, v, scale, mask=None):
    """Causal attention, q (T, NH, d), k (T, NH, d), v (T, NH, dv); ``mask`` (T, T): the
    positions each row may see (None: causal)."""
    T = q.shape[0]
    s = np.einsum("thd,uhd->htu", q, k) * scale
    s = np.where(np.tril(np.ones((T, T), bool)) if mask is None else mask, s, -np.inf)
    a = np.exp(s - s.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    return np.einsum("htu,uhv->thv", a, v).reshape(T, -1)


def _moe(h, W, p, cfg):
    """llama.cpp's MoE block: scored experts (selection bias, groups, normalised and scaled
    weights) plus the shared expert."""
    logits = h @ W[p + "ffn_gate_inp.weight"].T
    probs = 1 / (1 + np.exp(-logits)) if cfg.gating == 2 else np.exp(logits - logits.max(1, keepdims=True))
    if cfg.gating != 2:
        probs /= probs.sum(1, keepdims=True)
    choose = probs + W.get(p + "exp_probs_b.bias", 0.0)
    if getattr(cfg, "n_group", 1) > 1:
        g = choose.reshape(len(h), cfg.n_group, -1)
        keep = np.argsort(-np.sort(g, axis=2)[:, :, -2:].sum(2), axis=1, kind="stable")[:, :cfg.n_group_used]
        drop = np.ones(g.shape[:2], bool)
        np.put_along_axis(drop, keep, False, axis=1)
        choose = np.where(np.repeat(drop, g.shape[2], axis=1), -np.inf, choose)
    ids = np.argsort(-choose, axis=1, kind="stable")[:, :cfg.n_expert_used]
    wts = np.take_along_axis(probs, ids, 1)
    if cfg.normalize_weights:
        wts /= np.maximum(wts.sum(1, keepdims=True), 2.0 ** -14)
    wts *= cfg.weights_scale or 1.0
    out = np.zeros_like(h)
    for t in range(len(h)):
        for e, wt in zip(ids[t], wts[t]):
            act = _silu(W[p + "ffn_gate_exps.weight"][e] @ h[t]) * (W[p + "ffn_up_exps.weight"][e] @ h[t])
            out[t] += wt * (W[p + "ffn_down_exps.weight"][e] @ act)
    if cfg.n_expert_shared:
        out += (_silu(h @ W[p + "ffn_gate_shexp.weight"].T) * (h @ W[p + "ffn_up_shexp.weight"].T)) \
            @ W[p + "ffn_down_shexp.weight"].T
    return out


def _glm4moe_layer(x, W, p, cfg, pos):
    T, NH, NKV, hd = len(x), cfg.n_head, cfg.n_head_kv, cfg.head_dim
    h = _rms(x, W[p + "attn_norm.weight"], cfg.rms_eps)
    q = (h @ W[p + "attn_q.weight"].T + W[p + "attn_q.bias"]).reshape(T, NH, hd)
    k = (h @ W[p + "attn_k.weight"].T + W[p + "attn_k.bias"]).reshape(T, NKV, hd)
    v = (h @ W[p + "attn_v.weight"].T + W[p + "attn_v.bias"]).reshape(T, NKV, hd)
    if p + "attn_q_norm.weight" in W:
        q = _rms(q, W[p + "attn_q_norm.weight"], cfg.rms_eps)
        k = _rms(k, W[p + "attn_k_norm.weight"], cfg.rms_eps)
    q, k = _rope(q, pos, cfg.rope_base, cfg.n_rot, True), _rope(k, pos, cfg.rope_base, cfg.n_rot, True)
    rep = NH // NKV  # query head i reads key/value head i // rep
    a = _attend(q, np.repeat(k, rep, 1), np.repeat(v, rep, 1), 1 / np.sqrt(hd))
    x = x + a @ W[p + "attn_output.weight"].T
    return x + _moe(_rms(x, W[p + "post_attention_norm.weight"], cfg.rms_eps), W, p, cfg)


def _deepseek2_layer(x, W, p, cfg, pos, mask=None):
    # multi-head latent attention in its expanded form (keys and values per head)
    T, NH, R = len(x), cfg.n_head, cfg.n_rot
    h = _rms(x, W[p + "attn_norm.weight"], cfg.rms_eps)
    qa = _rms(h @ W[p + "attn_q_a.weight"].T, W[p + "attn_q_a_norm.weight"], cfg.rms_eps)
    q = (qa @ W[p + "attn_q_b.weight"].T).reshape(T, NH, -1)
    kv = h @ W[p + "attn_kv_a_mqa.weight"].T
    c = _rms(kv[:, :cfg.n_lora_kv], W[p + "attn_kv_a_norm.weight"], cfg.rms_eps)
    k_pe = _rope(kv[:, None, cfg.n_lora_kv:], pos, cfg.rope_base, R, False)[:, 0]
    keys = np.concatenate([np.einsum("hcd,tc->thd", W[p + "attn_k_b.weight"], c),
                           np.repeat(k_pe[:, None], NH, 1)], axis=2)
    values = np.einsum("hvc,tc->thv", W[p + "attn_v_b.weight"], c)
    q = np.concatenate([q[:, :, :cfg.n_nope], _rope(q[:, :, cfg.n_nope:], pos, cfg.rope_base, R, False)], 2)
    x = x + _attend(q, keys, values, 1 / np.sqrt(cfg.n_nope + R), mask) @ W[p + "attn_output.weight"].T
    return x + _moe(_rms(x, W[p + "ffn_norm.weight"], cfg.rms_eps), W, p, cfg)


def _glm_dsa_layer(x, W, p, cfg, pos, dense=False):
    """deepseek2's layer with each row's attention restricted to the top_k positions of the
    block's own indexer (float64, tests/glm_dsa_model.py); dense where the block has none."""
    T, K = len(x), cfg.idx_top_k
    mask = np.tril(np.ones((T, T), bool))
    if p + "indexer.attn_q_b.weight" in W and not dense:
        h = _rms(x, W[p + "attn_norm.weight"], cfg.rms_eps)
        qa = _rms(h @ W[p + "attn_q_a.weight"].T, W[p + "attn_q_a_norm.weight"], cfg.rms_eps)
        scores = glm_dsa_model.reference_indexer_scores(W, cfg, p, h, qa)
        for t in range(K, T):
            row = scores[t, :t + 1]
            order = np.argsort(-row, kind="stable")  # equal scores: the lower position first
            # a clear cut between kept and dropped: float32 selects the same positions
            assert row[order[K - 1]] - row[order[K]] > 1e-6 * np.abs(row).max(), t
            mask[t] = False
            mask[t, order[:K]] = True
    return _deepseek2_layer(x, W, p, cfg, pos, mask)


def _glm_dsa_dense_layer(x, W, p, cfg, pos):
    return _glm_dsa_layer(x, W, p, cfg, pos, dense=True)


def _nextn_reference(W, cfg, layer, hidden, tokens):
    """The NextN head in float64: rows (hidden_i, token_i) at positions 0..T-1 -> (normed y,
    logits)."""
    p = f"blk.{cfg.n_layer}."
    embed = W.get(p + "nextn.embed_tokens.weight", W["token_embd.weight"])
    e = _rms(embed[tokens], W[p + "nextn.enorm.weight"], cfg.rms_eps)
    h = _rms(np.asarray(hidden, np.float64), W[p + "nextn.hnorm.weight"], cfg.rms_eps)
    x = np.concatenate([e, h], 1) @ W[p + "nextn.eh_proj.weight"].T
    y = layer(x, W, p, cfg, np.arange(len(tokens)))
    n = _rms(y, W[p + "nextn.shared_head_norm.weight"], cfg.rms_eps)
    return n, n @ W.get(p + "nextn.shared_head_head.weight", W["output.weight"]).T


def _reference_weights(name):
    """(config, float64 weights) of a file of ``files``."""
    base = {"glm4moe-own-head": "glm4moe-f32", "glm-dsa-dense-nextn": "glm-dsa-f32"}.get(name, name)
    mod, cfg, _ = CASES[base]
    W = mod.random_weights(cfg, np.random.default_rng(SEED))
    if name.endswith("own-head"):  # NextN's own embedding and output matrix replace the model's
        W |= _own_tensors(cfg)
    if name == "glm-dsa-dense-nextn":
        W = {n: a for n, a in W.items() if n not in GLM_DSA_DENSE_DROP}
    return cfg, {n: a.astype(np.float64) for n, a in W.items()}


@pytest.mark.parametrize("name, layer", [("glm4moe-f32", _glm4moe_layer),
                                         ("deepseek2-f32", _deepseek2_layer),
                                         ("glm4moe-own-head", _glm4moe_layer),
                                         ("glm-dsa-f32", _glm_dsa_layer),
                                         ("glm-dsa-dense-nextn", _glm_dsa_layer)])
def test_draft_logits_match_a_float64_reference(files, name, layer):
    cfg, W = _reference_weights(name)
    eng = engine_for(files, name)
    pre = eng.forward(PROMPT, 0, want_final_hidden=True, logits="last")
    anchor = int(np.argmax(pre.logits[-1]))
    tokens = PROMPT[1:] + [anchor]

    # every prompt row of the head
    head = MtpHead(eng.model, drafter_for(eng).mtp.w)
    _, ours = head.head(head.run(pre.final_hidden, tokens, 0))
    _, want = _nextn_reference(W, cfg, layer, pre.final_hidden, tokens)
    err = np.abs(ours - want).max() / np.abs(want).max()
    assert err < 1e-5, err
    if name == "glm-dsa-f32":  # rows past top_k attend sparsely: a dense head is far off there
        _, dense = _nextn_reference(W, cfg, _glm_dsa_dense_layer, pre.final_hidden, tokens)
        K = cfg.idx_top_k
        assert np.abs(ours[K:] - dense[K:]).max() / np.abs(dense).max() > 1e-2

    # the drafts, through the recursion on the head's own state
    drafter = drafter_for(eng, n_draft=3)
    drafter.start(PROMPT, pre)
    got = drafter.propose(anchor, 3, GREEDY, np.random.default_rng(0)).tokens
    hid, toks, drafts = list(pre.final_hidden.astype(np.float64)), list(tokens), []
    for _ in range(3):
        normed, logits = _nextn_reference(W, cfg, layer, np.stack(hid), toks)
        top2 = np.sort(logits[-1])[-2:]
        assert top2[1] - top2[0] > 1e-3 * np.abs(top2).max()  # a clear argmax: comparable
        drafts.append(int(np.argmax(logits[-1])))
        hid.append(normed[-1])
        toks.append(drafts[-1])
    assert got == drafts


def test_glm_dsa_head_equals_the_dense_head_up_to_top_k_rows(files):
    # llama.cpp's MTP graph attends densely; the indexer keeps every position while a row sees at
    # most top_k, so there the two heads agree bit for bit (and differ after)
    sparse, dense = (engine_for(files, n) for n in ("glm-dsa-f32", "glm-dsa-dense-nextn"))
    K = CASES["glm-dsa-f32"][1].idx_top_k
    rng = np.random.default_rng(5)
    hid = rng.standard_normal((12, sparse.hparams.n_embd)).astype(np.float32)
    toks = list(rng.integers(0, 300, 12))
    ys = [MtpHead(e.model, drafter_for(e).mtp.w).run(hid, toks, 0) for e in (sparse, dense)]
    np.testing.assert_array_equal(ys[0][:K].view(np.uint32), ys[1][:K].view(np.uint32))
    assert (np.abs(ys[0][K:] - ys[1][K:]).max(1) > 1e-3).all()


# --- rollback of the head's cache --------------------------------------------------------------


def _same_cache(a, b):
    sa, sb = a.snapshot(), b.snapshot()
    assert type(sa) is type(sb) and sa.length == sb.length
    for f in dataclasses.fields(sa):
        va, vb = getattr(sa, f.name), getattr(sb, f.name)
        if isinstance(va, np.ndarray):
            np.testing.assert_array_equal(va.view(np.uint32), vb.view(np.uint32))


@pytest.mark.parametrize("name", ["glm4moe-f32", "deepseek2-f32", "glm-dsa-f32", "glm-dsa-dense-nextn"])
def test_head_truncate_and_rerun_equals_a_fresh_head(files, name):
    eng = engine_for(files, name)
    w = drafter_for(eng).mtp.w
    rng = np.random.default_rng(1)
    H = eng.hparams.n_embd
    hid_a, hid_b = (rng.standard_normal((10, H)).astype(np.float32) for _ in range(2))
    tok_a, tok_b = list(rng.integers(0, 300, 10)), list(rng.integers(0, 300, 10))
    head = MtpHead(eng.model, w)
    head.run(hid_a, tok_a, 0)
    head.cache.truncate(4)
    y = head.run(hid_b[4:], tok_b[4:], 4)
    fresh = MtpHead(eng.model, w)
    y_fresh = fresh.run(np.concatenate([hid_a[:4], hid_b[4:]]), tok_a[:4] + tok_b[4:], 0)
    np.testing.assert_array_equal(y.view(np.uint32), y_fresh[4:].view(np.uint32))
    _same_cache(head.cache, fresh.cache)  # a DSACache: the latent rows and the indexer keys


@pytest.mark.parametrize("name", ["glm4moe-q8_0-qknorm", "deepseek2-q8_0-lite-yarn",
                                  "glm-dsa-q8_0-shared-yarn"])
def test_partial_accept_leaves_the_head_as_a_fresh_start(files, name):
    # commit 2 of 3 drafts (as if the target had accepted them), then draft again: the same
    # drafts, the same head cache, as a drafter started on the committed sequence
    eng = engine_for(files, name)
    pre = eng.forward(PROMPT, 0, want_final_hidden=True, logits="last")
    anchor = int(np.argmax(pre.logits[-1]))
    drafter = drafter_for(eng)
    drafter.start(PROMPT, pre)
    prop = drafter.propose(anchor, 3, GREEDY, np.random.default_rng(0))
    verify = eng.forward([anchor] + prop.tokens, len(PROMPT), want_final_hidden=True, logits="all")
    drafter.commit(anchor, prop, 2, verify)
    nxt = int(np.argmax(verify.logits[2]))
    again = drafter.propose(nxt, 3, GREEDY, np.random.default_rng(0))

    seq = PROMPT + [anchor] + prop.tokens[:2]
    fresh = drafter_for(eng)
    fresh.start(seq, eng.forward(seq, 0, want_final_hidden=True, logits="last"))
    want = fresh.propose(nxt, 3, GREEDY, np.random.default_rng(0))
    assert again.tokens == want.tokens
    _same_cache(drafter.mtp.cache, fresh.mtp.cache)


# --- --mtp FILE with llama.cpp's MTP-only file --------------------------------------------------


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    """From the synthetic Hugging Face checkpoints: the model with its NextN layer embedded
    (--keep-nextn), and the trunk-only + MTP-only pair (--mtp-out), Q8_0."""
    d = tmp_path_factory.mktemp("mtp-moe-split")
    out = {}
    for arch in ("glm4moe", "deepseek2", "glm-dsa"):
        folder = hf_moe_models.BUILDERS[arch](d / arch)
        opts = lambda **kw: QuantizeOptions("Q8_0", progress=False, **kw)  # noqa: E731
        quantize_model(folder, d / f"{arch}-full.gguf", opts(keep_nextn=True), report=lambda m: None)
        quantize_model(folder, d / f"{arch}-trunk.gguf", opts(mtp_out=str(d / f"{arch}-mtp.gguf")),
                       report=lambda m: None)
        out[arch] = {k: d / f"{arch}-{k}.gguf" for k in ("full", "trunk", "mtp")}
    return out


def _generate(path, spec=None):
    eng = Engine(path, spec=spec)
    steps = []
    eng.on_spec_step = lambda st, proposal, m, s: steps.append((list(proposal.tokens), m))
    ids = [t.id for t in eng.generate("the model reads a token", 12, temperature=0)]
    return ids, steps, eng


@pytest.mark.parametrize("arch", ["glm4moe", "deepseek2", "glm-dsa"])
def test_mtp_only_file_drafts_as_the_embedded_layer(split, arch):
    f = split[arch]
    plain, _, _ = _generate(f["trunk"])
    embedded, steps_e, eng_e = _generate(f["full"], SpecConfig(glm_mtp=True))
    from_file, steps_f, eng_f = _generate(f["trunk"], SpecConfig(mtp_file=str(f["mtp"])))
    assert embedded == from_file == plain
    assert steps_f == steps_e and len(steps_e) > 0
    assert eng_f.drafter.describe() == f"mtp: NextN layer blk.2 of {f['mtp']}, draft depth 3"
    assert eng_e.drafter.describe() == f"mtp: NextN layer blk.2 embedded in {f['full']}, draft depth 3"


def test_run_command_with_mtp_file(split):
    f = split["deepseek2"]
    args = ["run", "-m", str(f["trunk"]), "-p", "the model reads", "-n", "8", "--temp", "0"]
    plain = CliRunner().invoke(main, args)
    r = CliRunner().invoke(main, args + ["--mtp", str(f["mtp"]), "--mtp-draft", "2", "--mtp-margin", "0.1"])
    assert r.exit_code == 0, r.stderr
    assert r.stdout == plain.stdout
    assert f"ds4tools: mtp: NextN layer blk.2 of {f['mtp']}, draft depth 2, margin 0.1" in r.stderr


# --- bad inputs ---------------------------------------------------------------------------------


def _err_line(r):
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    return lines[0]


def test_glm_mtp_on_a_trunk_only_file_is_one_line_exit_2(files, split):
    for path in (files["glm4moe-trunk"], split["deepseek2"]["trunk"], split["glm-dsa"]["trunk"]):
        r = CliRunner().invoke(main, ["run", "-m", str(path), "-p", "hi", "-n", "4", "--glm-mtp"])
        assert r.exit_code == 2
        line = _err_line(r)
        assert line.startswith(f"ds4tools: {path}: --glm-mtp: the NextN layer is not in this file")
        assert "--mtp FILE" in line
    # the trunk-only file given as --mtp FILE: the same, naming that file
    r = CliRunner().invoke(main, ["run", "-m", str(files["glm4moe-f32"]), "-p", "hi", "-n", "4",
                                  "--mtp", str(files["glm4moe-trunk"])])
    assert r.exit_code == 2
    assert _err_line(r).startswith(f"ds4tools: {files['glm4moe-trunk']}: --mtp: the NextN layer is not")


def test_mtp_file_of_another_model_is_refused(files, split):
    # another architecture: exit 2; the same architecture with other shapes: exit 1
    r = CliRunner().invoke(main, ["run", "-m", str(split["deepseek2"]["trunk"]), "-p", "hi", "-n", "4",
                                  "--mtp", str(split["glm4moe"]["mtp"])])
    assert r.exit_code == 2
    assert _err_line(r) == (f"ds4tools: {split['glm4moe']['mtp']}: is a glm4moe file with NextN layers; "
                            f"the model {split['deepseek2']['trunk']} is deepseek2")
    r = CliRunner().invoke(main, ["run", "-m", str(files["glm4moe-f32"]), "-p", "hi", "-n", "4",
                                  "--mtp", str(split["glm4moe"]["mtp"])])
    assert r.exit_code == 1
    assert _err_line(r).startswith(f"ds4tools: {split['glm4moe']['mtp']}: does not fit the model "
                                   f"{files['glm4moe-f32']}: ")
    # glm-dsa's MTP-only file for a deepseek2 model (the same layer names, another architecture)
    r = CliRunner().invoke(main, ["run", "-m", str(split["deepseek2"]["trunk"]), "-p", "hi", "-n", "4",
                                  "--mtp", str(split["glm-dsa"]["mtp"])])
    assert r.exit_code == 2
    assert _err_line(r) == (f"ds4tools: {split['glm-dsa']['mtp']}: is a glm-dsa file with NextN layers; "
                            f"the model {split['deepseek2']['trunk']} is deepseek2")


def test_glm_dsa_nextn_block_with_part_of_an_indexer_is_one_line_exit_1(tmp_path):
    # an indexer tensor makes the NextN layer a full indexer layer: the required ones must be there
    mod, cfg, _ = CASES["glm-dsa-f32"]
    path = tmp_path / "partial-indexer.gguf"
    mod.write_model(path, cfg, "F32", SEED, drop=["blk.3.indexer.attn_k.weight"])
    r = CliRunner().invoke(main, ["run", "-m", str(path), "-p", "hi", "-n", "4", "--glm-mtp"])
    assert r.exit_code == 1
    assert _err_line(r) == f"ds4tools: {path}: missing tensor blk.3.indexer.attn_k.weight"


def test_dspark_stays_refused(files):
    with pytest.raises(UsageError, match=r"drafting with a model \(--dspark\) is not available for "
                                         r"glm4moe models yet; --glm-mtp"):
        Engine(files["glm4moe-f32"], spec=SpecConfig(dspark=True))
    r = CliRunner().invoke(main, ["run", "-m", str(files["deepseek2-f32"]), "-p", "hi", "-n", "4",
                                  "--dspark", "--mtp", str(files["deepseek2-f32"])])
    assert r.exit_code == 2
    assert "is not available for deepseek2 models yet" in _err_line(r)
    with pytest.raises(UsageError, match=r"drafting with a model \(--dspark\) is not available for "
                                         r"glm-dsa models yet; --glm-mtp"):
        Engine(files["glm-dsa-f32"], spec=SpecConfig(dspark=True))
