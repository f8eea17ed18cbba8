"""ds4's DSpark support GGUF (deepseek4-dspark / deepseek41-dspark): written from tiny DeepSeek V4
DSpark checkpoints (FP8 / FP4), read back, validated, and every ds4 message produced by a file
with exactly that defect."""
import numpy as np
import pytest
from click.testing import CliRunner
from gguf import GGUFValueType as V

from ds4tools import formats
from ds4tools.cli import main
from ds4tools.gguf_io import open_gguf
from ds4tools.inspect import inspect_file
from ds4tools.quantize import QuantizeOptions, quantize_model
from ds4tools.support import open_support
from tests.fixtures.support_models import build_tiny_dsv4, build_tiny_dsv4_target, rewrite_gguf


def cli(*args):
    r = CliRunner().invoke(main, [str(a) for a in args])
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    return r


def cli_errors(path, *extra):
    """(exit code, the error lines) of `ds4tools inspect PATH`."""
    r = cli("inspect", path, *extra)
    return r.exit_code, [x[len("error: "):] for x in r.stdout.splitlines() if x.startswith("error: ")]


def errors(path, target=None):
    doc = inspect_file(str(path), target=None if target is None else str(target))
    return [x["message"] for x in doc["findings"] if x["level"] == "error"]


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    d = tmp_path_factory.mktemp("dspark-v4")
    folder, expected = build_tiny_dsv4(d / "ckpt", "dspark-v4")
    target = build_tiny_dsv4_target(d / "target")
    out = d / "draft.gguf"
    quantize_model(folder, None, QuantizeOptions("Q8_0", dspark_out=str(out), target=str(target),
                                                 progress=False), report=lambda m: None)
    return dict(path=out, expected=expected, target=target, folder=folder, dir=d)


@pytest.fixture(scope="module")
def v41(tmp_path_factory):
    d = tmp_path_factory.mktemp("dspark-v41")
    folder, expected = build_tiny_dsv4(d / "ckpt", "dspark-v41")
    target = build_tiny_dsv4_target(d / "target", v41=True)
    out = d / "draft.gguf"
    quantize_model(folder, None, QuantizeOptions("Q8_0", dspark_out=str(out), target=str(target),
                                                 progress=False), report=lambda m: None)
    return dict(path=out, expected=expected, target=target)


BLOCK = ["hc_attn_fn", "hc_attn_scale", "hc_attn_base", "attn_norm", "attn_q_a", "attn_q_a_norm",
         "attn_q_b", "attn_kv", "attn_kv_a_norm", "attn_sinks", "attn_output_a", "attn_output_b",
         "hc_ffn_fn", "hc_ffn_scale", "hc_ffn_base", "ffn_norm", "ffn_gate_inp", "exp_probs_b",
         "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_shexp", "ffn_up_shexp",
         "ffn_down_shexp"]


def _names(hc_head: bool):
    out = []
    for s in range(3):
        out += [f"mtp.{s}.{r}.bias" if r == "exp_probs_b" else f"mtp.{s}.{r}.weight" for r in BLOCK]
    out += ["mtp.0.main_proj.weight", "mtp.0.main_norm.weight", "mtp.2.norm.weight",
            "mtp.2.markov_head.markov_w1.weight", "mtp.2.markov_head.markov_w2.weight",
            "mtp.2.confidence_head.proj.weight"]
    if hc_head:
        out += ["mtp.2.hc_head_base.weight", "mtp.2.hc_head_fn.weight", "mtp.2.hc_head_scale.weight"]
    return sorted(out)


