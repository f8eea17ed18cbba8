"""Write a support GGUF: keys, then tensors streamed one at a time through the project's GGUF
writer (temporary file beside the target, renamed into place when complete), each converted to
the type its role allows (``pick_type``).
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGML_QUANT_VERSION, GGMLQuantizationType
from gguf import GGUFValueType as V

from .. import formats
from ..errors import InvalidContentError, about
from ..gguf_io import GGUFStreamWriter, format_bytes
from ..mixes import Target, TypeChooser, block_size
from .layout import DENSE_DS4, Q8_0_ONLY, TensorSpec

__all__ = ["OutTensor", "WriteResult", "pick_type", "write_support_gguf"]


@dataclass
class OutTensor:
    name: str
    shape: tuple  # numpy order (the row, ggml's ne0, last)
    type_name: str  # how it is stored
    load: Callable[[], np.ndarray] | None = None  # float32 values, numpy order
    raw: Callable[[], np.ndarray] | None = None  # bytes already in type_name: copied as they are
    #: a 3-D tensor loaded one leading index (expert) at a time: float32 [rows, ne0] of part i,
    #: so that a model's routed experts are never all in memory as float32 at once
    load_part: Callable[[int], np.ndarray] | None = None
    src_type: str = "F32"
    src_bytes: int = 0

    @property
    def ggml_shape(self) -> tuple:
        return tuple(reversed(self.shape))

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def out_bytes(self) -> int:
        blk, size = GGML_QUANT_SIZES[GGMLQuantizationType[self.type_name]]
        return self.n_elements // blk * size


@dataclass
class WriteResult:
    path: str
    tensors: list[OutTensor]
    seconds: float

    @property
    def summary(self) -> str:
        src = sum(t.src_bytes for t in self.tensors)
        out = sum(t.out_bytes for t in self.tensors)
        n = sum(t.n_elements for t in self.tensors)
        return (f"{self.path}: {len(self.tensors)} tensors, {format_bytes(src)} -> "
                f"{format_bytes(out)}, {8.0 * out / max(1, n):.2f} bits per weight, "
                f"{self.seconds:.1f} s")


def _fits(type_name: str, ne0: int) -> bool:
    return type_name in formats.FORMATS and ne0 % block_size(type_name) == 0


def pick_type(spec: TensorSpec, target: Target, ggml_shape, chooser: TypeChooser | None = None) -> str:
    """The stored type of a tensor of ``spec``: its role's fixed type, else the requested one
    when the role accepts it and the row length fits, else the role's usual type."""
    ne0 = int(ggml_shape[0])
    want = target.default_type
    kind = spec.kind
    if spec.default_type is not None and kind.accepts(spec.default_type):
        return spec.default_type
    if kind is Q8_0_ONLY:
        candidates = ["Q8_0"]
    elif kind is DENSE_DS4:
        candidates = [want, "Q8_0", "F16"]
    elif kind.routed:
        candidates = [want, "Q4_K", "Q2_K", "IQ2_XXS", "Q8_0"]
    else:  # our dense layouts: llama.cpp's rules for the requested type, with its fallbacks
        choice = (chooser or TypeChooser(target, "", 0, pure=True)).choose(spec.name, ggml_shape)
        return "F32" if choice is None else choice.type_name
    for t in candidates:
        if kind.accepts(t) and _fits(t, ne0):
            return t
    raise InvalidContentError(f"tensor {spec.name}: row length {ne0} fits none of the types its "
                              f"role accepts ({kind.label})")


def _encode(t: OutTensor, device: str, where: str) -> np.ndarray:
    if t.raw is not None:
        return t.raw()
    if t.load_part is not None:
        fmt = formats.get_format(t.type_name)
        out = np.empty(t.shape[:-1] + (fmt.row_bytes(t.shape[-1]),), np.uint8)
        for i in range(t.shape[0]):
            out[i] = _encode_values(t, t.load_part(i), t.shape[1:], device, where)
        return out
    return _encode_values(t, t.load(), t.shape, device, where)


def _encode_values(t: OutTensor, values: np.ndarray, shape, device: str, where: str) -> np.ndarray:
    if tuple(values.shape) != tuple(shape):
        raise InvalidContentError(about(where, f"tensor {t.name}: loaded shape {list(values.shape)}, "
                                               f"expected {list(shape)}"))
    bad = ~np.isfinite(values)
    if bad.any():
        raise InvalidContentError(about(where, f"tensor {t.name} holds {int(bad.sum())} NaN or "
                                               f"infinite values"))
    fmt = formats.get_format(t.type_name)
    weights = None
    if fmt.requires_imatrix:  # ds4's stand-in when no importance matrix is given
        from ..gguf_io.imatrix import synthetic_imatrix
        weights = synthetic_imatrix(values)
    try:
        return formats.quantize(values, t.type_name, imatrix=weights, device=device)
    except ValueError as e:
        raise InvalidContentError(about(where, f"tensor {t.name}: {e}")) from None


def write_support_gguf(path, arch: str, keys, tensors: list[OutTensor], *, where: str,
                       inputs=(), overwrite: bool = False, device: str = "cpu",
                       progress: bool | None = None, file_type: int | None = None) -> WriteResult:
    """Write ``tensors`` (in order) and ``keys`` (MetaKey list) to ``path`` as one GGUF."""
    start = time.perf_counter()
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        raise InvalidContentError(about(where, "two support tensors would get the same name"))
    writer = GGUFStreamWriter(path, arch, inputs=inputs, overwrite=overwrite)
    try:
        seen = set()
        for k in keys:
            if k.key in seen:
                continue
            seen.add(k.key)
            writer.add_key(k.key, k.value, k.vtype, k.sub_type)
        writer.add_key("general.quantization_version", GGML_QUANT_VERSION, V.UINT32)
        if file_type is not None:
            writer.add_key("general.file_type", int(file_type), V.UINT32)
        for t in tensors:
            writer.add_tensor_info(t.name, t.shape, t.type_name)
        writer.begin()
        from tqdm import tqdm
        with tqdm(total=len(tensors), unit="tensor", desc=os.path.basename(os.fspath(path)),
                  disable=None if progress is None else not progress, leave=False,
                  file=sys.stderr) as bar:
            for t in tensors:
                writer.write_tensor(t.name, _encode(t, device, where))
                bar.update(1)
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    return WriteResult(os.fspath(path), tensors, time.perf_counter() - start)
