"""ds4tools.gguf_io: the reader (open_gguf, TensorRef, split sets) and the streaming writer."""
import os

import gguf
import numpy as np
import pytest
from gguf import GGUFValueType as V

from ds4tools import formats
from ds4tools.errors import InvalidContentError, UnreadableError, UsageError
from ds4tools.gguf_io import GGUFStreamWriter, check_header, open_gguf, split_shard_paths

RNG = np.random.default_rng(42)


def write_model(path, tensors: dict, keys=(), arch="llama", **kw):
    """tensors: name -> (float32 values, type name)."""
    with GGUFStreamWriter(path, arch, **kw) as w:
        for key, value, vtype, sub in keys:
            w.add_key(key, value, vtype, sub)
        for name, (values, t) in tensors.items():
            w.add_tensor_info(name, values.shape, t)
        w.begin()
        for name, (values, t) in tensors.items():
            w.write_tensor(name, formats.quantize(values, t))
    return path


def sample_tensors():
    return {
        "a.weight": (RNG.standard_normal((4, 256)).astype(np.float32), "Q4_K"),
        "b.weight": (RNG.standard_normal((3, 64)).astype(np.float32), "Q8_0"),
        "c.weight": (RNG.standard_normal(64).astype(np.float32), "F32"),
        "d.weight": (RNG.standard_normal((2, 3, 32)).astype(np.float32), "F16"),
        "e.weight": (RNG.standard_normal((5, 32)).astype(np.float32), "BF16"),
    }


KEYS = [("llama.block_count", 3, V.UINT32, None), ("x.float", 0.5, V.FLOAT32, None),
        ("x.names", ["a", "", "ü"], V.ARRAY, V.STRING), ("x.ints", [1, -2, 3], V.ARRAY, V.INT32),
        ("x.flag", True, V.BOOL, None), ("x.empty", "", V.STRING, None), ("x.big", 2 ** 40, V.UINT64, None)]


def test_round_trip_metadata_types_and_tensor_refs(tmp_path):
    tensors = sample_tensors()
    path = write_model(tmp_path / "m.gguf", tensors, KEYS)
    f = open_gguf(path)
    assert f.version == 3 and f.alignment == 32 and f.architecture == "llama"
    assert f.paths == [str(path)]
    assert f.metadata == {"general.architecture": "llama", "llama.block_count": 3, "x.float": 0.5,
                          "x.names": ["a", "", "ü"], "x.ints": [1, -2, 3], "x.flag": True,
                          "x.empty": "", "x.big": 2 ** 40}
    assert f.value_type("x.names") == (V.ARRAY, V.STRING)
    assert f.value_type("x.big") == (V.UINT64, None)
    with pytest.raises(KeyError, match="no key 'nope'"):
        f.value_type("nope")
    assert list(f.tensors) == list(tensors)  # file order
    for name, (values, t) in tensors.items():
        ref = f.tensors[name]
        assert ref.type_name == t and ref.shape == values.shape
        assert ref.ggml_shape == tuple(reversed(values.shape))
        assert ref.n_elements == values.size
        assert ref.n_bytes == formats.tensor_nbytes(values.shape, t)
        assert ref.data_offset % 32 == 0 and ref.path == str(path)
        raw = ref.raw()
        assert raw.dtype == np.uint8 and raw.shape == formats.byte_shape(values.shape, t)
        assert np.array_equal(raw, formats.quantize(values, t))
        np.testing.assert_array_equal(ref.to_float32(), formats.dequantize(raw, t, values.shape))


def test_raw_is_a_view_of_the_mapped_file_not_a_copy(tmp_path):
    path = write_model(tmp_path / "m.gguf", sample_tensors())
    f = open_gguf(path)
    a, b = f.tensors["a.weight"].raw(), f.tensors["b.weight"].raw()
    base = f.tensors["a.weight"]._file_bytes
    assert isinstance(base, np.memmap)
    assert np.shares_memory(a, base) and np.shares_memory(b, base)
    assert not a.flags.writeable
    with open(path, "rb") as fh:
        fh.seek(f.tensors["b.weight"].data_offset)
        assert fh.read(16) == b.reshape(-1)[:16].tobytes()