def test_v4_layout_keys_and_summary(v4):
    f = open_gguf(v4["path"])
    assert f.architecture == "deepseek4-dspark"
    assert len(f.tensors) == 81 and sorted(f.tensors) == _names(True)
    md = f.metadata
    assert (md["dspark.block_size"], md["dspark.markov_rank"], md["dspark.noise_token_id"]) == (5, 32, 500)
    assert list(md["dspark.target_layer_ids"]) == [3, 4, 5]
    assert f.value_type("dspark.target_layer_ids") == (V.ARRAY, V.UINT32)
    assert md["dspark.stage_count"] == md["dspark.n_layers"] == 3 and md["general.alignment"] == 32
    assert md["dspark.embedding_length"] == 256 and md["dspark.vocab_size"] == 512
    assert md["dspark.n_expert"] == 4 and md["dspark.target_block_count"] == 6
    shapes = {n: tuple(t.ggml_shape) for n, t in f.tensors.items()}
    assert shapes["mtp.0.main_proj.weight"] == (768, 256)
    assert shapes["mtp.2.markov_head.markov_w1.weight"] == (32, 512) == shapes["mtp.2.markov_head.markov_w2.weight"]
    assert shapes["mtp.2.confidence_head.proj.weight"] == (288, 1)
    assert shapes["mtp.1.ffn_gate_exps.weight"] == (256, 256, 4)
    assert f.tensors["mtp.2.confidence_head.proj.weight"].type_name == "F32"
    assert f.tensors["mtp.0.hc_attn_fn.weight"].type_name == "F16"
    doc = inspect_file(str(v4["path"]), target=str(v4["target"]))
    assert doc["kind"] == "dspark-support" and doc["findings"] == []
    assert doc["summary"] == [
        "mtp/dspark: stages=3 block=5 markov_rank=32 noise_token=500 target_layers=3,4,5",
        "mtp/dspark tensors: main_proj=yes main_norm=yes markov=yes confidence=yes final_head=yes"]
    r = cli("inspect", v4["path"])
    assert r.exit_code == 0 and "kind: dspark-support" in r.stdout
    assert "mtp/dspark: stages=3 block=5 markov_rank=32 noise_token=500 target_layers=3,4,5" in r.stdout


def test_v4_values_round_trip(v4):
    f, exp = open_gguf(v4["path"]), v4["expected"]
    pairs = {"mtp.0.main_proj.weight": "mtp.0.main_proj.weight",
             "mtp.1.attn_q_b.weight": "mtp.1.attn.wq_b.weight",
             "mtp.2.ffn_up_shexp.weight": "mtp.2.ffn.shared_experts.w3.weight",
             "mtp.2.markov_head.markov_w1.weight": "mtp.2.markov_head.markov_w1.weight",
             "mtp.2.confidence_head.proj.weight": "mtp.2.confidence_head.proj.weight",
             "mtp.0.attn_kv_a_norm.weight": "mtp.0.attn.kv_norm.weight",
             "mtp.2.hc_head_base.weight": "mtp.2.hc_head_base"}
    for ours, theirs in pairs.items():
        t, want = f.tensors[ours], exp[theirs]
        np.testing.assert_array_equal(np.asarray(t.raw()).reshape(-1),
                                      formats.quantize(want, t.type_name).reshape(-1))
    for role, proj in (("ffn_gate_exps", "w1"), ("ffn_up_exps", "w3"), ("ffn_down_exps", "w2")):
        want = np.stack([exp[f"mtp.1.ffn.experts.{e}.{proj}.weight"] for e in range(4)])
        t = f.tensors[f"mtp.1.{role}.weight"]
        assert t.type_name == "Q8_0"  # --type Q8_0: a routed type ds4's DSpark validator takes
        np.testing.assert_array_equal(np.asarray(t.raw()), formats.quantize(want, "Q8_0"))
        err = np.abs(t.to_float32() - want)
        assert (err <= np.abs(want).max() / 127 * 0.57 + 1e-7).all()


def test_v41_has_78_tensors_and_its_own_expert_counts(v41):
    f = open_gguf(v41["path"])
    assert f.architecture == "deepseek41-dspark"
    assert len(f.tensors) == 78 and sorted(f.tensors) == _names(False)
    assert f.metadata["dspark.n_expert"] == 4 and f.metadata["dspark.n_expert_used"] == 1
    assert errors(v41["path"]) == [] and errors(v41["path"], v41["target"]) == []
    s = open_support(v41["path"], target=v41["target"])
    assert s.kind == "dspark-support" and s.hparams.block_size == 5
    assert s.hparams.target_layers == [3, 4, 5] and s.hparams.mask_token_id == 500
    assert s.tensor("markov_w1").name == "mtp.2.markov_head.markov_w1.weight"
    assert s.tensor("attn_q_a", layer=1).name == "mtp.1.attn_q_a.weight"


def _key(name, value, vtype=V.UINT32, sub=None):
    return {name: (value, vtype, sub)}


M = "DSpark metadata error: "


