"""llama.cpp importance matrices (imatrix): read and write both file formats.

* GGUF (llama.cpp's current ``llama-imatrix`` output): ``general.type = "imatrix"``, keys
  ``imatrix.datasets`` / ``imatrix.chunk_count`` / ``imatrix.chunk_size``, and per weight
  tensor ``<name>.in_sum2`` (F32, one row of summed squared activations per matrix, i.e. per
  expert for 3-D tensors) with ``<name>.counts`` (F32, one count per matrix). The importance
  of a column is ``in_sum2 / counts``; a matrix with no count (an expert never routed to) gets
  ones, as llama-quantize does.
* legacy ``.dat``: int32 n_entries; per entry int32 name length, the name, int32 ncall,
  int32 nval, float32[nval]; then optionally int32 chunk count, int32 length and the dataset
  name. The importance is ``values / ncall``. A 3-D tensor's entry holds all experts' vectors
  end to end, so its shape is known only once the tensor is (``Imatrix.for_tensor``).

Entries are keyed by GGUF tensor names (``blk.0.ffn_gate_exps.weight``). Every problem with a
file is a ``ValueError`` naming it; counts and lengths are checked against the file size
before anything is allocated.
"""
from __future__ import annotations

import mmap
import os
import struct
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

GGUF_MAGIC = b"GGUF"
_IN_SUM2 = ".in_sum2"
_COUNTS = ".counts"


@dataclass
class Imatrix:
    """Importance weights per tensor: float32 ``(n,)``, or ``(n_expert, n)`` for 3-D tensors
    (a legacy ``.dat`` entry of a 3-D tensor stays flat until ``for_tensor`` shapes it)."""

    entries: dict[str, np.ndarray] = field(default_factory=dict)
    datasets: list[str] = field(default_factory=list)
    chunk_count: int | None = None
    chunk_size: int | None = None
    path: str | None = None

    def __len__(self) -> int:
        return len(self.entries)

    def _entry_for(self, gguf_name: str, n_expert: int | None) -> tuple[str, np.ndarray] | None:
        if gguf_name in self.entries:
            return gguf_name, self.entries[gguf_name]
        if n_expert:
            # ds4 writes routed experts one entry each: <name>.expert.<id> or <name>.expert_<id>
            for sep in (".expert.", ".expert_"):
                keys = [f"{gguf_name}{sep}{e}" for e in range(n_expert)]
                if all(k in self.entries for k in keys):
                    parts = [np.ravel(self.entries[k]) for k in keys]
                    if len({p.size for p in parts}) != 1:
                        raise ValueError(f"{self._where()}: the per-expert entries of "
                                         f"{gguf_name} have different lengths")
                    return f"{gguf_name}{sep}*", np.stack(parts)
        return None

    def for_tensor(self, gguf_name: str, shape) -> np.ndarray | None:
        """The importance vector(s) for a tensor of numpy-order ``shape``, or None if absent.

        Returns float32 ``(n,)`` for a 2-D tensor with rows of n values, and ``(n,)`` or
        ``(n_expert, n)`` for a 3-D ``(n_expert, rows, n)`` one. A length that does not fit
        the tensor's rows is a ValueError naming both."""
        shape = tuple(int(s) for s in shape)
        if not shape or shape[-1] <= 0:
            raise ValueError(f"tensor {gguf_name} has no rows (shape {shape})")
        n = shape[-1]
        n_expert = shape[0] if len(shape) >= 3 else None
        found = self._entry_for(gguf_name, n_expert)
        if found is None:
            return None
        key, values = found
        what = f"tensor {gguf_name} of shape {shape} (rows of {n} values"
        what += f", {n_expert} experts)" if n_expert else ")"
        if values.ndim == 2 and values.shape[0] == 1:
            values = values[0]
        if values.ndim == 1:
            if values.size == n:
                return values
            if n_expert and values.size == n_expert * n:
                return values.reshape(n_expert, n)
            raise ValueError(f"{self._where()}: imatrix entry {key!r} has {values.size} values, "
                             f"which does not fit {what}")
        if values.shape[1] != n:
            raise ValueError(f"{self._where()}: imatrix entry {key!r} has rows of "
                             f"{values.shape[1]} values, but {what}")
        if n_expert and values.shape[0] == n_expert:
            return values
        raise ValueError(f"{self._where()}: imatrix entry {key!r} has {values.shape[0]} vectors, "
                         f"but {what}")

    def _where(self) -> str:
        return self.path or "imatrix"


