"""MTP drafting on deepseek4 (DeepSeek V4 Flash): ds4's own MTP support file (``mtp.0.*``: e_proj /
h_proj, one DeepSeek V4 block with its hyper-connections and experts, the head's own
hyper-connection collapse) and llama.cpp's MTP block embedded in the model file (``--glm-mtp``).

The target is tests/deepseek4_model.py's synthetic model widened to 256 (ds4's MTP file stores
its routed experts as IQ2_XXS / Q2_K / Q4_K, whose rows are 256 long) with its MTP block; the ds4
file is written by the project's support writer (Q8_0 projections, Q4_K experts, F16
hyper-connection matrices, as ds4 requires) and validates with ``ds4tools inspect --target``.
Random weights, so acceptance is about 0: these are identity and exactness tests, not speed.

- greedy speculative output equals plain greedy decoding for N = 1..3 (and with a margin), both
  paths; after every step the target's next logits equal a fresh prefill's bit for bit;
- the head's draft logits against a float64 numpy reference of DeepSeek V4's MTP layer written
  from the equations (llama.cpp's graph and ds4's, which expose no draft logits);
- rolling the head back (a partial accept) leaves it as a head started on the committed tokens;
- a ds4 MTP file made for another target is refused before anything runs, in one line.
"""
import dataclasses

import numpy as np
import pytest
from click.testing import CliRunner

from ds4tools.cli import main
from ds4tools.engine import Engine
from ds4tools.engine.compressed_attention import CompressedCache
from ds4tools.engine.generate import decode
from ds4tools.engine.sampling import Sampler
from ds4tools.engine.speculative import SpecStats, speculative_decode
from ds4tools.engine.speculative.config import SpecConfig, build_drafter
from ds4tools.engine.speculative.drafter import Drafter
from ds4tools.engine.speculative.mtp import MtpDrafter
from ds4tools.gguf_io import open_gguf
from ds4tools.mixes import GUESSED_FTYPE, Target
from ds4tools.support import mtp as mtp_layout
from ds4tools.support.build import _array_tensors
from ds4tools.support.target import open_target
from ds4tools.support.write import write_support_gguf
from tests import deepseek4_model

GREEDY = Sampler(temperature=0.0)
SEED = 5
CFG = dataclasses.replace(deepseek4_model.Deepseek4Config(), n_embd=256, n_ff_exp=256, n_nextn=1)
PROMPT = [5, 17, 250, 3, 99, 17, 250, 3, 42, 7, 7, 180]


def _ds4_mtp_arrays(cfg, seed: int) -> dict:
    """ds4's mtp.0.* tensors (numpy order): a DeepSeek V4 block drawn as the model's MTP block is,
    e_proj / h_proj the halves of its eh_proj (the embedding half first), its own hc_head."""
    w = deepseek4_model.random_weights(cfg, np.random.default_rng(seed))
    L, H = cfg.n_layer, cfg.n_embd
    p = f"blk.{L}."
    out = {}
    for name, a in w.items():
        if name.startswith(p) and ".nextn." not in name:
            out["mtp.0." + name[len(p):]] = a
    eh = w[p + "nextn.eh_proj.weight"]
    out["mtp.0.e_proj.weight"] = eh[:, :H] * np.float32(1.5)
    out["mtp.0.h_proj.weight"] = eh[:, H:] * np.float32(1.5)
    out["mtp.0.enorm.weight"] = w[p + "nextn.enorm.weight"]
    out["mtp.0.hnorm.weight"] = w[p + "nextn.hnorm.weight"]
    out["mtp.0.norm.weight"] = w[p + "nextn.shared_head_norm.weight"]
    out["mtp.0.hc_head_fn.weight"] = w["output_hc_fn.weight"][::-1].copy()
    out["mtp.0.hc_head_base.weight"] = w["output_hc_base.weight"] * np.float32(-1.0)
    out["mtp.0.hc_head_scale.weight"] = w["output_hc_scale.weight"]
    return out


def write_ds4_mtp(path, target_path, seed: int = 9, arrays: dict | None = None):
    """ds4's MTP support file for the target at ``target_path``, through the support writer."""
    info = open_target(str(target_path))
    arrays = _ds4_mtp_arrays(CFG, seed) if arrays is None else arrays
    keys = mtp_layout.metadata_keys(info.arch, info.dims, int(info.dims.n_layer))
    tensors = _array_tensors(mtp_layout.dsv4_specs(info.dims), arrays,
                             Target("Q8_0", "Q8_0", GUESSED_FTYPE, False), str(target_path))
    write_support_gguf(path, mtp_layout.arch_for(info.arch), keys, tensors, where=str(target_path),
                       progress=False)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("spec-deepseek4")
    out = {"model": d / "dsv4.gguf", "mtp": d / "mtp.gguf", "other": d / "other.gguf",
           "other_mtp": d / "other-mtp.gguf"}
    deepseek4_model.write_model(out["model"], CFG, "F32", SEED)
    write_ds4_mtp(out["mtp"], out["model"])
    # another DeepSeek V4 target (q LoRA rank 64): its MTP file does not fit the model
    other = dataclasses.replace(CFG, n_lora_q=64)
    deepseek4_model.write_model(out["other"], other, "F32", SEED)
    info = open_target(str(out["other"]))
    arrays = _ds4_mtp_arrays(other, 9)
    keys = mtp_layout.metadata_keys(info.arch, info.dims, int(info.dims.n_layer))
    tensors = _array_tensors(mtp_layout.dsv4_specs(info.dims), arrays,
                             Target("Q8_0", "Q8_0", GUESSED_FTYPE, False), str(out["other"]))
    write_support_gguf(out["other_mtp"], mtp_layout.arch_for(info.arch), keys, tensors,
                       where=str(out["other"]), progress=False)
    return out


