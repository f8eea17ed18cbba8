"""llama.cpp imatrix files: both formats round-trip, bad files are clear ValueErrors, names map."""
import struct

import gguf
import numpy as np
import pytest

from ds4tools import formats
from ds4tools.gguf_io.imatrix import Imatrix, load_imatrix, save_imatrix, synthetic_imatrix
from tests.oracle import ggml_quantize

RNG = np.random.default_rng(2024)
ATTN = "blk.0.attn_q.weight"
EXPS = "blk.1.ffn_gate_exps.weight"


def _sample() -> Imatrix:
    return Imatrix(
        {ATTN: RNG.random(64).astype(np.float32) * 3,
         EXPS: RNG.random((4, 32)).astype(np.float32)},
        datasets=["wiki.train.raw"], chunk_count=17, chunk_size=512)


@pytest.mark.parametrize("ext", ["gguf", "dat"])
def test_round_trip(tmp_path, ext):
    im = _sample()
    path = tmp_path / f"imatrix.{ext}"
    save_imatrix(im, path)
    back = load_imatrix(path)
    assert set(back.entries) == {ATTN, EXPS}
    np.testing.assert_array_equal(back.entries[ATTN], im.entries[ATTN])
    # .dat keeps a 3-D tensor's experts end to end; for_tensor shapes them either way
    np.testing.assert_array_equal(back.entries[EXPS].reshape(4, 32), im.entries[EXPS])
    np.testing.assert_array_equal(back.for_tensor(EXPS, (4, 16, 32)), im.entries[EXPS])
    assert back.datasets == ["wiki.train.raw"] and back.chunk_count == 17
    assert back.chunk_size == (512 if ext == "gguf" else None)
    assert back.path == str(path)
    assert all(v.dtype == np.float32 for v in back.entries.values())


def test_writer_format_follows_the_suffix_unless_told(tmp_path):
    save_imatrix(_sample(), tmp_path / "a.gguf")
    save_imatrix(_sample(), tmp_path / "b.dat")
    save_imatrix(_sample(), tmp_path / "c.bin", format="gguf")
    assert (tmp_path / "a.gguf").read_bytes()[:4] == b"GGUF"
    assert (tmp_path / "b.dat").read_bytes()[:4] == struct.pack("<i", 2)
    assert (tmp_path / "c.bin").read_bytes()[:4] == b"GGUF"
    with pytest.raises(ValueError, match=r"unknown imatrix format 'npz'"):
        save_imatrix(_sample(), tmp_path / "d", format="npz")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.gguf", "b.dat", "c.bin"]  # no temp files


def _write_llama_gguf(path, tensors: dict, general_type="imatrix"):
    """A GGUF imatrix the way llama-imatrix writes one: sums of squares and counts."""
    class W(gguf.GGUFWriter):
        def add_architecture(self):
            pass
    w = W(str(path), arch="")
    if general_type is not None:
        w.add_type(general_type)
    w.add_array("imatrix.datasets", ["a.txt", "b.txt"])
    w.add_uint32("imatrix.chunk_count", 3)
    w.add_uint32("imatrix.chunk_size", 256)
    for name, arr in tensors.items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_values_are_sums_over_counts_and_unseen_experts_get_ones(tmp_path):
    sums = RNG.random((3, 8)).astype(np.float32) * 100
    counts = np.array([[512.0], [0.0], [1024.0]], np.float32)  # expert 1 was never routed to
    path = tmp_path / "llama.gguf"
    _write_llama_gguf(path, {EXPS + ".in_sum2": sums, EXPS + ".counts": counts,
                             ATTN + ".in_sum2": sums[:1], ATTN + ".counts": counts[:1]})
    im = load_imatrix(path)
    np.testing.assert_array_equal(im.entries[EXPS][0], sums[0] / np.float32(512))
    np.testing.assert_array_equal(im.entries[EXPS][1], np.ones(8, np.float32))
    np.testing.assert_array_equal(im.entries[EXPS][2], sums[2] / np.float32(1024))
    assert im.entries[ATTN].shape == (8,)
    assert im.datasets == ["a.txt", "b.txt"] and im.chunk_count == 3 and im.chunk_size == 256


