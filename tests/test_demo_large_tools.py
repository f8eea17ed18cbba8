"""tools/train_demo_large.py and tools/demo_large/: shards, corpus rules, resumable training.

Everything runs on tiny shapes in tmp_path: the corpus tests read a fake site-packages tree (never
the environment's), and training uses a 2-layer, hidden-32, vocab-64 model on random tokens.
"""
from __future__ import annotations

import hashlib
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

TOOLS = Path(__file__).resolve().parents[1] / "tools"
if str(TOOLS) not in sys.path:
    sys.path.insert(0, str(TOOLS))

import train_demo_large  # noqa: E402
from demo.model import TargetShape  # noqa: E402
from demo_large import corpus, shards  # noqa: E402
from demo_large.model import LARGE_SHAPE, size_arithmetic  # noqa: E402

# --------------------------------------------------------------------------------------------
# shards

#: bf16 bit patterns at the edges: +-0, +-inf, NaNs (quiet, signalling, negative, with payload),
#: subnormals (smallest, largest, negative), smallest normal, largest finite, -1, 1
EDGE_BITS = [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFFC0, 0x7F81, 0xFFFF, 0x7FC1, 0x0001,
             0x8001, 0x007F, 0x807F, 0x0080, 0x8080, 0x7F7F, 0xFF7F, 0xBF80, 0x3F80]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def _edge_state_dict() -> dict:
    g = torch.Generator().manual_seed(0)
    edge = torch.tensor([b - 0x10000 if b >= 0x8000 else b for b in EDGE_BITS], dtype=torch.int16)
    random_bits = torch.randint(-32768, 32768, (37, 61), generator=g, dtype=torch.int32).to(torch.int16)
    return {
        "b.edges": edge.view(torch.bfloat16).reshape(1, -1),
        "a.random_bits": random_bits.view(torch.bfloat16),       # every kind of value, incompressible
        "c.weights": (torch.randn(48, 32, generator=g) * 0.02).to(torch.bfloat16),
        "d.norm": torch.ones(32, dtype=torch.bfloat16),
        "e.scalar": torch.tensor(-2.5, dtype=torch.bfloat16),
        "f.fp32": torch.randn(5, 7, 3, generator=g),              # exported as bf16 (round to nearest)
    }


@pytest.fixture
def small_shards(monkeypatch):
    """1000-byte shards, so a few KiB of weights spread over many shards and several parts."""
    monkeypatch.setattr(shards, "SHARD_BYTES", 1000)
    return shards


@pytest.mark.parametrize("compress", [True, False])
def test_shards_roundtrip_bit_identical(small_shards, tmp_path, compress):
    sd = _edge_state_dict()
    written = small_shards.export_state(sd, tmp_path, "all/3", meta={"step": 7}, compress=compress)
    dirs = [tmp_path / f"part{n}" for n in (1, 2, 3)]
    index = json.loads((dirs[0] / "index.json").read_text())
    n_shards = len(index["shards"])
    assert n_shards >= 6, "the test should spread the weights over many shards"
    assert index["codec"]["codec"] == ("raw" if not compress else index["codec"]["codec"])
    assert len(written) == n_shards + 3  # every shard once, one index per part
    for n, d in enumerate(dirs, 1):
        files = sorted(p.name for p in d.iterdir())
        mine = sorted(s["file"] for s in index["shards"] if s["part"] == n)
        assert files == sorted(mine + ["index.json"])
        assert mine, f"part {n} got no shard"
        assert len(mine) <= small_shards.PART_LIMIT_FILES
        assert json.loads((d / "index.json").read_text()) == index
        for f in mine:
            assert (d / f).stat().st_size <= small_shards.SHARD_BYTES
    parts = [s["part"] for s in index["shards"]]
    assert parts == sorted(parts), "parts are contiguous ranges of shards"

    for order in (dirs, dirs[::-1]):
        back, idx = small_shards.assemble(order)
        assert idx["meta"] == {"step": 7}
        assert list(back) == sorted(sd)
        for name, t in sd.items():
            want = t.to(torch.bfloat16)
            assert back[name].dtype == torch.bfloat16
            assert back[name].shape == t.shape, name
            assert torch.equal(_bits(back[name]), _bits(want)), name
    # the edge values themselves (NaN payloads and signed zeros included)
    got = _bits(back["b.edges"]).flatten().tolist()
    assert [b & 0xFFFF for b in got] == EDGE_BITS