@pytest.fixture(scope="module")
def engine(files):
    return Engine(files["model"], n_ctx=128, exact=True)


def drafter_for(engine, path=None, n_draft=3, margin=0.0):
    cfg = SpecConfig(mtp_file=None if path is None else str(path), glm_mtp=path is None,
                     mtp_draft=n_draft, mtp_margin=margin or None).resolved(0.0)
    d = build_drafter(engine, cfg)
    assert isinstance(d, MtpDrafter)
    return d


def _check_rollback(eng, seq):
    n = eng.cache.length
    assert n <= len(seq) - 1
    tail = eng.forward(seq[n:], n, logits="last").logits[-1].copy()
    fresh = eng.forward(seq, 0, logits="last").logits[-1]
    np.testing.assert_array_equal(tail.view(np.uint32), fresh.view(np.uint32))


# --- the file --------------------------------------------------------------------------------------


def test_the_ds4_mtp_file_validates_against_its_target(files):
    r = CliRunner().invoke(main, ["inspect", str(files["mtp"]), "--target", str(files["model"])])
    assert r.exit_code == 0, r.output
    f = open_gguf(str(files["mtp"]))
    types = {n: t.type_name for n, t in f.tensors.items()}
    assert types["mtp.0.ffn_gate_exps.weight"] == "Q4_K" and types["mtp.0.e_proj.weight"] == "Q8_0"
    assert types["mtp.0.hc_head_fn.weight"] == "F16" and len(types) == 32
    f.close()


# --- greedy identity, rollback ------------------------------------------------------------------


@pytest.mark.parametrize("path", ["mtp", "glm-mtp"])
def test_greedy_speculative_output_equals_plain(files, engine, path):
    eng = engine
    plain = list(decode(eng.model, PROMPT, 16, GREEDY, np.random.default_rng(0), frozenset()))
    for n_draft, margin in ((1, 0.0), (2, 0.0), (3, 0.0), (3, 0.5)):
        drafter = drafter_for(eng, files["mtp"] if path == "mtp" else None, n_draft, margin)
        cache = drafter.mtp.cache
        assert type(cache) is CompressedCache and cache.n_layer == 1 and cache.layout.ratios == (0,)
        st = SpecStats(method="mtp")
        got = list(speculative_decode(eng.model, drafter, PROMPT, 16, GREEDY, np.random.default_rng(0),
                                      frozenset(), spec=st, calibrate=False))
        assert got == plain, (path, n_draft, margin)
        assert st.drafted > 0 and st.steps > 0
        _check_rollback(eng, PROMPT + got)


def test_sampled_drafting_gives_its_distributions_and_is_reproducible(files, engine):
    # the loop's rejection sampling is exact when q is the distribution each draft was drawn from
    eng = engine
    sampler = Sampler(temperature=0.9)
    pre = eng.forward(PROMPT, 0, want_final_hidden=True, logits="last")
    drafter = drafter_for(eng, files["mtp"])
    drafter.start(PROMPT, pre)
    prop = drafter.propose(7, 3, sampler, np.random.default_rng(0))
    assert prop.q.shape == (3, eng.hparams.n_vocab)
    np.testing.assert_allclose(prop.q.sum(1), 1.0, rtol=1e-9)
    assert all(prop.q[i, d] > 0 for i, d in enumerate(prop.tokens))
    head = drafter_for(eng, files["mtp"]).mtp
    _, logits = head.head(head.run(pre.final_hidden, PROMPT[1:] + [7], 0)[-1:])
    np.testing.assert_array_equal(prop.q[0], sampler.distribution(logits[0]))

    def run(spec):
        e = Engine(files["model"], n_ctx=128, spec=spec)
        return [t.id for t in e.generate("the model reads", 10, temperature=0.9, seed=7)]
    a = run(SpecConfig(mtp_file=str(files["mtp"]), mtp_draft=2))
    assert a == run(SpecConfig(mtp_file=str(files["mtp"]), mtp_draft=2)) and len(a) == 10


