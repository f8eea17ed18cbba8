"""`ds4tools bench`: the JSON document (schema ds4tools.bench/1, sane values: r(1) = 1, the sweep's
rows with tau >= 1 and a speedup), the table, the demo default, and bad input (one line on
stderr, exit 2 for usage, 1 for an invalid file). Speeds are measured, never asserted."""
import json

import numpy as np
import pytest
from click.testing import CliRunner

from ds4tools.cli import main
from tests.reference_model import RefConfig, config_metadata, byte_level_tokenizer_metadata, \
    random_weights, write_gguf, write_random_model

CFG = RefConfig("qwen3", n_vocab=300, n_embd=64, n_layer=2, n_head=4, n_head_kv=2, head_dim=16, n_ff=96)
FAST = ("-p", "16", "-n", "6", "--rk", "1,2,4", "-r", "1")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "tiny-qwen3.gguf"
    write_random_model(path, CFG, seed=21, default_type="Q8_0")
    return path


def bench(*args, env=None):
    r = CliRunner().invoke(main, ["bench", *map(str, args)], env=env)
    return r.exit_code, r.stdout, r.stderr


def _json(*args, env=None):
    code, out, err = bench(*args, "--json", env=env)
    assert code == 0, err
    return json.loads(out)


def _positive(x):
    return isinstance(x, (int, float)) and x > 0 and np.isfinite(x)


def test_json_schema_and_values(model):
    doc = _json("-m", model, "-p", "8,16", "-n", "4,6", "--rk", "2,4", "-r", "2", "--threads", "1")
    assert doc["schema"] == "ds4tools.bench/1"
    assert set(doc) == {"schema", "version", "model", "system", "settings", "pp", "tg", "rk", "spec"}
    m = doc["model"]
    assert m["path"] == str(model) and m["architecture"] == "qwen3" and m["n_layer"] == 2
    assert m["formats"][0]["type"] == "Q8_0" and _positive(m["size_bytes"]) and _positive(m["params"])
    assert 0 < m["weight_bytes_per_token"] <= m["size_bytes"]
    sy = doc["system"]
    assert sy["threads"] == 1 and _positive(sy["memcpy_gbps"])
    st = doc["settings"]
    assert st["n_prompt"] == [8, 16] and st["n_gen"] == [4, 6] and st["rk"] == [1, 2, 4]
    assert st["repeat"] == 2 and st["prompt"] == "synthetic" and st["prompt_tokens"] == st["depth"] == 16
    assert [r["test"] for r in doc["pp"]] == ["pp8", "pp16"]
    assert [r["test"] for r in doc["tg"]] == ["tg4 @ d16", "tg6 @ d16"]
    for r in doc["pp"] + doc["tg"] + doc["rk"]:
        assert _positive(r["tps"]) and _positive(r["seconds"])
    for r in doc["tg"]:
        assert r["decode_tokens"] == r["n_tokens"] - 1
        assert _positive(r["weight_gbps"]) and r["memcpy_ratio"] == pytest.approx(r["weight_gbps"] / sy["memcpy_gbps"])
    rk = {r["k"]: r for r in doc["rk"]}
    assert list(rk) == [1, 2, 4] and rk[1]["r"] == 1.0  # k = 1 is always measured: the unit
    assert all(_positive(r["r"]) and r["depth"] == 16 for r in rk.values())
    assert doc["spec"] == []


def test_table_output(model):
    code, out, err = bench("-m", model, *FAST, "--lookup", "2,4")
    assert code == 0, err
    lines = out.splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header == ["model", "format", "size", "params", "matmul", "threads", "test", "spec", "t/s",
                      "GB/s", "r(k)", "speedup", "tau", "alpha"]
    assert set(lines[1]) <= set("|-: ")
    rows = [[c.strip() for c in l.strip("|").split("|")] for l in lines[2:] if l.startswith("|")]
    tests = [(r[6], r[7]) for r in rows]
    assert tests == [("pp16", ""), ("tg6 @ d16", "plain"), ("verify1 @ d16", ""), ("verify2 @ d16", ""),
                     ("verify4 @ d16", ""), ("tg6 @ d16", "lookup=2"), ("tg6 @ d16", "lookup=4")]
    assert all(r[0] == "tiny-qwen3" and r[1] == "Q8_0" and r[5] for r in rows)
    assert rows[2][10] == "1.00"
    assert float(rows[5][11]) > 0 and float(rows[5][12]) >= 1
    assert "memcpy" in out and "GB/s" in out and "r(k) = time of a k-token forward" in out
    assert "Traceback" not in err


def test_text_prompt_is_tiled_to_the_prompt_size(model):
    doc = _json("-m", model, "--prompt", "the model reads", "-p", "20", "-n", "0", "--rk", "1", "-r", "1")
    assert doc["settings"]["prompt"] == "text" and doc["settings"]["prompt_tokens"] == 20
    assert doc["tg"] == [] and [r["test"] for r in doc["pp"]] == ["pp20"]
    doc = _json("-m", model, "--prompt", "the model reads", "-n", "0", "--rk", "1", "-r", "1", "--exact")
    assert doc["settings"]["exact"] and 0 < doc["settings"]["prompt_tokens"] < 20


