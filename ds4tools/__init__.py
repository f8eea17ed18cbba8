"""ds4tools: GGUF quantizer, inspector and numba engine for lossless speculative decoding."""
import os

__version__ = "0.1.0"

__all__ = ["Engine", "__version__"]

# numba's OpenMP workers spin ~300,000 iterations (GNU libgomp's default) waiting for the next
# parallel region. When other processes keep the cores busy, that spinning takes the CPU time
# the work itself needs: on 2 loaded cores, 2-thread decoding ran 5-10x slower than 1 thread.
# A short spin keeps back-to-back kernels fast and lets the cores go quickly. libgomp reads
# this when it loads (at numba's first parallel call); a value set by the user wins.
os.environ.setdefault("GOMP_SPINCOUNT", "1000")


def __getattr__(name):
    # The engine pulls in numba and compiles kernels: load it only when someone asks for it,
    # so `import ds4tools` (and the CLI's other commands) stay cheap.
    if name == "Engine":
        from .engine import Engine
        return Engine
    raise AttributeError(f"module 'ds4tools' has no attribute {name!r}")