def test_shards_single_part_and_partial_export(small_shards, tmp_path):
    sd = _edge_state_dict()
    small_shards.export_state(sd, tmp_path / "p2", "2/3")
    index = json.loads((tmp_path / "p2" / "index.json").read_text())
    on_disk = sorted(p.name for p in (tmp_path / "p2").iterdir() if p.name != "index.json")
    assert on_disk == sorted(s["file"] for s in index["shards"] if s["part"] == 2)
    with pytest.raises(FileNotFoundError, match=r"missing shard-001-of-\d+\.bin \(part 1 of 3\)"):
        small_shards.assemble([tmp_path / "p2"])
    small_shards.export_state(sd, tmp_path / "p1", "1/3")
    small_shards.export_state(sd, tmp_path / "p3", "3/3")
    back, _ = small_shards.assemble([tmp_path / "p1", tmp_path / "p2", tmp_path / "p3"])
    assert all(torch.equal(_bits(back[k]), _bits(v.to(torch.bfloat16))) for k, v in sd.items())
    with pytest.raises(FileNotFoundError, match="no index.json"):
        small_shards.assemble([tmp_path / "nowhere"])
    with pytest.raises(ValueError, match="bad part"):
        small_shards.export_state(sd, tmp_path / "bad", "4/3")


def test_shards_corruption_is_caught(small_shards, tmp_path):
    sd = _edge_state_dict()
    small_shards.export_state(sd, tmp_path, "all/2")
    dirs = [tmp_path / "part1", tmp_path / "part2"]
    index = json.loads((dirs[0] / "index.json").read_text())
    victim = index["shards"][len(index["shards"]) // 2]
    path = tmp_path / f"part{victim['part']}" / victim["file"]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=rf"{victim['file']}: sha256 mismatch"):
        small_shards.assemble(dirs)
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    small_shards.assemble(dirs)  # repaired: reads again

    # a consistent-looking index whose stream checksum disagrees is caught after decoding
    index["stream_sha256"] = hashlib.sha256(b"something else").hexdigest()
    for d in dirs:
        (d / "index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="stream sha256 mismatch"):
        small_shards.assemble(dirs)


def test_shards_part_limits_enforced(small_shards, monkeypatch, tmp_path):
    S = small_shards.SHARD_BYTES
    assert small_shards.shard_plan(7 * S, 1)[0] == 7  # 7 files per part is the limit
    with pytest.raises(ValueError, match="8 shards .* do not fit 1 parts; use at least 2"):
        small_shards.shard_plan(7 * S + 1, 1)
    n, ranges = small_shards.shard_plan(7 * S + 1, 2)
    assert n == 8 and [len(r) for r in ranges] == [4, 4]
    with pytest.raises(ValueError, match="use at least 3"):
        small_shards.shard_plan(15 * S, 2)
    monkeypatch.setattr(small_shards, "PART_LIMIT_BYTES", 3 * S)  # now bytes bind before files
    small_shards.shard_plan(3 * S, 1)
    with pytest.raises(ValueError, match="use at least 2"):
        small_shards.shard_plan(3 * S + 1, 1)
    # export refuses before writing anything
    sd = {"w": torch.randint(-32768, 32768, (4000,), dtype=torch.int32).to(torch.int16).view(torch.bfloat16)}
    with pytest.raises(ValueError, match="do not fit 1 parts"):
        small_shards.export_state(sd, tmp_path / "out", "1/1", compress=False)
    assert not (tmp_path / "out").exists()


def test_shards_real_limits_arithmetic():
    """With the real constants every accepted plan fits one command's return limits."""
    S, limit, files = shards.SHARD_BYTES, shards.PART_LIMIT_BYTES, shards.PART_LIMIT_FILES
    assert files <= 7 and limit < 64 * 2**20 and S <= 16 * 2**20
    bf16 = size_arithmetic()["bf16_bytes"]
    for total in (1, S, S + 1, 4 * S, 4 * S + 1, int(0.7 * bf16), bf16, 30 * S):
        for parts in (1, 2, 3, 4):
            try:
                n, ranges = shards.shard_plan(total, parts)
            except ValueError:
                n_shards = math.ceil(total / S)
                assert max(len(range((i * n_shards) // parts, ((i + 1) * n_shards) // parts))
                           for i in range(parts)) * S > limit or n_shards > parts * files
                continue
            assert sum(len(r) for r in ranges) == n and n * S >= total
            assert all(len(r) <= files and len(r) * S <= limit for r in ranges)


# --------------------------------------------------------------------------------------------
# corpus: license rules, hold-out rule, dedup and filters on a fake site-packages


def _dist(root: Path, name: str, meta: list[str], files: dict[str, bytes], version: str = "1.0",
          license_text: str | None = None):
    info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    lines = ["Metadata-Version: 2.4", f"Name: {name}", f"Version: {version}", *meta]
    (info / "METADATA").write_text("\n".join(lines) + "\n\n")
    record = [f"{info.name}/METADATA,,"]
    if license_text is not None:
        (info / "licenses").mkdir()
        (info / "licenses" / "LICENSE").write_text(license_text)
        record.append(f"{info.name}/licenses/LICENSE,,")
    for rel, data in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        record.append(f"{rel},,")
    (info / "RECORD").write_text("\n".join(record) + "\n")
    import importlib.metadata as md

    return md.PathDistribution(info)


CLS = "Classifier: License :: OSI Approved :: "
LICENSE_CASES = [
    (["License-Expression: MIT"], True),
    (["License-Expression: BSD-3-Clause"], True),
    (["License-Expression: Apache-2.0"], True),
    (["License-Expression: (MIT OR Apache-2.0) AND BSD-3-Clause"], True),
    (["License-Expression: Apache-2.0 WITH LLVM-exception"], True),
    (["License: MIT"], True),
    (["License: BSD"], True),
    (["License: Apache 2.0"], True),
    (["License: BSD-3-Clause"], True),                            # SPDX in the old field
    ([CLS + "MIT License"], True),
    ([CLS + "BSD License", CLS + "Apache Software License"], True),
    (["License: Copyright (c) 2020 Someone\n        Permission is hereby granted, free of charge",
      CLS + "MIT License"], True),                                # full text in License: -> classifiers
    (["License-Expression: GPL-3.0-or-later"], False),
    (["License-Expression: MPL-2.0"], False),
    (["License-Expression: LGPL-2.1-only"], False),
    (["License-Expression: MIT AND GPL-2.0-only"], False),
    (["License: GPL"], False),
    (["License: UNKNOWN"], False),
    ([CLS + "GNU General Public License v3 (GPLv3)"], False),
    ([CLS + "Mozilla Public License 2.0 (MPL 2.0)"], False),
    ([CLS + "MIT License", CLS + "GNU General Public License v2 (GPLv2)"], False),
    (["Classifier: Programming Language :: Python :: 3"], False),  # no license classifier at all
    ([], False),
]


@pytest.mark.parametrize("meta,ok", LICENSE_CASES, ids=[f"{i}-{'ok' if o else 'no'}" for i, (_, o) in
                                                        enumerate(LICENSE_CASES)])
def test_license_decision(tmp_path, meta, ok):
    dist = _dist(tmp_path, "pkg", meta, {})
    lic = corpus.license_of(dist)
    assert lic["permissive"] is ok, lic["basis"]
    if not meta:
        assert lic["basis"] == "no license metadata"


def test_license_prefers_expression_and_reads_license_file(tmp_path):
    dist = _dist(tmp_path, "pkg", ["License-Expression: GPL-2.0-only", "License: MIT", CLS + "MIT License",
                                   "License-File: LICENSE"], {}, license_text="GPL text here\n")
    lic = corpus.license_of(dist)
    assert lic["permissive"] is False and lic["basis"] == "License-Expression: GPL-2.0-only"
    assert lic["license_text_head"] == "GPL text here\n"
    assert lic["license_text_sha256"] == hashlib.sha256(b"GPL text here\n").hexdigest()


def _md5_rule(key: str) -> bool:
    return int(hashlib.md5(key.encode()).hexdigest(), 16) % 100 < corpus.HELDOUT_PERCENT


def test_heldout_rule_is_a_path_hash():
    keys = [f"pkg{i % 37}/mod/file{i}.py" for i in range(20000)]
    flags = [corpus.is_heldout(k) for k in keys]
    assert flags == [_md5_rule(k) for k in keys]
    assert flags == [corpus.is_heldout(k) for k in keys]  # deterministic
    assert 0.015 < sum(flags) / len(flags) < 0.025
    assert corpus.heldout_key("my-pkg", "my_pkg/a.py") == "my-pkg/my_pkg/a.py"


def _first(pred, fmt: str) -> str:
    return next(fmt.format(i) for i in range(100000) if pred(fmt.format(i)))


def _code(tag: str, n: int = 6) -> bytes:
    body = "".join(f"    value_{j} = compute_{tag}({j}, name='{tag}')\n" for j in range(n))
    return f"def {tag}():\n{body}    return value_0\n\n\nclass {tag.title()}Thing:\n    pass\n".encode()


@pytest.fixture
def fake_site(tmp_path):
    root = tmp_path / "site-packages"
    root.mkdir()
    held = _first(lambda r: _md5_rule("alpha/" + r), "alpha/held_{}.py")
    kept = _first(lambda r: not _md5_rule("alpha/" + r), "alpha/kept_{}.py")
    beta_held = _first(lambda r: _md5_rule("beta-pkg/" + r), "beta_pkg/h{}.py")
    shared = _code("shared")
    _dist(root, "alpha", ["License-Expression: MIT"], {
        "alpha/__init__.py": _code("init"),
        "alpha/core.py": shared,
        held: _code("held"),
        kept: _code("kept"),
        "alpha/zz_again.py": shared,                         # duplicate inside the same dist
        "alpha/tests/helpers.py": _code("t1"),             # excluded dir
        "alpha/_vendor/six.py": _code("t2"),
        "alpha/sub/vendored/x.py": _code("t3"),
        "alpha/test_core.py": _code("t4"),                 # test files
        "alpha/core_test.py": _code("t5"),
        "alpha/conftest.py": _code("t6"),
        "alpha/empty.py": b"\n  \n",
        "alpha/crlf.py": _code("t7").replace(b"\n", b"\r\n"),
        "alpha/gen_pb2.py": b"# Generated by the protocol buffer compiler.  DO NOT EDIT!\n" + _code("t8"),
        "alpha/long.py": b"x = '" + b"a" * 2500 + b"'\n",
        "alpha/latin1.py": b"s = '\xe9'\n",
        "alpha/data.txt": b"not python\n",
    })
    _dist(root, "Beta_Pkg", [CLS + "BSD License"], {
        "beta_pkg/copy_of_core.py": shared,                # duplicate of alpha/core.py (alpha first)
        "beta_pkg/own.py": _code("beta"),
        beta_held: _code("bheld"),
        "beta_pkg/testing/util.py": _code("t9"),
    })
    _dist(root, "gamma", ["License-Expression: GPL-3.0-only"], {"gamma/mod.py": _code("gamma")})
    _dist(root, "delta", ["License-Expression: MPL-2.0"], {"delta/mod.py": _code("delta")})
    _dist(root, "epsilon", [], {"epsilon/mod.py": _code("epsilon")})
    _dist(root, "ds4tools", ["License-Expression: MIT"], {"ds4tools/mod.py": _code("ds4")})
    return {"root": root, "held": held, "kept": kept, "beta_held": beta_held, "shared": shared}


def test_gather_on_fake_site_packages(fake_site):
    g = corpus.gather(log=lambda *a: None, root=fake_site["root"])
    assert Path(g["root"]) == fake_site["root"].resolve()
    keys = sorted(f["key"] for f in g["files"])
    assert keys == sorted([
        "alpha/alpha/__init__.py", "alpha/alpha/core.py", "alpha/" + fake_site["held"],
        "alpha/" + fake_site["kept"], "beta-pkg/beta_pkg/own.py", "beta-pkg/" + fake_site["beta_held"],
    ])
    for f in g["files"]:
        assert f["heldout"] is _md5_rule(f["key"]) is corpus.is_heldout(f["key"])
        assert f["bytes"] == len((fake_site["root"] / f["rel"]).read_bytes())
    flags = {f["key"]: f["heldout"] for f in g["files"]}
    assert flags["alpha/" + fake_site["held"]] and flags["beta-pkg/" + fake_site["beta_held"]]
    assert not flags["alpha/" + fake_site["kept"]]
    # dedup: exact duplicates dropped, the first in (dist name, path) order kept
    assert g["stats"]["duplicates"] == 2
    assert g["stats"]["duplicate_bytes"] == 2 * len(fake_site["shared"])
    assert "alpha/alpha/core.py" in keys
    assert g["stats"]["rejected"] == {"excluded_dir": 4, "test_file": 3, "empty": 1, "crlf": 1,
                                      "generated": 1, "long_lines": 1, "not_utf8": 1}
    pk = {p["name"]: p for p in g["packages"]}
    assert set(pk) == {"alpha", "Beta_Pkg", "gamma", "delta", "epsilon", "ds4tools"}
    for name in ("gamma", "delta", "epsilon"):
        assert pk[name]["excluded"] == "license not on the permissive list" and pk[name]["files_kept"] == 0
    assert "project itself" in pk["ds4tools"]["excluded"]
    assert "excluded" not in pk["alpha"] and pk["alpha"]["files_kept"] == 4
    assert pk["Beta_Pkg"]["files_kept"] == 2
    assert not any(f["package"] in ("gamma", "delta", "epsilon", "ds4tools") for f in g["files"])
    # deterministic: the same tree gives the same answer
    assert corpus.gather(log=lambda *a: None, root=fake_site["root"])["files"] == g["files"]


def test_build_writes_the_training_format(fake_site, tmp_path):
    pytest.importorskip("tokenizers")
    out = tmp_path / "data"
    info = corpus.build(out, vocab_size=300, max_train_tokens=10**9, tokenizer_sample_bytes=10**6,
                        log=lambda *a: None, root=fake_site["root"])
    root = fake_site["root"]
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.get_vocab_size() == 300 and tok.token_to_id("<|endoftext|>") == 0
    held = json.loads((out / "heldout_bytes.json").read_text())
    npz = np.load(out / "heldout_tokens.npz")
    held_keys = (out / "heldout_files.txt").read_text().split()
    assert held_keys == sorted(["alpha/" + fake_site["held"], "beta-pkg/" + fake_site["beta_held"]])
    assert [f["key"] for f in held["files"]] == held_keys and sorted(npz.files) == ["f0000", "f0001"]
    for i, f in enumerate(held["files"]):
        a = npz[f"f{i:04d}"]
        assert a.dtype == np.uint16 and a[-1] == 0 and len(a) == f["tokens"]
        rel = f["key"].split("/", 1)[1]
        assert f["bytes"] == (root / rel).stat().st_size
        assert tok.decode(a[:-1].tolist()) == (root / rel).read_text()  # lossless byte-level BPE
    assert held["total_bytes"] == sum(f["bytes"] for f in held["files"])
    train_tokens = np.fromfile(out / "train_tokens.bin", dtype=np.uint16)
    train_keys = (out / "train_files.txt").read_text().split()
    assert sorted(train_keys) == sorted(["alpha/alpha/__init__.py", "alpha/alpha/core.py",
                                         "alpha/" + fake_site["kept"], "beta-pkg/beta_pkg/own.py"])
    assert int((train_tokens == 0).sum()) == len(train_keys)  # one <|endoftext|> per file
    assert info["train"]["tokens"] == len(train_tokens) and info["dedup"]["duplicates_dropped"] == 2
    assert not set(train_keys) & set(held_keys)

    # the token cap drops whole files from the end of the fixed order
    capped = corpus.build(tmp_path / "capped", vocab_size=300, max_train_tokens=len(train_tokens) - 1,
                          tokenizer_sample_bytes=10**6, log=lambda *a: None, root=root)
    capped_keys = (tmp_path / "capped" / "train_files.txt").read_text().split()
    assert capped_keys == train_keys[:len(capped_keys)] and len(capped_keys) < len(train_keys)
    capped_tokens = np.fromfile(tmp_path / "capped" / "train_tokens.bin", dtype=np.uint16)
    assert np.array_equal(capped_tokens, train_tokens[:len(capped_tokens)])
    assert capped["train"]["dropped_files"] == len(train_keys) - len(capped_keys)


# --------------------------------------------------------------------------------------------
# training: tiny shape, stop and resume

TINY = TargetShape(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=32, intermediate_size=64, max_position_embeddings=1024)


def _write_data(d: Path, n_train: int = 6000, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    d.mkdir(parents=True)
    toks = rng.integers(2, TINY.vocab_size, size=n_train).astype(np.uint16)
    toks[rng.integers(0, n_train, size=n_train // 200)] = 0  # file separators
    toks.tofile(d / "train_tokens.bin")
    held = [np.append(rng.integers(2, TINY.vocab_size, size=n), 0).astype(np.uint16) for n in (30, 90, 1100)]
    np.savez(d / "heldout_tokens.npz", **{f"f{i:04d}": a for i, a in enumerate(held)})
    files = [{"key": f"pkg/m{i}.py", "bytes": 3 * len(a), "tokens": len(a)} for i, a in enumerate(held)]
    (d / "heldout_bytes.json").write_text(json.dumps({
        "files": files, "total_bytes": sum(f["bytes"] for f in files),
        "total_tokens": sum(f["tokens"] for f in files)}))
    return d


def _train(work: Path, data: Path, *extra: str) -> dict:
    from demo_large.train import train

    args = train_demo_large.parse_args([
        "train", "--workdir", str(work), "--data", str(data), "--device", "cpu", "--seq", "16",
        "--batch-tokens", "64", "--micro-batch", "2", "--eval-tokens", "0", *extra])
    return train(args, shape=TINY)


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("demo_large_train")
    data = _write_data(base / "data")
    m1 = _train(base / "resumed", data, "--max-steps", "2", "--total-steps", "8")
    m2 = _train(base / "resumed", data, "--max-steps", "4", "--seq", "32")  # --total-steps auto: kept
    ref = _train(base / "straight", data, "--max-steps", "4", "--total-steps", "8")
    return {"base": base, "data": data, "m1": m1, "m2": m2, "ref": ref}


def test_train_stop_and_resume(tiny_runs):
    m1, m2, ref = tiny_runs["m1"], tiny_runs["m2"], tiny_runs["ref"]
    work = tiny_runs["base"] / "resumed"
    assert m1["step"] == 2 and m1["total_steps"] == 8 and not m1["finished"]
    assert m1["shape"] == TINY.as_dict() and m1["plan"]["shape"] == TINY.as_dict()
    # the step count continues; the schedule (and the rest of the plan) is the first run's
    assert m2["step"] == 4 and m2["total_steps"] == 8 and m2["plan"]["total_steps"] == 8
    assert m2["plan"] == m1["plan"] and m2["plan"]["seq"] == 16  # --seq 32 on resume is ignored
    assert m2["tokens_seen"] == 4 * 64
    assert [(s["start_step"], s["end_step"], s["stop"]) for s in m2["sessions"]] == [
        (0, 2, "--max-steps"), (2, 4, "--max-steps")]
    log = (work / "log.txt").read_text()
    assert "resumed at step 2 of 8" in log and "--seq 32 ignored" in log
    # loss history: continuous (steps only go up, nothing lost or repeated across the restart)
    steps = [h[0] for h in m2["loss_history"]]
    assert steps[:3] == [1, 2, 3] and steps == sorted(set(steps)) and set(steps) <= {1, 2, 3, 4}
    assert m2["loss_history"][:2] == m1["loss_history"][:2]
    assert all(math.isfinite(h[1]) and 0 < h[1] < 10 for h in m2["loss_history"])
    # ... and the same as an uninterrupted run: same batches, optimizer state and weights
    ref_losses = {h[0]: h[1] for h in ref["loss_history"]}
    for step, loss, _ in m2["loss_history"]:
        if step in ref_losses:
            assert loss == pytest.approx(ref_losses[step], abs=2e-4), step
    ck = torch.load(work / "ckpt.pt", map_location="cpu", weights_only=False)
    ck_ref = torch.load(tiny_runs["base"] / "straight" / "ckpt.pt", map_location="cpu", weights_only=False)
    assert ck["state"]["step"] == 4
    for k, v in ck_ref["model"].items():
        assert torch.allclose(ck["model"][k], v, rtol=0, atol=1e-6), k
    # the held-out evaluation: one final per session, bits/byte consistent with the loss
    fin = m2["heldout_final"]
    assert fin["step"] == 4 and fin["tag"] == "final" and fin["files"] == 3
    assert fin["file_tokens"] == 31 + 91 + 1101 and fin["bytes"] == 3 * fin["file_tokens"]
    assert fin["scored_tokens"] == fin["file_tokens"] - 3
    assert fin["bits_per_byte"] == pytest.approx(fin["loss"] / (3 * math.log(2)), rel=1e-3)
    assert 0 < fin["bits_per_byte"] < 8 / 3 * 1.5
    assert [(h["step"], h["tag"]) for h in m2["heldout_history"]] == [(2, "final"), (4, "final")]
    assert json.loads((work / "metrics.json").read_text())["heldout_final"] == fin


def test_train_exports_the_trunk(tiny_runs):
    work = tiny_runs["base"] / "resumed"
    dirs = [work / "export" / "part1", work / "export" / "part2"]
    sd, index = shards.assemble(dirs)
    ck = torch.load(work / "ckpt.pt", map_location="cpu", weights_only=False)
    mtp = f"model.layers.{TINY.num_hidden_layers}."
    assert sorted(sd) == sorted(k for k in ck["model"] if not k.startswith(mtp))
    assert any(k.startswith(mtp) for k in ck["model"])  # the NextN layer exists but is not shipped
    for k, v in sd.items():
        assert torch.equal(_bits(v), _bits(ck["model"][k].to(torch.bfloat16))), k
    assert index["meta"]["step"] == 4 and index["meta"]["shape"] == TINY.as_dict()
    assert shards.assemble_cli(dirs, work / "state.pt", work / "ckpt.pt") == 0
    assert sorted(torch.load(work / "state.pt")) == sorted(sd)


def test_train_resume_guards(tiny_runs, tmp_path):
    import shutil

    work = tmp_path / "w"
    shutil.copytree(tiny_runs["base"] / "resumed", work)
    with pytest.raises(SystemExit, match="--total-steps 3 is below the checkpoint's step 4"):
        _train(work, tiny_runs["data"], "--total-steps", "3")
    other = _write_data(tmp_path / "other", n_train=5000)
    with pytest.raises(SystemExit, match="differs from the one this checkpoint was trained on"):
        _train(work, other)


def test_large_shape_arithmetic():
    s = size_arithmetic()
    assert LARGE_SHAPE.num_hidden_layers == 12 and LARGE_SHAPE.vocab_size == 16384
    assert s["parameters"] == s["matrices"] + s["norm_weights"]
    assert s["q8_0_bytes"] >= s["q8_0_min_bytes"]
    assert s["bf16_bytes"] == 2 * s["parameters"]
