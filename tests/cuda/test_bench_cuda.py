"""benchmarks/bench_cuda.py (simulated): its --tiny run writes every section with numbers, and its
synthetic weight blocks decode to finite values of the intended magnitude in every format the
CUDA matmul runs.

The simulator runs one Python thread per CUDA thread, so --tiny shrinks everything (and measures
r(k) for k = 1..4 only: a forward there costs ~1.5 s per row).
"""
import importlib.util
import json
import math
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from numba import config

from ds4tools import formats
from ds4tools.engine.backends.cuda import matmul

assert config.ENABLE_CUDASIM == 1

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_cuda.py"


@pytest.fixture(scope="module")
def bench():
    name = "bench_cuda_under_test"
    spec = importlib.util.spec_from_file_location(name, SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(name, None)


@pytest.mark.parametrize("name", matmul.SUPPORTED)
def test_synthetic_blocks_decode_to_sane_values(bench, name):
    fmt = formats.get_format(name)
    rng = np.random.default_rng(3)
    for n_out, n_in in ((64, 256), (16, 4096)):
        raw = bench.synthetic_matrix(name, n_out, n_in, rng)
        assert raw.dtype == np.uint8 and raw.shape == formats.byte_shape((n_out, n_in), fmt)
        w = formats.dequantize(raw, name, (n_out, n_in)).astype(np.float64)
        assert np.isfinite(w).all()
        want = bench.target_rms(n_in)
        rms = math.sqrt((w ** 2).mean())
        assert 0.75 * want < rms < 1.33 * want, (name, n_in, rms, want)
        assert abs(w.mean()) < 0.15 * want, (name, n_in, w.mean(), want)  # centred
        assert np.abs(w).max() < 40 * want


def test_block_pools_give_every_matrix_its_own_memory(bench):
    hp, weights, types, pool_bytes = bench.synthetic_model(bench.TINY_SHAPE, "Q4_K_M",
                                                          np.random.default_rng(0), 24)
    mats = [lin for layer in weights.layers for lin in layer.linears()] + [weights.token_embd]
    assert len({lin.raw.__array_interface__["data"][0] for lin in mats}) == len(mats)
    ptr = lambda lin: lin.raw.__array_interface__["data"][0]  # noqa: E731
    assert ptr(weights.output) == ptr(weights.token_embd)  # tied: one upload, as a real file
    assert pool_bytes < sum(lin.nbytes for lin in mats) + 4096
    for lin in mats:
        w = lin.dequantize()
        assert np.isfinite(w).all() and 0.5 < math.sqrt(float((w ** 2).mean()) * lin.n_in) < 2


def test_q4_k_m_follows_llama_cpp_rules_at_8b(bench):
    types = bench.mix_types(bench.MODEL_SHAPES["8B"], "Q4_K_M")
    assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == "Q4_K"
    assert types["blk.0.attn_v.weight"] == "Q6_K" and types["blk.0.ffn_down.weight"] == "Q6_K"
    assert types["blk.0.attn_q.weight"] == types["blk.10.ffn_down.weight"] == "Q4_K"
    assert Counter(types.values()) == {"Q4_K": 217, "Q6_K": 37}
    assert set(bench.mix_types(bench.MODEL_SHAPES["0.6B"], "Q8_0").values()) == {"Q8_0"}


def test_verify_cost_covers_k_1_to_16_by_default(bench):
    assert bench.parse_args(["--out", "x.json"]).max_k == 16
    assert bench.parse_args(["--tiny", "--max-k", "16"]).max_k == 16
    # under the simulator a forward costs ~1.5 s per row: k = 1..16 would be ~4 minutes
    assert bench.parse_args(["--tiny"]).max_k == 4


def test_tiny_run_writes_every_section(bench, tmp_path):
    out = tmp_path / "b.json"
    assert bench.main(["--tiny", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert set(bench.SECTIONS) <= set(doc["sections"])
    for name in ("environment", "copy", "matvec", "models"):
        assert doc["sections"][name]["status"] == "ok", (name, doc[name])
    assert doc["environment"]["simulator"] is True

    copy = doc["copy"]
    assert copy["gbps_rw"] > 0 and copy["gbps_read_equivalent"] > 0
    assert copy["gbps_rw"] == pytest.approx(2 * copy["gbps_read_equivalent"])

    mv = doc["matvec"]["formats"]
    assert set(mv) == set(matmul.SUPPORTED)
    for name, r in mv.items():
        assert "error" not in r, (name, r)
        assert r["gbps"] > 0 and r["ratio_to_copy"] > 0 and r["finite"], (name, r)

    # no CUDA for torch here: skipped with a reason, not an error
    assert "skipped" in doc["torch"] or doc["torch"]["gbps"] > 0

    models = doc["models"]["models"]
    assert models
    for name, m in models.items():
        assert "error" not in m, (name, m)
        assert m["decode_tps"] > 0 and m["weight_gbps"] > 0 and m["weight_bytes_per_token"] > 0
        assert [int(k) for k in m["r"]] == m["ks"] == list(range(1, 5))  # --tiny: k = 1..4
        assert m["r"]["1"] == 1.0
        assert all(v > 0 for v in m["r"].values())

    assert "skipped" in doc["demo"]  # --tiny leaves the demo out
    goals = doc["goals"]
    assert {"matvec_Q4_K", "matvec_Q8_0", "decode_8B_Q4_K_M", "r8_8B_Q4_K_M", "dspark_demo"} <= set(goals)
    assert goals["matvec_Q4_K"]["value"] > 0 and goals["matvec_Q4_K"]["met"] in (True, False)
    assert goals["decode_8B_Q4_K_M"]["met"] is None  # the 8B model is not part of --tiny
    assert doc["elapsed_s"] > 0
