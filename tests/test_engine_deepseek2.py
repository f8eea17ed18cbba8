"""The deepseek2 (DeepSeek V2/V3, Kimi K2) decoder: MLA attention over a latent cache, YaRN,
leading dense layers and the mixture-of-experts block.

Oracle: llama.cpp's logits and greedy continuations on the synthetic models of
tests/deepseek2_model.py, captured once into tests/fixtures/llamacpp/deepseek2.npz by
tools/capture_llamacpp_fixtures.py (llama-cpp-python is not in CI); the files are rewritten
here from their seed and checked against the fixture's digest. Then the engine's own rules:
batch-independent logits, truncate + re-decode over the latent cache, one-line errors.
"""
import numpy as np
import pytest

from ds4tools.engine import Engine
from ds4tools.engine.latent_cache import LatentCache
from ds4tools.errors import UsageError
from tests import llamacpp_families
from tests.llamacpp_families import (assert_lookup_is_lossless, assert_one_line_error,
                                     assert_run_prints_what_the_api_generates,
                                     assert_snapshot_and_restore_bring_back_overwritten_rows,
                                     assert_truncate_and_redecode_equals_a_fresh_prefill,
                                     batched_single_and_chunked, greedy_continuation, load_fixture,
                                     logits_against_llama_cpp, write_cases, SEED)
from tests.deepseek2_model import ARCH, CASES, Deepseek2Config, write_case, write_model


@pytest.fixture(scope="module")
def fixture():
    return load_fixture(ARCH)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return write_cases(tmp_path_factory.mktemp(ARCH), CASES, write_case)


def engine_for(path, case, **kw):
    return llamacpp_families.engine_for(path, CASES[case][1], **kw)


# --- against llama.cpp --------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_llama_cpp(case, files, fixture):
    ours, theirs = logits_against_llama_cpp(engine_for(files[case], case), files[case], fixture,
                                            case, ARCH)
    err = np.abs(ours - theirs).max() / np.abs(theirs).max()
    assert err < 1e-3, err  # measured: 2e-7 (F32), 1e-7 (Q8_0)
    assert (ours.argmax(1) == theirs.argmax(1)).all()


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_continuation_matches_llama_cpp(case, files, fixture):
    got = greedy_continuation(engine_for(files[case], case), fixture, case)
    assert got == fixture[f"{case}/greedy"].tolist()


def test_default_int8_mode_keeps_llama_cpp_greedy(files, fixture):
    # what `ds4tools run` uses: int8 only where it pays; the continuation must not change
    # (not asked of the lite case: its first token is a near tie that llama.cpp's int8
    # activations decide, and float32 activations on the short rows decide otherwise)
    got = greedy_continuation(Engine(files["q8_0"]), fixture, "q8_0", 16)
    assert got == fixture["q8_0/greedy"].tolist()


@pytest.mark.parametrize("change", [
    {"deepseek2.rope.scaling.yarn_log_multiplier": 0.0},  # the mscale in the attention scale
    {"deepseek2.rope.scaling.type": "linear"},            # YaRN's ramp and rope attn_factor
])
def test_the_fixture_pins_yarn(change, fixture, tmp_path):
    # each part of YaRN moves the logits far beyond the tolerance: the match above tests them
    case = "f32-lite-softmax-yarn"
    path = tmp_path / "changed.gguf"
    write_model(path, CASES[case][0], "F32", SEED, extra_metadata=change)
    ours = Engine(path, exact=True).forward(fixture[f"{case}/prompt"], 0).logits
    theirs = fixture[f"{case}/logits"]
    assert np.abs(ours - theirs).max() / np.abs(theirs).max() > 1e-2


# --- the engine's own rules ---------------------------------------------------------------------


