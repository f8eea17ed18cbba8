"""Write a GGUF file one tensor at a time, through gguf.GGUFWriter's tensor-info-first path.

All tensor infos (names, shapes, types) are declared first; then the header, metadata and
infos are written, and the tensor data follows in the same order, one array at a time, so a
model bigger than memory can be produced. The file is written to a temporary name beside the
target and renamed into place only when complete; on any failure the temporary file is removed.
The writer refuses to replace one of its inputs, and an existing target unless told to.

    >>> with GGUFStreamWriter("out.gguf", "llama", inputs=[src]) as w:
    ...     w.add_key("llama.block_count", 2, GGUFValueType.UINT32)
    ...     w.add_tensor_info("token_embd.weight", (32000, 4096), "Q8_0")
    ...     w.begin()
    ...     w.write_tensor("token_embd.weight", raw_bytes)
"""
from __future__ import annotations

import os
import struct
import tempfile
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFEndian, GGUFValueType, GGUFWriter

from ..errors import UsageError, about
from .reader import byte_shape_of

__all__ = ["GGUFStreamWriter", "MetaKey", "format_bytes", "same_file", "remove_stale_temporaries"]


@dataclass(frozen=True)
class MetaKey:
    """One metadata key to write (``GGUFStreamWriter.add_key``'s arguments): its value type,
    and for an array the type of its elements."""
    key: str
    value: object
    vtype: GGUFValueType
    sub_type: GGUFValueType | None = None


