"""Every registered format: bytes equal ggml's quantizer, and decoding agrees with gguf-py."""
import zlib

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants as gq

from ds4tools import formats
from tests.oracle import ggml_quantize, requires_imatrix

ALL = list(formats.FORMATS)


def _rows(kind: str, n: int, rng) -> np.ndarray:
    rows = 6
    if kind == "random":
        return rng.standard_normal((rows, n)).astype(np.float32)
    if kind == "tiny":
        return (rng.standard_normal((rows, n)) * 1e-6).astype(np.float32)
    if kind == "huge":
        return (rng.standard_normal((rows, n)) * 1e4).astype(np.float32)
    if kind == "constant":
        return np.full((rows, n), 0.37, np.float32) * np.arange(1, rows + 1, dtype=np.float32)[:, None]
    if kind == "zero":
        return np.zeros((rows, n), np.float32)
    if kind == "sparse":
        x = rng.standard_normal((rows, n)).astype(np.float32)
        x[rng.random((rows, n)) < 0.9] = 0.0
        return x
    if kind == "outliers":  # heavy tails: a few large values per row, as real weights have
        x = (rng.standard_normal((rows, n)) * 0.02).astype(np.float32)
        x[rng.random((rows, n)) < 0.01] *= 100.0
        return x
    raise ValueError(kind)


KINDS = ["random", "tiny", "huge", "constant", "zero", "sparse", "outliers"]


def _n(fmt) -> int:
    return 2 * max(fmt.block_size, 256)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ALL)
def test_bytes_equal_ggml(name, kind):
    fmt = formats.FORMATS[name]
    rng = np.random.default_rng(zlib.crc32(f"{name}/{kind}".encode()))
    x = _rows(kind, _n(fmt), rng)
    if fmt.requires_imatrix:
        pytest.skip(f"{name} needs an imatrix; covered by test_bytes_equal_ggml_with_imatrix")
    ours = formats.quantize(x, name)
    np.testing.assert_array_equal(ours, ggml_quantize(x, name))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", [n for n in ALL if formats.FORMATS[n].uses_imatrix or requires_imatrix(n)])
def test_bytes_equal_ggml_with_imatrix(name, kind):
    fmt = formats.FORMATS[name]
    rng = np.random.default_rng(zlib.crc32(f"{name}/{kind}/imatrix".encode()))
    n = _n(fmt)
    x = _rows(kind, n, rng)
    imatrix = (rng.random(n) ** 2 * 10).astype(np.float32)
    imatrix[rng.random(n) < 0.05] = 0.0
    ours = formats.quantize(x, name, imatrix=imatrix)
    np.testing.assert_array_equal(ours, ggml_quantize(x, name, imatrix))


@pytest.mark.parametrize("name", [n for n in ALL if not formats.FORMATS[n].uses_imatrix])
def test_imatrix_ignored_where_ggml_ignores_it(name):
    fmt = formats.FORMATS[name]
    x = np.random.default_rng(1).standard_normal((3, _n(fmt))).astype(np.float32)
    w = np.random.default_rng(2).random(_n(fmt)).astype(np.float32)
    np.testing.assert_array_equal(formats.quantize(x, name, imatrix=w), formats.quantize(x, name))


@pytest.mark.parametrize("name", ALL)
def test_dequantize_matches_gguf_py(name):
    fmt = formats.FORMATS[name]
    rng = np.random.default_rng(7)
    x = rng.standard_normal((5, _n(fmt))).astype(np.float32)
    w = rng.random(x.shape[1]).astype(np.float32) + 0.1 if fmt.requires_imatrix else None
    raw = formats.quantize(x, name, imatrix=w)
    ours = formats.dequantize(raw, name, x.shape)
    assert ours.dtype == np.float32 and ours.shape == x.shape
    if name == "F32":
        np.testing.assert_array_equal(ours, x)
        return
    ref = gq.dequantize(raw, GGMLQuantizationType[name])
    np.testing.assert_array_equal(ours.view(np.uint32), np.asarray(ref, np.float32).view(np.uint32))