def test_to_float32_falls_back_to_gguf_quants_for_types_the_registry_lacks(tmp_path):
    # TQ2_0 is not one of our formats, but gguf-py can quantize and decode it
    x = RNG.standard_normal((2, 256)).astype(np.float32)
    raw = gguf.quants.quantize(x, gguf.GGMLQuantizationType.TQ2_0)
    w = gguf.GGUFWriter(tmp_path / "t.gguf", "llama")
    w.add_tensor("t.weight", raw, raw_dtype=gguf.GGMLQuantizationType.TQ2_0)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    t = open_gguf(tmp_path / "t.gguf").tensors["t.weight"]
    assert t.type_name == "TQ2_0" and t.shape == (2, 256)
    np.testing.assert_array_equal(t.to_float32(), gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.TQ2_0))


def test_writer_refuses_inputs_existing_targets_and_bad_calls(tmp_path):
    src = write_model(tmp_path / "src.gguf", sample_tensors())
    with pytest.raises(UsageError, match="refusing to write over an input file"):
        GGUFStreamWriter(src, "llama", inputs=[src], overwrite=True)
    with pytest.raises(UsageError, match="already exists"):
        GGUFStreamWriter(src, "llama")
    with pytest.raises(UsageError, match="its folder does not exist"):
        GGUFStreamWriter(tmp_path / "no" / "x.gguf", "llama")
    w = GGUFStreamWriter(tmp_path / "o.gguf", "llama")
    with pytest.raises(ValueError, match="empty: gguf cannot write empty arrays"):
        w.add_key("x.e", [], V.ARRAY, V.INT32)
    with pytest.raises(ValueError, match="not a multiple of Q8_0's block size 32"):
        w.add_tensor_info("t", (2, 48), "Q8_0")
    w.add_tensor_info("p", (2, 32), "Q8_0")
    w.add_tensor_info("q", (32,), "F32")
    w.begin()
    with pytest.raises(ValueError, match="written out of order: 'p' comes next"):
        w.write_tensor("q", np.zeros(32, np.float32))
    with pytest.raises(ValueError, match="68 declared"):
        w.write_tensor("p", np.zeros(10, np.uint8))
    with pytest.raises(ValueError, match="never written"):
        w.commit()
    w.abort()
    assert sorted(os.listdir(tmp_path)) == ["src.gguf"]


def test_writer_leaves_nothing_when_the_block_fails(tmp_path):
    with pytest.raises(RuntimeError, match="stop"):
        with GGUFStreamWriter(tmp_path / "o.gguf", "llama") as w:
            w.add_tensor_info("p", (32,), "F32")
            w.begin()
            raise RuntimeError("stop")
    assert os.listdir(tmp_path) == []


def test_writer_overwrite_replaces_atomically_and_sets_permissions(tmp_path):
    target = tmp_path / "o.gguf"
    target.write_bytes(b"old")
    write_model(target, {"c.weight": (np.ones(32, np.float32), "F32")}, overwrite=True)
    assert open_gguf(target).tensors["c.weight"].to_float32().tolist() == [1.0] * 32
    assert oct(os.stat(target).st_mode & 0o777) != oct(0o600)
    assert os.listdir(tmp_path) == ["o.gguf"]


def write_split(tmp_path, n_per_shard=2):
    tensors = sample_tensors()
    w = gguf.GGUFWriter(tmp_path / "m.gguf", "llama", split_max_tensors=n_per_shard)
    w.add_uint32("llama.block_count", 3)
    for name, (values, t) in tensors.items():
        raw = formats.quantize(values, t)
        w.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType[t])
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return tensors, sorted(tmp_path.glob("m-*.gguf"))