def format_bytes(n: int) -> str:
    """A byte count as the write summaries and plans print it ("3.42 MiB")."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def same_file(a, b) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def _as_type(t) -> GGMLQuantizationType:
    if isinstance(t, str):
        try:
            return GGMLQuantizationType[t.strip().upper()]
        except KeyError:
            raise UsageError(f"unknown tensor type {t!r}") from None
    return GGMLQuantizationType(int(getattr(t, "ggml_type", t)))


_ARRAY_DTYPES = {
    GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1", GGUFValueType.UINT16: "<u2",
    GGUFValueType.INT16: "<i2", GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4",
    GGUFValueType.FLOAT32: "<f4", GGUFValueType.UINT64: "<u8", GGUFValueType.INT64: "<i8",
    GGUFValueType.FLOAT64: "<f8", GGUFValueType.BOOL: "?",
}


class _BulkArrayWriter(GGUFWriter):
    """gguf's writer, packing metadata arrays in one go instead of element by element (the
    same bytes; a 150k-token vocabulary with its types and merges packs in a fraction of a
    second instead of seconds)."""

    def _pack_val(self, val, vtype, add_vtype, sub_type=None) -> bytes:
        if (vtype != GGUFValueType.ARRAY or sub_type is None or not val
                or self.endianess != GGUFEndian.LITTLE or isinstance(val, (bytes, str))):
            return super()._pack_val(val, vtype, add_vtype, sub_type)
        head = struct.pack("<I", vtype) if add_vtype else b""
        head += struct.pack("<IQ", sub_type, len(val))
        dtype = _ARRAY_DTYPES.get(sub_type)
        if dtype is not None:
            return head + np.asarray(val, dtype=dtype).tobytes()
        if sub_type == GGUFValueType.STRING:
            parts = [v.encode("utf-8") if isinstance(v, str) else bytes(v) for v in val]
            return head + b"".join(struct.pack("<Q", len(p)) + p for p in parts)
        return super()._pack_val(val, vtype, add_vtype, sub_type)


def _temp_prefix(target: str) -> str:
    return "." + os.path.basename(target) + "."


def _pid_alive(pid: int) -> bool:
    if os.name == "nt":  # os.kill there terminates the process: never probe, never remove
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # it exists but belongs to someone else (EPERM)
        return True
    return True


def remove_stale_temporaries(target) -> list[str]:
    """Delete the temporaries of ``target`` (``.NAME.<pid>.<random>.tmp`` beside it) whose
    writing process is gone; returns their paths. A process that dies without running its
    clean-up (SIGKILL) leaves one behind, and it can be as large as the model."""
    target = os.path.abspath(os.fspath(target))
    folder, prefix = os.path.dirname(target), _temp_prefix(target)
    removed = []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    for name in names:
        if not (name.startswith(prefix) and name.endswith(".tmp")):
            continue
        # exactly <pid>.<mkstemp letters>: a longer middle is another output's temporary
        # (the output "m.gguf.7" has temporaries ".m.gguf.7.<pid>.<random>.tmp")
        middle = name[len(prefix):-len(".tmp")].split(".")
        if len(middle) != 2 or not middle[0].isdigit() or _pid_alive(int(middle[0])):
            continue
        try:
            os.unlink(os.path.join(folder, name))
            removed.append(os.path.join(folder, name))
        except OSError:
            pass  # not ours to remove (permissions), or another run just removed it
    return removed


class GGUFStreamWriter:
    def __init__(self, target, arch: str, *, inputs=(), overwrite: bool = False,
                 alignment: int | None = None):
        self.target = os.path.abspath(os.fspath(target))
        for src in inputs:
            if os.path.exists(src) and os.path.exists(self.target) and same_file(src, self.target):
                raise UsageError(about(self.target, "refusing to write over an input file"))
        if os.path.isdir(self.target):
            raise UsageError(about(self.target, "is a directory"))
        if os.path.exists(self.target) and not overwrite:
            raise UsageError(about(self.target, "already exists (pass --overwrite to replace it)"))
        folder = os.path.dirname(self.target)
        if not os.path.isdir(folder):
            raise UsageError(about(self.target, "its folder does not exist"))
        remove_stale_temporaries(self.target)
        # the writer's pid is in the name, so a later run can tell a temporary that a killed
        # run left (kill -9, a power cut) from one that a live run is still writing
        fd, self.temp_path = tempfile.mkstemp(
            prefix=f"{_temp_prefix(self.target)}{os.getpid()}.", suffix=".tmp", dir=folder)
        os.close(fd)
        self._writer = _BulkArrayWriter(self.temp_path, arch)
        if alignment is not None and alignment != self._writer.data_alignment:
            self._writer.data_alignment = int(alignment)
            self._writer.add_key_value("general.alignment", int(alignment), GGUFValueType.UINT32)
        self._pending: list[tuple[str, int]] = []  # (name, n_bytes) still to write, in order
        self._begun = False
        self._done = False

    # --- declaring --------------------------------------------------------------------------
    def add_key(self, key: str, value, vtype: GGUFValueType, sub_type: GGUFValueType | None = None):
        """Add one key with an explicit type. Empty strings are kept (gguf's typed helpers drop
        them silently); an empty array is refused here, since gguf can only fail on it later,
        in the middle of writing."""
        if key == "general.architecture":
            return  # the gguf writer sets it from `arch`
        if isinstance(value, np.ndarray):
            value = value.tolist()  # gguf accepts arrays at add time, then fails at write time
        if vtype == GGUFValueType.ARRAY:
            value = list(value)
            if sub_type is None:
                raise ValueError(f"array key '{key}' needs its element type")
            if not value:
                raise ValueError(f"array key '{key}' is empty: gguf cannot write empty arrays")
        self._writer.add_key_value(key, value, vtype, sub_type)

    def add_tensor_info(self, name: str, shape, ggml_type) -> int:
        """Declare a tensor of numpy-order ``shape`` stored as ``ggml_type``; returns its bytes."""
        if self._begun:
            raise RuntimeError("all tensor infos must be added before begin()")
        qtype = _as_type(ggml_type)
        shape = tuple(int(s) for s in shape)
        block = GGML_QUANT_SIZES[qtype][0]
        if shape and shape[-1] % block:
            raise ValueError(f"tensor '{name}': row length {shape[-1]} is not a multiple of "
                             f"{qtype.name}'s block size {block}")
        bshape = byte_shape_of(shape, qtype)
        n_bytes = int(np.prod(bshape, dtype=np.int64))
        self._writer.add_tensor_info(name, bshape, np.dtype(np.uint8), n_bytes, raw_dtype=qtype)
        self._pending.append((name, n_bytes))
        return n_bytes

    # --- writing ----------------------------------------------------------------------------
    def begin(self) -> None:
        """Write the header, the metadata and the tensor infos; tensor data follows."""
        self._writer.write_header_to_file()
        self._writer.write_kv_data_to_file()
        self._writer.write_ti_data_to_file()
        self._begun = True

    def write_tensor(self, name: str, data: np.ndarray) -> None:
        """Write the next tensor's bytes (any dtype; its raw bytes are what is stored)."""
        if not self._begun:
            raise RuntimeError("call begin() before writing tensor data")
        if not self._pending:
            raise ValueError(f"tensor '{name}' was not declared")
        want, n_bytes = self._pending[0]
        if name != want:
            raise ValueError(f"tensor '{name}' written out of order: '{want}' comes next")
        data = np.ascontiguousarray(data)
        if data.nbytes != n_bytes:
            raise ValueError(f"tensor '{name}': {data.nbytes} bytes given, {n_bytes} declared")
        self._writer.write_tensor_data(data.reshape(-1).view(np.uint8))
        self._pending.pop(0)

    def commit(self) -> str:
        """Finish the file and move it into place; returns the target path."""
        if self._done:
            return self.target
        if not self._begun:
            self.begin()
        if self._pending:
            raise ValueError(f"{len(self._pending)} declared tensor(s) were never written, "
                             f"starting with '{self._pending[0][0]}'")
        self._writer.close()
        with open(self.temp_path, "rb+") as fh:
            os.fsync(fh.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(self.temp_path, 0o666 & ~umask)
        os.replace(self.temp_path, self.target)
        self._done = True
        return self.target

    def abort(self) -> None:
        """Drop the partial output (safe to call more than once)."""
        if self._done:
            return
        self._done = True
        try:
            self._writer.close()
        finally:
            try:
                os.unlink(self.temp_path)
            except FileNotFoundError:
                pass

    def __enter__(self) -> "GGUFStreamWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            try:
                self.commit()
            except BaseException:
                self.abort()
                raise
        else:
            self.abort()
