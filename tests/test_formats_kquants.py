"""Q4_0, Q4_1, Q5_0, Q5_1 and the K-quants: edge inputs against ggml, and the CPU fast paths
against the block functions the CUDA kernels share."""
import os
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import numpy as np
import pytest

from ds4tools import formats
from ds4tools.formats import kquants, legacy
from ds4tools.formats._numeric import FP16_TO_FP32
from tests.oracle import ggml_quantize

LEGACY = ["Q4_0", "Q4_1", "Q5_0", "Q5_1"]
KQUANTS = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
MINE = LEGACY + KQUANTS
ROOT = Path(__file__).resolve().parent.parent
N = 512


def _edge_rows(case: str, rng) -> np.ndarray:
    """Inputs that take ggml's rarer branches (4 rows of N values)."""
    normal = rng.standard_normal((4, N)).astype(np.float32)
    if case == "signed_zeros":  # the sign of a zero min, max or scale reaches the fp16 bytes
        normal[:, ::3] = 0.0
        normal[:, 1::3] = -0.0
        return normal
    if case == "zeros_of_both_signs":
        x = np.zeros((4, N), np.float32)
        x[0] = -0.0
        x[1, ::2] = -0.0
        x[2, 5] = 1.0
        x[3, 7] = -1.0
        return x
    if case == "first_zero_decides":  # min (or max) is a zero: ggml keeps the first one's sign
        x = np.abs(normal) + np.float32(0.5)
        x[:, 1::32] = -0.0
        x[:, 4::32] = 0.0
        x[:, 18::32] = 0.0
        x[2:] = -x[2:]
        x[2:, 6::32] = -0.0
        return x
    if case == "magnitude_ties":  # +m and -m in one block: the first one sets the sign
        normal[:, 3] = normal[:, 33] = 5.0
        normal[:, 9] = normal[:, 40] = -5.0
        return normal
    if case == "all_negative":  # min/max searches with max < 0
        return -np.abs(normal) - np.float32(0.5)
    if case == "negative_constant":
        return np.full((4, N), -0.75, np.float32)
    if case == "all_positive":  # the min clamps to 0
        return np.abs(normal) + np.float32(3.0)
    if case == "subnormal":  # scales underflow: inf inverse scales, ggml's nearest_int wraps
        return (normal * 1e-39).astype(np.float32)
    if case == "deep_subnormal":
        return (normal * 1e-42).astype(np.float32)
    if case == "huge":  # x*x overflows to inf in the weights
        return (normal * 1e30).astype(np.float32)
    if case == "one_outlier":
        normal[:, 100] = 1e6
        return normal
    if case == "small_integers":  # many exact ties in the rounding
        return rng.integers(-3, 4, (4, N)).astype(np.float32)
    raise ValueError(case)


EDGE_CASES = ["signed_zeros", "zeros_of_both_signs", "first_zero_decides", "magnitude_ties", "all_negative",
              "negative_constant", "all_positive", "subnormal", "deep_subnormal", "huge",
              "one_outlier", "small_integers"]


@pytest.mark.parametrize("case", EDGE_CASES)
@pytest.mark.parametrize("name", MINE)
def test_edge_inputs_equal_ggml(name, case):
    rng = np.random.default_rng(zlib.crc32(f"{name}/{case}".encode()))
    x = _edge_rows(case, rng)
    imatrices = {
        "none": None,
        "random": (rng.random(N) + 0.1).astype(np.float32),
        "all zero": np.zeros(N, np.float32),
        "half zero": np.where(rng.random(N) < 0.5, 0.0, rng.random(N)).astype(np.float32),
    }
    for label, im in imatrices.items():
        ours = formats.quantize(x, name, imatrix=im)
        np.testing.assert_array_equal(ours, ggml_quantize(x, name, im), err_msg=f"imatrix: {label}")
        back = formats.dequantize(ours, name, x.shape)
        assert back.shape == x.shape and back.dtype == np.float32


@pytest.mark.parametrize("name", MINE)
def test_long_rows_equal_ggml(name):
    # many blocks per row: lane-parallel searches span the whole row, legacy sigma2 too
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    x = (rng.standard_normal((3, 4096)) * rng.random((3, 1)) * 3).astype(np.float32)
    im = (rng.random(4096) ** 3 * 5).astype(np.float32)
    np.testing.assert_array_equal(formats.quantize(x, name), ggml_quantize(x, name))
    np.testing.assert_array_equal(formats.quantize(x, name, imatrix=im), ggml_quantize(x, name, im))


# --- the CPU fast paths restate the block functions the CUDA kernels call -------------------


def _sample(name, blocks):
    rng = np.random.default_rng(zlib.crc32(name.encode()) + 1)
    fmt = formats.FORMATS[name]
    x = rng.standard_normal((3, blocks * fmt.block_size)).astype(np.float32)
    x[1] *= 1e-3
    x[2, : fmt.block_size] = -0.0
    im = (rng.random(x.shape[1]) + 0.05).astype(np.float32)
    return fmt, x, im


