"""Bad input: one clear line naming the file and the problem, the documented exit code, no
traceback and no huge allocation, through both `inspect` and `quantize`."""
import json
import os
import struct

import numpy as np
import pytest
from click.testing import CliRunner

from ds4tools.cli import main
from ds4tools.gguf_io import GGUFStreamWriter, check_header
from tests.fixtures import hf_models
from gguf import GGUFValueType as V


def cli(*args):
    r = CliRunner().invoke(main, [str(a) for a in args])
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert "Traceback" not in r.output
    return r


def one_line(r) -> str:
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    return lines[0]


@pytest.fixture
def base(tmp_path):
    """A small valid GGUF: two keys, three F32 tensors; the last one ends in padding."""
    path = tmp_path / "base.gguf"
    with GGUFStreamWriter(path, "tinytest") as w:  # an architecture without key rules
        w.add_key("a.key", "value", V.STRING)
        w.add_key("b.key", 7, V.UINT32)
        w.add_tensor_info("first.weight", (2, 32), "F32")
        w.add_tensor_info("other.weight", (32,), "F32")
        w.add_tensor_info("last.weight", (4,), "F32")
        w.begin()
        w.write_tensor("first.weight", np.ones((2, 32), np.float32))
        w.write_tensor("other.weight", np.ones(32, np.float32))
        w.write_tensor("last.weight", np.ones(4, np.float32))
    return path


def patched(base, name, edits):
    """A copy of ``base`` with (offset, bytes) edits applied."""
    data = bytearray(base.read_bytes())
    for at, value in edits:
        data[at:at + len(value)] = value
    out = base.with_name(name)
    out.write_bytes(bytes(data))
    return out


def tensor_field(path, tensor, field):
    r = next(r for r in check_header(path).tensors if r.name == tensor)
    at = r.record_offset + 8 + len(r.name.encode())
    if field == "n_dims":
        return at
    at += 4 + 8 * len(r.ggml_shape)
    return at if field == "type" else at + 4  # "type" / "offset"


def u64(v):
    return struct.pack("<Q", v)


def check_both(path, code, message, tmp_path):
    """inspect and quantize both fail with ``code`` and one stderr line containing ``message``."""
    r = cli("inspect", path)
    assert r.exit_code == code, r.output
    line = one_line(r)
    assert line.startswith(f"ds4tools: {path}: ") and message in line, line
    if code == 1:  # a readable file: the report (with its error lines) is on stdout
        assert any(x.startswith("error: ") and message in x for x in r.stdout.splitlines())
    else:
        assert r.stdout == ""
    out = tmp_path / "q.gguf"
    r = cli("quantize", path, "-o", out, "--type", "Q8_0")
    assert r.exit_code == code, r.output
    assert message in one_line(r) and str(path) in one_line(r)
    assert not out.exists() and not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_the_base_file_is_valid(base, tmp_path):
    assert cli("inspect", base).exit_code == 0
    assert cli("quantize", base, "-o", tmp_path / "ok.gguf", "--type", "F16").exit_code == 0


def test_truncated_header(base, tmp_path):
    cut = base.with_name("cut.gguf")
    cut.write_bytes(base.read_bytes()[:40])
    check_both(cut, 2, "truncated or corrupt header", tmp_path)
    tiny = base.with_name("tiny.gguf")
    tiny.write_bytes(b"GGUF\x03\x00")
    check_both(tiny, 2, "truncated: 6 bytes is too short for a GGUF header", tmp_path)


def test_truncated_tensor_data(base, tmp_path):
    cut = base.with_name("cutdata.gguf")
    cut.write_bytes(base.read_bytes()[:-20])
    check_both(cut, 1, "tensor 'last.weight': its 16 bytes at offset", tmp_path)


def test_wrong_magic(base, tmp_path):
    check_both(patched(base, "magic.gguf", [(0, b"GGUX")]), 2,
               "not a GGUF file (magic b'GGUX', expected b'GGUF')", tmp_path)


def test_unsupported_version(base, tmp_path):
    check_both(patched(base, "v4.gguf", [(4, struct.pack("<I", 4))]), 2,
               "unsupported GGUF version 4 (supported: 2, 3)", tmp_path)
    check_both(patched(base, "be.gguf", [(4, struct.pack(">I", 3))]), 2,
               "big-endian GGUF files are not supported", tmp_path)


