"""ggml tensor types as numba kernels: one registry, byte-identical to ggml's quantizer.

    >>> from ds4tools import formats
    >>> raw = formats.quantize(w, "Q4_K")                 # uint8, shape (rows, row_bytes)
    >>> w2 = formats.dequantize(raw, "Q4_K", w.shape)     # float32

Shapes follow the ``gguf`` package: numpy order, the last axis is the row (ggml's ne0), and a
quantized tensor's bytes keep the leading axes with the last one replaced by the row's bytes.
Every problem with the input is a ``ValueError`` naming it, raised before any kernel runs.
"""
from __future__ import annotations

import numpy as np

from .base import FORMATS, QuantFormat, format_for_type, register
from ._numeric import nonfinite_rows
from . import floats, legacy, kquants, iq4_nl, iq2_xxs  # noqa: F401  (registration side effects)

__all__ = [
    "FORMATS", "QuantFormat", "register", "get_format", "format_for_type",
    "quantize", "dequantize", "matmul", "byte_shape", "tensor_nbytes",
]

DEVICES = ("cpu", "cuda")


def get_format(fmt) -> QuantFormat:
    """A format by name ("q4_k" and "Q4_K" both work), ggml type id, or instance."""
    if isinstance(fmt, QuantFormat):
        return fmt
    if isinstance(fmt, str):
        found = FORMATS.get(fmt.strip().upper())
        if found is None:
            raise ValueError(f"unknown tensor type {fmt!r} (known: {', '.join(FORMATS)})")
        return found
    if isinstance(fmt, (int, np.integer)):
        found = format_for_type(int(fmt))
        if found is None:
            raise ValueError(f"unsupported ggml type id {int(fmt)} (known: {', '.join(FORMATS)})")
        return found
    raise ValueError(f"a tensor type must be a name or a ggml type id, not {type(fmt).__name__}")


def byte_shape(shape, fmt) -> tuple[int, ...]:
    """The uint8 shape of a tensor of logical (numpy-order) ``shape`` stored as ``fmt``."""
    f = get_format(fmt)
    shape = tuple(int(s) for s in shape)
    if not shape:
        raise ValueError("a tensor needs at least one dimension")
    _check_row_length(shape[-1], f)
    return shape[:-1] + (f.row_bytes(shape[-1]),)


def tensor_nbytes(shape, fmt) -> int:
    return int(np.prod(byte_shape(shape, fmt), dtype=np.int64))


def _check_row_length(n: int, f: QuantFormat) -> None:
    if n <= 0:
        raise ValueError(f"row length must be positive, got {n}")
    if n % f.block_size:
        raise ValueError(
            f"row length {n} is not a multiple of {f.name}'s block size {f.block_size}")


def _check_device(device: str) -> str:
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r} (use 'cpu' or 'cuda')")
    if device == "cuda":
        from numba import cuda
        if not cuda.is_available():
            raise ValueError("device 'cuda' requested but no CUDA GPU (or simulator) is available")
    return device


def _as_f32_rows(array, what: str = "array") -> np.ndarray:
    a = np.asarray(array)
    if a.dtype.kind != "f":
        raise ValueError(f"{what} must be floating point, got dtype {a.dtype}")
    if a.ndim == 0:
        raise ValueError(f"{what} must have at least one dimension")
    a = np.ascontiguousarray(a, dtype=np.float32)
    bad_rows = nonfinite_rows(a.reshape(-1, a.shape[-1]).view(np.uint32) if a.size
                              else np.zeros((0, 1), np.uint32))
    if bad_rows.any():
        finite = np.isfinite(a)
        bad = np.unravel_index(int(np.argmin(finite)), a.shape)
        kind = "NaN" if np.isnan(a[bad]) else "Inf"
        raise ValueError(f"{what} contains {kind} at index {tuple(int(i) for i in bad)}")
    return a


def _prepare_imatrix(imatrix, f: QuantFormat, n: int, leading: tuple[int, ...]):
    """Importance weights as float32 (groups, n): one row for all, or one per leading index."""
    if imatrix is None:
        if f.requires_imatrix:
            raise ValueError(
                f"{f.name} requires an importance matrix (imatrix), as in ggml; pass one "
                f"(llama.cpp's GGUF or .dat format)")
        return None
    if not f.uses_imatrix:
        return None
    w = np.asarray(imatrix)
    if w.dtype.kind not in "fiu":
        raise ValueError(f"imatrix must be numeric, got dtype {w.dtype}")
    w = np.ascontiguousarray(w, dtype=np.float32)
    if w.shape == (n,):
        w = w.reshape(1, n)
    elif w.ndim == 2 and w.shape[1] == n and len(leading) >= 1 and w.shape[0] == leading[0]:
        pass  # one vector per expert (3-D tensors)
    else:
        raise ValueError(
            f"imatrix has shape {w.shape}, expected ({n},) for rows of {n} values"
            + (f" or ({leading[0]}, {n}) for one per expert" if leading else ""))
    if not np.isfinite(w).all() or (w < 0).any():
        raise ValueError("imatrix values must be finite and non-negative")
    return w


