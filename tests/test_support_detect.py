"""Support-file kinds (ds4's detection rule, llama.cpp drafts, mixed and unknown files), the
engine's ``open_support`` refusals, and the quantize command's support options and refusals."""
import pytest
from click.testing import CliRunner

from ds4tools.cli import main
from ds4tools.errors import InvalidContentError
from ds4tools.gguf_io import open_gguf
from ds4tools.inspect import detect_kind, inspect_file
from ds4tools.quantize import QuantizeOptions, quantize_model
from ds4tools.support import detect, open_support
from tests.fixtures.support_models import build_tiny_dsv4, build_tiny_dsv4_target, rewrite_gguf


def cli(*args):
    r = CliRunner().invoke(main, [str(a) for a in args])
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    return r


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("detect")
    mtp_folder, _ = build_tiny_dsv4(d / "mtp", "mtp")
    quantize_model(mtp_folder, None, QuantizeOptions("Q8_0", mtp_out=str(d / "mtp.gguf"), only_support=True,
                                                     progress=False), report=lambda m: None)
    ds_folder, _ = build_tiny_dsv4(d / "ds", "dspark-v4")
    quantize_model(ds_folder, None, QuantizeOptions("Q8_0", dspark_out=str(d / "ds.gguf"),
                                                    target=str(build_tiny_dsv4_target(d / "t")),
                                                    progress=False), report=lambda m: None)
    return dict(dir=d, mtp=d / "mtp.gguf", dspark=d / "ds.gguf", mtp_folder=mtp_folder)


def test_kinds(files, gguf_qwen3_f32):
    assert detect(open_gguf(files["mtp"])).kind == "mtp-support"
    assert detect(open_gguf(files["dspark"])).kind == "dspark-support"
    assert detect(open_gguf(gguf_qwen3_f32)).kind is None
    assert detect_kind(open_gguf(gguf_qwen3_f32)) == "model"


def test_two_stages_are_no_dspark_file(files, tmp_path):
    dropped = [n for n in open_gguf(files["dspark"]).tensors if n.startswith("mtp.2.")]
    bad = rewrite_gguf(files["dspark"], tmp_path / "two.gguf", drop_tensors=dropped)
    doc = inspect_file(str(bad))
    assert doc["kind"] == "unknown-support" and not doc["valid"]
    assert doc["findings"][0]["message"] == (
        "not a usable support GGUF: it holds mtp.* tensors for 2 stage(s), but neither an MTP head "
        "(no e_proj, h_proj, enorm or hnorm) nor a DSpark draft (at least 3 stages with main_proj, "
        "markov_head and confidence_head: main_proj=yes, markov_head=no, confidence_head=no)")
    with pytest.raises(InvalidContentError, match="not a usable support GGUF"):
        open_support(bad)


def test_mixed_mtp_and_dspark_tensors(files, tmp_path):
    mtp = open_gguf(files["mtp"])
    from ds4tools.gguf_io import GGUFStreamWriter
    ds = open_gguf(files["dspark"])
    out = tmp_path / "mixed.gguf"
    with GGUFStreamWriter(out, ds.architecture) as w:
        extra = {"mtp.0.e_proj.weight": mtp.tensors["mtp.0.e_proj.weight"]}
        tensors = {**ds.tensors, **extra}
        for name, t in tensors.items():
            w.add_tensor_info(name, t.shape, t.type_name)
        w.begin()
        for name, t in tensors.items():
            w.write_tensor(name, t.raw())
    doc = inspect_file(str(out))
    assert doc["kind"] == "mixed-support"
    assert doc["findings"] == [{"level": "error", "message":
                                "not a usable support GGUF: it holds both MTP-only tensors "
                                "(mtp.0.e_proj.weight) and DSpark tensors (mtp.0.main_proj.weight, "
                                "mtp.2.markov_head.markov_w1.weight, ...)"}]
    r = cli("inspect", out)
    assert r.exit_code == 1


def test_target_on_a_file_that_is_no_support_file(gguf_qwen3_f32, gguf_llama_f32):
    r = cli("inspect", gguf_qwen3_f32, "--target", gguf_llama_f32)
    assert r.exit_code == 2  # a wrong command (issue #18), not a wrong file
    assert r.stderr == (f"ds4tools: {gguf_qwen3_f32}: --target {gguf_llama_f32}: this is not a support "
                        f"GGUF; it is a qwen3 file with 25 tensors and no support tensors "
                        f"(mtp.*, markov_w1)\n")
    with pytest.raises(InvalidContentError, match="not a support GGUF: it is a qwen3 file"):
        open_support(gguf_qwen3_f32)