def test_sampled_dspark_drafting_is_reproducible(files, engine, dspark_file):
    sampler = Sampler(temperature=0.9)
    pre = engine.forward(PROMPT, 0, hidden_layers=DSPARK_LAYERS, logits="last")
    drafter = dspark_drafter_for(engine, dspark_file, 5)
    drafter.start(PROMPT, pre)
    prop = drafter.propose(7, 5, sampler, np.random.default_rng(0))
    assert prop.q.shape == (5, engine.hparams.n_vocab)
    np.testing.assert_allclose(prop.q.sum(1), 1.0, rtol=1e-9)
    assert all(prop.q[i, d] > 0 for i, d in enumerate(prop.tokens))

    def run():
        e = Engine(files["model"], n_ctx=128, spec=SpecConfig(mtp_file=str(dspark_file), dspark=True))
        return [t.id for t in e.generate("the model reads", 10, temperature=0.9, seed=7)]
    a = run()
    assert a == run() and len(a) == 10


@pytest.mark.parametrize("kind", ["mtp", "dspark"])
def test_every_partial_accept_leaves_the_target_as_a_fresh_prefill(files, engine, kind, request):
    # the drafter's drafts with the first one right and the others wrong: every step is a
    # partial accept (1 of 2 or more); after each, the target's next logits equal a fresh
    # prefill's of the committed tokens, and the output is still plain greedy's
    eng = engine
    V = eng.hparams.n_vocab
    plain = list(decode(eng.model, PROMPT, 12, GREEDY, np.random.default_rng(0), frozenset()))
    want = PROMPT + plain
    if kind == "mtp":
        inner = drafter_for(eng, files["mtp"], 3)
    else:
        inner = dspark_drafter_for(eng, request.getfixturevalue("dspark_file"), 4)
    partial = []

    class FirstRight(Drafter):
        name = kind
        wants_final_hidden = inner.wants_final_hidden
        hidden_layers = inner.hidden_layers

        def start(self, prompt, prefill):
            inner.start(prompt, prefill)
            self.pos = len(prompt)  # the anchor's index in the sequence

        def propose(self, anchor, max_tokens, sampler, rng):
            p = inner.propose(anchor, max_tokens, sampler, rng)
            i = self.pos + 1
            p.tokens = [want[i + j] if j == 0 else (want[i + j] + 1) % V
                        for j in range(len(p.tokens)) if i + j < len(want)]
            return p

        def commit(self, anchor, proposal, n_accepted, verify):
            inner.commit(anchor, proposal, n_accepted, verify)
            if n_accepted < len(proposal.tokens):
                partial.append(n_accepted)
            self.pos += 1 + n_accepted

    emitted = list(PROMPT)
    for t in speculative_decode(eng.model, FirstRight(), PROMPT, 12, GREEDY, np.random.default_rng(0),
                                frozenset(), calibrate=False):
        emitted.append(t)
        n = eng.cache.length
        if n == len(emitted) - 1:  # right after a step: the cache holds all but the newest token
            snap = eng.cache.snapshot()
            tail = eng.forward(emitted[n:], n, logits="last").logits[-1].copy()
            eng.cache.restore(snap)
            fresh = eng.model.forward(emitted, 0, logits="last",
                                      cache=eng.model.new_cache()).logits[-1]
            np.testing.assert_array_equal(tail.view(np.uint32), fresh.view(np.uint32))
    assert emitted == want
    assert len(partial) >= 3 and set(partial) == {1}


def test_partial_accept_leaves_the_head_as_a_fresh_start(files, engine):
    # commit 1 of 3 drafts (as if the target had rejected the second), then draft again: the
    # same drafts and head cache as a drafter started on the committed sequence
    eng = engine
    pre = eng.forward(PROMPT, 0, want_final_hidden=True, logits="last")
    assert pre.final_hidden.shape == (len(PROMPT), CFG.hc * CFG.n_embd)
    anchor = int(np.argmax(pre.logits[-1]))
    drafter = drafter_for(eng, files["mtp"])
    drafter.start(PROMPT, pre)
    prop = drafter.propose(anchor, 3, GREEDY, np.random.default_rng(0))
    assert len(prop.tokens) == 3
    verify = eng.forward([anchor] + prop.tokens, len(PROMPT), want_final_hidden=True, logits="all")
    drafter.commit(anchor, prop, 1, verify)
    nxt = int(np.argmax(verify.logits[1]))
    again = drafter.propose(nxt, 3, GREEDY, np.random.default_rng(0))

    seq = PROMPT + [anchor] + prop.tokens[:1]
    fresh = drafter_for(eng, files["mtp"])
    fresh.start(seq, eng.forward(seq, 0, want_final_hidden=True, logits="last"))
    want = fresh.propose(nxt, 3, GREEDY, np.random.default_rng(0))
    assert again.tokens == want.tokens
    a, b = drafter.mtp.cache, fresh.mtp.cache
    assert a.length == b.length
    np.testing.assert_array_equal(a.raw[:, :a.length].view(np.uint32), b.raw[:, :b.length].view(np.uint32))


# --- against a float64 reference ------------------------------------------------------------------


def _f64(f, name):
    t = f.tensors[name]
    return np.asarray(t.to_float32(), np.float64).reshape(t.shape)