def load_imatrix(path) -> Imatrix:
    """Read an imatrix file in either format (told apart by the GGUF magic)."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ValueError(f"{path}: cannot read imatrix file: {e.strerror or e}") from None
    if magic == GGUF_MAGIC:
        return _load_gguf(path)
    return _load_dat(path)


# --- GGUF -----------------------------------------------------------------------------------

def _field_value(reader, key):
    f = reader.fields.get(key)
    if f is None:
        return None
    try:
        return f.contents()
    except Exception:  # an unreadable field is as good as absent for optional metadata
        return None


def _load_gguf(path: str) -> Imatrix:
    from gguf import GGMLQuantizationType, GGUFReader

    try:
        reader = GGUFReader(path, "r")
    except Exception as e:  # gguf raises ValueError, struct.error, IndexError... on bad files
        raise ValueError(f"{path}: not a readable GGUF file: {e}") from None
    kind = _field_value(reader, "general.type")
    if kind != "imatrix":
        raise ValueError(f"{path}: a GGUF file, but not an imatrix "
                         f"(general.type is {kind!r}, expected 'imatrix')")
    tensors = {t.name: t for t in reader.tensors}
    names = sorted({n[:-len(_IN_SUM2)] for n in tensors if n.endswith(_IN_SUM2)}
                   | {n[:-len(_COUNTS)] for n in tensors if n.endswith(_COUNTS)})
    if not names:
        raise ValueError(f"{path}: the imatrix has no entries (no *.in_sum2 / *.counts tensors)")
    entries = {}
    for name in names:
        sums, counts = tensors.get(name + _IN_SUM2), tensors.get(name + _COUNTS)
        if sums is None or counts is None:
            raise ValueError(f"{path}: entry {name!r} needs both {name}{_IN_SUM2} and "
                             f"{name}{_COUNTS}")
        for t in (sums, counts):
            if t.tensor_type != GGMLQuantizationType.F32:
                raise ValueError(f"{path}: {t.name} must be F32, not {t.tensor_type.name}")
        s = np.asarray(sums.data, dtype=np.float32)
        c = np.asarray(counts.data, dtype=np.float32).reshape(-1)
        n_mat = c.size
        if n_mat == 0 or s.size == 0 or s.size % n_mat:
            raise ValueError(f"{path}: {name}{_IN_SUM2} has {s.size} values, not a multiple of "
                             f"its {n_mat} counts")
        s = s.reshape(n_mat, s.size // n_mat)
        if not (np.isfinite(s).all() and np.isfinite(c).all()):
            raise ValueError(f"{path}: entry {name!r} holds non-finite values")
        values = np.ones_like(s)
        seen = c > 0
        values[seen] = s[seen] / c[seen, None]
        if (values < 0).any():
            raise ValueError(f"{path}: entry {name!r} holds negative importances")
        entries[name] = values[0].copy() if n_mat == 1 else values
    datasets = _field_value(reader, "imatrix.datasets")
    if isinstance(datasets, str):
        datasets = [datasets]
    chunk_count = _field_value(reader, "imatrix.chunk_count")
    chunk_size = _field_value(reader, "imatrix.chunk_size")
    return Imatrix(entries, [str(d) for d in (datasets or [])],
                   None if chunk_count is None else int(chunk_count),
                   None if chunk_size is None else int(chunk_size), path)


# --- legacy .dat ----------------------------------------------------------------------------

class _Cursor:
    """Bounds-checked little-endian reads over a byte buffer."""

    def __init__(self, buf, path: str):
        self.buf, self.pos, self.path = buf, 0, path

    @property
    def left(self) -> int:
        return len(self.buf) - self.pos

    def int32(self, what: str) -> int:
        if self.left < 4:
            raise ValueError(f"{self.path}: truncated imatrix: file ends inside {what} "
                             f"(offset {self.pos})")
        (v,) = struct.unpack_from("<i", self.buf, self.pos)
        self.pos += 4
        return v

    def take(self, nbytes: int, what: str) -> bytes:
        self.check(nbytes, what)
        v = self.buf[self.pos:self.pos + nbytes]
        self.pos += nbytes
        return v

    def float32s(self, count: int, what: str) -> np.ndarray:
        self.check(4 * count, what)
        v = np.frombuffer(self.buf, dtype="<f4", count=count, offset=self.pos).astype(np.float32)
        self.pos += 4 * count
        return v  # a copy: nothing keeps a view into the mapped file

    def check(self, nbytes: int, what: str) -> None:
        if nbytes < 0 or nbytes > self.left:
            raise ValueError(f"{self.path}: {what} claims {nbytes} bytes at offset {self.pos}, "
                             f"but only {self.left} remain")


def _load_dat(path: str) -> Imatrix:
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise ValueError(f"{path}: empty file, not an imatrix")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse_dat(buf, path)


def _parse_dat(buf, path: str) -> Imatrix:
    cur = _Cursor(buf, path)
    n_entries = cur.int32("the entry count")
    smallest_entry = 4 + 1 + 4 + 4 + 4  # name length, a 1-byte name, ncall, nval, one value
    if n_entries < 1:
        raise ValueError(f"{path}: not an imatrix: it claims {n_entries} entries")
    if n_entries > cur.left // smallest_entry:
        raise ValueError(f"{path}: not an imatrix (or truncated): it claims {n_entries} entries, "
                         f"but {cur.left} bytes hold at most {cur.left // smallest_entry}")
    entries = {}
    for i in range(n_entries):
        length = cur.int32(f"entry {i}'s name length")
        if length < 1:
            raise ValueError(f"{path}: entry {i} has a name of length {length}")
        raw_name = cur.take(length, f"entry {i}'s name")
        try:
            name = raw_name.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{path}: entry {i}'s name is not UTF-8 text: {raw_name[:40]!r}") from None
        ncall = cur.int32(f"entry {name!r}'s call count")
        nval = cur.int32(f"entry {name!r}'s value count")
        if nval < 1:
            raise ValueError(f"{path}: entry {name!r} claims {nval} values")
        if nval > cur.left // 4:
            raise ValueError(f"{path}: entry {name!r} claims {nval} values ({4 * nval} bytes) at "
                             f"offset {cur.pos}, but only {cur.left} bytes remain")
        values = cur.float32s(nval, f"entry {name!r}'s values")
        if not np.isfinite(values).all():
            raise ValueError(f"{path}: entry {name!r} holds non-finite values")
        if ncall > 0:
            values /= np.float32(ncall)
        if (values < 0).any():
            raise ValueError(f"{path}: entry {name!r} holds negative importances")
        if name in entries:
            raise ValueError(f"{path}: entry {name!r} appears twice")
        entries[name] = values
    chunk_count, datasets = None, []
    if cur.left:
        chunk_count = cur.int32("the chunk count")
        length = cur.int32("the dataset name's length")
        if length < 0:
            raise ValueError(f"{path}: the dataset name has length {length}")
        dataset = cur.take(length, "the dataset name").decode("utf-8", errors="replace")
        if dataset:
            datasets.append(dataset)
        if cur.left:
            raise ValueError(f"{path}: {cur.left} unexpected bytes after the dataset name")
    return Imatrix(entries, datasets, chunk_count, None, path)


# --- writing --------------------------------------------------------------------------------

def save_imatrix(imatrix: Imatrix, path, format: str | None = None) -> None:
    """Write ``imatrix`` as GGUF (``format="gguf"``, the default for a ``.gguf`` path) or
    legacy ``.dat``. Values are stored with a count of one (GGUF) / ncall = 1 (.dat), so
    reading the file back gives the same float32 values. Written to a temporary file first,
    then renamed into place."""
    path = Path(path)
    fmt = format or ("gguf" if path.suffix.lower() == ".gguf" else "dat")
    if fmt not in ("gguf", "dat"):
        raise ValueError(f"unknown imatrix format {fmt!r} (use 'gguf' or 'dat')")
    if not imatrix.entries:
        raise ValueError("an imatrix needs at least one entry")
    entries = {}
    for name, values in sorted(imatrix.entries.items()):
        v = np.asarray(values, dtype=np.float32)
        if v.ndim not in (1, 2) or v.size == 0:
            raise ValueError(f"imatrix entry {name!r} must be a non-empty vector or a matrix "
                             f"(one row per expert), got shape {v.shape}")
        if not np.isfinite(v).all() or (v < 0).any():
            raise ValueError(f"imatrix entry {name!r} must be finite and non-negative")
        entries[name] = v
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent or ".")
    os.close(fd)
    try:
        if fmt == "gguf":
            _write_gguf(imatrix, entries, tmp)
        else:
            _write_dat(imatrix, entries, tmp)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _write_gguf(imatrix: Imatrix, entries: dict, tmp: str) -> None:
    import gguf

    class _ImatrixWriter(gguf.GGUFWriter):
        def add_architecture(self) -> None:  # an imatrix has no architecture key
            pass

    w = _ImatrixWriter(tmp, arch="")
    w.add_type("imatrix")
    w.add_array("imatrix.datasets", [str(d) for d in imatrix.datasets])
    w.add_uint32("imatrix.chunk_count", int(imatrix.chunk_count or 0))
    w.add_uint32("imatrix.chunk_size", int(imatrix.chunk_size or 0))
    for name, v in entries.items():
        sums = v.reshape(1, -1) if v.ndim == 1 else v
        w.add_tensor(name + _IN_SUM2, np.ascontiguousarray(sums))
        w.add_tensor(name + _COUNTS, np.ones((sums.shape[0], 1), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _write_dat(imatrix: Imatrix, entries: dict, tmp: str) -> None:
    with open(tmp, "wb") as f:
        f.write(struct.pack("<i", len(entries)))
        for name, v in entries.items():
            raw = name.encode("utf-8")
            f.write(struct.pack("<i", len(raw)))
            f.write(raw)
            f.write(struct.pack("<ii", 1, v.size))
            f.write(np.ascontiguousarray(v, dtype="<f4").tobytes())
        dataset = (imatrix.datasets[0] if imatrix.datasets else "").encode("utf-8")
        f.write(struct.pack("<ii", int(imatrix.chunk_count or 0), len(dataset)))
        f.write(dataset)


# --- fallback -------------------------------------------------------------------------------

def synthetic_imatrix(w) -> np.ndarray:
    """ds4's stand-in when a type requires an imatrix and none is given: per column, the sum
    over rows of w**2. A 3-D ``(n_expert, rows, n)`` tensor gets one vector per expert."""
    a = np.asarray(w)
    if a.dtype.kind != "f" or a.ndim not in (2, 3):
        raise ValueError(f"synthetic_imatrix needs a 2-D or 3-D float tensor, got "
                         f"{a.ndim}-D {a.dtype}")
    mats = a.reshape((1,) + a.shape) if a.ndim == 2 else a
    out = np.zeros((mats.shape[0], mats.shape[-1]), np.float64)
    step = 1024  # bounded float64 temporaries, whatever the tensor size
    for e in range(mats.shape[0]):
        for r in range(0, mats.shape[1], step):
            chunk = mats[e, r:r + step].astype(np.float64)
            out[e] += np.einsum("rn,rn->n", chunk, chunk)
    out = out.astype(np.float32)
    return out[0] if a.ndim == 2 else out
