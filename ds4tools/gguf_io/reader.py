"""Open a GGUF file, or a split set of them, as one model: metadata as Python values and tensors
as memory-mapped views that are never copied on open.

``gguf.GGUFReader`` does the parsing. It trusts the header, though: a lying count or length
makes it loop for ages, grow lists without bound or fail with an IndexError deep inside. So each
file first goes through ``check_header``, a bounds-only walk over the header that checks every
count and length against the file size (and the rules the reader would trip on: duplicate
names, unknown type ids, tensor data outside the file) before the reader sees it.

    >>> f = open_gguf("model-00001-of-00003.gguf")    # any shard opens the whole set
    >>> f.architecture, f.metadata["llama.block_count"]
    >>> w = f.tensors["blk.0.attn_q.weight"].to_float32()
"""
from __future__ import annotations

import mmap
import os
import re
import struct
from dataclasses import dataclass, field

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType

from ..errors import InvalidContentError, UnreadableError, about

__all__ = ["open_gguf", "GGUFFile", "TensorRef", "ShardInfo", "check_header", "HeaderLayout",
           "split_shard_paths", "byte_shape_of", "SPLIT_NAME_RE"]

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
_PSEUDO_KEYS = ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count")
SPLIT_NAME_RE = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")

_SCALAR_SIZE = {
    GGUFValueType.UINT8: 1, GGUFValueType.INT8: 1, GGUFValueType.UINT16: 2,
    GGUFValueType.INT16: 2, GGUFValueType.UINT32: 4, GGUFValueType.INT32: 4,
    GGUFValueType.FLOAT32: 4, GGUFValueType.BOOL: 1, GGUFValueType.UINT64: 8,
    GGUFValueType.INT64: 8, GGUFValueType.FLOAT64: 8,
}
# The smallest possible records: a key/value (empty key, u8 value) and a tensor info (empty
# name, no dims). A count that could not fit even at this size is a lie.
_MIN_KV_BYTES = 8 + 4 + 1
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8
_MAX_ARRAY_NESTING = 8


# --- the header check --------------------------------------------------------------------------


@dataclass
class TensorRecord:
    name: str
    ggml_shape: tuple[int, ...]
    type_id: int
    rel_offset: int  # from the start of the data section
    record_offset: int  # where its tensor-info record starts in the file


@dataclass
class HeaderLayout:
    """What the header walk learned: enough to bound the reader, not the values."""
    version: int
    n_tensors: int
    n_kv: int
    alignment: int
    data_start: int
    file_size: int
    keys: list[str]
    tensors: list[TensorRecord]
    #: rule violations that gguf.GGUFReader cannot get past (so the file cannot be opened)
    problems: list[str] = field(default_factory=list)