@pytest.mark.parametrize("case,change,want", [
    ("no-block", dict(drop_keys=["dspark.block_size"]), [M + "missing or zero block size"]),
    ("zero-block", dict(set_keys=_key("dspark.block_size", 0)), [M + "missing or zero block size"]),
    ("int32-block", dict(set_keys=_key("dspark.block_size", 5, V.INT32)), [M + "missing or zero block size"]),
    ("big-block", dict(set_keys=_key("dspark.block_size", 17)), [M + "block size exceeds runtime limit"]),
    ("no-noise", dict(drop_keys=["dspark.noise_token_id"]), [M + "missing or out-of-range noise token"]),
    ("big-noise", dict(set_keys=_key("dspark.noise_token_id", 512)), [M + "missing or out-of-range noise token"]),
    ("outside", dict(set_keys=_key("dspark.target_layer_ids", [3, 4, 6], V.ARRAY, V.UINT32)),
     [M + "target layer is outside the target model"]),
    ("order", dict(set_keys=_key("dspark.target_layer_ids", [3, 5, 4], V.ARRAY, V.UINT32)),
     [M + "target layers are not strictly increasing"]),
    ("alias", dict(drop_keys=["dspark.block_size"], set_keys=_key("deepseek4.dspark_block_size", 4)), []),
    ("int32-layers", dict(set_keys=_key("dspark.target_layer_ids", [3, 4, 5], V.ARRAY, V.INT32)), []),
    # ds4 shapes main_proj from the layer list and the Markov tensors from the rank, as here
    ("no-layers", dict(drop_keys=["dspark.target_layer_ids"]),
     [M + "missing target layer list",
      "DSpark tensor mtp.0.main_proj.weight (main_proj) has dim[0]=768, expected 0"]),
    ("negative-layers", dict(set_keys=_key("dspark.target_layer_ids", [-1, 4, 5], V.ARRAY, V.INT32)),
     [M + "missing target layer list",
      "DSpark tensor mtp.0.main_proj.weight (main_proj) has dim[0]=768, expected 0"]),
    ("no-rank", dict(drop_keys=["dspark.markov_rank"]),
     [M + "missing or zero Markov rank",
      "DSpark tensor mtp.2.markov_head.markov_w1.weight (markov_w1) has dim[0]=32, expected 0",
      "DSpark tensor mtp.2.markov_head.markov_w2.weight (markov_w2) has dim[0]=32, expected 0",
      "DSpark tensor mtp.2.confidence_head.proj.weight (confidence_proj) has dim[0]=288, expected 256"]),
])
def test_metadata_messages(v4, tmp_path, case, change, want):
    bad = rewrite_gguf(v4["path"], tmp_path / f"{case}.gguf", **change)
    assert cli_errors(bad) == (1 if want else 0, want)


R = "DSpark tensor "


@pytest.mark.parametrize("case,change,want", [
    ("dense-type", dict(retype={"mtp.0.main_proj.weight": "Q4_0"}),
     [R + "mtp.0.main_proj.weight (main_proj) has type Q4_0, expected F16, F32, or Q8_0"]),
    ("f32-type", dict(retype={"mtp.1.attn_norm.weight": "F16"}),
     [R + "mtp.1.attn_norm.weight (attn_norm) has type F16, expected F32"]),
    ("plain-type", dict(retype={"mtp.0.hc_attn_fn.weight": "Q8_0"}),
     [R + "mtp.0.hc_attn_fn.weight (hc_attn_fn) has type Q8_0, expected F16 or F32"]),
    ("routed-type", dict(retype={"mtp.2.ffn_down_exps.weight": "F16"}),
     [R + "mtp.2.ffn_down_exps.weight (ffn_down_exps) has type F16, expected routed expert quant"]),
    ("ndim", dict(reshape={"mtp.0.attn_sinks.weight": np.zeros((2, 2), np.float32)}),
     [R + "mtp.0.attn_sinks.weight (attn_sinks) has 2 dimensions, expected 1"]),
    ("dim", dict(reshape={"mtp.2.attn_kv_a_norm.weight": np.ones(32, np.float32)}),
     [R + "mtp.2.attn_kv_a_norm.weight (attn_kv_a_norm) has dim[0]=32, expected 64"]),
    ("gate-up", dict(retype={"mtp.1.ffn_up_exps.weight": "Q4_K"}),
     ["DSpark routed gate/up experts use different quant types"]),
    ("missing", dict(drop_tensors=["mtp.2.hc_head_fn.weight"]),
     [R + "mtp.2.hc_head_fn.weight (hc_head_fn) is missing"]),
])
def test_tensor_messages(v4, tmp_path, case, change, want):
    bad = rewrite_gguf(v4["path"], tmp_path / f"{case}.gguf", **change)
    assert cli_errors(bad) == (1, want)


