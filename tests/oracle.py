"""ggml's own quantizer, through ggml-python: the byte-exact oracle for every format."""
import ctypes

import numpy as np
import pytest

ggml = pytest.importorskip("ggml", reason="ggml-python (the `test` extra) is the quantization oracle")


def ggml_type(name: str) -> int:
    return getattr(ggml, "GGML_TYPE_" + name)


def requires_imatrix(name: str) -> bool:
    return bool(ggml.ggml_quantize_requires_imatrix(ggml_type(name)))


def ggml_quantize(x: np.ndarray, name: str, imatrix=None) -> np.ndarray:
    """Bytes of ggml_quantize_chunk for float32 rows ``x`` (rows, n), shape (rows, row_bytes)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows, n = x.shape
    t = ggml_type(name)
    ggml.ggml_quantize_init(t)
    out = np.zeros((rows, ggml.ggml_row_size(t, n)), np.uint8)
    fptr = ctypes.POINTER(ctypes.c_float)
    w = None
    if imatrix is not None:
        imatrix = np.ascontiguousarray(imatrix, dtype=np.float32)
        w = imatrix.ctypes.data_as(fptr)
    written = ggml.ggml_quantize_chunk(t, x.ctypes.data_as(fptr), out.ctypes.data_as(ctypes.c_void_p),
                                       0, rows, n, w)
    assert written == out.nbytes
    return out
