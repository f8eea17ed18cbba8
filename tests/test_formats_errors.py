"""Bad input to the formats API is a ValueError that names the problem, never a numba crash."""
import numpy as np
import pytest

from ds4tools import formats


def test_unknown_type_name():
    with pytest.raises(ValueError, match=r"unknown tensor type 'Q9_K'"):
        formats.quantize(np.zeros((1, 32), np.float32), "Q9_K")


def test_unknown_type_id():
    with pytest.raises(ValueError, match=r"unsupported ggml type id 999"):
        formats.get_format(999)


def test_type_names_are_case_insensitive():
    assert formats.get_format("q8_0") is formats.FORMATS["Q8_0"]


@pytest.mark.parametrize("name", list(formats.FORMATS))
def test_row_length_not_a_multiple_of_the_block(name):
    fmt = formats.FORMATS[name]
    if fmt.block_size == 1:
        pytest.skip("float types take any row length")
    with pytest.raises(ValueError, match=rf"row length {fmt.block_size + 1} is not a multiple of {name}'s block size {fmt.block_size}"):
        formats.quantize(np.zeros((2, fmt.block_size + 1), np.float32), name)


def test_non_float_array():
    with pytest.raises(ValueError, match=r"must be floating point, got dtype int32"):
        formats.quantize(np.zeros((2, 32), np.int32), "Q8_0")


@pytest.mark.parametrize("bad,kind", [(np.nan, "NaN"), (np.inf, "Inf"), (-np.inf, "Inf")])
def test_nan_or_inf(bad, kind):
    x = np.zeros((2, 64), np.float32)
    x[1, 33] = bad
    with pytest.raises(ValueError, match=rf"contains {kind} at index \(1, 33\)"):
        formats.quantize(x, "Q8_0")


def test_raw_buffer_of_the_wrong_size():
    raw = np.zeros(100, np.uint8)
    with pytest.raises(ValueError, match=r"raw buffer has 100 bytes, but a Q8_0 tensor of shape \(2, 64\) needs 136"):
        formats.dequantize(raw, "Q8_0", (2, 64))


def test_raw_buffer_of_a_non_numeric_type():
    with pytest.raises(ValueError, match=r"raw data must be a uint8 buffer"):
        formats.dequantize(np.array(["a"] * 136), "Q8_0", (2, 64))


def _imatrix_format():
    name = next((n for n, f in formats.FORMATS.items() if f.uses_imatrix), None)
    if name is None:
        pytest.skip("no registered format takes an imatrix")
    return name, 2 * max(256, formats.FORMATS[name].block_size)


def test_bad_imatrix_shape():
    name, n = _imatrix_format()
    with pytest.raises(ValueError, match=rf"imatrix has shape \(3,\), expected \({n},\)"):
        formats.quantize(np.zeros((2, n), np.float32), name, imatrix=np.ones(3, np.float32))


def test_negative_imatrix():
    name, n = _imatrix_format()
    with pytest.raises(ValueError, match=r"imatrix values must be finite and non-negative"):
        formats.quantize(np.zeros((2, n), np.float32), name, imatrix=-np.ones(n, np.float32))


def test_missing_required_imatrix():
    name = next((n for n, f in formats.FORMATS.items() if f.requires_imatrix), None)
    if name is None:
        pytest.skip("no registered format requires an imatrix")
    with pytest.raises(ValueError, match=rf"{name} requires an importance matrix"):
        formats.quantize(np.zeros((2, 256), np.float32), name)


def test_unknown_device():
    with pytest.raises(ValueError, match=r"unknown device 'tpu'"):
        formats.quantize(np.zeros((1, 32), np.float32), "Q8_0", device="tpu")


def test_matmul_shape_mismatch():
    raw = formats.quantize(np.zeros((4, 64), np.float32), "Q8_0")
    with pytest.raises(ValueError, match=r"x has shape \(2, 32\), expected \(k, 64\)"):
        formats.matmul(raw, "Q8_0", (4, 64), np.zeros((2, 32), np.float32))


def test_byte_shape_and_nbytes():
    assert formats.byte_shape((3, 4, 256), "Q8_0") == (3, 4, 272)
    assert formats.tensor_nbytes((3, 4, 256), "Q8_0") == 3 * 4 * 272