def test_all_defects_reported_together_exit_1(v4, tmp_path):
    bad = rewrite_gguf(v4["path"], tmp_path / "many.gguf", set_keys=_key("dspark.block_size", 40),
                       drop_keys=["dspark.noise_token_id"],
                       retype={"mtp.0.main_proj.weight": "Q4_0", "mtp.1.ffn_up_exps.weight": "Q4_K"})
    r = cli("inspect", bad)
    assert r.exit_code == 1
    lines = r.stdout.splitlines()
    for want in ("error: DSpark metadata error: block size exceeds runtime limit",
                 "error: DSpark metadata error: missing or out-of-range noise token",
                 "error: DSpark tensor mtp.0.main_proj.weight (main_proj) has type Q4_0, expected F16, "
                 "F32, or Q8_0",
                 "error: DSpark routed gate/up experts use different quant types"):
        assert want in lines, want
    assert r.stderr.startswith(f"ds4tools: {bad}: DSpark metadata error: block size exceeds runtime limit")


def test_mismatched_target(v4, tmp_path):
    v41_target = build_tiny_dsv4_target(tmp_path / "v41", v41=True)
    assert errors(v4["path"], v41_target) == [
        "DSpark metadata error: a deepseek4-dspark support file does not belong to a deepseek41 target"]
    small = build_tiny_dsv4_target(tmp_path / "small", num_hidden_layers=5, vocab_size=480)
    errs = errors(v4["path"], small)
    assert errs[:4] == [
        f"the DSpark draft was made for a target with vocabulary size 512, but {small} has 480",
        f"the DSpark draft was made for a target with layer count 6, but {small} has 5",
        M + "missing or out-of-range noise token", M + "target layer is outside the target model"]
    assert R + "mtp.2.markov_head.markov_w1.weight (markov_w1) has dim[1]=512, expected 480" in errs
    r = cli("inspect", v4["path"], "--target", small)
    assert r.exit_code == 1


def test_converter_flags(v4, tmp_path):
    base = ["quantize", v4["folder"], "--target", v4["target"], "--type", "Q8_0"]
    r = cli(*base, "--dspark-out", tmp_path / "a.gguf", "--dspark-block-size", "3",
            "--dspark-target-layers", "2,3,4", "--dspark-noise-token-id", "7", "--dspark-markov-rank", "32")
    assert r.exit_code == 0, r.output
    f = open_gguf(tmp_path / "a.gguf")
    assert f.metadata["dspark.block_size"] == 3 and list(f.metadata["dspark.target_layer_ids"]) == [2, 3, 4]
    assert f.metadata["dspark.noise_token_id"] == 7 and errors(tmp_path / "a.gguf") == []
    for extra, msg in ((["--dspark-block-size", "6"], "trained with block size 5; it may only be lowered"),
                       (["--dspark-target-layers", "4,5"], "takes 3 target layers, 2 given"),
                       (["--dspark-target-layers", "4,5,6"], "the target has 6 layers"),
                       (["--dspark-markov-rank", "16"], "Markov head has rank 32"),
                       (["--dspark-noise-token-id", "512"], "outside the target's 512 tokens"),
                       (["--layout", "llama.cpp"], "--layout llama.cpp"),
                       (["-o", tmp_path / "x.gguf"], "drop -o")):
        r = cli(*base, "--dspark-out", tmp_path / "b.gguf", *extra)
        assert r.exit_code == 2 and msg in r.stderr, (extra, r.stderr)
        assert not (tmp_path / "b.gguf").exists()
    r = cli("quantize", v4["folder"], "--dspark-out", tmp_path / "c.gguf")
    assert r.exit_code == 2 and "needs --target" in r.stderr
    # --type defaults to Q8_0 for a draft
    r = cli("quantize", v4["folder"], "--dspark-out", tmp_path / "d.gguf", "--target", v4["target"])
    assert r.exit_code == 0 and "d.gguf: 81 tensors" in r.stdout


def test_fp8_checkpoint_with_a_lying_scale_is_refused(tmp_path):
    folder, _ = build_tiny_dsv4(tmp_path / "ckpt", "dspark-v4")
    from tests.fixtures.support_models import save_raw_safetensors
    import json
    raw = (folder / "model.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        data = raw[8 + n + a:8 + n + b]
        shape = info["shape"]
        if name == "mtp.0.main_proj.scale":  # one scale block too few
            shape, data = [2, 5], data[:10]
        entries[name] = (info["dtype"], shape, data)
    save_raw_safetensors(folder / "model.safetensors", entries)
    target = build_tiny_dsv4_target(tmp_path / "t")
    r = cli("quantize", folder, "--dspark-out", tmp_path / "x.gguf", "--target", target)
    assert r.exit_code == 1 and "mtp.0.main_proj.weight" in r.stderr and "FP8 scale has shape [2, 5]" in r.stderr
    assert not (tmp_path / "x.gguf").exists()
