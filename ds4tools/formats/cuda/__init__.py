"""numba.cuda kernels, one module per format family, imported only when device="cuda".

Each kernel runs one thread per block (or per element for float types): it stages the
block in ``cuda.local.array`` buffers and calls the same ``@njit`` block functions as the CPU
kernels, so both devices share one implementation of ggml's rounding rules. The tests run
them under numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``).
"""
from numba import cuda

THREADS = 64


def _no_fma_contraction():
    """Make NVVM keep a*b+c as two roundings, as ggml's C reference (and our CPU kernels) do.

    libNVVM contracts multiply-adds into FMAs unless told `-fma=0`, and numba-cuda only sets
    that option through fastmath (which turns contraction ON). Without this, a real GPU could
    pick a different scale in the K-quant searches than the CPU. The simulator is unaffected.
    """
    try:
        from numba.cuda.cudadrv import nvvm
    except ImportError:  # simulator-only or unusual installs: nothing is compiled by NVVM
        return
    original = getattr(nvvm, "compile_ir", None)
    if original is None or getattr(original, "_ds4tools_no_fma", False):
        return

    def compile_ir(llvmir, **options):
        if not options.get("fastmath", False):
            options.setdefault("fma", False)
        return original(llvmir, **options)

    compile_ir._ds4tools_no_fma = True
    nvvm.compile_ir = compile_ir


_no_fma_contraction()


def grid(n: int) -> tuple[int, int]:
    return (max(1, (n + THREADS - 1) // THREADS), THREADS)


def to_device(a):
    return cuda.to_device(a)
