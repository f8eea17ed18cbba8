"""bf16 weight shards small enough to come back from the GPU machine, and their reassembly.

All tensors (sorted by name, cast to bf16, C order) form one byte stream; index.json records each
tensor's offset and shape and each shard's sha256. The stream is stored losslessly compressed: its
high bytes (sign + exponent, few distinct values) zlib-compressed, then the low bytes (mantissa,
incompressible) raw, which brings 136 MB of bf16 to about 70%; the blob is cut into shards of
SHARD_BYTES.
`part N/M` writes index.json plus only the shards of part N (contiguous ranges), so M commands,
each under the 64 MiB / 8 files / 16 MiB-per-file return limit, fetch everything (M = 2 for the
large target). Reading them back needs only the standard library and numpy/torch.
"""
from __future__ import annotations

import hashlib
import json
import math
import zlib
from pathlib import Path

import torch

SHARD_BYTES = 15 * 2**20
PART_LIMIT_BYTES = 64 * 2**20 - 2**20  # what one command may bring back, less room for index/logs
PART_LIMIT_FILES = 7                   # 8 files per command, one is index.json


def parse_part(part: str) -> tuple[int, int]:
    n, m = (int(x) for x in part.split("/"))
    if not 1 <= n <= m:
        raise ValueError(f"bad part {part!r}")
    return n, m


def _compress(data: bytes) -> tuple[bytes, dict]:
    import numpy as np

    u = np.frombuffer(data, dtype=np.uint8).reshape(-1, 2)  # little-endian bf16: [low, high]
    hi = zlib.compress(u[:, 1].tobytes(), 6)
    lo = u[:, 0].tobytes()  # mantissa bytes: incompressible, stored raw
    return hi + lo, {"codec": "bf16-planes: zlib(high bytes) then raw low bytes",
                     "high_bytes": len(hi), "low_bytes": len(lo)}


def _decompress(blob: bytes, codec: dict) -> bytes:
    import numpy as np

    if codec["codec"] == "raw":
        return blob
    hi = np.frombuffer(zlib.decompress(blob[:codec["high_bytes"]]), dtype=np.uint8)
    lo = np.frombuffer(blob[codec["high_bytes"]:], dtype=np.uint8)
    return np.stack([lo, hi], axis=1).tobytes()


def _stream(sd: dict) -> tuple[bytes, list[dict]]:
    chunks, entries, off = [], [], 0
    for name in sorted(sd):
        t = sd[name].detach().to("cpu", torch.bfloat16).contiguous()
        b = t.view(torch.int16).numpy().tobytes()
        entries.append({"name": name, "shape": list(t.shape), "offset": off, "nbytes": len(b)})
        chunks.append(b)
        off += len(b)
    return b"".join(chunks), entries


