"""What the engine tests of the families with a committed llama.cpp fixture share
(tests/test_engine_{glm4moe,deepseek2,glm_dsa,deepseek4}.py): the fixture, the synthetic files
rewritten from its seed, the engine mode each case runs in, and the checks every family makes
(logits and greedy continuations against llama.cpp, one-line errors for bad files, `run`
printing what the API generates).

The fixtures are captured by tools/capture_llamacpp_fixtures.py (llama-cpp-python is not in
CI); ``weights_digest`` ties each to the very files it ran.
"""
from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest
from click.testing import CliRunner

from ds4tools.cli import main
from ds4tools.engine import Engine
from ds4tools.engine.generate import decode
from ds4tools.engine.sampling import Sampler
from ds4tools.errors import InvalidContentError

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "llamacpp")
SEED = 0  # tools/capture_llamacpp_fixtures.py's


def weights_digest(path) -> str:
    """sha256 over every tensor's name, type, shape and bytes (not the metadata)."""
    from ds4tools.gguf_io.reader import open_gguf
    h = hashlib.sha256()
    f = open_gguf(path)
    try:
        for name in sorted(f.tensors):
            t = f.tensors[name]
            h.update(f"{name}:{t.type_name}:{t.shape}".encode())
            h.update(np.asarray(t.raw()).tobytes())
    finally:
        f.close()
    return h.hexdigest()


def load_fixture(arch: str) -> dict:
    with np.load(os.path.join(FIXTURES, f"{arch}.npz")) as f:
        return {k: f[k] for k in f.files}


def write_cases(directory, cases, write_case) -> dict:
    """Every case's file under ``directory``, from the fixture's seed: case -> path."""
    paths = {}
    for case in cases:
        paths[case] = directory / f"{case}.gguf"
        write_case(paths[case], case, SEED)
    return paths


def engine_for(path, weight_type: str, **kw) -> Engine:
    # F32: the exact float32 path; Q8_0: ggml's int8-activation path on every matrix, as llama.cpp
    return Engine(path, exact=True, **kw) if weight_type == "F32" else Engine(path, int8="all", **kw)


def logits_against_llama_cpp(eng: Engine, path, fixture: dict, case: str, arch: str):
    """(ours, theirs) for the fixture's prompt, after checking the file is the one it ran."""
    assert weights_digest(path) == str(fixture[f"{case}/digest"]), \
        f"the synthetic model changed: rerun tools/capture_llamacpp_fixtures.py {arch}"
    ours = eng.forward(fixture[f"{case}/prompt"], 0).logits
    theirs = fixture[f"{case}/logits"]
    assert ours.shape == theirs.shape
    return ours, theirs


def greedy_continuation(eng: Engine, fixture: dict, case: str, n: int | None = None) -> list:
    """``n`` greedy tokens after the fixture's prompt (as many as llama.cpp's by default)."""
    prompt = fixture[f"{case}/prompt"].tolist()
    n = len(fixture[f"{case}/greedy"]) if n is None else n
    return list(decode(eng.model, prompt, n, Sampler(0.0), np.random.default_rng(0)))


def assert_one_line_error(path, message: str) -> None:
    """Loading ``path`` fails with ``message`` naming the file: from the API, and from `run`
    as one line on stderr with exit code 1."""
    with pytest.raises(InvalidContentError) as e:
        Engine(path)
    assert str(e.value).startswith(f"{path}: {message}")
    r = CliRunner().invoke(main, ["run", "-m", str(path), "-p", "hello"])
    assert r.exit_code == 1
    assert r.stderr.startswith(f"ds4tools: {path}: {message}") and r.stderr.count("\n") == 1


def assert_run_prints_what_the_api_generates(path, prompt: str = "the model reads", n: int = 8):
    r = CliRunner().invoke(main, ["run", "-m", str(path), "-p", prompt, "-n", str(n), "--temp", "0"])
    assert r.exit_code == 0, r.stderr
    text = "".join(t.text for t in Engine(path).generate(prompt, n, temperature=0))
    assert r.stdout == text + "\n"


def batched_single_and_chunked(path, tokens, **kw):
    """Logits of ``tokens`` as one batch, one token at a time and in chunks of 4, each on a
    fresh engine; and the batched engine (for what its workspace shows of the batch)."""
    batched = Engine(path, **kw)
    whole = batched.forward(tokens, 0).logits
    one = Engine(path, **kw)
    single = np.concatenate([one.forward([t], i).logits for i, t in enumerate(tokens)])
    chunked = Engine(path, chunk=4, **kw).forward(tokens, 0).logits
    return whole, single, chunked, batched


def assert_truncate_and_redecode_equals_a_fresh_prefill(path, **kw):
    rng = np.random.default_rng(4)
    prompt, first, second = (rng.integers(0, 300, n) for n in (9, 5, 4))
    eng = Engine(path, **kw)
    eng.forward(prompt, 0)
    eng.forward(first, len(prompt))
    eng.cache.truncate(len(prompt))
    again = eng.forward(second, len(prompt)).logits
    fresh = Engine(path, **kw).forward(np.concatenate([prompt, second]), 0).logits[len(prompt):]
    assert np.array_equal(again, fresh)


def assert_snapshot_and_restore_bring_back_overwritten_rows(path, n_prompt: int):
    rng = np.random.default_rng(6)
    prompt, other, nxt = (rng.integers(0, 300, n) for n in (n_prompt, 6, 3))
    eng = Engine(path)
    eng.forward(prompt, 0)
    snap = eng.cache.snapshot()
    eng.forward(other, 2)  # overwrites committed rows 2..7
    eng.cache.restore(snap)
    got = eng.forward(nxt, len(prompt)).logits
    want = Engine(path).forward(np.concatenate([prompt, nxt]), 0).logits[len(prompt):]
    assert np.array_equal(got, want)


def assert_lookup_is_lossless(path):
    from ds4tools.engine.speculative.config import SpecConfig
    prompt = "the model reads a token and the model reads a token and the model"
    plain = [t.id for t in Engine(path).generate(prompt, 12, temperature=0)]
    eng = Engine(path, spec=SpecConfig(lookup=3))
    assert [t.id for t in eng.generate(prompt, 12, temperature=0)] == plain
