"""Mixture-of-experts decoding: the one-call expert kernels and the weight bytes a forward reads.

* The MoE block's one-call path (K-quant experts on the int8 path: gate + up of every used
  expert and the shared FFN in one parallel call, then down) gives the bits of the per-projection
  path, and a token's logits do not depend on its batch.
* ``ds4tools bench`` counts, for a MoE tensor, only the experts the forward used: the bytes
  counted are the used experts' bytes plus every other matrix (``bench.measure``).
* ``benchmarks/bench_moe.py`` writes the glm4moe, deepseek2 and glm-dsa files it measures (their
  quick shapes here), which our engine loads as their family.
"""
import json

import numpy as np
import pytest
from click.testing import CliRunner

from ds4tools.bench import measure
from ds4tools.cli import main
from ds4tools.engine import Engine, glm4moe, moe
from tests.glm4moe_model import Glm4MoeConfig, write_model

# K-quant rows are multiples of 256: every matrix can be Q4_K
CFG = Glm4MoeConfig(n_vocab=300, n_embd=256, n_layer=3, n_nextn=0, n_head=4, n_head_kv=2,
                    head_dim=64, n_rot=32, n_ff=256, n_ff_exp=256, n_expert=8, n_expert_used=3)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe")
    out = {}
    for wt in ("Q4_K", "Q8_0"):
        out[wt] = d / f"glm4moe-{wt}.gguf"
        write_model(out[wt], CFG, wt, seed=3)
    return out


def _expert_tensors(eng):
    return [m for m in eng.weights.linears() if isinstance(m, moe.ExpertMatrices)]


def _other_bytes(eng):
    return sum(m.nbytes for m in eng.weights.linears() if not isinstance(m, moe.ExpertMatrices))


def _per_expert_layer_bytes(eng):
    """{layer's MoEWeights id: bytes of one expert's gate + up + down}."""
    return {id(lw.moe): lw.moe.gate_exps.expert_nbytes + lw.moe.up_exps.expert_nbytes
            + lw.moe.down_exps.expert_nbytes
            for lw in eng.weights.layers if lw.moe is not None}


@pytest.fixture
def routing(monkeypatch):
    """Records, per MoE layer call, the distinct experts its rows chose."""
    seen = []
    real = glm4moe.moe_forward

    def spy(h, w, hp, ws, out):
        real(h, w, hp, ws, out)
        seen.append((id(w), set(ws.ids[:h.shape[0]].ravel().tolist())))
    monkeypatch.setattr(glm4moe, "moe_forward", spy)
    return seen


@pytest.mark.parametrize("wt", ["Q4_K", "Q8_0"])  # the one-call path and the per-expert loop
@pytest.mark.parametrize("k", [1, 5])
def test_forward_bytes_are_the_used_experts_plus_the_rest(files, routing, wt, k):
    eng = Engine(files[wt], n_ctx=64)
    fast = moe._fast_path(eng.weights.layers[1].moe)
    assert fast == (wt == "Q4_K")
    per = _per_expert_layer_bytes(eng)
    toks = np.random.default_rng(k).integers(0, CFG.n_vocab, k)
    measure.reset_expert_reads(eng)
    routing.clear()
    eng.forward(toks, 0)
    assert len(routing) == CFG.n_layer - CFG.n_dense_lead
    used = sum(len(experts) * per[layer] for layer, experts in routing)
    want = _other_bytes(eng) + used
    assert measure.forward_weight_bytes(eng) == want
    assert measure.decode_weight_bytes(eng, rows=k) == want  # one forward recorded: its bytes
    if k > 1:  # several rows share experts: fewer than k * top-k of them read
        assert any(len(experts) < k * CFG.n_expert_used for _, experts in routing)
    assert want < sum(m.nbytes for m in eng.weights.linears())


def test_decode_bytes_average_over_the_steps(files, routing):
    eng = Engine(files["Q4_K"], n_ctx=64)
    per = _per_expert_layer_bytes(eng)
    eng.forward([1, 2, 3], 0)
    measure.reset_expert_reads(eng)
    routing.clear()
    for i in range(4):
        eng.forward([5 + i], 3 + i)
    # a single token reads exactly its top-k experts in every MoE layer
    assert all(len(experts) == CFG.n_expert_used for _, experts in routing)
    want = _other_bytes(eng) + CFG.n_expert_used * sum(per.values())
    assert measure.decode_weight_bytes(eng) == want
    # the expert tensors' records: 4 single-row forwards, top-k experts each
    for m in _expert_tensors(eng):
        assert m.reads == {1: [4, 4 * CFG.n_expert_used]}
    measure.reset_expert_reads(eng)  # nothing recorded: one row's top-k, the same count
    assert measure.decode_weight_bytes(eng) == want


def test_bench_reports_the_used_experts_bytes(files):
    path = files["Q4_K"]
    r = CliRunner().invoke(main, ["bench", "-m", str(path), "-p", "8", "-n", "4", "--rk", "1,2",
                                  "-r", "1", "--threads", "1", "--json"])
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    eng = Engine(path, n_ctx=64)
    want = _other_bytes(eng) + CFG.n_expert_used * sum(_per_expert_layer_bytes(eng).values())
    assert doc["model"]["weight_bytes_per_token"] == want
    full = sum(m.nbytes for m in eng.weights.linears())
    assert want < full
    tg = doc["tg"][0]
    assert tg["weight_gbps"] == pytest.approx(want * tg["tps"] / 1e9)


