"""The leader's frames to the workers: a fixed 16-byte header and, for the forward frames, the
rows' tokens and positions (docs/engine.md, "Tensor parallelism").

    offset  size  field
    0       1     kind      1 PREFILL, 2 DECODE, 3 VERIFY, 4 COMMIT, 5 STOP
    1       1     version   1
    2       2     flags     0 (reserved)
    4       4     seq       u32, the frame's number since the start (checked by the workers)
    8       4     arg       i32: PREFILL / DECODE / VERIFY: the first row's position;
                            COMMIT: the cache length every rank keeps; STOP: the leader's
                            exit code (the workers exit 0)
    12      4     n         u32: rows that follow (0 for COMMIT and STOP)
    16      4n    tokens    int32 x n
    16+4n   4n    positions int32 x n (consecutive from arg: the decoder writes one run of rows)

Little-endian throughout. A frame travels as one MPI message (tag FRAME_TAG) from rank 0 to
each worker, in the order the leader runs them.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

PREFILL, DECODE, VERIFY, COMMIT, STOP = 1, 2, 3, 4, 5
NAMES = {PREFILL: "PREFILL", DECODE: "DECODE", VERIFY: "VERIFY", COMMIT: "COMMIT", STOP: "STOP"}
VERSION = 1
HEADER = struct.Struct("<BBHIiI")
assert HEADER.size == 16
FRAME_TAG = 41
#: the largest frame: a chunk of rows never exceeds the context, so this bounds the buffer
MAX_ROWS = 1 << 20


@dataclass
class Frame:
    kind: int
    seq: int
    arg: int
    tokens: np.ndarray | None = None       # int32 (n,)
    positions: np.ndarray | None = None    # int32 (n,)

    @property
    def name(self) -> str:
        return NAMES.get(self.kind, f"kind {self.kind}")


def encode(kind: int, seq: int, arg: int, tokens=None) -> bytes:
    """The bytes of one frame; forward frames carry ``tokens`` at positions arg, arg + 1, ..."""
    if tokens is None:
        return HEADER.pack(kind, VERSION, 0, seq & 0xFFFFFFFF, int(arg), 0)
    t = np.ascontiguousarray(tokens, "<i4")
    n = t.shape[0]
    pos = np.arange(arg, arg + n, dtype="<i4")
    return HEADER.pack(kind, VERSION, 0, seq & 0xFFFFFFFF, int(arg), n) + t.tobytes() + pos.tobytes()


def decode(buf, size: int) -> Frame:
    """A Frame from the first ``size`` bytes of ``buf``; raises ValueError on a malformed one."""
    if size < HEADER.size:
        raise ValueError(f"frame of {size} bytes, shorter than its header")
    kind, version, _flags, seq, arg, n = HEADER.unpack_from(buf, 0)
    if version != VERSION or kind not in NAMES:
        raise ValueError(f"unknown frame (kind {kind}, version {version})")
    if size != HEADER.size + 8 * n:
        raise ValueError(f"{NAMES[kind]} frame of {size} bytes for {n} rows")
    if n == 0:
        return Frame(kind, seq, arg)
    body = np.frombuffer(buf, "<i4", 2 * n, HEADER.size)
    tokens, positions = body[:n].astype(np.int64), body[n:].astype(np.int64)
    if positions[0] != arg or np.any(np.diff(positions) != 1):
        raise ValueError(f"{NAMES[kind]} frame: positions are not consecutive from {arg}")
    return Frame(kind, seq, arg, tokens, positions)
