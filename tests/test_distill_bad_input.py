"""`ds4tools distill` refuses bad input before it trains or writes anything: one line on stderr
naming the file, exit 2, nothing left in the output's folder. None of this needs torch (the
checks come first); a missing torch is itself one line naming the `train` extra."""
import os
import sys

import numpy as np
import pytest
from click.testing import CliRunner

from ds4tools.cli import main
from ds4tools.distill.options import parse_duration
from ds4tools.errors import UsageError
from tests.reference_model import (RefConfig, byte_level_tokenizer_metadata, config_metadata,
                                   random_weights, write_gguf, write_random_model)

CFG = RefConfig("qwen3", n_vocab=300, n_embd=64, n_layer=4, n_head=4, n_head_kv=2, head_dim=16, n_ff=96)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("distill-bad")
    write_random_model(d / "target.gguf", CFG, seed=3, default_type="Q8_0")
    meta = {k.replace("qwen3.", "bloom."): v for k, v in config_metadata(CFG).items()}
    meta.update(byte_level_tokenizer_metadata(CFG.n_vocab))
    write_gguf(d / "bloom.gguf", "bloom", meta, random_weights(CFG, np.random.default_rng(0)))
    (d / "text").mkdir()
    (d / "text" / "a.txt").write_text("def f(a, b):\n    return a * b\n" * 40, encoding="utf-8")
    (d / "empty").mkdir()
    (d / "binary").mkdir()
    (d / "binary" / "x.bin").write_bytes(b"\0\1\2" * 100)
    return d


def distill(*args):
    r = CliRunner().invoke(main, ["distill", *map(str, args)])
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    return r.exit_code, r.stdout, r.stderr


CASES = [
    # (name, args after TARGET given as a callable of the files folder, message part)
    ("support-target", None, "is a support GGUF (kind 'dspark-draft'), not a target model"),
    ("unsupported-arch", None, "architecture 'bloom' is not supported for distilling"),
    ("empty-data", lambda d: ["--data", d / "empty"], "--data: the folder holds no text files"),
    ("binary-data", lambda d: ["--data", d / "binary"], "--data: the folder holds no text files"),
    ("missing-data", lambda d: ["--data", d / "nope"], "--data: no such file or folder"),
    ("block-0", lambda d: ["--data", d / "text", "--block-size", 0], "--block-size 0: must be in 1..16"),
    ("no-budget", lambda d: ["--data", d / "text"], "give the training budget as --steps N or --time"),
    ("both-budgets", lambda d: ["--data", d / "text", "--time", "1m"],
     "give the training budget as --steps N or --time"),
    ("bad-time", lambda d: ["--data", d / "text", "--time", "soon"], "--time 'soon': expected a duration"),
    ("last-layer", lambda d: ["--data", d / "text", "--target-layers", "1,3"],
     "--target-layers 3: target layer 3 (dflash.target_layers 4) is the output of the last of"),
    ("layer-range", lambda d: ["--data", d / "text", "--target-layers", "-2,1"],
     "--target-layers -2:"),
    ("mtp-block", lambda d: ["--kind", "mtp", "--data", d / "text", "--block-size", 4],
     "--block-size applies to --kind dspark"),
    ("mtp-layers", lambda d: ["--kind", "mtp", "--data", d / "text", "--layers", 2],
     "an MTP head is one decoder layer"),
    ("bad-kind", lambda d: ["--kind", "eagle", "--data", d / "text"], "--kind 'eagle': use dspark or mtp"),
    ("no-kind", lambda d: ["--data", d / "text"], "missing option --kind dspark|mtp"),
    ("bad-prompts", lambda d: ["--data", d / "text", "--eval-prompts", d / "text" / "a.txt.json"],
     "--eval-prompts: no such file"),
]


@pytest.mark.parametrize("name,extra,message", CASES, ids=[c[0] for c in CASES])
def test_bad_input_exits_2_with_one_line_and_writes_nothing(files, spec_files, tmp_path, name, extra, message):
    target = files / "target.gguf"
    if name == "support-target":
        target = spec_files / "draft.gguf"
    elif name == "unsupported-arch":
        target = files / "bloom.gguf"
    args = extra(files) if extra else ["--data", files / "text"]
    if name not in ("bad-kind", "no-kind", "mtp-block", "mtp-layers"):
        args = ["--kind", "dspark", *args]
    if name not in ("no-budget", "bad-time"):
        args += ["--steps", 2]
    before = set(os.listdir(files))
    code, out, err = distill(target, "-o", tmp_path / "out.gguf", *args)
    assert code == 2, err
    assert err.startswith("ds4tools: ") and err.count("\n") == 1 and message in err, err
    assert out == ""
    assert os.listdir(tmp_path) == [] and set(os.listdir(files)) == before


def test_existing_output_is_kept(files, tmp_path):
    out = tmp_path / "out.gguf"
    out.write_bytes(b"mine")
    code, _, err = distill(files / "target.gguf", "--kind", "dspark", "-o", out, "--data", files / "text",
                           "--steps", 1)
    assert code == 2 and "already exists (pass --overwrite to replace it)" in err
    assert out.read_bytes() == b"mine" and sorted(os.listdir(tmp_path)) == ["out.gguf"]
    code, _, err = distill(files / "target.gguf", "--kind", "dspark", "-o", files / "target.gguf",
                           "--data", files / "text", "--steps", 1, "--overwrite")
    assert code == 2 and "refusing to write over an input file" in err


def test_resume_into_a_foreign_folder(files, tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("mine")
    code, _, err = distill(files / "target.gguf", "--kind", "dspark", "-o", tmp_path / "o.gguf",
                           "--data", files / "text", "--steps", 1, "--resume", tmp_path / "run")
    # torch is needed before the run directory is looked at; without it, that is the message
    assert code == 2
    assert "holds no distill run" in err or "pip install 'ds4tools[train]'" in err
    assert sorted(os.listdir(tmp_path / "run")) == ["notes.txt"]


def test_missing_torch_names_the_extra(files, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    code, out, err = distill(files / "target.gguf", "--kind", "mtp", "-o", tmp_path / "o.gguf",
                             "--data", files / "text", "--steps", 1)
    assert code == 2 and err.count("\n") == 1
    assert "ds4tools distill trains with PyTorch, which is not installed: pip install 'ds4tools[train]'" in err
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("text,seconds", [("90", 90), ("90s", 90), ("2m", 120), ("1h30m", 5400),
                                          ("1.5h", 5400), ("30m", 1800)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "m", "-1m", "0", "1x", "1m30"])
def test_bad_durations(text):
    with pytest.raises(UsageError):
        parse_duration(text)


def test_torch_stays_out_of_the_rest_of_ds4tools():
    """Only the training modules import torch: the command line, the options, the data, the
    features, the export and the evaluation load without it."""
    import subprocess
    code = ("import sys, ds4tools.cli, ds4tools.distill, ds4tools.distill.run, ds4tools.distill.data, "
            "ds4tools.distill.target, ds4tools.distill.features, ds4tools.distill.export, "
            "ds4tools.distill.evaluate; print('torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr
