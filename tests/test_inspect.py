"""`ds4tools inspect`: text and JSON reports, kinds, validation findings and exit codes."""
import json

import gguf
import numpy as np
import pytest
from click.testing import CliRunner
from gguf import GGUFReader
from gguf import GGUFValueType as V

from ds4tools import formats
from ds4tools.cli import main
from ds4tools.gguf_io import GGUFStreamWriter, open_gguf
from ds4tools.inspect import SCHEMA, detect_kind, inspect_file, known_kinds, register_kind

DOC_KEYS = {"schema", "file", "files", "file_size", "gguf_version", "alignment", "data_offset",
            "architecture", "kind", "summary", "tensor_count", "key_count", "metadata", "tensors",
            "totals", "findings", "valid"}


def inspect(*args):
    r = CliRunner().invoke(main, ["inspect", *map(str, args)])
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    return r


def rewrite(src, dst, *, drop_keys=(), set_keys=(), drop_tensors=(), tensors=None, arch=None):
    """A copy of a GGUF with some keys / tensors changed (tensors: name -> (values, type))."""
    f = open_gguf(src)
    with GGUFStreamWriter(dst, arch or f.architecture) as w:
        for key, value in f.metadata.items():
            if key in drop_keys or key in dict((k[0], 0) for k in set_keys):
                continue
            vtype, sub = f.value_type(key)
            w.add_key(key, value, vtype, sub)
        for key, value, vtype, sub in set_keys:
            w.add_key(key, value, vtype, sub)
        plan = {n: (t.shape, t.type_name, t.raw) for n, t in f.tensors.items() if n not in drop_tensors}
        for name, (values, t) in (tensors or {}).items():
            plan[name] = (values.shape, t, lambda v=values, t=t: formats.quantize(v, t))
        for name, (shape, t, _) in plan.items():
            w.add_tensor_info(name, shape, t)
        w.begin()
        for name, (_, _, data) in plan.items():
            w.write_tensor(name, data())
    return dst


# --- reports -----------------------------------------------------------------------------------


def test_text_report_of_a_converted_model(gguf_qwen3_f32):
    r = inspect(gguf_qwen3_f32)
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0] == f"file: {gguf_qwen3_f32}"
    assert "GGUF version: 3, alignment: 32, data offset: " in r.stdout
    assert "architecture: qwen3" in lines and "kind: model" in lines
    assert "tensors: 25, keys: 27" in lines
    row = next(x for x in lines if x.strip().startswith("tokenizer.ggml.tokens"))
    assert row.split()[1:3] == ["[STRING]", "x416"]
    assert "['<|endoftext|>', '<|im_start|>', '<|im_end|>'," in row and row.endswith(", ...]")
    eps = next(x for x in lines if "layer_norm_rms_epsilon" in x)
    assert eps.split()[1:] == ["FLOAT32", "1e-06"]
    tmpl = next(x for x in lines if x.strip().startswith("tokenizer.chat_template"))
    assert tmpl.endswith("... (155 chars)")
    assert "tensors:" not in lines  # the table needs --tensors
    assert lines[-3] == "total: 25 tensors, 1,296,000 weights, 5,184,000 bytes, 32.00 bits per weight"
    assert lines[-1] == "ok: no problems found"


def test_tensor_table_and_totals_by_type(gguf_llama_f32, tmp_path):
    src = gguf_llama_f32
    q = tmp_path / "q.gguf"
    from ds4tools.quantize import QuantizeOptions, quantize_model
    quantize_model(src, q, QuantizeOptions("Q4_K_M", progress=False), report=lambda m: None)
    r = inspect(q, "--tensors")
    assert r.exit_code == 0, r.output
    ref = {t.name: t for t in GGUFReader(q).tensors}
    lines = r.stdout.splitlines()
    start = lines.index("tensors:")
    assert lines[start + 1].split() == ["name", "type", "shape", "(ne0", "first)", "bytes", "offset"]
    rows = {x.split()[0]: x.split() for x in lines[start + 3:start + 3 + len(ref)]}
    assert set(rows) == set(ref)
    for name, t in ref.items():
        cells = rows[name]
        assert cells[1] == t.tensor_type.name
        assert cells[2:-2] == " x ".join(map(str, t.shape.tolist())).split()
        assert cells[-2] == f"{t.n_bytes:,}" and cells[-1] == f"{t.data_offset:,}"
    by = lines.index("by type:")
    end = lines.index("", by)
    table = {x.split()[0]: x.split() for x in lines[by + 3:end]}
    assert set(table) == {"Q4_K", "Q6_K", "F32"}
    q6 = [t for t in ref.values() if t.tensor_type.name == "Q6_K"]
    assert table["Q6_K"] == ["Q6_K", str(len(q6)), f"{sum(t.n_elements for t in q6):,}",
                             f"{sum(t.n_bytes for t in q6):,}", "6.56"]
    assert table["F32"][-1] == "32.00" and table["Q4_K"][-1] == "4.50"


def test_json_document_has_the_documented_keys(gguf_llama_f32):
    r = inspect(gguf_llama_f32, "--json", "--tensors")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert set(doc) == DOC_KEYS and doc["schema"] == SCHEMA == "ds4tools.inspect/1"
    assert doc["architecture"] == "llama" and doc["kind"] == "model" and doc["valid"] is True
    assert doc["findings"] == [] and doc["tensor_count"] == 39 and doc["gguf_version"] == 3
    assert doc["files"] == [str(gguf_llama_f32)] and doc["file_size"] == gguf_llama_f32.stat().st_size
    md = doc["metadata"]
    assert md["llama.block_count"] == {"type": "UINT32", "element_type": None, "length": None,
                                       "truncated": False, "value": 4}
    tokens = md["tokenizer.ggml.tokens"]
    assert tokens["type"] == "ARRAY" and tokens["element_type"] == "STRING"
    assert tokens["length"] == 384 and tokens["truncated"] is True and len(tokens["value"]) == 8
    assert md["llama.attention.layer_norm_rms_epsilon"]["value"] == 1e-05
    ref = {t.name: t for t in GGUFReader(gguf_llama_f32).tensors}
    assert [t["name"] for t in doc["tensors"]] == list(ref)
    t0 = doc["tensors"][1]
    assert set(t0) == {"name", "type", "shape", "n_elements", "bytes", "offset", "file"}
    assert t0["shape"] == ref[t0["name"]].shape.tolist() and t0["offset"] == ref[t0["name"]].data_offset
    assert doc["totals"]["bytes"] == sum(t.n_bytes for t in ref.values())
    assert doc["totals"]["by_type"] == [{"type": "F32", "tensors": 39, "n_elements": 2558208,
                                         "bytes": 10232832, "bits_per_weight": 32.0}]
    assert json.loads(inspect(gguf_llama_f32, "--json").stdout)["tensors"] is None


def test_keys_pattern_filters_metadata(gguf_llama_f32):
    doc = json.loads(inspect(gguf_llama_f32, "--json", "--keys", r"^tokenizer\.ggml\.(pre|model)$").stdout)
    assert list(doc["metadata"]) == ["tokenizer.ggml.model", "tokenizer.ggml.pre"]
    assert doc["key_count"] == 27  # the count is the file's, not the filter's
    text = inspect(gguf_llama_f32, "--keys", "rope").stdout
    assert "llama.rope.freq_base" in text and "tokenizer.ggml.tokens" not in text
    r = inspect(gguf_llama_f32, "--keys", "([")
    assert r.exit_code == 2 and "--keys '([': bad regular expression" in r.stderr


# --- kinds -------------------------------------------------------------------------------------


