"""`ds4tools run` and the Engine API: output, JSON, stats, the demo default, and bad input
(one line on stderr, documented exit codes: 1 invalid content, 2 unreadable or bad usage)."""
import json
import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
from click.testing import CliRunner

from ds4tools.cli import main
from ds4tools.engine import Engine
from tests.reference_model import RefConfig, config_metadata, byte_level_tokenizer_metadata, write_gguf, \
    random_weights, write_random_model

CFG = RefConfig("qwen3", n_vocab=300, n_embd=64, n_layer=2, n_head=4, n_head_kv=2, head_dim=16, n_ff=96)
PROMPT = "the model reads a token"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "tiny-qwen3.gguf"
    write_random_model(path, CFG, seed=21, default_type="Q8_0")
    return path


def run(*args, env=None):
    r = CliRunner().invoke(main, ["run", *map(str, args)], env=env)
    return r.exit_code, r.stdout, r.stderr


def test_greedy_stream_matches_the_api_and_json(model):
    code, out, err = run("-m", model, "-p", PROMPT, "-n", 12, "--temp", 0)
    assert code == 0, err
    eng = Engine(model)
    toks = list(eng.generate(PROMPT, 12, temperature=0))
    text = "".join(t.text for t in toks)
    assert out == text + "\n"
    assert PROMPT not in out  # the continuation only
    code, out, err = run("-m", model, "-p", PROMPT, "-n", 12, "--temp", 0, "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["text"] == text and doc["tokens"] == [t.id for t in toks]
    st = doc["stats"]
    for key in ("prompt_tokens", "decode_tokens", "prefill_seconds", "decode_seconds", "decode_tps"):
        assert key in st
    assert st["prompt_tokens"] == len(eng.tokenize(PROMPT))
    assert st["generated_tokens"] == len(doc["tokens"]) <= 12
    assert st["decode_tokens"] in (st["generated_tokens"] - 1, st["generated_tokens"])
    assert st["decode_tps"] > 0 and st["stop_reason"] in ("length", "eog")


def test_stats_on_stderr(model, tmp_path):
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(PROMPT, encoding="utf-8")
    code, out, err = run("-m", model, "-f", prompt_file, "-n", 4, "--temp", 0, "--stats")
    assert code == 0, err
    assert out == run("-m", model, "-p", PROMPT, "-n", 4, "--temp", 0)[1]
    assert "prompt tokens:" in err and "prefill:" in err and "decode:" in err and "total time:" in err
    assert "t/s" in err


def test_seed_makes_sampling_reproducible(model):
    args = ("-m", model, "-p", PROMPT, "-n", 16, "--temp", 1.5, "--top-k", 0, "--top-p", 1, "--min-p", 0)
    a = json.loads(run(*args, "--seed", 5, "--json")[1])
    b = json.loads(run(*args, "--seed", 5, "--json")[1])
    c = json.loads(run(*args, "--seed", 6, "--json")[1])
    assert a["tokens"] == b["tokens"] and a["stats"]["seed"] == 5
    assert a["tokens"] != c["tokens"]


def test_options_reach_the_engine(model):
    code, out, err = run("-m", model, "-p", PROMPT, "-n", 3, "--temp", 0, "--ctx", 64, "--threads", 1,
                         "--cache-type", "f16", "--exact", "--json")
    assert code == 0, err
    exact = json.loads(out)["tokens"]
    eng = Engine(model, n_ctx=64, cache_type="f16", exact=True)
    assert eng.n_ctx == 64 and eng.cache.k.dtype == np.uint16
    assert [t.id for t in eng.generate(PROMPT, 3, temperature=0)] == exact


def test_context_end_stops_generation(model):
    n_prompt = len(Engine(model).tokenize(PROMPT))
    eng = Engine(model, n_ctx=n_prompt + 5)
    toks = list(eng.generate(PROMPT, 100, temperature=0, stop_at_eog=False))
    # the prompt's logits give one token, each of the 5 free positions one more
    assert len(toks) == 6 and eng.last_stats.stop_reason == "context"
    assert eng.cache.length == n_prompt + 5


# --- bad input ----------------------------------------------------------------------------------


def _arch_model(path, arch):
    meta = {k.replace("qwen3.", f"{arch}."): v for k, v in config_metadata(CFG).items()}
    meta.update(byte_level_tokenizer_metadata(CFG.n_vocab))
    w = random_weights(CFG, np.random.default_rng(0))
    write_gguf(path, arch, meta, w)


def _imatrix(path):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_string("general.type", "imatrix")
    w.add_tensor("blk.0.attn_q.weight.in_sum2", np.ones((1, 64), np.float32))
    w.add_tensor("blk.0.attn_q.weight.counts", np.ones((1, 1), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()


def _drop_tensor(path, name):
    meta = config_metadata(CFG) | byte_level_tokenizer_metadata(CFG.n_vocab)
    w = random_weights(CFG, np.random.default_rng(0))
    del w[name]
    write_gguf(path, "qwen3", meta, w)


def _bad_shape(path):
    meta = config_metadata(CFG) | byte_level_tokenizer_metadata(CFG.n_vocab)
    w = random_weights(CFG, np.random.default_rng(0))
    w["blk.0.attn_k.weight"] = w["blk.0.attn_q.weight"]
    write_gguf(path, "qwen3", meta, w)


def _bad_heads(path):
    meta = config_metadata(CFG) | byte_level_tokenizer_metadata(CFG.n_vocab)
    meta["qwen3.attention.head_count_kv"] = 3
    write_gguf(path, "qwen3", meta, random_weights(CFG, np.random.default_rng(0)))


@pytest.mark.parametrize("make, code, message", [
    (lambda p: _arch_model(p, "bloom"), 1, "unsupported architecture 'bloom' (the engine runs: llama, qwen3, glm4moe, deepseek2, glm-dsa, deepseek4)"),
    (_imatrix, 1, "is not a model but a file of kind 'imatrix'"),
    (lambda p: _drop_tensor(p, "blk.1.ffn_up.weight"), 1, "missing tensor blk.1.ffn_up.weight"),
    (_bad_shape, 1, "tensor blk.0.attn_k.weight has shape (64, 64) (numpy order), expected (32, 64)"),
    (_bad_heads, 1, "qwen3.attention.head_count (4) is not a multiple of qwen3.attention.head_count_kv (3)"),
    (lambda p: p.write_bytes(b"not a gguf file at all"), 2, ""),
])
def test_bad_model_files(tmp_path, make, code, message):
    path = tmp_path / "bad.gguf"
    make(path)
    got, out, err = run("-m", path, "-p", PROMPT)
    assert got == code, err
    assert err.startswith(f"ds4tools: {path}: ") and err.count("\n") == 1
    assert message in err
    assert out == ""


@pytest.mark.parametrize("args, message", [
    (("-p", ""), "ds4tools: the prompt is empty"),
    (("-p", PROMPT, "--ctx", 3), "ds4tools: the prompt is 15 tokens, longer than the context of 3 (--ctx)"),
    ((), "ds4tools: no prompt: give one with -p PROMPT or -f FILE"),
    (("-p", "x", "-f", "y"), "ds4tools: give the prompt with -p or -f, not both"),
    (("-f", "/nonexistent/prompt.txt"), "ds4tools: /nonexistent/prompt.txt: No such file or directory"),
    (("-p", PROMPT, "--temp", -1), "ds4tools: temperature must not be negative, got -1.0"),
    (("-p", PROMPT, "--threads", 0), "ds4tools: --threads 0: must be at least 1"),
    (("-p", PROMPT, "-n", -2), "ds4tools: -n -2: must not be negative"),
])
def test_bad_usage(model, args, message):
    assert len(Engine(model).tokenize(PROMPT)) == 15
    code, out, err = run("-m", model, *args)
    assert code == 2, err
    assert err == message + "\n"


def test_missing_model_file_and_directory(tmp_path):
    code, _, err = run("-m", tmp_path / "nope.gguf", "-p", "x")
    assert code == 2 and err == f"ds4tools: {tmp_path / 'nope.gguf'}: no such file\n"
    code, _, err = run("-m", tmp_path, "-p", "x")
    assert code == 2 and "is a directory; convert it first" in err


# --- the bundled demo default ----------------------------------------------------------------


def test_default_model_is_prepared_once_then_reused(hf_qwen3, tmp_path):
    env = {"DS4TOOLS_DEMO_SOURCE": str(hf_qwen3), "DS4TOOLS_CACHE": str(tmp_path / "cache")}
    code, out1, err = run("-p", "the model", "-n", 5, "--temp", 0, env=env)
    assert code == 0, err
    assert "preparing the demo model (first use)" in err
    cached = list((tmp_path / "cache").glob("demo-*-q8_0.gguf"))
    assert len(cached) == 1
    stamp = cached[0].stat().st_mtime_ns
    code, out2, err = run("-p", "the model", "-n", 5, "--temp", 0, env=env)
    assert code == 0 and err == "" and out2 == out1
    assert cached[0].stat().st_mtime_ns == stamp
    eng = Engine(cached[0])
    assert {lin.fmt.name for lin in eng.weights.linears()} == {"Q8_0"}


def test_default_model_missing(tmp_path):
    env = {"DS4TOOLS_DEMO_SOURCE": str(tmp_path / "none"), "DS4TOOLS_CACHE": str(tmp_path)}
    code, _, err = run("-p", "x", env=env)
    assert code == 2 and "the bundled demo model is not installed" in err


def test_engine_is_exposed_lazily():
    code = ("import sys, ds4tools; assert 'ds4tools.engine' not in sys.modules; "
            "assert 'numba' not in sys.modules; E = ds4tools.Engine; "
            "assert 'ds4tools.engine' in sys.modules; print(E.__module__)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=os.path.dirname(os.path.dirname(__file__)))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ds4tools.engine.api"


def test_support_file_given_as_the_model(hf_qwen3_nextn, tmp_path):
    from ds4tools.quantize import QuantizeOptions, quantize_model
    mtp = tmp_path / "mtp.gguf"
    quantize_model(hf_qwen3_nextn, None, QuantizeOptions("Q8_0", mtp_out=str(mtp), only_support=True,
                                                          progress=False), report=lambda m: None)
    code, out, err = run("-m", mtp, "-p", PROMPT)
    assert code == 1 and out == ""
    assert err == f"ds4tools: {mtp}: is not a model but a file of kind 'mtp-support' (see `ds4tools inspect`)\n"


# --- --device cuda -------------------------------------------------------------------------------
# tests/cuda (run under numba's CUDA simulator) checks what the CUDA backend computes; these check
# the refusals that come before any kernel runs.


def test_device_cuda_without_a_gpu_is_a_usage_error(model):
    from numba import cuda
    if cuda.is_available():
        pytest.skip("a CUDA GPU (or the simulator) is present: the backend would run")
    code, out, err = run("-m", model, "-p", PROMPT, "--device", "cuda")
    assert code == 2 and out == ""
    assert err.startswith("ds4tools: --device cuda: ") and err.count("\n") == 1
    assert "`cuda` extra" in err


def test_device_cuda_names_the_architectures_it_runs(tmp_path):
    from tests.deepseek4_model import write_model
    path = tmp_path / "deepseek4.gguf"
    write_model(path)
    code, out, err = run("-m", path, "-p", PROMPT, "--device", "cuda")
    assert code == 2 and out == ""
    assert err == f"ds4tools: {path}: --device cuda: deepseek4 models run on cpu so far\n"


def test_device_cuda_with_tensor_parallelism_is_refused(model):
    code, out, err = run("-m", model, "-p", PROMPT, "--device", "cuda", "--tp", 2)
    assert code == 2
    assert err == "ds4tools: --device cuda and --tp: tensor parallelism runs on the CPU so far\n"