def test_one_call_path_is_bit_identical(files, monkeypatch):
    eng = Engine(files["Q4_K"], n_ctx=64)
    toks = np.random.default_rng(9).integers(0, CFG.n_vocab, 11)  # > 4 rows per expert: tiles
    batched = eng.forward(toks, 0).logits.copy()
    single = np.concatenate([eng.forward(toks[i:i + 1], i).logits for i in range(len(toks))])
    np.testing.assert_array_equal(batched, single)
    monkeypatch.setattr(moe, "_fast_path", lambda w: False)  # one call per projection
    np.testing.assert_array_equal(eng.forward(toks, 0).logits, batched)
    monkeypatch.setattr(moe, "_shared_fast", lambda w: None)
    monkeypatch.setattr(moe, "_fast_path", lambda w: True)  # the shared FFN on its own
    np.testing.assert_array_equal(eng.forward(toks, 0).logits, batched)


def _bench_moe():
    import importlib.util
    import os
    spec = importlib.util.spec_from_file_location(
        "bench_moe", os.path.join(os.path.dirname(__file__), "..", "benchmarks", "bench_moe.py"))
    bm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bm)
    return bm


def test_bench_moe_writes_its_model(tmp_path):
    bm = _bench_moe()
    cfg = dict(bm.QUICK, n_layer=2, n_expert=4, n_expert_used=2, n_vocab=512)
    path = tmp_path / "m.gguf"
    n = bm.make_f16_model(str(path), cfg)
    total, active = bm.model_params(cfg)
    assert n == total and active < total
    eng = Engine(str(path), n_ctx=32)
    assert eng.hparams.arch == "glm4moe" and eng.hparams.moe.n_expert == 4
    assert np.isfinite(eng.forward([1, 2, 3], 0).logits).all()


@pytest.mark.parametrize("arch", ["deepseek2", "glm-dsa"])
def test_bench_moe_writes_the_mla_families(tmp_path, arch):
    bm = _bench_moe()
    cfg = dict(bm.config(arch, quick=True, nextn=True), n_layer=2, n_expert=4, n_expert_used=2,
               n_vocab=512)
    if cfg["n_group"]:  # deepseek2: 2 groups of 2 experts, 1 used
        cfg.update(n_group=2, n_group_used=1)
    path = tmp_path / "m.gguf"
    n = bm.make_f16_model(str(path), cfg)
    total, active = bm.model_params(cfg)
    assert n == total and active < total
    eng = Engine(str(path), n_ctx=64)
    hp = eng.hparams
    assert hp.arch == arch and hp.moe.n_expert == 4 and hp.n_nextn == 1
    assert np.isfinite(eng.forward(list(range(3, 40)), 0).logits).all()


def test_bench_moe_smoke(tmp_path, capsys):
    bm = _bench_moe()
    assert bm.main(["--quick", "--no-llama-cpp", "--rounds", "1", "--repeat", "1", "--n-decode", "4",
                    "--dir", str(tmp_path)]) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("SUMMARY ")][-1]
    doc = json.loads(line[len("SUMMARY "):])
    ours = doc["ours"]
    assert ours["decode_tps"] > 0 and ours["prefill_tps"] > 0 and ours["peak_rss_mb"] > 0
    assert sorted(int(k) for k in ours["r"]) == list(range(1, 9)) and ours["r"]["1"] == 1.0
    total, active = bm.model_params(bm.QUICK)
    assert 0 < ours["weight_bytes_per_token"] < total  # the used experts' bytes, not all


def test_bench_moe_nextn_sweep(tmp_path, capsys):
    # --nextn: the model with a NextN layer, then the --glm-mtp sweep (r, c, greedy identity)
    bm = _bench_moe()
    assert bm.main(["--quick", "--nextn", "--no-llama-cpp", "--rounds", "1", "--repeat", "1",
                    "--n-decode", "4", "--mtp-draft", "1,2", "--alpha", "0.6",
                    "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "glm4moe-quick-nextn-q4_k_m" in out
    lines = [x for x in out.splitlines() if x.startswith("MTP N=")]
    assert [x.split(":")[0] for x in lines] == ["MTP N=1", "MTP N=2"], out
    assert all("identical to plain" in x and "predicted speedup" in x for x in lines), lines
    total, active = bm.model_params(dict(bm.QUICK, n_nextn=1))
    assert (total, active) != bm.model_params(bm.QUICK) and active == bm.model_params(bm.QUICK)[1]


def test_bench_moe_predicted_speedup():
    bm = _bench_moe()
    assert bm.predicted_speedup(0.0, 3, 1.5, 0.5) == 1 / 2.0
    assert bm.predicted_speedup(1.0, 2, 1.2, 0.3) == 3 / 1.5
    assert abs(bm.predicted_speedup(0.5, 2, 1.0, 0.0) - 1.75) < 1e-12