def quantize(array, type, imatrix=None, device: str = "cpu") -> np.ndarray:
    """Quantize a float array to raw GGUF bytes of ``type``, byte-identical to ggml.

    ``imatrix``: importance weights per column (shape ``(n_per_row,)``), or for a 3-D
    tensor one vector per leading index (shape ``(n_expert, n_per_row)``), as ggml takes them.
    """
    f = get_format(type)
    _check_device(device)
    a = _as_f32_rows(array)
    n = a.shape[-1]
    _check_row_length(n, f)
    leading = a.shape[:-1]
    w = _prepare_imatrix(imatrix, f, n, leading)
    run = f._cuda_quantize if device == "cuda" else f._cpu_quantize
    if w is None or w.shape[0] == 1:
        raw = run(a.reshape(-1, n), None if w is None else w[0])
    else:
        per = a.reshape(w.shape[0], -1, n)
        raw = np.concatenate([run(np.ascontiguousarray(per[e]), w[e]) for e in range(w.shape[0])])
    return raw.reshape(leading + (f.row_bytes(n),))


def _as_raw(raw, f: QuantFormat, shape) -> tuple[np.ndarray, tuple[int, ...]]:
    shape = tuple(int(s) for s in shape)
    expect = byte_shape(shape, f)
    r = np.asarray(raw)
    if r.dtype != np.uint8:
        if r.dtype.kind in "fiu" and r.ndim >= 1:
            r = r.view(np.uint8) if r.flags.c_contiguous else np.ascontiguousarray(r).view(np.uint8)
        else:
            raise ValueError(f"raw data must be a uint8 buffer, got dtype {r.dtype}")
    need = int(np.prod(expect, dtype=np.int64))
    if r.size != need:
        raise ValueError(
            f"raw buffer has {r.size} bytes, but a {f.name} tensor of shape {shape} needs {need}")
    return np.ascontiguousarray(r).reshape(-1, expect[-1]), shape


def dequantize(raw, type, shape, device: str = "cpu") -> np.ndarray:
    """Decode raw GGUF bytes of ``type`` to a float32 array of logical ``shape``."""
    f = get_format(type)
    _check_device(device)
    r, shape = _as_raw(raw, f, shape)
    run = f._cuda_dequantize if device == "cuda" else f._cpu_dequantize
    return run(r, shape[-1]).reshape(shape)


def matmul(raw, type, shape, x, out=None, int8: bool = False) -> np.ndarray:
    """``x @ W.T`` with W (``shape`` = (n_out, n_in)) decoded on the fly from raw blocks.

    ``x``: float32 (k, n_in) or (n_in,). Returns float32 (k, n_out) (or (n_out,)).
    ``int8=True`` takes ggml's int8-activation path where the format has one (faster, not
    exact to the float product), else the float path.
    """
    f = get_format(type)
    if len(shape) != 2:
        raise ValueError(f"matmul needs a 2-D weight shape, got {tuple(shape)}")
    r, shape = _as_raw(raw, f, shape)
    xa = np.asarray(x)
    if xa.dtype.kind != "f":
        raise ValueError(f"x must be floating point, got dtype {xa.dtype}")
    vec = xa.ndim == 1
    xa = np.ascontiguousarray(np.atleast_2d(xa), dtype=np.float32)
    if xa.ndim != 2 or xa.shape[1] != shape[1]:
        raise ValueError(f"x has shape {np.asarray(x).shape}, expected (k, {shape[1]})")
    if out is None:
        out = np.empty((xa.shape[0], shape[0]), np.float32)
    elif out.shape != (xa.shape[0], shape[0]) or out.dtype != np.float32:
        raise ValueError(f"out must be float32 of shape {(xa.shape[0], shape[0])}")
    if int8 and f.has_int8_matmul:
        f._cpu_matmul_int8(r, xa, out)
    else:
        f._cpu_matmul(r, xa, out)
    return out[0] if vec else out
