"""The glm4moe (GLM-4.5 family) decoder and the mixture-of-experts block.

Oracle: llama.cpp's logits and greedy continuations on the synthetic models of
tests/glm4moe_model.py, captured once into tests/fixtures/llamacpp/glm4moe.npz by
tools/capture_llamacpp_fixtures.py (llama-cpp-python is not in CI); the files are rewritten
here from their seed and checked against the fixture's digest. Then the engine's own rules:
batch-independent logits, truncate + re-decode, and one-line errors for bad files.
"""
import numpy as np
import pytest

from ds4tools.engine import Engine
from ds4tools.engine.moe import select_experts
from ds4tools.errors import UsageError
from tests import llamacpp_families
from tests.llamacpp_families import (assert_lookup_is_lossless, assert_one_line_error,
                                     assert_run_prints_what_the_api_generates,
                                     assert_truncate_and_redecode_equals_a_fresh_prefill,
                                     batched_single_and_chunked, greedy_continuation, load_fixture,
                                     logits_against_llama_cpp, write_cases, SEED)
from tests.glm4moe_model import ARCH, CASES, Glm4MoeConfig, write_case, write_model


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
    assert err < 1e-3, err  # measured: 3e-7 (F32), 7e-8 (Q8_0)
    assert (ours.argmax(1) == theirs.argmax(1)).all()


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_continuation_matches_llama_cpp(case, files, fixture):
    got = greedy_continuation(engine_for(files[case], case), fixture, case)
    assert got == fixture[f"{case}/greedy"].tolist()


def test_default_int8_mode_keeps_llama_cpp_greedy(files, fixture):
    # what `ds4tools run` uses: int8 only where it pays; the continuation must not change
    got = greedy_continuation(Engine(files["q8_0"]), fixture, "q8_0", 16)
    assert got == fixture["q8_0/greedy"].tolist()


# --- the engine's own rules ---------------------------------------------------------------------


@pytest.mark.parametrize("case, int8, cache_type", [
    ("f32", "none", "f32"), ("q8_0", "all", "f32"), ("q8_0", "default", "f16"),
    ("f32-softmax-groups", "none", "f32")])
def test_batched_and_single_token_logits_are_bit_identical(case, int8, cache_type, files):
    toks = np.random.default_rng(3).integers(0, 300, 11)
    whole, single, chunked, batched = batched_single_and_chunked(files[case], toks, int8=int8,
                                                                 cache_type=cache_type)
    assert np.array_equal(whole, single) and np.array_equal(whole, chunked)
    # the tokens are routed differently (the last layer's choice, left in the workspace), so
    # the batch mixes experts: otherwise this test would prove little
    chosen = batched.model.moe_ws.ids[:len(toks)]
    assert len({tuple(r) for r in chosen}) > 3 and len(np.unique(chosen)) >= 6


@pytest.mark.parametrize("case", ["f32", "q8_0"])
def test_truncate_and_redecode_equals_a_fresh_prefill(case, files):
    assert_truncate_and_redecode_equals_a_fresh_prefill(files[case])


def test_nextn_layers_are_loaded_by_name_and_not_run(files, tmp_path):
    eng = Engine(files["f32"], exact=True)
    assert (eng.hparams.n_layer, eng.hparams.n_nextn) == (3, 1)
    assert len(eng.weights.layers) == 3
    # a trunk-only file (the NextN layer split out, as llama.cpp accepts) gives the same logits
    cfg = Glm4MoeConfig()
    nextn = [n for n in _tensor_names(files["f32"]) if n.startswith("blk.3.")]
    trunk = tmp_path / "trunk.gguf"
    write_model(trunk, cfg, "F32", SEED, drop=nextn)
    toks = np.arange(7)
    assert np.array_equal(Engine(trunk, exact=True).forward(toks, 0).logits,
                          eng.forward(toks, 0).logits)


def _tensor_names(path):
    from ds4tools.gguf_io.reader import open_gguf
    f = open_gguf(path)
    try:
        return list(f.tensors)
    finally:
        f.close()


# --- the routing, against a plain numpy statement of it ---------------------------------------


