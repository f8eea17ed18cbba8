"""ds4tools: GGUF quantizer, inspector and numba engine for lossless speculative decoding."""
import os

__version__ = "0.1.0"

__all__ = ["Engine", "__version__"]

# numba's OpenMP workers spin GOMP_SPINCOUNT iterations waiting for the next parallel region,
# then sleep; waking them costs more than a small matmul. A decode step runs ~200 parallel
# regions with a few microseconds of Python between them, so the workers must still be spinning
# when the next one starts: 100,000 spins (a third of libgomp's default) decoded a 350M Q8_0
# model 1.5x faster than 1,000 on an idle 2-core Zen 4, and 0.8-0.9x as fast as 1,000 when two
# decoders shared the cores (libgomp's default was 5-10x slower there). Processes that expect
# to share cores (the test suite's workers) set a short spin. libgomp reads this when it loads
# (at numba's first parallel call); a value set by the user wins.
os.environ.setdefault("GOMP_SPINCOUNT", "100000")


def __getattr__(name):
    # The engine pulls in numba and compiles kernels: load it only when someone asks for it,
    # so `import ds4tools` (and the CLI's other commands) stay cheap.
    if name == "Engine":
        from .engine import Engine
        return Engine
    raise AttributeError(f"module 'ds4tools' has no attribute {name!r}")
