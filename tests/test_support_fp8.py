"""DeepSeek V4's FP8 E4M3 / E8M0 / FP4 E2M1 decoding (ds4tools.support.fp8), checked against an
independent reference (IEEE bit patterns and the OCP table in tests/fixtures/support_models.py)."""
import numpy as np
import pytest

from ds4tools.support import fp8
from tests.fixtures.support_models import ref_e2m1, ref_e4m3, ref_e8m0


def test_e4m3_every_code():
    codes = np.arange(256, dtype=np.uint8)
    finite = (codes & 0x7F) != 0x7F
    got = fp8.e4m3_to_float32(codes)
    np.testing.assert_array_equal(got[finite], ref_e4m3(codes[finite]))
    assert np.isnan(got[~finite]).all()
    # landmarks of the format: 1.0, the largest finite value, the smallest subnormal
    assert got[0x38] == 1.0 and got[0x7E] == 448.0 and got[0x01] == 2.0 ** -9
    assert got[0xB8] == -1.0 and np.signbit(got[0x80])


def test_e8m0_and_e2m1_every_code():
    codes = np.arange(255, dtype=np.uint8)
    np.testing.assert_array_equal(fp8.e8m0_to_float32(codes), ref_e8m0(codes))
    assert np.isnan(fp8.e8m0_to_float32(np.array([255], np.uint8)))[0]
    nib = np.arange(16, dtype=np.uint8)
    np.testing.assert_array_equal(fp8.E2M1_VALUES, ref_e2m1(nib))


@pytest.mark.parametrize("shape", [(300, 200), (128, 128), (5, 7), (129, 257)])
def test_fp8_block_scales(shape):
    rng = np.random.default_rng(1)
    codes = rng.integers(0, 0x7E, size=shape, dtype=np.uint8)
    scale = rng.integers(100, 140, size=fp8.fp8_scale_shape(shape), dtype=np.uint8)
    got = fp8.dequantize_fp8(codes, scale)
    rows, cols = shape
    want = np.empty(shape, np.float32)
    for i in range(rows):  # the slow, obvious way: each value times its block's scale
        for j in range(0, cols, 37):
            blk = slice(j, min(j + 37, cols))
            want[i, blk] = ref_e4m3(codes[i, blk]) * ref_e8m0(scale[i // 128, np.arange(cols)[blk] // 128])
    np.testing.assert_array_equal(got, want)


def test_fp4_low_nibble_first_and_group_scales():
    rng = np.random.default_rng(2)
    nib = rng.integers(0, 16, size=(3, 64), dtype=np.uint8)
    packed = (nib[:, 0::2] | (nib[:, 1::2] << 4)).astype(np.uint8)
    scale = rng.integers(120, 130, size=(3, 2), dtype=np.uint8)
    got = fp8.dequantize_fp4(packed.view(np.int8), scale)  # stored as I8 in the checkpoint
    want = ref_e2m1(nib) * np.repeat(ref_e8m0(scale), 32, axis=1)
    np.testing.assert_array_equal(got, want)
    # one byte: 0x21 holds value 1 (0x1 -> 0.5) then value 2 (0x2 -> 1.0)
    one = fp8.dequantize_fp4(np.array([[0x21] * 16], np.uint8), np.array([[127]], np.uint8))
    assert one[0, 0] == 0.5 and one[0, 1] == 1.0


def test_bad_shapes_are_clear_errors():
    with pytest.raises(ValueError, match=r"FP8 scale has shape \[1, 1\], expected \[2, 1\]"):
        fp8.dequantize_fp8(np.zeros((200, 100), np.uint8), np.zeros((1, 1), np.uint8))
    with pytest.raises(ValueError, match="holds 32 inputs per row, expected 64"):
        fp8.dequantize_fp4(np.zeros((2, 16), np.uint8), np.zeros((2, 1), np.uint8), n_inputs=64)
    with pytest.raises(ValueError, match="one byte per value"):
        fp8.dequantize_fp8(np.zeros((2, 2), np.float32), np.zeros((1, 1), np.uint8))
    with pytest.raises(ValueError, match=r"FP4 scale has shape \[2, 3\]"):
        fp8.dequantize_fp4(np.zeros((2, 32), np.uint8), np.zeros((2, 3), np.uint8))


def test_encoders_round_trip():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((150, 260)).astype(np.float32) * 3
    codes, scale = fp8.quantize_fp8(x)
    y = fp8.dequantize_fp8(codes, scale)
    # E4M3 keeps 3 mantissa bits: at most half a step (1/16 relative) plus the subnormal floor
    block_scale = np.repeat(np.repeat(fp8.e8m0_to_float32(scale), 128, 0), 128, 1)[:150, :260]
    assert (np.abs(y - x) <= np.abs(x) / 16 + block_scale * 2.0 ** -10).all()
    # values FP4 represents exactly come back exactly
    grid = np.tile(np.concatenate([fp8.E2M1_VALUES] * 2), (4, 1)) * 0.25
    packed, s = fp8.quantize_fp4(grid)
    np.testing.assert_array_equal(fp8.dequantize_fp4(packed, s), grid)
    np.testing.assert_array_equal(fp8.encode_e4m3(np.array([1.0, -448.0, 1e6, 0.0])),
                                  np.array([0x38, 0xFE, 0x7E, 0x00], np.uint8))
