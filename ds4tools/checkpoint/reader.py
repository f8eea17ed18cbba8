"""Read a Hugging Face checkpoint directory lazily: config.json, the tokenizer files, and the
safetensors weights one tensor at a time (memory-mapped; nothing is loaded until asked).

safetensors files are a little-endian u64 header length, a JSON header and the raw data; the
header is read here directly so that BF16 (which numpy lacks) and zero-copy views both work.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

from ..errors import InvalidContentError, UnreadableError, about

__all__ = ["HFCheckpoint", "HFTensor", "is_hf_dir"]

_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
           "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
           "BOOL": np.bool_,
           # DeepSeek V4's FP8 weights and E8M0 scales: one byte each, decoded by
           # ds4tools.support.fp8 (load_raw), never by load_float32
           "F8_E4M3": np.uint8, "F8_E8M0": np.uint8}
_MAX_HEADER = 100 * 1024 * 1024  # the format's own limit


@dataclass(frozen=True)
class HFTensor:
    name: str
    dtype: str  # safetensors dtype name ("BF16", "F32"...)
    shape: tuple[int, ...]
    path: str
    start: int  # absolute byte offset in ``path``
    n_bytes: int

    def load_raw(self) -> np.ndarray:
        """The stored values in their storage dtype (one byte per value for F8_*; BF16 as
        uint16), memory-mapped, in the tensor's shape."""
        mm = np.memmap(self.path, dtype=np.uint8, mode="r", offset=self.start, shape=(self.n_bytes,))
        return mm.view(_DTYPES[self.dtype]).reshape(self.shape)

    def load_float32(self) -> np.ndarray:
        if self.dtype not in ("F32", "F16", "BF16", "F64"):
            raise InvalidContentError(about(
                self.path, f"tensor '{self.name}' has dtype {self.dtype}; only float weights convert"))
        mm = np.memmap(self.path, dtype=np.uint8, mode="r", offset=self.start, shape=(self.n_bytes,))
        raw = mm.view(_DTYPES[self.dtype])
        if self.dtype == "BF16":
            out = (raw.astype(np.uint32) << 16).view(np.float32)
        else:
            out = raw.astype(np.float32)
        return out.reshape(self.shape)


def is_hf_dir(path) -> bool:
    return os.path.isdir(path)


def _read_json(path: str, what: str):
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except FileNotFoundError:
        raise UnreadableError(about(path, f"{what} is missing")) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UnreadableError(about(path, f"{what} is not valid JSON: {e}")) from None


def read_safetensors_header(path: str) -> dict[str, HFTensor]:
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise UnreadableError(about(path, "truncated safetensors file"))
            n = int.from_bytes(head, "little")
            if n > min(size - 8, _MAX_HEADER):
                raise UnreadableError(about(path, f"safetensors header of {n} bytes does not fit the file"))
            header = json.loads(fh.read(n))
    except FileNotFoundError:
        raise UnreadableError(about(path, "no such file")) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UnreadableError(about(path, f"safetensors header is not valid JSON: {e}")) from None
    if not isinstance(header, dict):
        raise UnreadableError(about(path, "safetensors header is not a JSON object"))
    base, out = 8 + n, {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape = info["dtype"], tuple(int(s) for s in info["shape"])
            a, b = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise UnreadableError(about(path, f"safetensors entry '{name}' is malformed")) from None
        if dtype not in _DTYPES:
            raise InvalidContentError(about(path, f"tensor '{name}' has unsupported dtype {dtype}"))
        expect = int(np.prod(shape, dtype=np.int64)) * np.dtype(_DTYPES[dtype]).itemsize
        if not 0 <= a <= b or base + b > size or b - a != expect:
            raise UnreadableError(about(
                path, f"tensor '{name}': data [{a}, {b}) does not match its shape {list(shape)} "
                      f"and dtype {dtype} inside the file"))
        out[name] = HFTensor(name, dtype, shape, path, base + a, b - a)
    return out


class HFCheckpoint:
    """config.json + tokenizer files + weights of one Hugging Face model directory."""

    def __init__(self, folder):
        self.folder = os.path.abspath(os.fspath(folder))
        if not os.path.isdir(self.folder):
            raise UnreadableError(about(self.folder, "not a directory"))
        cfg_path = os.path.join(self.folder, "config.json")
        if not os.path.exists(cfg_path):
            raise UnreadableError(about(self.folder, "not a Hugging Face model directory (no config.json)"))
        self.config: dict = _read_json(cfg_path, "config.json")
        if not isinstance(self.config, dict):
            raise UnreadableError(about(cfg_path, "config.json is not a JSON object"))
        self.weight_files = self._weight_files()
        self.tensors: dict[str, HFTensor] = {}
        for f in self.weight_files:
            for name, t in read_safetensors_header(f).items():
                if name in self.tensors:
                    raise InvalidContentError(about(
                        f, f"tensor '{name}' is also in {self.tensors[name].path}"))
                self.tensors[name] = t

    def _weight_files(self) -> list[str]:
        index = os.path.join(self.folder, "model.safetensors.index.json")
        single = os.path.join(self.folder, "model.safetensors")
        if os.path.exists(index):
            data = _read_json(index, "model.safetensors.index.json")
            weight_map = data.get("weight_map") if isinstance(data, dict) else None
            if not isinstance(weight_map, dict) or not weight_map:
                raise UnreadableError(about(index, "has no weight_map"))
            files = []
            for fname in dict.fromkeys(weight_map.values()):
                path = os.path.join(self.folder, str(fname))
                if not os.path.exists(path):
                    raise UnreadableError(about(self.folder, f"shard {fname} named in "
                                                             f"model.safetensors.index.json is missing"))
                files.append(path)
            return files
        if os.path.exists(single):
            return [single]
        raise UnreadableError(about(self.folder, "no model.safetensors or model.safetensors.index.json"))

    @property
    def paths(self) -> list[str]:
        return list(self.weight_files)

    def file(self, name: str) -> str:
        return os.path.join(self.folder, name)

    def read_json(self, name: str, required: bool = True):
        path = self.file(name)
        if not os.path.exists(path):
            if required:
                raise UnreadableError(about(self.folder, f"{name} is missing"))
            return None
        return _read_json(path, name)