class _Cursor:
    def __init__(self, buf, size: int, path: str):
        self.buf, self.size, self.path, self.pos = buf, size, path, 0

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise UnreadableError(about(
                self.path, f"truncated or corrupt header: {what} at byte {self.pos} needs {n} "
                           f"bytes, but the file has {self.size}"))

    def take(self, fmt: str, what: str) -> int:
        n = struct.calcsize(fmt)
        self.need(n, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v

    def string(self, what: str) -> bytes:
        start = self.pos
        n = self.take("<Q", what + " length")
        if n > self.size - self.pos:
            raise UnreadableError(about(
                self.path, f"{what} at byte {start} claims {n} bytes, past the end of the "
                           f"file ({self.size} bytes)"))
        s = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return s

    def skip_value(self, vtype: int, what: str, depth: int = 0) -> None:
        try:
            t = GGUFValueType(vtype)
        except ValueError:
            raise UnreadableError(about(self.path, f"{what} has unknown value type {vtype}")) from None
        if t in _SCALAR_SIZE:
            self.need(_SCALAR_SIZE[t], what)
            self.pos += _SCALAR_SIZE[t]
        elif t == GGUFValueType.STRING:
            self.string(what)
        else:  # ARRAY
            if depth >= _MAX_ARRAY_NESTING:
                raise UnreadableError(about(self.path, f"{what} nests arrays too deeply"))
            item_type = self.take("<I", what + " element type")
            start = self.pos
            count = self.take("<Q", what + " length")
            left = self.size - self.pos
            try:
                it = GGUFValueType(item_type)
            except ValueError:
                raise UnreadableError(about(
                    self.path, f"{what} has unknown element type {item_type}")) from None
            least = _SCALAR_SIZE.get(it, 8)  # a string or array element takes >= 8 bytes
            if count > left // least:
                raise UnreadableError(about(
                    self.path, f"{what} at byte {start} claims {count} items, but only {left} "
                               f"bytes are left in the file"))
            if it in _SCALAR_SIZE:
                self.pos += count * least
            elif it == GGUFValueType.STRING:
                self._skip_strings(count, what)
            else:
                for i in range(count):
                    self.skip_value(item_type, f"{what}[{i}]", depth + 1)

    def _skip_strings(self, count: int, what: str) -> None:
        # the hot loop of a vocabulary (hundreds of thousands of tokens): no copies, no f-strings
        buf, pos, size, unpack = self.buf, self.pos, self.size, struct.unpack_from
        for i in range(count):
            if pos + 8 > size:
                self.pos = pos
                self.need(8, f"{what}[{i}] length")
            (n,) = unpack("<Q", buf, pos)
            pos += 8
            if n > size - pos:
                raise UnreadableError(about(
                    self.path, f"{what}[{i}] at byte {pos - 8} claims {n} bytes, past the end of "
                               f"the file ({size} bytes)"))
            pos += n
        self.pos = pos


def check_header(path) -> HeaderLayout:
    """Walk the header of one GGUF file, checking each count and length against the file size.

    Raises ``UnreadableError`` when the bytes do not form a GGUF header. Rule violations that
    leave the header readable (duplicate names, unknown tensor types, data outside the file)
    are returned in ``HeaderLayout.problems``.
    """
    path = os.fspath(path)
    size = _file_size(path)
    if size < 24:
        if size >= 4 and not _starts_with_magic(path):
            raise UnreadableError(about(path, "not a GGUF file (wrong magic)"))
        raise UnreadableError(about(path, f"truncated: {size} bytes is too short for a GGUF header"))
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        return _walk(buf, size, path)


def _walk(buf, size: int, path: str) -> HeaderLayout:
    cur = _Cursor(buf, size, path)
    magic = bytes(buf[0:4])
    if magic != GGUF_MAGIC:
        raise UnreadableError(about(path, f"not a GGUF file (magic {magic!r}, expected b'GGUF')"))
    cur.pos = 4
    version = cur.take("<I", "version")
    if version & 0xFFFF == 0 and int.from_bytes(version.to_bytes(4, "little"), "big") in (1, 2, 3):
        raise UnreadableError(about(path, "big-endian GGUF files are not supported"))
    if version not in SUPPORTED_VERSIONS:
        raise UnreadableError(about(
            path, f"unsupported GGUF version {version} (supported: "
                  f"{', '.join(map(str, SUPPORTED_VERSIONS))})"))
    n_tensors = cur.take("<Q", "tensor count")
    n_kv = cur.take("<Q", "key/value count")
    left = size - cur.pos
    if n_kv > left // _MIN_KV_BYTES:
        raise UnreadableError(about(
            path, f"truncated or corrupt header: it claims {n_kv} key/value pairs, but the file "
                  f"has only {left} bytes left (at least {_MIN_KV_BYTES} bytes each)"))
    if n_tensors > left // _MIN_TENSOR_INFO_BYTES:
        raise UnreadableError(about(
            path, f"truncated or corrupt header: it claims {n_tensors} tensors, but the file has "
                  f"only {left} bytes left (at least {_MIN_TENSOR_INFO_BYTES} bytes per tensor record)"))

    problems: list[str] = []
    keys: list[str] = []
    seen = set(_PSEUDO_KEYS)
    alignment = DEFAULT_ALIGNMENT
    for i in range(n_kv):
        start = cur.pos
        raw_key = cur.string(f"key #{i}")
        try:
            key = raw_key.decode("utf-8")
        except UnicodeDecodeError:
            raise UnreadableError(about(
                path, f"key #{i} at byte {start} is not valid UTF-8: {raw_key[:40]!r}")) from None
        vtype = cur.take("<I", f"type of key '{key}'")
        value_at = cur.pos
        cur.skip_value(vtype, f"value of key '{key}'")
        if key in seen:
            problems.append(f"duplicate key '{key}'")
        seen.add(key)
        keys.append(key)
        if key == "general.alignment":
            if vtype != GGUFValueType.UINT32:
                problems.append(f"general.alignment must be UINT32, not {_type_name(vtype)}")
            else:
                (a,) = struct.unpack_from("<I", buf, value_at)
                if a == 0 or a & (a - 1):
                    problems.append(f"general.alignment {a} is not a power of two")
                else:
                    alignment = a

    records: list[TensorRecord] = []
    for i in range(n_tensors):
        start = cur.pos
        raw_name = cur.string(f"name of tensor #{i}")
        try:
            name = raw_name.decode("utf-8")
        except UnicodeDecodeError:
            raise UnreadableError(about(
                path, f"name of tensor #{i} at byte {start} is not valid UTF-8: "
                      f"{raw_name[:40]!r}")) from None
        n_dims = cur.take("<I", f"dimension count of tensor '{name}'")
        cur.need(8 * n_dims, f"dimensions of tensor '{name}'")
        dims = struct.unpack_from(f"<{n_dims}Q", buf, cur.pos)
        cur.pos += 8 * n_dims
        type_id = cur.take("<I", f"type of tensor '{name}'")
        rel = cur.take("<Q", f"data offset of tensor '{name}'")
        records.append(TensorRecord(name, tuple(int(d) for d in dims), type_id, rel, start))
        if n_dims > MAX_DIMS:
            problems.append(f"tensor '{name}' has {n_dims} dimensions (at most {MAX_DIMS})")

    data_start = -(-cur.pos // alignment) * alignment
    names = set()
    for r in records:
        if r.name in names:
            problems.append(f"duplicate tensor name '{r.name}'")
            continue
        names.add(r.name)
        problem = _tensor_extent_problem(r, data_start, size)
        if problem:
            problems.append(problem)
    return HeaderLayout(version, n_tensors, n_kv, alignment, data_start, size, keys, records, problems)


def _tensor_extent_problem(r: TensorRecord, data_start: int, size: int) -> str | None:
    try:
        qtype = GGMLQuantizationType(r.type_id)
        block, type_size = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        return f"tensor '{r.name}' has unknown type id {r.type_id}"
    n = 1
    for d in r.ggml_shape:
        n *= d
    if n >= 2 ** 62:
        return f"tensor '{r.name}' has an impossible shape {list(r.ggml_shape)}"
    if r.ggml_shape and r.ggml_shape[0] % block:
        return (f"tensor '{r.name}': row length {r.ggml_shape[0]} is not a multiple of "
                f"{qtype.name}'s block size {block}")
    n_bytes = n // block * type_size
    start = data_start + r.rel_offset
    if start + n_bytes > size:
        return (f"tensor '{r.name}': its {n_bytes} bytes at offset {start} end past the end of "
                f"the file ({size} bytes): the file is truncated or the offset is wrong")
    return None


def _type_name(vtype: int) -> str:
    try:
        return GGUFValueType(vtype).name
    except ValueError:
        return str(vtype)


def _file_size(path: str) -> int:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise UnreadableError(about(path, "no such file")) from None
    except OSError as e:
        raise UnreadableError(about(path, f"cannot read: {e.strerror or e}")) from None
    if not os.path.isfile(path):
        raise UnreadableError(about(path, "not a regular file"))
    if not os.access(path, os.R_OK):
        raise UnreadableError(about(path, "permission denied"))
    return st.st_size


def _starts_with_magic(path: str) -> bool:
    with open(path, "rb") as fh:
        return fh.read(4) == GGUF_MAGIC


# --- the opened model --------------------------------------------------------------------------


def byte_shape_of(shape, ggml_type) -> tuple[int, ...]:
    """uint8 shape of a tensor of numpy-order ``shape`` stored as ``ggml_type`` (any gguf type)."""
    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(int(ggml_type))]
    shape = tuple(int(s) for s in shape)
    if not shape:
        return (type_size,)
    return shape[:-1] + (shape[-1] // block * type_size,)


@dataclass(frozen=True, eq=False)
class TensorRef:
    """One tensor of an opened GGUF: where its bytes are, and how to read them (no copy)."""
    name: str
    ggml_type: int
    type_name: str
    shape: tuple[int, ...]  # numpy order: the row (ne0) is the last axis
    ggml_shape: tuple[int, ...]  # ne0 first, as GGUF stores it
    n_elements: int
    n_bytes: int
    data_offset: int  # absolute, in its shard
    path: str  # its shard
    _file_bytes: np.ndarray = field(repr=False)

    @property
    def byte_shape(self) -> tuple[int, ...]:
        return byte_shape_of(self.shape, self.ggml_type)

    def raw(self) -> np.ndarray:
        """The stored bytes as a read-only uint8 memmap view of byte shape (no copy)."""
        view = self._file_bytes[self.data_offset:self.data_offset + self.n_bytes]
        return view.reshape(self.byte_shape)

    def release_pages(self) -> None:
        """Let the OS drop this tensor's pages from memory (they are re-read from the file if
        touched again). A streaming pass over a model calls it once done with each tensor, so
        the mapped file does not pile up in the process's resident memory."""
        mm = getattr(self._file_bytes, "_mmap", None)
        if mm is None or not hasattr(mm, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = self.data_offset - self.data_offset % mmap.PAGESIZE
        length = self.data_offset + self.n_bytes - start
        length -= length % mmap.PAGESIZE  # whole pages inside the map only
        if length > 0:
            try:
                mm.madvise(mmap.MADV_DONTNEED, start, length)
            except (OSError, ValueError):
                pass  # advice only

    def to_float32(self) -> np.ndarray:
        """The values as float32 in numpy order, decoded by ds4tools.formats where it has the type."""
        from .. import formats  # the lowest layer; imported here to keep `import` of this light
        raw = self.raw()
        fmt = formats.format_for_type(self.ggml_type)
        try:
            if fmt is not None:
                return formats.dequantize(raw, fmt, self.shape)
            plain = _PLAIN_DTYPES.get(self.ggml_type)
            if plain is not None:
                return np.asarray(raw.view(plain).reshape(self.shape), dtype=np.float32)
            from gguf import quants
            return np.asarray(quants.dequantize(np.asarray(raw), GGMLQuantizationType(self.ggml_type)),
                              dtype=np.float32).reshape(self.shape)
        except NotImplementedError:
            raise InvalidContentError(about(
                self.path, f"tensor '{self.name}': type {self.type_name} cannot be decoded")) from None
        except ValueError as e:
            raise InvalidContentError(about(self.path, f"tensor '{self.name}': {e}")) from None


_PLAIN_DTYPES = {
    int(GGMLQuantizationType.I8): np.int8, int(GGMLQuantizationType.I16): np.int16,
    int(GGMLQuantizationType.I32): np.int32, int(GGMLQuantizationType.I64): np.int64,
    int(GGMLQuantizationType.F64): np.float64,
}


@dataclass
class ShardInfo:
    path: str
    size: int
    version: int
    alignment: int
    data_offset: int
    metadata: dict
    tensor_names: list[str]


class GGUFFile:
    """A GGUF model: one file or a split set read as one (metadata of the first shard)."""

    def __init__(self, path: str, shards: list[tuple[ShardInfo, GGUFReader, dict]]):
        self.path = path
        self.paths = [s.path for s, _, _ in shards]
        self.shards = [s for s, _, _ in shards]
        first_info, _, first_types = shards[0]
        self.version = first_info.version
        self.alignment = first_info.alignment
        self.metadata: dict = first_info.metadata
        self._types: dict = first_types
        arch = self.metadata.get("general.architecture")
        self.architecture: str | None = arch if isinstance(arch, str) else None
        self.tensors: dict[str, TensorRef] = {}
        for info, reader, _ in shards:
            for t in reader.tensors:
                if t.name in self.tensors:
                    raise InvalidContentError(about(
                        info.path, f"tensor '{t.name}' is also in {self.tensors[t.name].path}"))
                self.tensors[t.name] = _tensor_ref(t, info.path, reader.data)
        self._readers = [r for _, r, _ in shards]

    @property
    def file_size(self) -> int:
        return sum(s.size for s in self.shards)

    @property
    def kv_count(self) -> int:
        return len(self.metadata)

    @property
    def tensor_count(self) -> int:
        return len(self.tensors)

    def value_type(self, key: str) -> tuple[GGUFValueType, GGUFValueType | None]:
        """The stored type of a key, and for an array the type of its elements."""
        try:
            return self._types[key]
        except KeyError:
            raise KeyError(f"{self.path}: no key '{key}'") from None

    def close(self) -> None:
        """Drop this object's references to the memory maps (views handed out stay valid)."""
        self.tensors = {}
        self._readers = []

    def __enter__(self) -> "GGUFFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"<GGUFFile {self.path!r}: {self.architecture}, {len(self.tensors)} tensors, "
                f"{len(self.metadata)} keys, {len(self.paths)} file(s)>")


def _tensor_ref(t, path: str, file_bytes: np.ndarray) -> TensorRef:
    ggml_shape = tuple(int(d) for d in t.shape)
    qtype = GGMLQuantizationType(int(t.tensor_type))
    return TensorRef(
        name=t.name, ggml_type=int(qtype), type_name=qtype.name,
        shape=tuple(reversed(ggml_shape)), ggml_shape=ggml_shape,
        n_elements=int(t.n_elements), n_bytes=int(t.n_bytes), data_offset=int(t.data_offset),
        path=path, _file_bytes=file_bytes)


def split_shard_paths(path) -> list[str]:
    """All shards of the split set ``path`` belongs to (just ``[path]`` for a single file)."""
    path = os.fspath(path)
    m = SPLIT_NAME_RE.match(os.path.basename(path))
    if not m:
        return [path]
    count, no = int(m.group("count")), int(m.group("no"))
    if count < 1 or not 1 <= no <= count:
        raise UnreadableError(about(path, f"shard number {no} of {count} makes no sense"))
    folder = os.path.dirname(path)
    paths = [os.path.join(folder, f"{m.group('stem')}-{i:05d}-of-{count:05d}.gguf")
             for i in range(1, count + 1)]
    for p in paths:
        if not os.path.exists(p):
            raise UnreadableError(about(path, f"split set is missing shard {os.path.basename(p)}"))
    return paths


def open_gguf(path) -> GGUFFile:
    """Open a GGUF file (or, from any of its shards, a whole split set) without copying data."""
    path = os.fspath(path)
    return GGUFFile(path, [_open_shard(p) for p in split_shard_paths(path)])


class _BulkArrayReader(GGUFReader):
    """gguf's reader, with metadata arrays read in bulk.

    gguf-py parses an array one element at a time (about 60 µs each, so a 150k-token
    vocabulary with its types and merges takes half a minute). Here an array of scalars is a
    single numpy view and an array of strings a list of memoryview slices; ReaderField.contents()
    reads both exactly as it reads gguf-py's own parts. Nested arrays keep gguf-py's path.
    """

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        if raw_type != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        item_type, count = GGUFValueType(int(raw_itype[0])), int(alen[0])
        offs = orig_offs + 12
        parts, idxs, types = [raw_itype, alen], [], [GGUFValueType.ARRAY]
        scalar = self.gguf_scalar_to_np.get(item_type)
        if scalar is not None:
            if count:
                values = self._get(offs, scalar, count)
                parts.append(values)
                idxs.append(2)
                types.append(item_type)
                offs += int(values.nbytes)
            return offs - orig_offs, parts, idxs, types
        if item_type == GGUFValueType.STRING:
            if not hasattr(self, "_bytes"):
                self._bytes = memoryview(self.data).cast("B")
            mv = self._bytes
            for _ in range(count):
                (n,) = struct.unpack_from("<Q", mv, offs)
                parts.append(mv[offs:offs + 8])
                parts.append(mv[offs + 8:offs + 8 + n])
                idxs.append(len(parts) - 1)
                offs += 8 + n
            if count:
                types.append(GGUFValueType.STRING)
            return offs - orig_offs, parts, idxs, types
        return super()._get_field_parts(orig_offs, raw_type)


def _open_shard(path: str):
    layout = check_header(path)
    if layout.problems:
        raise InvalidContentError(about(path, layout.problems[0]),
                                  findings=[about(path, p) for p in layout.problems])
    try:
        reader = _BulkArrayReader(path, "r")
    except Exception as e:  # noqa: BLE001 - whatever the reader trips on, the file is unreadable
        raise UnreadableError(about(path, f"cannot be parsed as GGUF: {e}")) from None
    metadata, types = {}, {}
    for name, fld in reader.fields.items():
        if name in _PSEUDO_KEYS:
            continue
        try:
            metadata[name] = fld.contents()
        except UnicodeDecodeError:
            raise UnreadableError(about(path, f"key '{name}' holds text that is not UTF-8")) from None
        main = GGUFValueType(fld.types[0]) if fld.types else None
        sub = GGUFValueType(fld.types[1]) if main == GGUFValueType.ARRAY and len(fld.types) > 1 else None
        if main == GGUFValueType.ARRAY and sub is None:
            # an empty array still records its element type in the file
            sub = GGUFValueType(int(fld.parts[3][0])) if len(fld.parts) > 3 else None
        types[name] = (main, sub)
    info = ShardInfo(path=path, size=layout.file_size, version=layout.version,
                     alignment=int(reader.alignment), data_offset=int(reader.data_offset),
                     metadata=metadata, tensor_names=[t.name for t in reader.tensors])
    return info, reader, types