@pytest.mark.parametrize("name", LEGACY)
def test_legacy_fast_paths_equal_block_functions(name):
    fmt, x, im = _sample(name, 6)
    ts, kind = fmt.type_size, legacy.KIND[name]
    by_block = np.zeros((x.shape[0], fmt.row_bytes(x.shape[1])), np.uint8)
    by_block_w = np.zeros_like(by_block)
    decoded = np.zeros_like(x)
    L = np.empty(32, np.int32)
    iw = np.empty(legacy.weighted_int_scratch(32), np.int32)
    fw = np.empty(legacy.weighted_float_scratch(32), np.float32)
    for r in range(x.shape[0]):
        sigma2 = legacy.row_sigma2(x[r])
        for b in range(x.shape[1] // 32):
            xb, ob, obw = x[r, 32 * b:32 * b + 32], by_block[r, ts * b:ts * b + ts], by_block_w[r, ts * b:ts * b + ts]
            legacy.quantize_block(kind, xb, ob, L)
            legacy.quantize_row_weighted(kind, xb, im[32 * b:32 * b + 32], sigma2, obw, iw, fw)
            legacy.dequantize_block(kind, ob, decoded[r, 32 * b:32 * b + 32])
    raw = fmt._cpu_quantize(x, None)
    np.testing.assert_array_equal(raw, by_block)
    np.testing.assert_array_equal(fmt._cpu_quantize(x, im), by_block_w)
    np.testing.assert_array_equal(fmt._cpu_dequantize(raw, x.shape[1]).view(np.uint32), decoded.view(np.uint32))


@pytest.mark.parametrize("name", KQUANTS)
def test_kquant_rows_equal_super_block_at_a_time(name):
    fmt, x, im = _sample(name, 3)
    ts, kind = fmt.type_size, kquants.KIND[name]
    iw = np.empty(kquants.int_scratch(256), np.int32)
    fw = np.empty(kquants.float_scratch(256), np.float32)
    for weighted in (False, True):
        by_block = np.zeros((x.shape[0], fmt.row_bytes(x.shape[1])), np.uint8)
        for r in range(x.shape[0]):
            for b in range(x.shape[1] // 256):
                kquants.quantize_row(kind, x[r, 256 * b:256 * b + 256], im[256 * b:256 * b + 256],
                                     weighted, by_block[r, ts * b:ts * b + ts], iw, fw)
        np.testing.assert_array_equal(fmt._cpu_quantize(x, im if weighted else None), by_block)
    raw = fmt._cpu_quantize(x, im)
    decoded = np.zeros_like(x)
    for r in range(x.shape[0]):
        for b in range(x.shape[1] // 256):
            kquants.dequantize_block(kind, raw[r, ts * b:ts * b + ts], decoded[r, 256 * b:256 * b + 256])
    np.testing.assert_array_equal(fmt._cpu_dequantize(raw, x.shape[1]).view(np.uint32), decoded.view(np.uint32))


@pytest.mark.parametrize("name", MINE)
def test_matmul_of_long_rows(name):
    rng = np.random.default_rng(3)
    w = rng.standard_normal((7, 2048)).astype(np.float32)
    raw = formats.quantize(w, name)
    x = rng.standard_normal((3, 2048)).astype(np.float32)
    ref = x.astype(np.float64) @ formats.dequantize(raw, name, w.shape).astype(np.float64).T
    got = formats.matmul(raw, name, w.shape, x)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


# --- CUDA kernels on rows of several blocks (tests/cuda uses one block per row) --------------

_CUDA_SCRIPT = textwrap.dedent("""
    import numpy as np
    from numba import config
    from ds4tools import formats
    assert config.ENABLE_CUDASIM == 1
    rng = np.random.default_rng(0)
    for name in {names!r}:
        fmt = formats.FORMATS[name]
        x = rng.standard_normal((2, 2 * fmt.block_size)).astype(np.float32)
        x[1, : fmt.block_size] *= 1e-3
        im = (rng.random(x.shape[1]) + 0.1).astype(np.float32)
        for w in (None, im):
            cpu = formats.quantize(x, name, imatrix=w)
            gpu = formats.quantize(x, name, imatrix=w, device="cuda")
            assert np.array_equal(cpu, gpu), (name, w is None)
        back = formats.dequantize(cpu, name, x.shape, device="cuda")
        assert np.array_equal(back.view(np.uint32), formats.dequantize(cpu, name, x.shape).view(np.uint32)), name
    print("cuda ok")
""")


def test_cuda_kernels_on_rows_of_two_blocks():
    pytest.importorskip("numba.cuda", reason="numba's CUDA target is needed for the simulator")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=str(ROOT))
    env.pop("NUMBA_DISABLE_JIT", None)
    proc = subprocess.run([sys.executable, "-c", _CUDA_SCRIPT.format(names=MINE)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and "cuda ok" in proc.stdout, (proc.stdout + proc.stderr)[-4000:]