def test_open_support_collects_every_error(files, tmp_path):
    bad = rewrite_gguf(files["mtp"], tmp_path / "bad.gguf", drop_tensors=["mtp.0.enorm.weight"],
                       retype={"mtp.0.e_proj.weight": "F16"})
    with pytest.raises(InvalidContentError) as e:
        open_support(bad)
    assert str(e.value).endswith("tensor mtp.0.e_proj.weight has type F16, expected Q8_0 (and 1 more)")
    assert len(e.value.findings) == 2 and e.value.exit_code == 1
    s = open_support(bad, strict=False)
    assert s.kind == "mtp-support" and len(s.problems.errors) == 2


def test_quantize_support_refusals(files, hf_qwen3, hf_qwen3_nextn, tmp_path):
    cases = (
        (["quantize", hf_qwen3_nextn, "--type", "Q8_0", "--only-support"], 2, "needs --mtp-out"),
        (["quantize", hf_qwen3_nextn, "-o", tmp_path / "a.gguf", "--type", "Q8_0", "--only-support",
          "--mtp-out", tmp_path / "m.gguf"], 2, "drop -o"),
        (["quantize", hf_qwen3, "-o", tmp_path / "a.gguf", "--type", "Q8_0", "--mtp-out", tmp_path / "m.gguf"],
         1, "no num_nextn_predict_layers"),
        # a DeepSeek V4 folder with --mtp-out converts the model first: this MTP-only config
        # lacks the model's keys
        (["quantize", files["mtp_folder"], "-o", tmp_path / "a.gguf", "--type", "Q8_0",
          "--mtp-out", tmp_path / "m.gguf"], 1, "config.json lacks 'index_n_heads'"),
        (["quantize", hf_qwen3, "-o", tmp_path / "a.gguf", "--type", "Q8_0", "--keep-nextn"], 1,
         "--keep-nextn: the checkpoint has no NextN layer"),
        (["quantize", hf_qwen3_nextn, "-o", tmp_path / "a.gguf"], 2, "missing option --type"),
    )
    for args, code, msg in cases:
        r = cli(*args)
        assert r.exit_code == code and msg in r.stderr, (args, r.stderr)
    assert not list(tmp_path.iterdir())


def test_mix_types_with_row_fallbacks_and_dry_run(hf_qwen3_nextn, tmp_path):
    r = cli("quantize", hf_qwen3_nextn, "--type", "Q4_K_M", "--mtp-out", tmp_path / "m.gguf",
            "--only-support", "--dry-run")
    assert r.exit_code == 0 and "mtp.0.attn_output.weight" in r.stdout and not list(tmp_path.iterdir())
    r = cli("quantize", hf_qwen3_nextn, "--type", "Q4_K_M", "--mtp-out", tmp_path / "m.gguf", "--only-support")
    assert r.exit_code == 0, r.output
    f = open_gguf(tmp_path / "m.gguf")
    types = {n.split(".")[2]: t.type_name for n, t in f.tensors.items()}
    # rows of 256 take Q4_K; rows of 384 (4 heads x 96) fall back as llama.cpp does: Q5_0
    assert types["attn_q"] == "Q4_K" and types["attn_output"] == "Q5_0" and types["enorm"] == "F32"
    assert inspect_file(str(tmp_path / "m.gguf"))["valid"]


def test_an_existing_support_output_is_refused_before_the_target_is_written(hf_qwen3_nextn, tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"keep me")
    r = cli("quantize", hf_qwen3_nextn, "-o", tmp_path / "t.gguf", "--type", "Q8_0", "--mtp-out", tmp_path / "m.gguf")
    assert r.exit_code == 2 and "m.gguf: already exists (pass --overwrite to replace it)" in r.stderr
    assert not (tmp_path / "t.gguf").exists() and (tmp_path / "m.gguf").read_bytes() == b"keep me"
    r = cli("quantize", hf_qwen3_nextn, "-o", tmp_path / "same.gguf", "--type", "Q8_0", "--mtp-out",
            tmp_path / "same.gguf")
    assert r.exit_code == 2 and "name the same file" in r.stderr
    r = cli("quantize", hf_qwen3_nextn, "-o", tmp_path / "t.gguf", "--type", "Q8_0", "--mtp-out",
            tmp_path / "m.gguf", "--overwrite")
    assert r.exit_code == 0 and r.stdout.count(" tensors, ") == 2