def test_split_set_opens_from_any_shard_as_one_model(tmp_path):
    tensors, shards = write_split(tmp_path)
    assert [p.name for p in shards] == [f"m-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    for shard in shards:
        f = open_gguf(shard)
        assert f.path == str(shard) and f.paths == [str(p) for p in shards]
        assert list(f.tensors) == list(tensors)
        assert f.metadata["llama.block_count"] == 3 and f.metadata["split.count"] == 3
        assert f.tensors["e.weight"].path == str(shards[2])
        for name, (values, t) in tensors.items():
            assert np.array_equal(f.tensors[name].raw(), formats.quantize(values, t))
    assert split_shard_paths(tmp_path / "plain.gguf") == [str(tmp_path / "plain.gguf")]


def test_split_set_with_a_missing_shard(tmp_path):
    _, shards = write_split(tmp_path)
    os.remove(shards[1])
    with pytest.raises(UnreadableError, match="split set is missing shard m-00002-of-00003.gguf"):
        open_gguf(shards[0])


def test_check_header_reports_layout(tmp_path):
    path = write_model(tmp_path / "m.gguf", sample_tensors(), KEYS)
    layout = check_header(path)
    assert layout.version == 3 and layout.n_tensors == 5 and layout.n_kv == len(KEYS) + 1
    assert layout.keys[0] == "general.architecture" and not layout.problems
    assert [r.name for r in layout.tensors] == list(sample_tensors())
    assert layout.data_start == open_gguf(path).shards[0].data_offset


def test_open_errors_name_the_file(tmp_path):
    with pytest.raises(UnreadableError, match="no such file"):
        open_gguf(tmp_path / "missing.gguf")
    with pytest.raises(UnreadableError, match="not a regular file"):
        open_gguf(tmp_path)
    (tmp_path / "e.gguf").write_bytes(b"")
    with pytest.raises(UnreadableError, match=r"e\.gguf: truncated: 0 bytes"):
        open_gguf(tmp_path / "e.gguf")
    # a duplicate tensor name is content the reader refuses: InvalidContentError, exit code 1
    p = write_model(tmp_path / "d.gguf", {"aa.weight": (np.ones(32, np.float32), "F32"),
                                          "ab.weight": (np.ones(32, np.float32), "F32")})
    data = p.read_bytes().replace(b"ab.weight", b"aa.weight")
    p.write_bytes(data)
    with pytest.raises(InvalidContentError, match="duplicate tensor name 'aa.weight'") as e:
        open_gguf(p)
    assert e.value.exit_code == 1


def test_bulk_array_reading_gives_what_gguf_reader_gives(tmp_path):
    """Metadata arrays are read in bulk (gguf-py goes element by element); the values must be
    exactly what gguf's own GGUFReader returns, for every element type."""
    path = tmp_path / "arrays.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_array("a.strings", ["", "x", "ü日本", "a b", "<|x|>"] * 50)
    for vtype, values in ((V.UINT8, [0, 255, 7]), (V.INT8, [-128, 127]), (V.UINT16, [65535, 1]),
                          (V.INT16, [-2, 3]), (V.UINT32, [2 ** 32 - 1]), (V.INT32, list(range(-5, 500))),
                          (V.FLOAT32, [0.5, -1e-6, 3e38]), (V.UINT64, [2 ** 64 - 1]),
                          (V.INT64, [-(2 ** 63)]), (V.FLOAT64, [1e-300, 2.5]), (V.BOOL, [True, False, True])):
        w.add_key_value(f"a.{vtype.name.lower()}", values, V.ARRAY, vtype)
    w.add_key_value("a.nested", [[1, 2], [3, 4, 5]], V.ARRAY)  # arrays of arrays keep gguf's path
    w.add_string("a.after", "still in place")
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    f = open_gguf(path)
    ref = gguf.GGUFReader(path)
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):
            continue
        assert f.metadata[key] == field.contents(), key
        assert f.value_type(key)[0] == field.types[0]
    assert f.value_type("a.int32") == (V.ARRAY, V.INT32)
    assert f.metadata["a.after"] == "still in place"


def test_bulk_array_writing_gives_the_bytes_gguf_writer_gives(tmp_path):
    keys = [("a.strings", ["", "x", "ü日本", "a b"] * 40, V.ARRAY, V.STRING),
            ("a.i32", list(range(-300, 300)), V.ARRAY, V.INT32),
            ("a.f32", [0.1, -2.5, 1e-7, 3.0e38], V.ARRAY, V.FLOAT32),
            ("a.u8", [0, 1, 255], V.ARRAY, V.UINT8), ("a.bool", [True, False], V.ARRAY, V.BOOL),
            ("a.u64", [2 ** 64 - 1, 0], V.ARRAY, V.UINT64), ("a.f64", [1e-300], V.ARRAY, V.FLOAT64),
            ("a.nested", [[1, 2], [3]], V.ARRAY, None), ("a.s", "text", V.STRING, None)]
    ref = gguf.GGUFWriter(tmp_path / "ref.gguf", "llama")
    for key, value, vtype, sub in keys:
        ref.add_key_value(key, value, vtype, sub)
    ref.write_header_to_file(); ref.write_kv_data_to_file(); ref.write_tensors_to_file(); ref.close()
    with GGUFStreamWriter(tmp_path / "ours.gguf", "llama") as w:
        for key, value, vtype, sub in keys:
            w._writer.add_key_value(key, value, vtype, sub)  # nested arrays have no sub type
    assert (tmp_path / "ours.gguf").read_bytes() == (tmp_path / "ref.gguf").read_bytes()