@pytest.mark.parametrize("at,what", [(8, "tensors"), (16, "key/value pairs")])
def test_counts_far_beyond_the_file(base, tmp_path, at, what):
    check_both(patched(base, "count.gguf", [(at, u64(2 ** 62))]), 2,
               f"truncated or corrupt header: it claims {2 ** 62} {what}, but the file has only", tmp_path)


def test_string_length_past_the_end(base, tmp_path):
    check_both(patched(base, "strlen.gguf", [(24, u64(2 ** 40))]), 2,
               f"key #0 at byte 24 claims {2 ** 40} bytes, past the end of the file", tmp_path)


def test_array_length_past_the_end(tmp_path):
    path = tmp_path / "arr.gguf"
    with GGUFStreamWriter(path, "llama") as w:
        w.add_key("z.list", [1, 2, 3], V.ARRAY, V.INT32)
    data = path.read_bytes()
    at = data.index(b"z.list") + len("z.list") + 4 + 4  # past the value type and element type
    check_both(patched(path, "arr2.gguf", [(at, u64(2 ** 61))]), 2,
               f"value of key 'z.list' at byte {at} claims {2 ** 61} items", tmp_path)


def test_duplicate_tensor_names(base, tmp_path):
    data = base.read_bytes()
    at = data.index(b"other.weight")
    check_both(patched(base, "dup.gguf", [(at, b"first")]), 1,
               "duplicate tensor name 'first.weight'", tmp_path)


def test_tensor_past_the_end(base, tmp_path):
    bad = patched(base, "past.gguf", [(tensor_field(base, "other.weight", "offset"), u64(1 << 20))])
    check_both(bad, 1, "tensor 'other.weight': its 128 bytes at offset", tmp_path)
    assert "end past the end of the file" in cli("inspect", bad).stderr


def test_misaligned_offset(base, tmp_path):
    at = tensor_field(base, "last.weight", "offset")
    rel = int.from_bytes(base.read_bytes()[at:at + 8], "little")
    bad = patched(base, "misaligned.gguf", [(at, u64(rel + 4))])
    r = cli("inspect", bad)
    assert r.exit_code == 1
    msg = f"tensor 'last.weight': offset {rel + 4} is not a multiple of the alignment 32"
    assert one_line(r) == f"ds4tools: {bad}: {msg}"
    assert f"error: {msg}" in r.stdout.splitlines()
    doc = json.loads(cli("inspect", bad, "--json").stdout)
    assert [x for x in doc["findings"] if x["level"] == "error"] == [{"level": "error", "message": msg}]


def test_unknown_type_id(base, tmp_path):
    bad = patched(base, "type.gguf", [(tensor_field(base, "other.weight", "type"), struct.pack("<I", 99))])
    check_both(bad, 1, "tensor 'other.weight' has unknown type id 99", tmp_path)


def test_too_many_dimensions(base, tmp_path):
    # 5 dims would shift the record; claim 5 and let the walker read on: it must stay bounded
    bad = patched(base, "dims.gguf", [(tensor_field(base, "last.weight", "n_dims"), struct.pack("<I", 2 ** 30))])
    check_both(bad, 2, "dimensions of tensor 'last.weight'", tmp_path)


def test_key_that_is_not_utf8(base, tmp_path):
    at = base.read_bytes().index(b"b.key")
    check_both(patched(base, "utf8.gguf", [(at, b"\xff\xfe")]), 2,
               "key #2 at byte", tmp_path)
    assert "is not valid UTF-8: b'\\xff\\xfekey'" in cli("inspect", base.with_name("utf8.gguf")).stderr


def test_string_value_that_is_not_utf8(base, tmp_path):
    at = base.read_bytes().index(b"value")
    check_both(patched(base, "utf8v.gguf", [(at, b"\xc3\x28")]), 2,
               "key 'a.key' holds text that is not UTF-8", tmp_path)


def test_bad_alignment_key(tmp_path):
    path = tmp_path / "align.gguf"
    with GGUFStreamWriter(path, "llama") as w:
        w.add_key("general.alignment", 48, V.UINT32)
    check_both(path, 1, "general.alignment 48 is not a power of two", tmp_path)


