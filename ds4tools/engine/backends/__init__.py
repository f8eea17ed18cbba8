"""Where a model's operations run: the CPU (numba kernels) or an NVIDIA GPU (numba.cuda).

An architecture is written once against a small set of operations, which a backend
implements on arrays of its own device:

    buffers     empty(shape), asarray(host array), to_host(array), host_copy(array),
                copy_into(dst, src) (either may be a strided view), concat_columns(a, b, out),
                is_c_contiguous(array)
    weights     place_weights(weights): matrices stay in their GGUF block formats; a placed
                matrix has ``matmul(x, out)`` (fused dequantize-matmul) and ``rows(ids)``
    row ops     rmsnorm, layer_norm, add_bias, add_into, scale, swiglu, rope, rotate_rows,
                weighted_sum, dsa_scores (the DSA indexer's)
    attention   kv_cache(...), latent_cache(...) (MLA's; with the DSA indexer's keys): caches
                on the device with ``store`` and ``attend``

Every operation computes each row with the same code in the same order whatever the number of
rows, on every backend: a token's logits do not depend on its batch, so speculative greedy
output equals plain greedy output on each device.
"""
from __future__ import annotations

DEVICES = ("cpu", "cuda")


class BackendUnavailable(RuntimeError):
    """The device asked for cannot run here (no GPU, no numba-cuda); the message says why."""


def get_backend(device: str = "cpu"):
    """The backend running on ``device`` ("cpu" or "cuda"); raises BackendUnavailable."""
    if device == "cpu":
        from .cpu import CPU
        return CPU
    if device == "cuda":
        why = _cuda_missing()
        if why:
            raise BackendUnavailable(why)
        from .cuda.backend import CUDA
        return CUDA
    raise ValueError(f"unknown device {device!r} (use {' or '.join(DEVICES)})")


def _cuda_missing() -> str | None:
    """Why the CUDA backend cannot run here, or None."""
    try:
        from numba import cuda
    except ImportError:
        return "numba's CUDA target is not installed (install the `cuda` extra: pip install 'ds4tools[cuda]')"
    if not cuda.is_available():
        return ("no CUDA GPU is available here (the `cuda` extra, numba-cuda, needs an NVIDIA GPU "
                "and its driver; NUMBA_ENABLE_CUDASIM=1 runs numba's simulator instead)")
    return None
