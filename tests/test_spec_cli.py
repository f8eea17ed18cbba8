"""`ds4tools run` with speculative decoding: ds4's flags, the load line, statistics in --stats
and --json, per-step timing, and every wrong combination refused with one line and exit 2
(an invalid or mismatched support file: inspect's message and exit 1)."""
import json

import pytest
from click.testing import CliRunner

from ds4tools.cli import main
from tests.fixtures import support_models

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n"


def run(*args):
    r = CliRunner().invoke(main, ["run", *map(str, args)])
    return r.exit_code, r.stdout, r.stderr


@pytest.fixture(scope="module")
def f(spec_files):
    return spec_files


def _plain(f, n=24, *extra):
    code, out, err = run("-m", f / "target.gguf", "-p", PROMPT, "-n", n, "--temp", 0, *extra)
    assert code == 0, err
    return out


@pytest.mark.parametrize("flags,line", [
    (["--mtp", "mtp.gguf", "--mtp-draft", "2"], "mtp: MTP head"),
    (["--mtp", "draft.gguf", "--dspark", "--dspark-block-size", "3", "--dspark-confidence", "0.2"],
     "mtp/dspark: stages=2 block=4 markov_rank=32"),
    (["--lookup", "4"], "lookup: prompt n-gram drafting, up to 4 tokens"),
])
def test_greedy_speculative_equals_plain_with_load_line_and_stats(f, flags, line):
    flags = [str(f / a) if a.endswith(".gguf") else a for a in flags]
    code, out, err = run("-m", f / "target.gguf", "-p", PROMPT, "-n", 24, "--temp", 0, "--stats", *flags)
    assert code == 0, err
    assert out == _plain(f)
    assert line in err.splitlines()[0]
    assert "spec " in err and "tau" in err and "predicted" in err


def test_glm_mtp_uses_the_embedded_nextn_layer(f):
    code, out, err = run("-m", f / "target-nextn.gguf", "-p", PROMPT, "-n", 24, "--temp", 0, "--glm-mtp")
    assert code == 0, err
    assert "NextN layer blk.2 embedded" in err
    assert out == _plain(f)


def test_glm_mtp_timing_logs_each_step(f):
    code, out, err = run("-m", f / "target-nextn.gguf", "-p", PROMPT, "-n", 12, "--temp", 0,
                         "--glm-mtp-timing")
    assert code == 0, err
    steps = [l for l in err.splitlines() if " step " in l]
    assert steps and all("drafted=" in l and "accepted=" in l and "verify=" in l for l in steps)


def test_json_carries_speculative_statistics(f):
    code, out, err = run("-m", f / "target.gguf", "-p", PROMPT, "-n", 16, "--temp", 0.8, "--seed", 3,
                         "--mtp", f / "draft.gguf", "--dspark", "--json")
    assert code == 0, err
    sp = json.loads(out)["stats"]["speculative"]
    for key in ("steps", "drafted", "verified", "accepted", "tau", "alpha", "accept_per_position",
                "accepted_length_histogram", "confidence_cuts", "strict_fallbacks", "time_split",
                "decode_tps", "predicted_speedup", "measured_speedup"):
        assert key in sp
    assert set(sp["time_split"]) == {"target_verify", "draft", "sampling", "other"}
    assert sum(sp["accepted_length_histogram"].values()) == sp["steps"] > 0


@pytest.mark.parametrize("flags,message", [
    (["--glm-mtp", "--mtp", "mtp.gguf"], "--glm-mtp uses the NextN layers inside the model GGUF; it takes no --mtp FILE"),
    (["--mtp", "draft.gguf"], "draft.gguf: is a DSpark draft: add --dspark to draft with it"),
    (["--mtp", "mtp.gguf", "--dspark"], "mtp.gguf: is an MTP head, not a DSpark draft"),
    (["--glm-mtp"], "--glm-mtp: the model has no NextN layers"),
    (["--dspark"], "--dspark needs the DSpark draft: --mtp DRAFT.gguf"),
    (["--mtp", "draft.gguf", "--dspark-strict", "--temp", "0.7"], "--dspark-strict is lossless only at --temp 0"),
    (["--mtp-draft", "3"], "--mtp-draft and --mtp-margin apply to MTP drafting"),
    (["--mtp", "mtp.gguf", "--mtp-draft", "17"], "--mtp-draft 17: must be in 1..16"),
    (["--mtp", "draft.gguf", "--dspark", "--dspark-block-size", "9"], "--dspark-block-size 9: must be in 1..4"),
    (["--mtp", "draft.gguf", "--dspark-confidence", "1.5"], "--dspark-confidence 1.5: must be in 0..1"),
    (["--lookup", "3", "--mtp", "mtp.gguf"], "choose one drafting path"),
    (["--mtp", "nothere.gguf"], "nothere.gguf"),
])
def test_wrong_combinations(f, flags, message):
    flags = [str(f / a) if a.endswith(".gguf") else a for a in flags]
    args = ["-m", f / "target.gguf", "-p", PROMPT, "-n", 4] + flags
    if "--temp" not in flags:
        args += ["--temp", "0"]
    code, out, err = run(*args)
    assert code == 2, (code, err)
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err


def test_a_broken_support_file_is_refused_with_inspects_message(f, tmp_path):
    bad = tmp_path / "bad.gguf"
    support_models.rewrite_gguf(f / "draft.gguf", bad, drop_tensors=("blk.1.attn_q.weight",))
    code, out, err = run("-m", f / "target.gguf", "-p", PROMPT, "-n", 4, "--temp", 0, "--mtp", bad, "--dspark")
    assert code == 1, err
    assert err.startswith(f"ds4tools: {bad}: ") and "blk.1.attn_q.weight" in err
    assert "Traceback" not in err


def test_a_draft_for_another_target_is_refused(f, gguf_llama_f32):
    code, out, err = run("-m", gguf_llama_f32, "-p", PROMPT, "-n", 4, "--temp", 0,
                         "--mtp", f / "draft.gguf", "--dspark")
    assert code == 1, err
    assert "draft.gguf" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
