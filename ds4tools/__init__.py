"""ds4tools: GGUF quantizer, inspector and numba engine for lossless speculative decoding."""
__version__ = "0.1.0"

__all__ = ["Engine", "__version__"]


def __getattr__(name):
    # The engine pulls in numba and compiles kernels: load it only when someone asks for it,
    # so `import ds4tools` (and the CLI's other commands) stay cheap.
    if name == "Engine":
        from .engine import Engine
        return Engine
    raise AttributeError(f"module 'ds4tools' has no attribute {name!r}")