def _route_reference(logits, bias, sigmoid, n_group, n_group_used, normalize, scale, n_used):
    x = logits.astype(np.float64)
    probs = 1 / (1 + np.exp(-x)) if sigmoid else np.exp(x - x.max(1, keepdims=True))
    if not sigmoid:
        probs /= probs.sum(1, keepdims=True)
    choose = probs + bias
    if n_group > 1:
        g = choose.reshape(len(x), n_group, -1)
        score = np.sort(g, axis=2)[:, :, -2:].sum(2)
        keep = np.argsort(-score, axis=1, kind="stable")[:, :n_group_used]
        mask = np.ones_like(score, bool)
        np.put_along_axis(mask, keep, False, axis=1)
        choose = np.where(np.repeat(mask, g.shape[2], axis=1), -np.inf, choose)
    ids = np.argsort(-choose, axis=1, kind="stable")[:, :n_used]
    w = np.take_along_axis(probs, ids, 1)
    if normalize:
        w /= w.sum(1, keepdims=True)
    return ids, w * scale


@pytest.mark.parametrize("sigmoid, n_group, n_group_used, normalize, scale", [
    (True, 0, 0, True, 2.5), (False, 0, 0, False, 1.0), (False, 4, 2, True, 1.0), (True, 8, 3, False, 16.0)])
def test_expert_selection(sigmoid, n_group, n_group_used, normalize, scale):
    rng = np.random.default_rng(5)
    k, n_expert, n_used = 40, 16, 4
    logits = (rng.standard_normal((k, n_expert)) * 2).astype(np.float32)
    bias = (0.1 * rng.standard_normal(n_expert)).astype(np.float32)
    ids = np.empty((k, n_used), np.int64)
    w = np.empty((k, n_used), np.float32)
    select_experts(logits, bias, sigmoid, n_group, n_group_used, normalize, np.float32(scale), ids, w)
    want_ids, want_w = _route_reference(logits, bias, sigmoid, n_group, n_group_used, normalize,
                                        scale, n_used)
    assert np.array_equal(ids, want_ids)
    np.testing.assert_allclose(w, want_w, rtol=1e-5)
    if n_group:  # every chosen expert lies in one of the chosen groups
        assert max(len(set(r)) for r in ids // (n_expert // n_group)) <= n_group_used


# --- bad files and requests: one line naming the file -----------------------------------------


def _bad(tmp_path, **kw):
    path = tmp_path / "bad.gguf"
    cfg = kw.pop("cfg", Glm4MoeConfig())
    write_model(path, cfg, "F32", SEED, **kw)
    return path


def _fewer_experts(tmp_path):
    rng = np.random.default_rng(0)
    cfg = Glm4MoeConfig()
    return _bad(tmp_path, override={"blk.1.ffn_up_exps.weight": rng.standard_normal(
        (6, cfg.n_ff_exp, cfg.n_embd)).astype(np.float32)})


def _meta_patch(tmp_path, **changes):
    # metadata that says something the tensors do not
    return _bad(tmp_path, extra_metadata={f"glm4moe.{k}": v for k, v in changes.items()})


@pytest.mark.parametrize("make, message", [
    (lambda p: _bad(p, drop=["blk.2.ffn_up_exps.weight"]), "missing tensor blk.2.ffn_up_exps.weight"),
    (_fewer_experts, "tensor blk.1.ffn_up_exps.weight holds 6 experts but glm4moe.expert_count is 8"),
    (lambda p: _meta_patch(p, expert_count=10),
     "tensor blk.1.ffn_gate_inp.weight has shape (8, 64) (numpy order), expected (10, 64)"),
    (lambda p: _meta_patch(p, expert_used_count=9),
     "glm4moe.expert_used_count (9) is larger than glm4moe.expert_count (8)"),
    (lambda p: _meta_patch(p, expert_gating_func=4), "unsupported glm4moe.expert_gating_func 4"),
    (lambda p: _bad(p, drop=["blk.1.exp_probs_b.bias"]), "missing tensor blk.1.exp_probs_b.bias"),
    (lambda p: _bad(p, override={"blk.1.bogus.weight": np.ones(4, np.float32)}),
     "unexpected tensor blk.1.bogus.weight for a glm4moe model"),
])
def test_bad_files_give_one_line_naming_the_file(tmp_path, make, message):
    assert_one_line_error(make(tmp_path), message)


# --- the command line ---------------------------------------------------------------------------


def test_run_command_generates_as_the_api(files):
    assert_run_prints_what_the_api_generates(files["q8_0"])


def test_prompt_lookup_drafting_is_lossless_and_model_drafters_are_refused(files):
    from ds4tools.engine.speculative.config import SpecConfig
    assert_lookup_is_lossless(files["f32"])
    with pytest.raises(UsageError, match="drafting with a model .* is not available for glm4moe"):
        Engine(files["f32"], spec=SpecConfig(dspark=True))  # MTP drafting: tests/test_mtp_moe.py