def shard_plan(total_bytes: int, parts: int) -> tuple[int, list[range]]:
    n_shards = max(1, math.ceil(total_bytes / SHARD_BYTES))
    ranges = [range((i * n_shards) // parts, ((i + 1) * n_shards) // parts) for i in range(parts)]
    worst = max(len(r) for r in ranges)
    if worst * SHARD_BYTES > PART_LIMIT_BYTES or worst > PART_LIMIT_FILES:
        need = math.ceil(n_shards / min(PART_LIMIT_FILES, PART_LIMIT_BYTES // SHARD_BYTES))
        raise ValueError(f"{n_shards} shards of {SHARD_BYTES >> 20} MiB do not fit {parts} parts; use at least {need}")
    return n_shards, ranges


def export_state(sd: dict, out: Path, part: str = "1/1", meta: dict | None = None,
                 compress: bool = True) -> list[Path]:
    """Write part N/M of the shards (and index.json) into out; part "all/M": every part, each into
    out/part<N>/ (so a later command only copies one directory)."""
    every = part.startswith("all/")
    m = int(part.split("/")[1]) if every else parse_part(part)[1]
    data, entries = _stream(sd)
    blob, codec = _compress(data) if compress else (data, {"codec": "raw"})
    n_shards, ranges = shard_plan(len(blob), m)
    names = [f"shard-{i + 1:03d}-of-{n_shards:03d}.bin" for i in range(n_shards)]
    shards = [blob[i * SHARD_BYTES:(i + 1) * SHARD_BYTES] for i in range(n_shards)]
    index = {
        "format": "ds4tools demo_large bf16 shards v1: concatenate the shards, undo the codec, then "
                  "each tensor is nbytes of little-endian bf16 at offset, C order",
        "codec": codec, "blob_bytes": len(blob),
        "dtype": "bfloat16", "total_bytes": len(data), "shard_bytes": SHARD_BYTES,
        "shards": [{"file": f, "bytes": len(s), "sha256": hashlib.sha256(s).hexdigest(),
                    "part": next(j + 1 for j, r in enumerate(ranges) if i in r)}
                   for i, (f, s) in enumerate(zip(names, shards))],
        "parts": m, "stream_sha256": hashlib.sha256(data).hexdigest(),
        "tensors": entries, "meta": meta or {},
    }
    written = []
    for n in range(1, m + 1) if every else [parse_part(part)[0]]:
        d = out / f"part{n}" if every else out
        d.mkdir(parents=True, exist_ok=True)
        for i in ranges[n - 1]:
            p = d / names[i]
            p.write_bytes(shards[i])
            written.append(p)
        (d / "index.json").write_text(json.dumps(index, indent=1) + "\n")
        written.append(d / "index.json")
    return written


def assemble(dirs: list[Path]) -> tuple[dict, dict]:
    """State dict (bf16 tensors) from shard directories (each may hold any subset of the shards)."""
    index = None
    for d in dirs:
        if (d / "index.json").exists():
            index = json.loads((d / "index.json").read_text())
            break
    if index is None:
        raise FileNotFoundError("no index.json in " + ", ".join(map(str, dirs)))
    parts = []
    for s in index["shards"]:
        found = [d / s["file"] for d in dirs if (d / s["file"]).exists()]
        if not found:
            raise FileNotFoundError(f"missing {s['file']} (part {s['part']} of {index['parts']})")
        b = found[0].read_bytes()
        if hashlib.sha256(b).hexdigest() != s["sha256"]:
            raise ValueError(f"{found[0]}: sha256 mismatch")
        parts.append(b)
    data = _decompress(b"".join(parts), index.get("codec", {"codec": "raw"}))
    if hashlib.sha256(data).hexdigest() != index["stream_sha256"]:
        raise ValueError("stream sha256 mismatch")
    buf = bytearray(data)
    sd = {}
    for e in index["tensors"]:
        t = torch.frombuffer(buf, dtype=torch.bfloat16, offset=e["offset"], count=e["nbytes"] // 2)
        sd[e["name"]] = t.view(e["shape"]).clone()
    return sd, index


def export_from_workdir(work: Path, out: Path, part: str = "1/1", source: str = "ckpt") -> list[Path]:
    from .model import LARGE_SHAPE

    ck = torch.load(work / ("ckpt.pt" if source == "ckpt" else "final.pt"), map_location="cpu",
                    weights_only=False)
    model_sd = ck["model"]
    shape = (ck.get("plan") or {}).get("shape") or LARGE_SHAPE.as_dict()  # a tiny test shape, too
    prefix = f"model.layers.{shape['num_hidden_layers']}."
    sd = {k: v for k, v in model_sd.items() if not k.startswith(prefix)}
    st = ck.get("state", {})
    meta = {"shape": shape, "step": st.get("step"), "plan": ck.get("plan"),
            "tokens_seen": st.get("tokens_seen"),
            "excluded": f"{prefix}* (the NextN/MTP layer, trained later)",
            "last_eval": (st.get("heldout_history") or [None])[-1]}
    written = export_state(sd, out, part, meta)
    total = sum(p.stat().st_size for p in written)
    print(f"export: part {part}: {len(written)} files, {total:,} bytes -> {out}", flush=True)
    return written


def assemble_cli(dirs: list[Path], out: Path | None, check: Path | None) -> int:
    sd, index = assemble(dirs)
    n = sum(t.numel() for t in sd.values())
    print(f"assemble: {len(sd)} tensors, {n:,} parameters, step {index['meta'].get('step')}")
    if out is not None:
        torch.save(sd, out)
        print(f"assemble: wrote {out}")
    if check is not None:
        ck = torch.load(check, map_location="cpu", weights_only=False)["model"]
        bad = [k for k, v in sd.items() if not torch.equal(v, ck[k].to(torch.bfloat16))]
        mtp = f"model.layers.{index['meta']['shape']['num_hidden_layers']}."
        missing = [k for k in ck if k not in sd and not k.startswith(mtp)]
        print(f"assemble: check against {check}: {len(sd) - len(bad)}/{len(sd)} tensors equal in bf16, "
              f"{len(missing)} trunk tensors missing")
        return 1 if bad or missing else 0
    return 0
