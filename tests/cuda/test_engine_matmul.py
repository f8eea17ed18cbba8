"""The CUDA backend's fused dequantize-matmul kernels (simulated), for every format they support.

For each format: a small random matrix is quantized on the CPU; then
* matmul agrees with the CPU dequantized weights times x (float64) to float32 rounding;
* matmul is batch-invariant: each row of a k = 9 launch (two row groups, the second partial) is
  bit-identical to that row launched alone and to the same rows in a k = 3 launch;
* dequantize_rows gives exactly the bits of formats.dequantize for the requested rows.

The simulator runs one Python thread per CUDA thread, so the shapes are tiny.
"""
import numpy as np
import pytest
from numba import config, cuda

from ds4tools import formats
from ds4tools.engine.backends.cuda import matmul as M

assert config.ENABLE_CUDASIM == 1

N_OUT = 6  # not a multiple of WARPS_PER_BLOCK: the last block has idle warps
K_BIG = 9  # crosses a ROWS_PER_GROUP boundary


def _n_in(name):
    block = formats.FORMATS[name].block_size
    if block == 1:
        return 40  # float formats take any length; 40 leaves some lanes one element more
    return 2 * block  # two blocks (64) or two super-blocks (512) per row


def _quantized(name, seed=0):
    fmt = formats.FORMATS[name]
    n_in = _n_in(name)
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((N_OUT, n_in)).astype(np.float32)
    w[1] *= 1e-3  # a row of small scales
    imatrix = (rng.random(n_in) + 0.1).astype(np.float32) if fmt.requires_imatrix else None
    raw = formats.quantize(w, name, imatrix=imatrix)
    assert raw.shape == formats.byte_shape(w.shape, name)
    return raw, formats.dequantize(raw, name, w.shape)


def _matmul(name, d_raw, x):
    d_out = cuda.device_array((x.shape[0], d_raw.shape[0]), np.float32)
    M.matmul(name, d_raw, cuda.to_device(np.ascontiguousarray(x)), d_out)
    return d_out.copy_to_host()


@pytest.mark.parametrize("name", M.SUPPORTED)
def test_matmul_matches_dequantized_product_and_is_batch_invariant(name):
    raw, w = _quantized(name)
    d_raw = cuda.to_device(raw)
    x = np.random.default_rng(1).standard_normal((K_BIG, w.shape[1])).astype(np.float32)

    got = _matmul(name, d_raw, x)
    expected = x.astype(np.float64) @ w.astype(np.float64).T
    scale = np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T
    assert np.all(np.abs(got - expected) <= 1e-5 * scale + 1e-30), name

    # A row of W is one warp whatever its neighbours, so the first block's worth of rows of W
    # (one simulated block per launch, the simulator's cost) stands for all of them here.
    first_rows = M.WARPS_PER_BLOCK
    bits = got[:, :first_rows].view(np.uint32)
    d_first = d_raw[:first_rows]
    for t in range(K_BIG):
        alone = _matmul(name, d_first, x[t:t + 1])
        np.testing.assert_array_equal(alone.view(np.uint32), bits[t:t + 1], err_msg=f"row {t}")
    three = _matmul(name, d_raw, x[6:9])  # one group here; split across two in the k = 9 launch
    np.testing.assert_array_equal(three.view(np.uint32), got[6:9].view(np.uint32))


@pytest.mark.parametrize("name", M.SUPPORTED)
def test_dequantize_rows_is_exact(name):
    raw, w = _quantized(name, seed=2)
    ids = np.array([3, 0, N_OUT - 1, 3, 1], np.int64)  # any order, repeats allowed
    d_out = cuda.device_array((ids.size, w.shape[1]), np.float32)
    M.dequantize_rows(name, cuda.to_device(raw), cuda.to_device(ids), d_out)
    np.testing.assert_array_equal(d_out.copy_to_host().view(np.uint32), w[ids].view(np.uint32))


def test_rejects_bad_arguments():
    raw, w = _quantized("Q8_0")
    d_raw = cuda.to_device(raw)
    x = cuda.to_device(np.zeros((2, w.shape[1] + 32), np.float32))
    with pytest.raises(ValueError):
        M.matmul("Q8_0", d_raw, x, cuda.device_array((2, N_OUT), np.float32))
    x = cuda.to_device(np.zeros((2, w.shape[1]), np.float32))
    with pytest.raises(ValueError):
        M.matmul("Q8_0", d_raw, x, cuda.device_array((3, N_OUT), np.float32))
    with pytest.raises(ValueError):
        M.matmul("Q8_1", d_raw, x, cuda.device_array((2, N_OUT), np.float32))
    with pytest.raises(ValueError):
        M.matmul("Q8_0", d_raw, cuda.to_device(np.zeros((2, w.shape[1]), np.float64)),
                 cuda.device_array((2, N_OUT), np.float32))


@pytest.mark.parametrize("name", ["Q8_0", "Q4_K", "IQ4_NL", "F16"])
def test_expert_matmul_gives_each_pair_its_experts_plain_matmul_bits(name):
    """The routed experts of a MoE block: pair p = (row p // n_used, slot) reads its own
    expert; its result equals the dequantized product and, bit for bit, a plain matmul of that
    row by that expert's matrix."""
    rng = np.random.default_rng(3)
    n_expert, n_out, n_in, k, n_used = 3, 5, _n_in(name), 2, 2
    w = rng.standard_normal((n_expert, n_out, n_in)).astype(np.float32)
    imatrix = np.ones(n_in, np.float32) if formats.FORMATS[name].requires_imatrix else None
    raw = np.stack([formats.quantize(w[e], name, imatrix=imatrix) for e in range(n_expert)])
    dense = np.stack([formats.dequantize(raw[e], name, (n_out, n_in)) for e in range(n_expert)])
    x = rng.standard_normal((k, n_in)).astype(np.float32)
    expert = np.array([2, 0, 1, 2], np.int64)
    out = cuda.device_array((k * n_used, n_out), np.float32)
    M.expert_matmul(name, cuda.to_device(raw), cuda.to_device(x), cuda.to_device(expert), n_used, out)
    got = out.copy_to_host()
    want = np.stack([dense[expert[p]].astype(np.float64) @ x[p // n_used] for p in range(k * n_used)])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    for p in range(k * n_used):
        plain = _matmul(name, cuda.to_device(raw[expert[p]]), x[p // n_used:p // n_used + 1])
        np.testing.assert_array_equal(got[p].view(np.uint32), plain[0].view(np.uint32))
