"""The engine against a float64 numpy reference written from the equations (tests/reference_model.py).

F32 weights: logits agree to 1e-4 relative. Every format of the registry: the engine's exact
(float32-activation) path equals the reference run on the dequantized weights to float32
tolerance; the int8-activation path, where a format has one, stays close.
"""
import json

import numpy as np
import pytest

from ds4tools import formats
from ds4tools.engine import Engine
from ds4tools.engine.weights import int8_for
from tests.fixtures import hf_models
from tests.reference_model import RefConfig, reference_forward, write_random_model

# Rows of 256 so that every format (K-quants, IQ types) can store every matrix.
LLAMA = RefConfig("llama", n_vocab=300, n_embd=256, n_layer=2, n_head=4, n_head_kv=2, head_dim=64, n_ff=512)
QWEN3 = RefConfig("qwen3", n_vocab=300, n_embd=256, n_layer=2, n_head=4, n_head_kv=1, head_dim=64, n_ff=512)
TOKENS = np.random.default_rng(3).integers(0, 300, 24)


def rel_err(a, ref) -> float:
    return float(np.abs(np.asarray(a, np.float64) - ref).max() / np.abs(ref).max())


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tmp_path_factory.mktemp("engine-ref")


@pytest.mark.parametrize("cfg", [LLAMA, QWEN3], ids=["llama", "qwen3"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_f32_logits_match_reference(models, cfg, tied):
    path = models / f"{cfg.arch}-{tied}-f32.gguf"
    stored = write_random_model(path, cfg, seed=1, tied=tied)
    eng = Engine(path, exact=True)
    assert eng.weights.tied_output == tied
    res = eng.forward(TOKENS, 0, hidden_layers=(0, 1), want_final_hidden=True)
    ref, hidden, final = reference_forward(stored, cfg, TOKENS, hidden_layers=(0, 1))
    assert res.logits.shape == (len(TOKENS), cfg.n_vocab) and res.logits.dtype == np.float32
    assert rel_err(res.logits, ref) < 1e-4
    for layer in (0, 1):
        assert rel_err(res.hidden[layer], hidden[layer]) < 1e-4
    assert rel_err(res.final_hidden, final) < 1e-4
    # "last" gives the last row only, bit-identical to the full run's last row
    eng.cache.clear()
    last = eng.forward(TOKENS, 0, logits="last").logits
    np.testing.assert_array_equal(last, res.logits[-1:])


FORMATS = sorted(formats.FORMATS)


# every format on qwen3; llama (which differs only outside the matmuls) on a few
CASES = [(QWEN3, f) for f in FORMATS] + [(LLAMA, f) for f in ("Q8_0", "Q4_K", "IQ2_XXS")]


@pytest.mark.parametrize("cfg, fmt", CASES, ids=[f"{c.arch}-{f}" for c, f in CASES])
def test_every_format_matches_reference_on_dequantized_weights(models, cfg, fmt):
    path = models / f"{cfg.arch}-{fmt}.gguf"
    stored = write_random_model(path, cfg, seed=2, default_type=fmt)
    eng = Engine(path, exact=True)
    assert all(lin.fmt.name == fmt for lin in eng.weights.linears())
    ref = reference_forward(stored, cfg, TOKENS)[0]
    assert rel_err(eng.forward(TOKENS, 0).logits, ref) < 2e-5
    if formats.FORMATS[fmt].has_int8_matmul:
        eng.set_int8("all")
        assert all(lin.int8 for lin in eng.weights.linears())
        approx = eng.forward(TOKENS, 0).logits
        assert rel_err(approx, ref) < 3e-2
        eng.set_exact(True)
        assert not np.array_equal(approx, eng.forward(TOKENS, 0).logits)  # another path ran


def test_mixed_formats_per_tensor(models):
    types = {"blk.0.attn_q.weight": "Q4_K", "blk.0.ffn_down.weight": "Q6_K", "blk.1.attn_v.weight": "F16",
             "token_embd.weight": "Q8_0", "output.weight": "Q5_K", "blk.1.ffn_gate.weight": "IQ4_NL"}
    path = models / "mixed.gguf"
    stored = write_random_model(path, QWEN3, seed=4, types=types)
    eng = Engine(path, exact=True)
    assert eng.weights.layers[0].wq.fmt.name == "Q4_K" and eng.weights.output.fmt.name == "Q5_K"
    ref = reference_forward(stored, QWEN3, TOKENS)[0]
    assert rel_err(eng.forward(TOKENS, 0).logits, ref) < 2e-5


def test_biases_partial_rotary_and_rope_scaling(models):
    cfg = RefConfig("llama", n_vocab=300, n_embd=128, n_layer=2, n_head=4, n_head_kv=4, head_dim=32,
                    n_ff=192, rope_base=5000.0, n_rot=16, freq_scale=0.25)
    path = models / "llama-bias-rope.gguf"
    stored = write_random_model(path, cfg, seed=5, biases=True, extra_metadata={
        "llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0})
    eng = Engine(path, exact=True)
    assert eng.hparams.n_rot == 16 and eng.hparams.rope_freq_scale == 0.25
    assert eng.weights.layers[0].bq is not None
    ref = reference_forward(stored, cfg, TOKENS)[0]
    assert rel_err(eng.forward(TOKENS, 0).logits, ref) < 1e-4


def test_llama3_rope_freq_factors(models):
    cfg = RefConfig("llama", n_vocab=300, n_embd=128, n_layer=1, n_head=2, n_head_kv=1, head_dim=64, n_ff=128)
    path = models / "llama-ropefreqs.gguf"
    factors = np.linspace(1.0, 8.0, 32).astype(np.float32)
    rng = np.random.default_rng(6)
    from tests.reference_model import (byte_level_tokenizer_metadata, config_metadata, random_weights,
                                       write_gguf)
    w = random_weights(cfg, rng)
    w["rope_freqs.weight"] = factors
    meta = config_metadata(cfg) | byte_level_tokenizer_metadata(cfg.n_vocab)
    stored = write_gguf(path, "llama", meta, w)
    eng = Engine(path, exact=True)
    np.testing.assert_array_equal(eng.weights.rope_freqs, factors)
    ref = reference_forward(stored, cfg, TOKENS)[0]
    assert rel_err(eng.forward(TOKENS, 0).logits, ref) < 1e-4
    no_factors = {k: v for k, v in stored.items() if k != "rope_freqs.weight"}
    assert rel_err(reference_forward(no_factors, cfg, TOKENS)[0], ref) > 1e-3  # they matter


# --- end to end: a Hugging Face checkpoint, converted by `ds4tools quantize`, then run --------


def _hf_to_reference(folder) -> tuple[dict, RefConfig]:
    """The checkpoint's own weights under llama.cpp's names, and its config; Hugging Face
    rotates the two halves of each head (neox) for both architectures."""
    cfg = json.loads((folder / "config.json").read_text())
    w = hf_models.load_weights(folder)
    names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
    out = {"token_embd.weight": w["model.embed_tokens.weight"], "output_norm.weight": w["model.norm.weight"]}
    if "lm_head.weight" in w:
        out["output.weight"] = w["lm_head.weight"]
    for i in range(cfg["num_hidden_layers"]):
        for hf, gg in names.items():
            key = f"model.layers.{i}.{hf}.weight"
            if key in w:
                out[f"blk.{i}.{gg}.weight"] = w[key]
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    ref = RefConfig(cfg["model_type"], cfg["vocab_size"], cfg["hidden_size"], cfg["num_hidden_layers"],
                    cfg["num_attention_heads"], cfg["num_key_value_heads"], hd, cfg["intermediate_size"],
                    rms_eps=cfg["rms_norm_eps"], rope_base=cfg["rope_theta"], rope_style="neox")
    return out, ref


@pytest.mark.parametrize("which", ["hf_llama", "hf_qwen3"])
def test_converted_checkpoint_matches_reference_on_hf_weights(which, request, tmp_path):
    from ds4tools.quantize import QuantizeOptions, quantize_model
    folder = request.getfixturevalue(which)
    path = tmp_path / "model.gguf"
    quantize_model(folder, path, QuantizeOptions("F32", progress=False), report=lambda m: None)
    weights, cfg = _hf_to_reference(folder)  # the converter permutes llama's q/k for llama.cpp
    eng = Engine(path, exact=True)
    toks = TOKENS % 300
    ref = reference_forward(weights, cfg, toks)[0]
    assert rel_err(eng.forward(toks, 0).logits, ref) < 1e-4


def test_int8_path_policy(models):
    # by default every quantized matrix takes the int8 path where its rows are long enough for
    # the integer kernel to pay; "all" forces it wherever a format has one; float formats,
    # "none" and --exact never take it
    for fmt in ("IQ2_XXS", "IQ4_NL", "Q8_0", "Q4_K", "F16"):
        path = models / f"policy-{fmt}.gguf"
        write_random_model(path, QWEN3, seed=8, default_type=fmt, types={"blk.0.attn_q.weight": "Q8_0"}
                           if fmt == "F16" else None)
        assert formats.FORMATS[fmt].has_int8_matmul == (fmt != "F16")
        for lin in Engine(path).weights.linears():
            assert lin.int8 == (lin.fmt.has_int8_matmul and lin.n_in >= lin.fmt.int8_min_row
                                and lin.n_out * lin.n_in >= lin.fmt.int8_min_weights), lin
        assert all(lin.int8 == lin.fmt.has_int8_matmul for lin in Engine(path, int8="all").weights.linears())
        assert {lin.int8 for lin in Engine(path, int8="none").weights.linears()} == {False}
        assert {lin.int8 for lin in Engine(path, int8="all", exact=True).weights.linears()} == {False}
    q8 = formats.FORMATS["Q8_0"]
    assert int8_for(q8, "default", 4096) and not int8_for(q8, "default", q8.int8_min_row - 32)
    assert int8_for(q8, "all", 64) and not int8_for(q8, "none", 4096)
    # a small matrix stays in float32 however long its rows (the int8 path's cost per call)
    assert int8_for(q8, "default", 1024, 256) and not int8_for(q8, "default", 1024, 255)
    assert int8_for(formats.FORMATS["Q4_K"], "default", 256, 16)  # its float32 path is slow