def test_dat_values_are_divided_by_ncall(tmp_path):
    vals = np.array([2.0, 4.0, 6.0, 8.0], np.float32)
    raw = struct.pack("<i", 1) + struct.pack("<i", len(ATTN)) + ATTN.encode()
    raw += struct.pack("<ii", 2, 4) + vals.tobytes()  # no trailer: it is optional
    path = tmp_path / "old.dat"
    path.write_bytes(raw)
    im = load_imatrix(path)
    np.testing.assert_array_equal(im.entries[ATTN], vals / 2)
    assert im.datasets == [] and im.chunk_count is None


def _dat_bytes() -> bytes:
    path_bytes = []
    name = ATTN.encode()
    vals = np.arange(1, 9, dtype=np.float32)
    path_bytes.append(struct.pack("<i", 1))
    path_bytes.append(struct.pack("<i", len(name)) + name + struct.pack("<ii", 1, 8) + vals.tobytes())
    path_bytes.append(struct.pack("<ii", 5, 4) + b"data")
    return b"".join(path_bytes)


def test_every_truncation_of_a_dat_file_is_a_clear_error(tmp_path):
    full = _dat_bytes()
    path = tmp_path / "cut.dat"
    for cut in range(len(full)):
        if cut == len(full) - 12:  # exactly before the optional trailer: a valid file
            continue
        path.write_bytes(full[:cut])
        with pytest.raises(ValueError, match=str(path)):
            load_imatrix(path)
    path.write_bytes(full)
    assert load_imatrix(path).datasets == ["data"]


@pytest.mark.parametrize("patch,message", [
    (lambda b: struct.pack("<i", 2**31 - 1) + b[4:], r"claims 2147483647 entries, but \d+ bytes hold at most"),
    (lambda b: struct.pack("<i", 0) + b[4:], r"claims 0 entries"),
    (lambda b: b[:4] + struct.pack("<i", 2**30) + b[8:], r"entry 0's name claims 1073741824 bytes"),
    (lambda b: b[:4] + struct.pack("<i", -5) + b[8:], r"entry 0 has a name of length -5"),
    (lambda b: b[:8 + len(ATTN) + 4] + struct.pack("<i", 2**29) + b[8 + len(ATTN) + 8:],
     r"entry 'blk.0.attn_q.weight' claims 536870912 values"),
    (lambda b: b[:8 + len(ATTN) + 4] + struct.pack("<i", -1) + b[8 + len(ATTN) + 8:],
     r"entry 'blk.0.attn_q.weight' claims -1 values"),
    (lambda b: b + b"xx", r"2 unexpected bytes after the dataset name"),
    (lambda b: b[:8 + len(ATTN) + 12] + np.float32(np.nan).tobytes() + b[8 + len(ATTN) + 16:],
     r"non-finite values"),
])
def test_lying_dat_headers(tmp_path, patch, message):
    path = tmp_path / "lying.dat"
    path.write_bytes(patch(_dat_bytes()))
    with pytest.raises(ValueError, match=message) as err:
        load_imatrix(path)
    assert str(path) in str(err.value)


def test_unreadable_and_foreign_files(tmp_path):
    with pytest.raises(ValueError, match=r"missing\.dat: cannot read imatrix file"):
        load_imatrix(tmp_path / "missing.dat")
    (tmp_path / "empty.dat").write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty\.dat: empty file"):
        load_imatrix(tmp_path / "empty.dat")
    (tmp_path / "bad.gguf").write_bytes(b"GGUF" + b"\xff" * 10)
    with pytest.raises(ValueError, match=r"bad\.gguf: not a readable GGUF file"):
        load_imatrix(tmp_path / "bad.gguf")
    model = tmp_path / "model.gguf"
    _write_llama_gguf(model, {"token_embd.weight": np.zeros((2, 4), np.float32)}, general_type="model")
    with pytest.raises(ValueError, match=r"model\.gguf: a GGUF file, but not an imatrix \(general.type is 'model'"):
        load_imatrix(model)