def test_kinds_vocab_only_imatrix_and_unknown(gguf_llama_f32, tmp_path):
    vocab = rewrite(gguf_llama_f32, tmp_path / "vocab.gguf", drop_tensors=list(open_gguf(gguf_llama_f32).tensors))
    doc = inspect_file(vocab)
    assert doc["kind"] == "vocab-only" and doc["valid"] and doc["tensor_count"] == 0

    from ds4tools.gguf_io.imatrix import Imatrix, save_imatrix
    save_imatrix(Imatrix({"blk.0.attn_q.weight": np.ones(64, np.float32)}, ["x"], 4), tmp_path / "im.gguf")
    doc = inspect_file(tmp_path / "im.gguf", tensors=True)
    assert doc["kind"] == "imatrix" and doc["valid"] and doc["architecture"] is None
    assert {t["name"] for t in doc["tensors"]} == {"blk.0.attn_q.weight.in_sum2", "blk.0.attn_q.weight.counts"}

    w = gguf.GGUFWriter(tmp_path / "bare.gguf", "x")
    w.kv_data[0].clear()  # no general.architecture at all
    w.add_tensor("t", np.zeros(4, np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    r = inspect(tmp_path / "bare.gguf")
    assert r.exit_code == 0 and "kind: unknown" in r.stdout and "architecture: (none)" in r.stdout


def test_kind_detectors_are_an_extension_point(gguf_llama_f32):
    f = open_gguf(gguf_llama_f32)
    assert detect_kind(f) == "model"
    try:
        register_kind("test-support", order=20, description="test")(
            lambda g: g.metadata.get("general.name") == "tiny-llama")
        assert detect_kind(f) == "test-support"
        assert [k.name for k in known_kinds()][:3] == ["imatrix", "test-support", "vocab-only"]
    finally:
        register_kind("test-support", order=20)(lambda g: False)
    assert detect_kind(f) == "model"


# --- validation --------------------------------------------------------------------------------


@pytest.mark.parametrize("change,expect", [
    (dict(drop_keys=["llama.block_count"]), "error: required key 'llama.block_count' is missing"),
    (dict(drop_keys=["llama.context_length"], set_keys=[("llama.context_length", 2048, V.INT32, None)]),
     "error: key 'llama.context_length' is INT32, expected UINT32"),
    (dict(drop_tensors=["blk.1.ffn_up.weight"]), "error: tensor 'blk.1.ffn_up.weight' is missing (architecture llama)"),
    (dict(tensors={"blk.2.attn_k.weight": (np.zeros((64, 256), np.float32), "F32")}),
     "error: tensor 'blk.2.attn_k.weight' has shape [256, 64], expected [256, 128] from the hyperparameters"),
    (dict(drop_keys=["tokenizer.ggml.token_type"],
          set_keys=[("tokenizer.ggml.token_type", [1] * 5, V.ARRAY, V.INT32)]),
     "error: key 'tokenizer.ggml.token_type' has 5 entries for 384 tokens"),
    (dict(drop_keys=["tokenizer.ggml.bos_token_id"], set_keys=[("tokenizer.ggml.bos_token_id", 999, V.UINT32, None)]),
     "error: key 'tokenizer.ggml.bos_token_id' is 999, outside the 384 tokens"),
    (dict(drop_keys=["tokenizer.ggml.model"]),
     "error: key 'tokenizer.ggml.model' is missing (llama.cpp cannot load a vocabulary)"),
    (dict(drop_keys=["tokenizer.ggml.merges"]), "error: a gpt2 (byte-level BPE) tokenizer needs 'tokenizer.ggml.merges'"),
])
def test_validation_errors_exit_1(gguf_llama_f32, tmp_path, change, expect):
    bad = rewrite(gguf_llama_f32, tmp_path / "bad.gguf", **change)
    r = inspect(bad)
    assert r.exit_code == 1, r.output
    assert expect in r.stdout.splitlines()
    doc = json.loads(inspect(bad, "--json").stdout)
    assert doc["valid"] is False and {"level": "error", "message": expect[7:]} in doc["findings"]


def test_warnings_do_not_fail_validation(gguf_llama_f32, tmp_path):
    odd = rewrite(gguf_llama_f32, tmp_path / "odd.gguf",
                  tensors={"blk.0.extra.weight": (np.ones((2, 32), np.float32), "F32")},
                  drop_keys=["tokenizer.ggml.pre"])
    r = inspect(odd)
    assert r.exit_code == 0, r.output
    assert "warning: tensor 'blk.0.extra.weight' is not part of architecture llama " \
           "(llama.cpp will refuse or ignore it)" in r.stdout.splitlines()
    assert any(x.startswith("warning: no 'tokenizer.ggml.pre'") for x in r.stdout.splitlines())
    other = rewrite(gguf_llama_f32, tmp_path / "other.gguf", arch="mamba")
    r = inspect(other)
    assert r.exit_code == 0 and "warning: no rules for architecture 'mamba'" in r.stdout


def test_overlapping_tensors_are_an_error(gguf_llama_f32, tmp_path):
    from ds4tools.gguf_io import check_header
    path = tmp_path / "overlap.gguf"
    path.write_bytes(gguf_llama_f32.read_bytes())
    layout = check_header(path)
    second, third = layout.tensors[1], layout.tensors[2]
    data = bytearray(path.read_bytes())
    # move the third tensor's data to start 32 bytes into the second one's
    at = third.record_offset + 8 + len(third.name.encode()) + 4 + 8 * len(third.ggml_shape) + 4
    data[at:at + 8] = (second.rel_offset + 32).to_bytes(8, "little")
    path.write_bytes(bytes(data))
    r = inspect(path)
    assert r.exit_code == 1
    assert f"error: tensor '{second.name}' (F32, shape [256]) needs 1024 bytes, but tensor " \
           f"'{third.name}' starts 32 bytes after it" in r.stdout.splitlines()


def test_split_set_is_inspected_as_one_model(gguf_qwen3_f32, tmp_path):
    r0 = GGUFReader(gguf_qwen3_f32)
    w = gguf.GGUFWriter(tmp_path / "s.gguf", "qwen3", split_max_tensors=9)
    for k, f in r0.fields.items():
        if not k.startswith("GGUF.") and k != "general.architecture":
            w.add_key_value(k, f.contents(), f.types[0], f.types[-1] if f.types[0] == V.ARRAY else None)
    for t in r0.tensors:
        w.add_tensor(t.name, np.array(t.data))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    r = inspect(tmp_path / "s-00003-of-00003.gguf", "--json", "--tensors")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert len(doc["files"]) == 3 and doc["tensor_count"] == 25 and doc["valid"]
    assert doc["tensors"][-1]["file"].endswith("s-00003-of-00003.gguf")
    assert "shards: 3" in inspect(tmp_path / "s-00001-of-00003.gguf").stdout
    # a renamed shard is read alone, with a warning
    (tmp_path / "lonely.gguf").write_bytes((tmp_path / "s-00002-of-00003.gguf").read_bytes())
    r = inspect(tmp_path / "lonely.gguf")
    assert "warning: this file is shard 2 of 3; name it *-0000k-of-0000N.gguf" in r.stdout


def test_exit_code_2_for_unreadable_files_and_usage(tmp_path):
    r = inspect(tmp_path / "nope.gguf")
    assert r.exit_code == 2 and r.stderr == f"ds4tools: {tmp_path / 'nope.gguf'}: no such file\n"
    assert r.stdout == ""
    (tmp_path / "t.txt").write_text("hello, this is not a model at all")
    r = inspect(tmp_path / "t.txt", "--json")
    assert r.exit_code == 2 and "not a GGUF file (magic b'hell'" in r.stderr and r.stdout == ""
    r = CliRunner().invoke(main, ["inspect"])
    assert r.exit_code == 2 and "Missing argument" in r.stderr
    r = CliRunner().invoke(main, ["inspect", "x", "--bogus"])
    assert r.exit_code == 2