def _rope_pairs(x, positions, base, n_rot):
    """llama.cpp's "norm" rope on the last axis of x (k, ..., n_rot), in float64."""
    inv = base ** (-np.arange(0, n_rot, 2) / n_rot)
    ang = positions[:, None] * inv[None, :]
    shape = (len(positions),) + (1,) * (x.ndim - 2) + (n_rot // 2,)
    c, s = np.cos(ang).reshape(shape), np.sin(ang).reshape(shape)
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * c - b * s
    out[..., 1::2] = a * s + b * c
    return out


def test_absorbed_attention_equals_expanded_multi_head_attention(tmp_path):
    # the latent path (q through Wk_b into latent space, values from the latent through Wv_b)
    # against plain causal multi-head attention on expanded keys and values, in float64
    from ds4tools.engine import kernels
    from ds4tools.engine.mla import MLAWorkspace, mla_attention_block
    cfg = Deepseek2Config()
    path = tmp_path / "m.gguf"
    w = {n: a.astype(np.float64) for n, a in write_model(path, cfg, "F32", SEED).items()}
    eng = Engine(path, exact=True)
    hp = eng.hparams
    k, NH, R = 7, cfg.n_head, cfg.n_rot
    x = np.random.default_rng(8).standard_normal((k, cfg.n_embd)).astype(np.float32)
    pos = np.arange(k)

    ours = x.copy()
    cache = LatentCache(1, 16, cfg.n_lora_kv, R)
    mla_attention_block(ours, eng.weights.layers[1].attn, hp.mla, hp.rms_eps, hp.kq_scale, cache, 0,
                        pos, pos + 1, kernels.rope_tables(16, R, cfg.rope_base),
                        MLAWorkspace(hp.mla, cfg.n_embd, 8))

    def rms(v, g):
        return v / np.sqrt((v * v).mean(-1, keepdims=True) + cfg.rms_eps) * g

    p = "blk.1."
    h = rms(x.astype(np.float64), w[p + "attn_norm.weight"])
    q = rms(h @ w[p + "attn_q_a.weight"].T, w[p + "attn_q_a_norm.weight"]) @ w[p + "attn_q_b.weight"].T
    q = q.reshape(k, NH, -1)
    kv = h @ w[p + "attn_kv_a_mqa.weight"].T
    c = rms(kv[:, :cfg.n_lora_kv], w[p + "attn_kv_a_norm.weight"])
    k_pe = _rope_pairs(kv[:, cfg.n_lora_kv:], pos, cfg.rope_base, R)
    keys = np.concatenate([np.einsum("hcd,tc->thd", w[p + "attn_k_b.weight"], c),
                           np.repeat(k_pe[:, None], NH, 1)], axis=2)            # (k, NH, n_k)
    values = np.einsum("hvc,tc->thv", w[p + "attn_v_b.weight"], c)              # (k, NH, n_v)
    qr = np.concatenate([q[:, :, :cfg.n_nope], _rope_pairs(q[:, :, cfg.n_nope:], pos, cfg.rope_base, R)], 2)
    s = np.einsum("thd,uhd->htu", qr, keys) / np.sqrt(cfg.n_nope + R)
    s = np.where(np.tril(np.ones((k, k), bool)), s, -np.inf)
    a = np.exp(s - s.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    o = np.einsum("htu,uhv->thv", a, values).reshape(k, -1) @ w[p + "attn_output.weight"].T
    want = x + o
    assert np.abs(ours - want).max() < 1e-4 * np.abs(want).max()
    # and what the cache holds is the latent: [rmsnorm(c) | rope(k_pe)]
    np.testing.assert_allclose(cache.rows[0, :k], np.concatenate([c, k_pe], 1), rtol=1e-4, atol=1e-5)


def test_the_cache_holds_the_latent(files):
    eng = Engine(files["f32"], n_ctx=64)
    cfg = CASES["f32"][0]
    assert isinstance(eng.cache, LatentCache)
    # one row of kv_lora_rank + rope dims per layer and position, whatever the head count
    assert eng.cache.rows.shape == (cfg.n_layer, 64, cfg.n_lora_kv + cfg.n_rot)
    eng.forward(np.arange(5), 0)
    assert eng.cache.length == 5
    assert eng.cache.rows[:, :5].any(axis=2).all()
    assert not eng.cache.rows[:, 5:].any()


@pytest.mark.parametrize("case, int8, cache_type", [
    ("f32", "none", "f32"), ("q8_0", "all", "f32"), ("q8_0", "default", "f16"),
    ("f32-lite-softmax-yarn", "none", "f32"), ("q8_0-lite-softmax-yarn", "all", "f16")])
def test_batched_and_single_token_logits_are_bit_identical(case, int8, cache_type, files):
    toks = np.random.default_rng(3).integers(0, 300, 11)
    whole, single, chunked, batched = batched_single_and_chunked(files[case], toks, int8=int8,
                                                                 cache_type=cache_type)
    assert np.array_equal(whole, single) and np.array_equal(whole, chunked)
    # the tokens are routed differently (the last layer's choice, left in the workspace), so
    # the batch mixes experts: otherwise this test would prove little
    chosen = batched.model.moe_ws.ids[:len(toks)]
    assert len({tuple(r) for r in chosen}) > 3 and len(np.unique(chosen)) >= 5


@pytest.mark.parametrize("case, cache_type", [("f32", "f32"), ("q8_0", "f32"),
                                              ("q8_0-lite-softmax-yarn", "f16")])
def test_truncate_and_redecode_equals_a_fresh_prefill(case, cache_type, files):
    assert_truncate_and_redecode_equals_a_fresh_prefill(files[case], cache_type=cache_type)


def test_snapshot_and_restore_bring_back_overwritten_rows(files):
    assert_snapshot_and_restore_bring_back_overwritten_rows(files["f32"], 8)


def test_nextn_layers_are_loaded_by_name_and_not_run(files, tmp_path):
    cfg = Deepseek2Config(n_nextn=1)
    with_nextn = tmp_path / "with-nextn.gguf"
    write_model(with_nextn, cfg, "F32", SEED)
    eng = Engine(with_nextn, exact=True)
    assert (eng.hparams.n_layer, eng.hparams.n_nextn, len(eng.weights.layers)) == (3, 1, 3)
    # the decoder blocks are the f32 case's (the NextN block's weights come after theirs)
    toks = np.arange(7)
    assert np.array_equal(eng.forward(toks, 0).logits,
                          Engine(files["f32"], exact=True).forward(toks, 0).logits)


def test_prompt_lookup_drafting_is_lossless_and_model_drafters_are_refused(files):
    from ds4tools.engine.speculative.config import SpecConfig
    assert_lookup_is_lossless(files["f32"])
    with pytest.raises(UsageError, match="drafting with a model .* is not available for deepseek2"):
        Engine(files["f32"], spec=SpecConfig(dspark=True))  # MTP drafting: tests/test_mtp_moe.py


def test_run_command_generates_as_the_api(files):
    assert_run_prints_what_the_api_generates(files["q8_0"])


# --- bad files: one line naming the file --------------------------------------------------------


def _bad(tmp_path, **kw):
    path = tmp_path / "bad.gguf"
    cfg = kw.pop("cfg", Deepseek2Config())
    write_model(path, cfg, "F32", SEED, **kw)
    return path


def _meta_patch(tmp_path, **changes):
    # metadata that says something the tensors do not
    return _bad(tmp_path, extra_metadata={f"deepseek2.{k}": v for k, v in changes.items()})


def _fewer_experts(tmp_path):
    cfg = Deepseek2Config()
    return _bad(tmp_path, override={"blk.1.ffn_up_exps.weight": np.ones(
        (6, cfg.n_ff_exp, cfg.n_embd), np.float32)})


def _legacy_kv_b(tmp_path):
    # the layout older converters wrote: one attn_kv_b instead of attn_k_b / attn_v_b, and no
    # key_length_mla / value_length_mla keys
    cfg = Deepseek2Config()
    kv_b = np.ones((cfg.n_head * (cfg.n_nope + cfg.n_v), cfg.n_lora_kv), np.float32)
    return _bad(tmp_path, drop=[f"blk.{i}.attn_{t}_b.weight" for i in range(cfg.n_layer) for t in "kv"],
                override={f"blk.{i}.attn_kv_b.weight": kv_b for i in range(cfg.n_layer)},
                drop_metadata=[f"deepseek2.attention.{k}_length_mla" for k in ("key", "value")])


@pytest.mark.parametrize("make, message", [
    (lambda p: _bad(p, drop=["blk.2.ffn_gate_exps.weight"]), "missing tensor blk.2.ffn_gate_exps.weight"),
    (_fewer_experts, "tensor blk.1.ffn_up_exps.weight holds 6 experts but deepseek2.expert_count is 8"),
    (lambda p: _meta_patch(p, expert_used_count=9),
     "deepseek2.expert_used_count (9) is larger than deepseek2.expert_count (8)"),
    # kv_lora_rank that the tensors do not have (the cache row keys kept consistent with it) ...
    (lambda p: _meta_patch(p, **{"attention.kv_lora_rank": 24, "attention.key_length": 40,
                                 "attention.value_length": 24}),
     "tensor blk.0.attn_kv_a_mqa.weight has shape (48, 64) (numpy order), expected (40, 64)"),
    # ... or the cache row keys that do not follow from it
    (lambda p: _meta_patch(p, **{"attention.kv_lora_rank": 24}),
     "deepseek2.attention.key_length (48) is not deepseek2.attention.kv_lora_rank + "
     "deepseek2.rope.dimension_count (24 + 16)"),
    (lambda p: _meta_patch(p, **{"attention.key_length_mla": 40}),
     "tensor blk.0.attn_q_b.weight has shape (192, 32) (numpy order), expected (160, 32)"),
    (lambda p: _bad(p, drop=["blk.0.attn_k_b.weight"]), "missing tensor blk.0.attn_k_b.weight"),
    (lambda p: _bad(p, drop=["blk.1.attn_q_a_norm.weight"]), "missing tensor blk.1.attn_q_a_norm.weight"),
    (_legacy_kv_b, "no deepseek2.attention.key_length_mla: the legacy MLA layout"),
    (lambda p: _bad(p, override={"blk.1.bogus.weight": np.ones(4, np.float32)}),
     "unexpected tensor blk.1.bogus.weight for a deepseek2 model"),
])
def test_bad_files_give_one_line_naming_the_file(tmp_path, make, message):
    assert_one_line_error(make(tmp_path), message)