# --- Hugging Face directories -------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_hf(tmp_path_factory):
    return hf_models.build_tiny_qwen3(tmp_path_factory.mktemp("bad") / "model", num_hidden_layers=1, shards=2)


def copy_dir(src, dst):
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def quantize_fails(folder, code, message, tmp_path):
    out = tmp_path / "o.gguf"
    r = cli("quantize", folder, "-o", out, "--type", "Q8_0")
    assert r.exit_code == code, r.output
    line = one_line(r)
    assert line.startswith("ds4tools: ") and message in line, line
    assert not out.exists()
    return line


def test_hf_dir_without_config(small_hf, tmp_path):
    d = copy_dir(small_hf, tmp_path / "m")
    (d / "config.json").unlink()
    line = quantize_fails(d, 2, "not a Hugging Face model directory (no config.json)", tmp_path)
    assert line == f"ds4tools: {d}: not a Hugging Face model directory (no config.json)"


def test_hf_dir_with_a_missing_shard(small_hf, tmp_path):
    d = copy_dir(small_hf, tmp_path / "m")
    (d / "model-00002-of-00002.safetensors").unlink()
    quantize_fails(d, 2, "shard model-00002-of-00002.safetensors named in "
                         "model.safetensors.index.json is missing", tmp_path)


def test_hf_unsupported_architecture(small_hf, tmp_path):
    d = copy_dir(small_hf, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    quantize_fails(d, 1, "unsupported architecture GPT2LMHeadModel (supported: LlamaForCausalLM, "
                         "Qwen3ForCausalLM, DeepseekV2ForCausalLM, DeepseekV3ForCausalLM, "
                         "Glm4MoeForCausalLM, GlmMoeDsaForCausalLM, DeepseekV4ForCausalLM)", tmp_path)


def test_hf_broken_config_and_safetensors(small_hf, tmp_path):
    d = copy_dir(small_hf, tmp_path / "m")
    (d / "config.json").write_text("{not json")
    quantize_fails(d, 2, "config.json is not valid JSON", tmp_path)
    d2 = copy_dir(small_hf, tmp_path / "m2")
    shard = d2 / "model-00001-of-00002.safetensors"
    shard.write_bytes(u64(2 ** 40) + shard.read_bytes()[8:])
    quantize_fails(d2, 2, "safetensors header of 1099511627776 bytes does not fit the file", tmp_path)


def test_nan_in_the_weights(tmp_path):
    d = hf_models.build_tiny_qwen3(tmp_path / "nan", num_hidden_layers=1)
    w = hf_models.load_weights(d)
    w["model.layers.0.mlp.up_proj.weight"][3, 5] = np.nan
    hf_models.write_weights(d, w)
    line = quantize_fails(d, 1, "tensor 'blk.0.ffn_up.weight': array contains NaN at index (3, 5)", tmp_path)
    assert line.startswith(f"ds4tools: {d}: ")
    # the same in a GGUF input
    f32 = tmp_path / "f32.gguf"
    assert cli("quantize", d, "-o", f32, "--type", "F16", "--tensor-type", "x=Q8_0").exit_code == 1
    w["model.layers.0.mlp.up_proj.weight"][3, 5] = 0
    w["model.layers.0.self_attn.v_proj.weight"][0, 1] = np.inf
    hf_models.write_weights(d, w)
    quantize_fails(d, 1, "tensor 'blk.0.attn_v.weight': array contains Inf at index (0, 1)", tmp_path)


def test_missing_or_broken_imatrix(small_hf, tmp_path):
    r = cli("quantize", small_hf, "-o", tmp_path / "o.gguf", "--type", "Q4_K_M", "--imatrix", tmp_path / "no.dat")
    assert r.exit_code == 2 and one_line(r) == f"ds4tools: {tmp_path / 'no.dat'}: no such imatrix file"
    (tmp_path / "bad.dat").write_bytes(struct.pack("<i", 2 ** 30) + b"\x00" * 16)
    r = cli("quantize", small_hf, "-o", tmp_path / "o.gguf", "--type", "Q4_K_M", "--imatrix", tmp_path / "bad.dat")
    assert r.exit_code == 1 and one_line(r).startswith(f"ds4tools: {tmp_path / 'bad.dat'}: ")
    assert not (tmp_path / "o.gguf").exists()