def test_sweep_lookup_mtp_dspark(spec_files):
    f = spec_files
    doc = _json("-m", f / "target-nextn.gguf", *FAST, "--lookup", "2", "--glm-mtp", "--mtp-draft", "1,2",
                "--mtp", f / "draft.gguf", "--dspark-block-size", "2,4", "--dspark-confidence", "0")
    sp = doc["spec"]
    assert [r["setting"] for r in sp] == ["lookup=2", "glm-mtp n=1", "glm-mtp n=2", "dspark b=2 c=0",
                                          "dspark b=4 c=0"]
    assert [r["family"] for r in sp] == ["lookup", "mtp", "mtp", "dspark", "dspark"]
    plain = doc["tg"][0]["tps"]
    for r in sp:
        assert r["test"] == "tg6 @ d16" and r["n_tokens"] == 6 and r["temperature"] == 0
        assert r["tau"] >= 1 and 0 <= r["alpha"] <= 1 and _positive(r["tps"])
        assert r["plain_tps"] == plain and r["speedup"] == pytest.approx(r["tps"] / plain)
        assert r["matches_plain"] is True  # greedy speculative decoding is lossless
        assert r["stats"]["steps"] > 0 and r["stats"]["tau"] == r["tau"]
    assert sp[1]["params"] == {"glm_mtp": True, "mtp_draft": 1, "mtp_margin": None}
    assert sp[3]["params"]["dspark_block_size"] == 2


def test_sweep_sampled_with_an_mtp_file(spec_files):
    f = spec_files
    doc = _json("-m", f / "target.gguf", *FAST, "--mtp", f / "mtp.gguf", "--mtp-draft", "2", "--temp", "0,1")
    sp = doc["spec"]
    assert [(r["setting"], r["temperature"]) for r in sp] == [("mtp n=2", 0.0), ("mtp n=2", 1.0)]
    assert sp[1]["test"] == "tg6 @ d16 T=1" and sp[1]["matches_plain"] is None
    assert all(r["tau"] >= 1 and _positive(r["speedup"]) for r in sp)
    code, out, err = bench("-m", f / "target.gguf", *FAST, "--mtp", f / "mtp.gguf", "--temp", "0,1")
    assert code == 0, err
    assert [l for l in out.splitlines() if "T=1" in l and "| plain " in l]  # the sampled baseline row


def test_demo_model_is_the_default(hf_qwen3, tmp_path):
    env = {"DS4TOOLS_DEMO_SOURCE": str(hf_qwen3), "DS4TOOLS_CACHE": str(tmp_path / "cache")}
    doc = _json("-p", "8", "-n", "4", "--rk", "1", "-r", "1", env=env)
    assert doc["model"]["path"].startswith(str(tmp_path / "cache")) and doc["tg"]


def _bloom(path):
    meta = {k.replace("qwen3.", "bloom."): v for k, v in config_metadata(CFG).items()}
    meta.update(byte_level_tokenizer_metadata(CFG.n_vocab))
    write_gguf(path, "bloom", meta, random_weights(CFG, np.random.default_rng(0)))


@pytest.mark.parametrize("args, message", [
    (("-p", "abc"), "ds4tools: -p 'abc': expected comma-separated integers"),
    (("-n", "1"), "ds4tools: -n 1: must be 0 (no decode test) or at least 2"),
    (("--rk", "0"), "ds4tools: --rk 0: must be in 1..256"),
    (("-r", "0"), "ds4tools: --repeat 0: must be at least 1"),
    (("--threads", "0"), "ds4tools: --threads 0: must be at least 1"),
    (("--lookup", "4,x"), "ds4tools: --lookup '4,x': expected comma-separated integers"),
    (("--lookup", "0"), "ds4tools: --lookup 0: must be in 1..64"),
    (("--mtp-draft", "2"), "ds4tools: --mtp-draft and --mtp-margin apply to MTP drafting"),
    (("--dspark-confidence", "1.5"), "ds4tools: --dspark-confidence 1.5: must be in 0..1"),
    (("--dspark",), "ds4tools: --dspark needs the DSpark draft: --mtp DRAFT.gguf"),
    (("--temp", "1"), "ds4tools: --temp applies to the drafter sweep"),
    (("--lookup", "2", "--temp", "inf"), "ds4tools: --temp 'inf': expected comma-separated numbers"),
    (("--seed", "-3"), "ds4tools: --seed -3: must not be negative"),
    (("--lookup", "2", "--dspark-strict", "--mtp", "x.gguf", "--temp", "0.5"),
     "ds4tools: --dspark-strict is lossless only at --temp 0"),
    (("--prompt", ""), "ds4tools: the prompt is empty"),
    (("--prompt", "x", "-f", "y"), "ds4tools: give the prompt with --prompt or -f, not both"),
    (("-f", "/nonexistent/prompt.txt"), "ds4tools: /nonexistent/prompt.txt: No such file or directory"),
    (("--lookup", "2", "-n", "0"), "ds4tools: a drafter sweep decodes: give -n N (at least 2)"),
])
def test_bad_usage(model, args, message):
    code, out, err = bench("-m", model, *FAST, *args)
    assert code == 2, err
    assert err.startswith(message) and err.count("\n") == 1, err
    assert out == ""


def test_bad_files(model, tmp_path):
    code, out, err = bench("-m", tmp_path / "nope.gguf", *FAST)
    assert code == 2 and err == f"ds4tools: {tmp_path / 'nope.gguf'}: no such file\n"
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    code, out, err = bench("-m", bad, *FAST)
    assert code == 2 and err.startswith(f"ds4tools: {bad}: ") and err.count("\n") == 1
    bloom = tmp_path / "bloom.gguf"
    _bloom(bloom)
    code, out, err = bench("-m", bloom, *FAST)
    assert code == 1 and "unsupported architecture 'bloom'" in err and err.count("\n") == 1
    code, out, err = bench("-m", model, *FAST, "--mtp", tmp_path / "nope.gguf")
    assert code == 2 and "nope.gguf: no such file" in err and err.count("\n") == 1
    assert out == "" and "Traceback" not in err