def _rms(x, w=None, eps=1e-6):
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y if w is None else y * w


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _rope_tail(x, positions, n_rot, base, inverse=False):
    """Rotate the last n_rot dims of x (k, ..., d) by position: adjacent pairs."""
    x = x.copy()
    d = x.shape[-1]
    half = n_rot // 2
    inv = base ** (-2.0 * np.arange(half) / n_rot)
    th = positions[:, None] * inv[None, :]
    if inverse:
        th = -th
    shape = (len(positions),) + (1,) * (x.ndim - 2) + (half,)
    c, s = np.cos(th).reshape(shape), np.sin(th).reshape(shape)
    a, b = x[..., d - n_rot::2].copy(), x[..., d - n_rot + 1::2].copy()
    x[..., d - n_rot::2] = a * c - b * s
    x[..., d - n_rot + 1::2] = a * s + b * c
    return x


def _hc_pre(x, fn, scale, base, hc, iters, eps, hc_eps):
    k = x.shape[0]
    m = _rms(x.reshape(k, -1), eps=eps) @ fn.T
    pre = _sigmoid(m[:, :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2.0 * _sigmoid(m[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
    c = (m[:, 2 * hc:] * scale[2] + base[2 * hc:]).reshape(k, hc, hc)  # [t, src, dst]
    comb = np.transpose(c, (0, 2, 1))                                   # [t, dst, src]
    comb = np.exp(comb - comb.max(1, keepdims=True))
    comb = comb / comb.sum(1, keepdims=True) + hc_eps                   # softmax over dst
    for it in range(iters):
        if it:
            comb = comb / (comb.sum(1, keepdims=True) + hc_eps)
        comb = comb / (comb.sum(2, keepdims=True) + hc_eps)
    return np.einsum("ts,tsn->tn", pre, x), post, comb


def _hc_post(y, x, post, comb):
    return post[:, :, None] * y[:, None, :] + np.einsum("tds,tsn->tdn", comb, x)


def ds4_names(mf):
    """ds4's file: every tensor under mtp.0."""
    return lambda n: _f64(mf, "mtp.0." + n)


def llamacpp_names(mp, block, H):
    """llama.cpp's layout in the model file: the block under blk.L., e_proj / h_proj the halves
    of nextn.eh_proj, the model's output_hc_* as the head's, nextn.shared_head_norm."""
    def g(n):
        if n in ("e_proj.weight", "h_proj.weight"):
            eh = _f64(mp, f"blk.{block}.nextn.eh_proj.weight")
            return eh[:, :H] if n.startswith("e_") else eh[:, H:]
        if n in ("enorm.weight", "hnorm.weight"):
            return _f64(mp, f"blk.{block}.nextn.{n}")
        if n == "norm.weight":
            return _f64(mp, f"blk.{block}.nextn.shared_head_norm.weight")
        if n.startswith("hc_head_"):
            return _f64(mp, "output_hc_" + n[len("hc_head_"):])
        return _f64(mp, f"blk.{block}.{n}")
    return g


def _ref_layer(g, hp, x, pos, clamp, keys_before=None, bidirectional=False):
    """A DeepSeek V4 decoder layer (compress ratio 0) in float64 on streams x (k, hc, H) at
    positions ``pos``: causal over its own rows, or (``bidirectional``) every row seeing the
    whole block; ``keys_before`` (m, D): rows at positions 0..m-1 before them (a DSpark
    context). Rows see the window pos - n_swa < s."""
    H, hc, NH, D, R = hp.n_embd, hp.hc, hp.n_head, hp.head_dim, hp.n_rot
    eps, hc_eps = hp.rms_eps, hp.hc_eps
    k = x.shape[0]
    a, post, comb = _hc_pre(x, g("hc_attn_fn.weight"), g("hc_attn_scale.weight"),
                            g("hc_attn_base.weight"), hc, hp.hc_iters, eps, hc_eps)
    a = _rms(a, g("attn_norm.weight"), eps)
    qr = _rms(a @ g("attn_q_a.weight").T, g("attn_q_a_norm.weight"), eps)
    q = _rms((qr @ g("attn_q_b.weight").T).reshape(k, NH, D), eps=eps)
    q = _rope_tail(q, pos, R, hp.rope_freq_base)
    kv = _rope_tail(_rms(a @ g("attn_kv.weight").T, g("attn_kv_a_norm.weight"), eps), pos, R,
                    hp.rope_freq_base)
    before = np.zeros((0, D)) if keys_before is None else keys_before
    keys_all = np.concatenate([before, kv])
    pos_all = np.concatenate([np.arange(len(before), dtype=np.float64), pos])
    sinks = g("attn_sinks.weight")
    o = np.zeros((k, NH, D))
    for t in range(k):
        vis = pos_all > pos[t] - hp.n_swa
        if not bidirectional:
            vis &= pos_all <= pos[t]
        keys = keys_all[vis]
        for hh in range(NH):
            sc = keys @ q[t, hh] / np.sqrt(D)
            mx = max(sc.max(), sinks[hh])
            w = np.exp(sc - mx)
            o[t, hh] = (w / (w.sum() + np.exp(sinks[hh] - mx))) @ keys
    o = _rope_tail(o, pos, R, hp.rope_freq_base, inverse=True)
    G, OR = hp.o_groups, hp.o_lora_rank
    og = o.reshape(k, G, NH * D // G)
    wo_a = g("attn_output_a.weight")
    oa = np.concatenate([og[:, gi] @ wo_a[gi * OR:(gi + 1) * OR].T for gi in range(G)], axis=1)
    x = _hc_post(oa @ g("attn_output_b.weight").T, x, post, comb)
    f, post, comb = _hc_pre(x, g("hc_ffn_fn.weight"), g("hc_ffn_scale.weight"),
                            g("hc_ffn_base.weight"), hc, hp.hc_iters, eps, hc_eps)
    f = _rms(f, g("ffn_norm.weight"), eps)
    L, Ls = clamp

    def swiglu(gv, uv, lim):
        if lim > 1e-6:
            gv, uv = np.minimum(gv, lim), np.clip(uv, -lim, lim)
        return gv / (1.0 + np.exp(-gv)) * uv

    probs = np.sqrt(np.logaddexp(0.0, f @ g("ffn_gate_inp.weight").T))
    choose = probs + g("exp_probs_b.bias")
    ge, ue, de = g("ffn_gate_exps.weight"), g("ffn_up_exps.weight"), g("ffn_down_exps.weight")
    m = hp.moe
    ff = np.zeros((k, H))
    for t in range(k):
        ids = np.argsort(-choose[t], kind="stable")[:m.n_expert_used]
        wts = probs[t, ids]
        if m.normalize_weights:
            wts = wts / max(wts.sum(), 6.103515625e-5)
        wts = wts * m.weights_scale
        for e_id, wt in zip(ids, wts):
            ff[t] += wt * (swiglu(ge[e_id] @ f[t], ue[e_id] @ f[t], L) @ de[e_id].T)
    ff += swiglu(f @ g("ffn_gate_shexp.weight").T, f @ g("ffn_up_shexp.weight").T, Ls) \
        @ g("ffn_down_shexp.weight").T
    return _hc_post(ff, x, post, comb)


def _ref_hc_head(g, hp, y):
    k = y.shape[0]
    mix = _rms(y.reshape(k, -1), eps=hp.rms_eps) @ g("hc_head_fn.weight").T
    pre = _sigmoid(mix * g("hc_head_scale.weight")[0] + g("hc_head_base.weight")) + hp.hc_eps
    return np.einsum("ts,tsn->tn", pre, y)


def reference_mtp(g, mp, hp, hidden, tokens):
    """DeepSeek V4's MTP layer in float64 for rows at positions 0.. (hidden: the target's
    streams, tokens: the next ones; g: role name -> float64 tensor); returns (the layer's
    output streams, logits)."""
    H, hc = hp.n_embd, hp.hc
    k = len(tokens)
    pos = np.arange(k, dtype=np.float64)
    emb = _f64(mp, "token_embd.weight")[np.asarray(tokens)]
    e = _rms(emb, g("enorm.weight"), hp.rms_eps) @ g("e_proj.weight").T
    h = _rms(np.asarray(hidden, np.float64).reshape(k, hc, H), g("hnorm.weight"), hp.rms_eps)
    x = e[:, None, :] + h @ g("h_proj.weight").T
    y = _ref_layer(g, hp, x, pos, (hp.clamp_exp[hp.n_layer], hp.clamp_shexp[hp.n_layer]))
    z = _rms(_ref_hc_head(g, hp, y), g("norm.weight"), hp.rms_eps)
    return y.reshape(k, hc * H), z @ _f64(mp, "output.weight").T


@pytest.mark.parametrize("path", ["mtp", "glm-mtp"])
def test_draft_logits_match_a_float64_reference(files, engine, path):
    eng = engine
    drafter = drafter_for(eng, files["mtp"] if path == "mtp" else None)
    head = drafter.mtp
    pre = eng.forward(PROMPT, 0, want_final_hidden=True, logits="last")
    hidden, toks = pre.final_hidden[:-1], PROMPT[1:]
    y = head.run(hidden, toks, 0)
    streams, logits = head.head(y)
    assert streams is y
    mf, mp = open_gguf(str(files["mtp"])), open_gguf(str(files["model"]))
    g = ds4_names(mf) if path == "mtp" else llamacpp_names(mp, CFG.n_layer, CFG.n_embd)
    ref_y, ref = reference_mtp(g, mp, eng.hparams, hidden, toks)
    err = np.abs(logits - ref).max() / np.abs(ref).max()
    # measured (ds4's file, F32 engine): 1.3e-7 (logits), 1.8e-7 (streams)
    assert err < 2e-5, err
    assert np.abs(y - ref_y).max() / np.abs(ref_y).max() < 2e-5
    assert (logits.argmax(1) == ref.argmax(1)).all()
    # the recursion: a draft row reads the previous row's output streams
    d = int(np.argmax(logits[-1]))
    head.cache.truncate(len(toks))
    y2 = head.run(y[-1:], [d], len(toks))
    _, l2 = head.head(y2)
    ref_y2, ref2 = reference_mtp(g, mp, eng.hparams, np.concatenate([hidden, y[-1:]]), toks + [d])
    assert np.abs(l2[0] - ref2[-1]).max() / np.abs(ref2[-1]).max() < 2e-5
    mf.close()
    mp.close()


def test_glm_mtp_head_uses_the_models_hc_head(files, engine):
    # llama.cpp's layout: eh_proj over [enorm(e); hnorm(h)] per stream, the model's output_hc_*
    eng = engine
    head = drafter_for(eng, None).mtp
    assert head.hc_head is eng.model.weights.hc_head and head.w.eh_proj is not None
    assert "embedded in" in drafter_for(eng, None).describe()
    assert "ds4 layout" in drafter_for(eng, files["mtp"]).describe()


# --- refusals -----------------------------------------------------------------------------------


def _err_line(r):
    lines = [ln for ln in r.output.splitlines() if ln.startswith("ds4tools:")]
    assert len(lines) == 1, r.output
    return lines[0]


def test_an_mtp_file_of_another_target_is_refused_before_anything_runs(files):
    r = CliRunner().invoke(main, ["run", "-m", str(files["model"]), "-p", "hi", "-n", "4",
                                  "--temp", "0", "--mtp", str(files["other_mtp"]), "--mtp-draft", "2"])
    assert r.exit_code == 1
    assert _err_line(r) == (f"ds4tools: {files['other_mtp']}: the MTP head was made for a target "
                            f"with q LoRA rank 64, but {files['model']} has 32 (and 3 more)")
    # the same words as inspect --target
    r2 = CliRunner().invoke(main, ["inspect", str(files["other_mtp"]), "--target", str(files["model"])])
    assert r2.exit_code == 1
    assert _err_line(r2).startswith(f"ds4tools: {files['other_mtp']}: the MTP head was made for a "
                                    f"target with q LoRA rank 64, but {files['model']} has 32")


def test_run_command_drafts_with_the_ds4_file(files):
    r = CliRunner().invoke(main, ["run", "-m", str(files["model"]), "-p", "hello", "-n", "6",
                                  "--temp", "0", "--mtp", str(files["mtp"]), "--mtp-draft", "2"])
    assert r.exit_code == 0, r.output
    assert f"mtp: MTP support model loaded: {files['mtp']} (ds4 layout" in r.output
    plain = CliRunner().invoke(main, ["run", "-m", str(files["model"]), "-p", "hello", "-n", "6",
                                      "--temp", "0"])
    assert plain.exit_code == 0
    assert r.stdout == plain.stdout
    # llama.cpp's layout: the block embedded in the model file
    g = CliRunner().invoke(main, ["run", "-m", str(files["model"]), "-p", "hello", "-n", "6",
                                  "--temp", "0", "--glm-mtp", "--mtp-draft", "3"])
    assert g.exit_code == 0, g.output
    assert f"mtp: NextN layer blk.{CFG.n_layer} embedded in {files['model']}" in g.output
    assert g.stdout == plain.stdout


def test_an_mtp_head_with_dspark_is_refused(files):
    r = CliRunner().invoke(main, ["run", "-m", str(files["model"]), "-p", "hi", "-n", "4",
                                  "--mtp", str(files["mtp"]), "--dspark"])
    assert r.exit_code == 2
    assert _err_line(r) == (f"ds4tools: {files['mtp']}: is an MTP head, not a DSpark draft: drop "
                            f"--dspark (and the --dspark-* options) to draft with it")


# --- DSpark: ds4's DeepSeek V4 layout -----------------------------------------------------------

DSPARK_BLOCK = 8
DSPARK_RANK = 32
DSPARK_LAYERS = (1, 2, 3)
NOISE = 299


def _ds4_dspark_arrays(cfg, seed: int) -> dict:
    """ds4's deepseek4-dspark tensors (numpy order): three DeepSeek V4 stages drawn as the
    model's MTP block is, main_proj / main_norm, the final stage's norm, hc_head, Markov head
    and confidence projection."""
    H, V, r = cfg.n_embd, cfg.n_vocab, DSPARK_RANK
    out = {}
    for j in range(3):
        w = deepseek4_model.random_weights(cfg, np.random.default_rng(seed + j))
        p = f"blk.{cfg.n_layer}."
        for name, a in w.items():
            if name.startswith(p) and ".nextn." not in name:
                out[f"mtp.{j}." + name[len(p):]] = a
    rng = np.random.default_rng(seed + 100)
    n_t = len(DSPARK_LAYERS)
    out["mtp.0.main_proj.weight"] = (rng.standard_normal((H, n_t * H)) / np.sqrt(n_t * H)).astype(np.float32)
    out["mtp.0.main_norm.weight"] = (1 + 0.1 * rng.standard_normal(H)).astype(np.float32)
    last = "mtp.2."
    out[last + "norm.weight"] = (1 + 0.1 * rng.standard_normal(H)).astype(np.float32)
    out[last + "hc_head_fn.weight"] = (rng.standard_normal((cfg.hc, cfg.hc * H))
                                       / np.sqrt(cfg.hc * H)).astype(np.float32)
    out[last + "hc_head_base.weight"] = (0.3 * rng.standard_normal(cfg.hc)).astype(np.float32)
    out[last + "hc_head_scale.weight"] = np.ones(1, np.float32)
    out[last + "markov_head.markov_w1.weight"] = rng.standard_normal((V, r)).astype(np.float32)
    out[last + "markov_head.markov_w2.weight"] = (rng.standard_normal((V, r)) / np.sqrt(r)).astype(np.float32)
    out[last + "confidence_head.proj.weight"] = (rng.standard_normal((1, H + r))
                                                 / np.sqrt(H + r)).astype(np.float32)
    return out


def write_ds4_dspark(path, target_path, seed: int = 21, block: int = DSPARK_BLOCK, cfg=CFG):
    from ds4tools.support import dspark_ds4
    info = open_target(str(target_path))
    keys = dspark_ds4.metadata_keys(dspark_ds4.ARCH_V4, block, DSPARK_RANK, NOISE, DSPARK_LAYERS,
                                    info.dims, "synthetic DSpark")
    specs = dspark_ds4.specs(info.dims, 3, len(DSPARK_LAYERS), DSPARK_RANK, True)
    tensors = _array_tensors(specs, _ds4_dspark_arrays(cfg, seed),
                             Target("Q8_0", "Q8_0", GUESSED_FTYPE, False), str(target_path))
    write_support_gguf(path, dspark_ds4.ARCH_V4, keys, tensors, where=str(target_path), progress=False)


@pytest.fixture(scope="module")
def dspark_file(files, tmp_path_factory):
    path = tmp_path_factory.mktemp("dspark-deepseek4") / "dspark.gguf"
    write_ds4_dspark(path, files["model"])
    return path


def dspark_drafter_for(engine, path, block=None, confidence=None, strict=False):
    cfg = SpecConfig(mtp_file=str(path), dspark=True, dspark_block_size=block,
                     dspark_confidence=confidence, dspark_strict=strict).resolved(0.0)
    return build_drafter(engine, cfg)


def test_the_ds4_dspark_file_validates_against_its_target(files, dspark_file):
    r = CliRunner().invoke(main, ["inspect", str(dspark_file), "--target", str(files["model"])])
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("block", [2, 3, 5, 8])
def test_dspark_greedy_output_equals_plain(files, engine, dspark_file, block):
    eng = engine
    plain = list(decode(eng.model, PROMPT, 16, GREEDY, np.random.default_rng(0), frozenset()))
    for confidence, strict in ((None, False), (0.5, False), (None, True)):
        drafter = dspark_drafter_for(eng, dspark_file, block, confidence, strict)
        assert drafter.bb is not None and drafter.hidden_layers == DSPARK_LAYERS
        st = SpecStats(method="dspark")
        got = list(speculative_decode(eng.model, drafter, PROMPT, 16, GREEDY, np.random.default_rng(0),
                                      frozenset(), spec=st, strict=strict, calibrate=False))
        assert got == plain, (block, confidence, strict)
        assert st.steps > 0
        _check_rollback(eng, PROMPT + got)


def reference_dspark(df, mp, hp, feats, anchor, block):
    """The DSpark block in float64 (see deepseek4.Deepseek4DSpark): (z, base logits) of the B
    slots after the context rows 0..len(feats)-1."""
    H, hc, R = hp.n_embd, hp.hc, hp.n_rot
    stage = lambda j: (lambda n: _f64(df, f"mtp.{j}." + n))  # noqa: E731
    ctx = _rms(np.asarray(feats, np.float64) @ _f64(df, "mtp.0.main_proj.weight").T,
               _f64(df, "mtp.0.main_norm.weight"), hp.rms_eps)
    a = len(feats)
    pos_ctx = np.arange(a, dtype=np.float64)
    ids = [anchor] + [NOISE] * (block - 1)
    x = np.repeat(_f64(mp, "token_embd.weight")[ids][:, None, :], hc, axis=1)
    pos = np.arange(a, a + block, dtype=np.float64)
    clamp = (hp.clamp_exp[hp.n_layer - 1], hp.clamp_shexp[hp.n_layer - 1])
    for j in range(3):
        g = stage(j)
        before = _rope_tail(_rms(ctx @ g("attn_kv.weight").T, g("attn_kv_a_norm.weight"), hp.rms_eps),
                            pos_ctx, R, hp.rope_freq_base)
        x = _ref_layer(g, hp, x, pos, clamp, before, bidirectional=True)
    z = _ref_hc_head(stage(2), hp, x)
    normed = _rms(z, _f64(df, "mtp.2.norm.weight"), hp.rms_eps)
    return z, normed @ _f64(mp, "output.weight").T


def test_dspark_block_matches_a_float64_reference(files, engine, dspark_file):
    eng = engine
    drafter = dspark_drafter_for(eng, dspark_file, confidence=0.01)
    pre = eng.forward(PROMPT, 0, hidden_layers=DSPARK_LAYERS, logits="last")
    drafter.start(PROMPT, pre)
    anchor = int(np.argmax(pre.logits[-1]))
    z, normed = drafter.bb.block(anchor)
    U = drafter._base_logits(np.ascontiguousarray(normed))
    feats = drafter._features(pre.hidden, PROMPT, len(PROMPT))
    # the features: the streams' mean of each target layer's output
    assert feats.shape == (len(PROMPT), len(DSPARK_LAYERS) * CFG.n_embd)
    df, mp = open_gguf(str(dspark_file)), open_gguf(str(files["model"]))
    ref_z, ref_U = reference_dspark(df, mp, eng.hparams, feats, anchor, DSPARK_BLOCK)
    err_z = np.abs(z - ref_z).max() / np.abs(ref_z).max()
    err_U = np.abs(U - ref_U).max() / np.abs(ref_U).max()
    # measured: z 3.3e-7, logits 1.8e-7 (F32 engine; the file's Q8_0 weights dequantized)
    assert err_z < 2e-5 and err_U < 2e-5, (err_z, err_U)
    assert (U.argmax(1) == ref_U.argmax(1)).all()
    # the confidence head reads the pre-norm collapsed row and W1[previous token]
    prop = drafter.propose(anchor, DSPARK_BLOCK, GREEDY, np.random.default_rng(0))
    w1 = _f64(df, "mtp.2.markov_head.markov_w1.weight")
    cw = _f64(df, "mtp.2.confidence_head.proj.weight")[0]
    c0 = 1.0 / (1.0 + np.exp(-(np.concatenate([ref_z[0], w1[anchor]]) @ cw)))
    assert abs(prop.confidence[0] - c0) < 1e-5
    w2 = _f64(df, "mtp.2.markov_head.markov_w2.weight")
    assert prop.tokens[0] == int(np.argmax(ref_U[0] + w2 @ w1[anchor]))
    df.close()
    mp.close()


def test_dspark_partial_accept_leaves_the_context_as_a_fresh_start(files, engine, dspark_file):
    # commit the anchor and one draft (as if the target had accepted one), then draft again:
    # the same context rows and drafts as a drafter started on the committed sequence
    eng = engine
    pre = eng.forward(PROMPT, 0, hidden_layers=DSPARK_LAYERS, logits="last")
    anchor = int(np.argmax(pre.logits[-1]))
    drafter = dspark_drafter_for(eng, dspark_file)
    drafter.start(PROMPT, pre)
    prop = drafter.propose(anchor, 4, GREEDY, np.random.default_rng(0))
    assert len(prop.tokens) == 4
    verify = eng.forward([anchor] + prop.tokens, len(PROMPT), hidden_layers=DSPARK_LAYERS, logits="all")
    drafter.commit(anchor, prop, 1, verify)
    nxt = int(np.argmax(verify.logits[1]))
    again = drafter.propose(nxt, 4, GREEDY, np.random.default_rng(0))
    seq = PROMPT + [anchor] + prop.tokens[:1]
    fresh = dspark_drafter_for(eng, dspark_file)
    fresh.start(seq, eng.forward(seq, 0, hidden_layers=DSPARK_LAYERS, logits="last"))
    want = fresh.propose(nxt, 4, GREEDY, np.random.default_rng(0))
    assert again.tokens == want.tokens
    a, b = drafter.bb.cache, fresh.bb.cache
    assert a.length == b.length == len(seq)
    np.testing.assert_array_equal(a.raw[:, :a.length].view(np.uint32), b.raw[:, :b.length].view(np.uint32))


def test_dspark_run_command(files, dspark_file):
    r = CliRunner().invoke(main, ["run", "-m", str(files["model"]), "-p", "hello", "-n", "6",
                                  "--temp", "0", "--mtp", str(dspark_file), "--dspark",
                                  "--dspark-block-size", "4"])
    assert r.exit_code == 0, r.output
    assert f"mtp/dspark: stages=3 block={DSPARK_BLOCK} markov_rank={DSPARK_RANK} " in r.output
    plain = CliRunner().invoke(main, ["run", "-m", str(files["model"]), "-p", "hello", "-n", "6",
                                      "--temp", "0"])
    assert r.stdout == plain.stdout


def test_a_dspark_file_of_another_target_is_refused_before_anything_runs(files, tmp_path):
    path = tmp_path / "other-dspark.gguf"
    write_ds4_dspark(path, files["other"], cfg=dataclasses.replace(CFG, n_lora_q=64))
    r = CliRunner().invoke(main, ["run", "-m", str(files["model"]), "-p", "hi", "-n", "4",
                                  "--temp", "0", "--mtp", str(path), "--dspark"])
    assert r.exit_code == 1
    first = (f"ds4tools: {path}: the DSpark draft was made for a target with q LoRA rank 64, but "
             f"{files['model']} has 32")
    assert _err_line(r) == first + " (and 9 more)"
    # the same words as inspect --target
    r2 = CliRunner().invoke(main, ["inspect", str(path), "--target", str(files["model"])])
    assert r2.exit_code == 1 and _err_line(r2) == first + " (and 9 more errors)"