GGUF_PY_QUANTIZERS = ["F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]


@pytest.mark.parametrize("name", [n for n in GGUF_PY_QUANTIZERS if n in formats.FORMATS])
def test_bytes_equal_gguf_py(name):
    x = np.random.default_rng(3).standard_normal((7, 128)).astype(np.float32)
    ref = np.asarray(gq.quantize(x, GGMLQuantizationType[name])).view(np.uint8).reshape(7, -1)
    np.testing.assert_array_equal(formats.quantize(x, name), ref)


@pytest.mark.parametrize("name", ALL)
def test_matmul_fused_equals_dequantized_product(name):
    fmt = formats.FORMATS[name]
    rng = np.random.default_rng(11)
    n_in = _n(fmt)
    w = rng.standard_normal((24, n_in)).astype(np.float32)
    im = rng.random(n_in).astype(np.float32) + 0.1 if fmt.requires_imatrix else None
    raw = formats.quantize(w, name, imatrix=im)
    x = rng.standard_normal((5, n_in)).astype(np.float32)
    ref = x.astype(np.float64) @ formats.dequantize(raw, name, w.shape).astype(np.float64).T
    got = formats.matmul(raw, name, w.shape, x)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


@pytest.mark.parametrize("name", ALL)
def test_matmul_batch_rows_bit_identical_to_single_rows(name):
    fmt = formats.FORMATS[name]
    rng = np.random.default_rng(12)
    n_in = _n(fmt)
    w = rng.standard_normal((40, n_in)).astype(np.float32)
    im = rng.random(n_in).astype(np.float32) + 0.1 if fmt.requires_imatrix else None
    raw = formats.quantize(w, name, imatrix=im)
    x = rng.standard_normal((17, n_in)).astype(np.float32)
    batch = formats.matmul(raw, name, w.shape, x)
    for k in (1, 2, 3, 8, 17):
        part = formats.matmul(raw, name, w.shape, x[:k])
        np.testing.assert_array_equal(part.view(np.uint32), batch[:k].view(np.uint32))
    for t in range(x.shape[0]):
        single = formats.matmul(raw, name, w.shape, x[t])
        np.testing.assert_array_equal(single.view(np.uint32), batch[t].view(np.uint32))


@pytest.mark.parametrize("name", ALL)
def test_three_dimensional_tensor_with_per_expert_imatrix(name):
    fmt = formats.FORMATS[name]
    rng = np.random.default_rng(5)
    n = _n(fmt)
    x = rng.standard_normal((3, 4, n)).astype(np.float32)
    w = (rng.random((3, n)) + 0.05).astype(np.float32)
    raw = formats.quantize(x, name, imatrix=w)
    assert raw.shape == (3, 4, fmt.row_bytes(n))
    for e in range(3):
        expect = ggml_quantize(x[e], name, w[e] if (fmt.uses_imatrix or fmt.requires_imatrix) else None)
        np.testing.assert_array_equal(raw[e], expect)


def test_f16_matmul_decodes_every_bit_pattern_exactly():
    # the F16 mat-vec converts its rows with integer and float operations, not the table: every
    # fp16 pattern (subnormals, infinities, NaN payloads) gives the table's float32 bits
    from ds4tools.formats._numeric import FP16_TO_FP32
    from ds4tools.formats.floats import f16_row_to_f32
    h = np.arange(65536, dtype=np.uint16)
    got = np.empty(65536, np.float32)
    f16_row_to_f32(h, got)
    np.testing.assert_array_equal(got.view(np.uint32), FP16_TO_FP32.view(np.uint32))


def test_f16_matmul_rows_by_f16c_keep_every_value():
    # where the CPU has F16C the mat-vec's rows go through vcvtph2ps, 8 at a time (the last
    # len % 8 through f16_row_to_f32): every pattern but a NaN gives the table's bits, and a
    # NaN stays a NaN (a signalling one comes back quiet)
    from ds4tools.formats._numeric import FP16_TO_FP32
    from ds4tools.formats.floats import f16_row_to_f32_fast
    h = np.concatenate([np.arange(65536), np.arange(0x7C00, 0x7C05)]).astype(np.uint16)
    got = np.empty(h.shape[0], np.float32)
    f16_row_to_f32_fast(h, got)
    ref = FP16_TO_FP32[h]
    nan = np.isnan(ref)
    np.testing.assert_array_equal(got[~nan].view(np.uint32), ref[~nan].view(np.uint32))
    assert np.isnan(got[nan]).all()


def test_f16c_conversion_can_be_left_out(monkeypatch):
    # USE_F16C = False compiles the conversion to nothing (count 0), so f16_row_to_f32 does all
    # of a row; with it, hosts with F16C convert the whole multiples of 8
    from numba import njit
    from ds4tools.formats import floats
    from ds4tools.formats._llvm_ir import host_cpu_features
    h = np.arange(20, dtype=np.uint16)

    def fresh():
        @njit
        def run(h, out):
            return floats.f16c_row_to_f32(h, out)
        return run(h, np.zeros(20, np.float32))

    assert fresh() == (16 if "f16c" in host_cpu_features() else 0)
    monkeypatch.setattr(floats, "USE_F16C", False)
    assert fresh() == 0
