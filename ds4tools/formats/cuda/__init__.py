"""numba.cuda kernels, one module per format family, imported only when device="cuda".

Each kernel runs one thread per block (or per element for float types): it stages the
block in ``cuda.local.array`` buffers and calls the same ``@njit`` block functions as the CPU
kernels, so both devices share one implementation of ggml's rounding rules. The tests run
them under numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``).
"""
from numba import cuda

THREADS = 64


def grid(n: int) -> tuple[int, int]:
    return (max(1, (n + THREADS - 1) // THREADS), THREADS)


def to_device(a):
    return cuda.to_device(a)
