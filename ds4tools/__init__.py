"""ds4tools: GGUF quantizer, inspector and numba engine for lossless speculative decoding."""
__version__ = "0.1.0"
