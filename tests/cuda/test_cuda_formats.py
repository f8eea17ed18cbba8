"""CUDA kernels (simulated) give the same bytes and floats as the CPU kernels, for every format.

The simulator runs one Python thread per CUDA thread, so the tensors are tiny.
"""
import numpy as np
import pytest
from numba import config

from ds4tools import formats

assert config.ENABLE_CUDASIM == 1


@pytest.mark.parametrize("name", list(formats.FORMATS))
def test_cuda_matches_cpu(name):
    fmt = formats.FORMATS[name]
    n = max(fmt.block_size, 32)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, n)).astype(np.float32)
    x[1, : n // 2] *= 1e-3
    im = (rng.random(n) + 0.1).astype(np.float32) if (fmt.uses_imatrix or fmt.requires_imatrix) else None
    cpu = formats.quantize(x, name, imatrix=im)
    gpu = formats.quantize(x, name, imatrix=im, device="cuda")
    np.testing.assert_array_equal(gpu, cpu)
    if fmt.uses_imatrix and not fmt.requires_imatrix:
        np.testing.assert_array_equal(formats.quantize(x, name, device="cuda"), formats.quantize(x, name))
    np.testing.assert_array_equal(
        formats.dequantize(cpu, name, x.shape, device="cuda").view(np.uint32),
        formats.dequantize(cpu, name, x.shape).view(np.uint32))