def test_gguf_entry_without_counts(tmp_path):
    path = tmp_path / "half.gguf"
    _write_llama_gguf(path, {ATTN + ".in_sum2": np.ones((1, 8), np.float32)})
    with pytest.raises(ValueError, match=rf"entry '{ATTN}' needs both {ATTN}.in_sum2 and {ATTN}.counts"):
        load_imatrix(path)


def test_gguf_sums_not_divisible_by_counts(tmp_path):
    path = tmp_path / "odd.gguf"
    _write_llama_gguf(path, {ATTN + ".in_sum2": np.ones((1, 9), np.float32),
                             ATTN + ".counts": np.ones((2, 1), np.float32)})
    with pytest.raises(ValueError, match=r"has 9 values, not a multiple of its 2 counts"):
        load_imatrix(path)


def test_for_tensor_name_mapping_and_length_checks():
    im = Imatrix({ATTN: np.ones(64, np.float32),
                  EXPS: np.ones(4 * 32, np.float32),  # legacy layout: experts end to end
                  "blk.2.ffn_up_exps.weight": np.ones((4, 32), np.float32),
                  "blk.3.ffn_down_exps.weight.expert.0": np.full(16, 1.0, np.float32),
                  "blk.3.ffn_down_exps.weight.expert.1": np.full(16, 2.0, np.float32)},
                 path="im.dat")
    assert im.for_tensor(ATTN, (128, 64)).shape == (64,)
    assert im.for_tensor("blk.9.attn_q.weight", (128, 64)) is None
    assert im.for_tensor(EXPS, (4, 8, 32)).shape == (4, 32)
    assert im.for_tensor("blk.2.ffn_up_exps.weight", (4, 8, 32)).shape == (4, 32)
    per_expert = im.for_tensor("blk.3.ffn_down_exps.weight", (2, 8, 16))
    np.testing.assert_array_equal(per_expert[:, 0], [1.0, 2.0])
    with pytest.raises(ValueError, match=r"im.dat: imatrix entry 'blk.0.attn_q.weight' has 64 values, "
                                         r"which does not fit tensor blk.0.attn_q.weight of shape \(128, 32\) "
                                         r"\(rows of 32 values\)"):
        im.for_tensor(ATTN, (128, 32))
    with pytest.raises(ValueError, match=r"has 4 vectors, but tensor blk.2.ffn_up_exps.weight of shape "
                                         r"\(3, 8, 32\) \(rows of 32 values, 3 experts\)"):
        im.for_tensor("blk.2.ffn_up_exps.weight", (3, 8, 32))
    with pytest.raises(ValueError, match=r"has rows of 32 values, but tensor"):
        im.for_tensor("blk.2.ffn_up_exps.weight", (4, 8, 64))
    with pytest.raises(ValueError, match=r"has 128 values, which does not fit"):
        im.for_tensor(EXPS, (128, 32))  # a 2-D tensor cannot take a per-expert entry


def test_synthetic_imatrix_is_the_column_sum_of_squares():
    w = RNG.standard_normal((3, 50, 32)).astype(np.float32)
    got = synthetic_imatrix(w)
    assert got.shape == (3, 32) and got.dtype == np.float32
    np.testing.assert_allclose(got, (w.astype(np.float64) ** 2).sum(axis=1), rtol=1e-6)
    np.testing.assert_allclose(synthetic_imatrix(w[0]), (w[0].astype(np.float64) ** 2).sum(axis=0), rtol=1e-6)
    with pytest.raises(ValueError, match=r"needs a 2-D or 3-D float tensor, got 1-D"):
        synthetic_imatrix(np.ones(4, np.float32))


@pytest.mark.parametrize("ext", ["gguf", "dat"])
def test_quantizing_with_a_loaded_imatrix_matches_ggml(tmp_path, ext):
    w = RNG.standard_normal((2, 3, 256)).astype(np.float32)
    path = tmp_path / f"im.{ext}"
    save_imatrix(Imatrix({EXPS: (RNG.random((2, 256)) + 0.01).astype(np.float32)}), path)
    weights = load_imatrix(path).for_tensor(EXPS, w.shape)
    raw = formats.quantize(w, "IQ2_XXS", imatrix=weights)
    for e in range(2):
        np.testing.assert_array_equal(raw[e], ggml_quantize(w[e], "IQ2_XXS", weights[e]))
