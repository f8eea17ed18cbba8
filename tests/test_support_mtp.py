"""MTP support GGUFs (ds4's layout): written from a Qwen3 / Llama NextN layer, from a DeepSeek V4
MTP layer (FP8 / FP4) and from a NextN layer embedded in a model GGUF; read back, validated, and
every defect reported in ds4's words."""
import json

import numpy as np
import pytest
from click.testing import CliRunner
from gguf import GGUFValueType as V

from ds4tools import formats
from ds4tools.checkpoint import interleave_rope_rows
from ds4tools.cli import main
from ds4tools.gguf_io import open_gguf
from ds4tools.inspect import inspect_file
from ds4tools.quantize import QuantizeOptions, quantize_model
from ds4tools.support import open_support
from tests.fixtures import hf_models
from tests.fixtures.support_models import build_tiny_dsv4, rewrite_gguf

H = 256  # the tiny qwen3's hidden size


def quiet(src, out, type_name="Q8_0", **kw):
    return quantize_model(src, out, QuantizeOptions(type_name, progress=False, **kw),
                          report=lambda msg: None)


def errors(path, target=None):
    doc = inspect_file(path, target=None if target is None else str(target))
    return [x["message"] for x in doc["findings"] if x["level"] == "error"]


def cli(*args):
    r = CliRunner().invoke(main, [str(a) for a in args])
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    return r


def cli_errors(path, *extra):
    """(exit code, the error lines) of `ds4tools inspect PATH`."""
    r = cli("inspect", path, *extra)
    return r.exit_code, [x[len("error: "):] for x in r.stdout.splitlines() if x.startswith("error: ")]


@pytest.fixture(scope="module")
def qwen3_pair(hf_qwen3_nextn, tmp_path_factory):
    """(target GGUF, MTP GGUF) written by one quantize run with --mtp-out."""
    d = tmp_path_factory.mktemp("mtp")
    quiet(hf_qwen3_nextn, d / "target.gguf", mtp_out=str(d / "mtp.gguf"))
    return d / "target.gguf", d / "mtp.gguf"


@pytest.fixture(scope="module")
def dsv4_mtp(tmp_path_factory):
    d = tmp_path_factory.mktemp("dsv4")
    folder, expected = build_tiny_dsv4(d / "ckpt", "mtp")
    out = d / "mtp.gguf"
    quiet(folder, None, mtp_out=str(out), only_support=True)
    return out, expected


DENSE_NAMES = ["e_proj", "h_proj", "enorm", "hnorm", "norm", "attn_norm", "attn_q", "attn_k",
               "attn_v", "attn_output", "attn_q_norm", "attn_k_norm", "ffn_norm", "ffn_gate",
               "ffn_up", "ffn_down"]


def test_qwen3_mtp_names_shapes_keys_and_values(hf_qwen3_nextn, qwen3_pair):
    _, mtp_path = qwen3_pair
    f = open_gguf(mtp_path)
    cfg = json.loads((hf_qwen3_nextn / "config.json").read_text())
    hd, nq = cfg["head_dim"], cfg["num_attention_heads"]
    nkv, ff = cfg["num_key_value_heads"], cfg["intermediate_size"]
    assert f.architecture == "qwen3-mtp"
    assert list(f.tensors) == [f"mtp.0.{n}.weight" for n in DENSE_NAMES]
    shapes = {n: tuple(t.ggml_shape) for n, t in f.tensors.items()}
    assert shapes["mtp.0.e_proj.weight"] == (H, H) == shapes["mtp.0.h_proj.weight"]
    assert shapes["mtp.0.attn_q.weight"] == (H, nq * hd)
    assert shapes["mtp.0.attn_k.weight"] == (H, nkv * hd)
    assert shapes["mtp.0.attn_output.weight"] == (nq * hd, H)
    assert shapes["mtp.0.attn_q_norm.weight"] == (hd,)
    assert shapes["mtp.0.ffn_down.weight"] == (ff, H)
    md = f.metadata
    expect = {"qwen3-mtp.target_architecture": "qwen3", "qwen3-mtp.block_count": 1,
              "qwen3-mtp.target_block_count": 2, "qwen3-mtp.nextn_layer_index": 2,
              "qwen3-mtp.embedding_length": H, "qwen3-mtp.vocab_size": cfg["vocab_size"],
              "qwen3-mtp.feed_forward_length": ff, "qwen3-mtp.attention.head_count": nq,
              "qwen3-mtp.attention.head_count_kv": nkv, "qwen3-mtp.attention.key_length": hd}
    for k, v in expect.items():
        assert md[k] == v, k
    assert f.value_type("qwen3-mtp.embedding_length")[0] == V.UINT32
    assert md["qwen3-mtp.rope.freq_base"] == pytest.approx(cfg["rope_theta"])
    # every tensor is the checkpoint's values at its type (byte for byte what formats gives)
    w = hf_models.load_weights(hf_qwen3_nextn)
    p = "model.layers.2."
    source = {"e_proj": w[p + "eh_proj.weight"][:, :H], "h_proj": w[p + "eh_proj.weight"][:, H:],
              "enorm": w[p + "enorm.weight"], "hnorm": w[p + "hnorm.weight"],
              "norm": w[p + "shared_head.norm.weight"], "attn_norm": w[p + "input_layernorm.weight"],
              "attn_q": w[p + "self_attn.q_proj.weight"], "attn_k": w[p + "self_attn.k_proj.weight"],
              "attn_v": w[p + "self_attn.v_proj.weight"], "attn_output": w[p + "self_attn.o_proj.weight"],
              "attn_q_norm": w[p + "self_attn.q_norm.weight"], "attn_k_norm": w[p + "self_attn.k_norm.weight"],
              "ffn_norm": w[p + "post_attention_layernorm.weight"], "ffn_gate": w[p + "mlp.gate_proj.weight"],
              "ffn_up": w[p + "mlp.up_proj.weight"], "ffn_down": w[p + "mlp.down_proj.weight"]}
    for role, values in source.items():
        t = f.tensors[f"mtp.0.{role}.weight"]
        if values.ndim == 1:
            assert t.type_name == "F32"
            np.testing.assert_array_equal(t.to_float32(), values)
        else:
            assert t.type_name == "Q8_0"
            np.testing.assert_array_equal(np.asarray(t.raw()), formats.quantize(values, "Q8_0"))
            amax = np.abs(values).reshape(values.shape[0], -1, 32).max(axis=2, keepdims=True)
            err = np.abs(t.to_float32() - values).reshape(values.shape[0], -1, 32)
            # half a step, plus the step's own fp16 rounding over up to 127 steps
            assert (err <= amax / 127 * (0.5 + 127 * 2.0 ** -11) + 1e-7).all()


def test_qwen3_mtp_validates_clean_alone_and_with_its_target(qwen3_pair):
    target, mtp_path = qwen3_pair
    assert errors(mtp_path) == [] and errors(mtp_path, target) == []
    doc = inspect_file(str(mtp_path))
    assert doc["kind"] == "mtp-support" and doc["findings"] == []
    assert doc["summary"][0] == "mtp/dspark: stages=1"
    s = open_support(mtp_path, target=target)
    assert s.kind == "mtp-support" and s.hparams.dims.n_embd == H and s.hparams.nextn_layer_index == 2
    assert s.tensor("e_proj").ggml_shape == (H, H) and s.tensor("attn_q", layer=0).name == "mtp.0.attn_q.weight"


def test_llama_mtp_rows_follow_the_target_rope_order(tmp_path):
    folder = hf_models.build_tiny_llama(tmp_path / "llama", num_hidden_layers=2)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (folder / "config.json").write_text(json.dumps(cfg))
    w = hf_models.load_weights(folder)
    hf_models.add_nextn_layer(w, cfg, seed=3)
    for k in [k for k in w if k.endswith(("q_norm.weight", "k_norm.weight"))]:
        del w[k]  # llama has no q/k norms
    hf_models.write_weights(folder, w)
    quiet(folder, tmp_path / "t.gguf", mtp_out=str(tmp_path / "m.gguf"))
    f = open_gguf(tmp_path / "m.gguf")
    assert f.architecture == "llama-mtp" and "mtp.0.attn_q_norm.weight" not in f.tensors
    want = interleave_rope_rows(w["model.layers.2.self_attn.k_proj.weight"], cfg["num_key_value_heads"])
    np.testing.assert_array_equal(np.asarray(f.tensors["mtp.0.attn_k.weight"].raw()),
                                  formats.quantize(want, "Q8_0"))
    assert errors(tmp_path / "m.gguf", tmp_path / "t.gguf") == []


def test_keep_nextn_embeds_the_layer_and_extraction_gives_the_same_mtp_file(hf_qwen3_nextn, qwen3_pair, tmp_path):
    _, mtp_path = qwen3_pair
    quiet(hf_qwen3_nextn, tmp_path / "emb.gguf", keep_nextn=True)
    f = open_gguf(tmp_path / "emb.gguf")
    assert f.metadata["qwen3.block_count"] == 3 and f.metadata["qwen3.nextn_predict_layers"] == 1
    for part, shape in (("eh_proj", (2 * H, H)), ("enorm", (H,)), ("hnorm", (H,)), ("shared_head_norm", (H,))):
        assert tuple(f.tensors[f"blk.2.nextn.{part}.weight"].ggml_shape) == shape
    assert "blk.2.attn_q.weight" in f.tensors and "blk.2.ffn_down.weight" in f.tensors
    doc = inspect_file(str(tmp_path / "emb.gguf"))
    assert doc["kind"] == "model" and not [x for x in doc["findings"] if x["level"] == "error"]
    quiet(tmp_path / "emb.gguf", None, mtp_out=str(tmp_path / "x.gguf"), only_support=True)
    a, b = open_gguf(mtp_path), open_gguf(tmp_path / "x.gguf")
    assert list(a.tensors) == list(b.tensors)
    for name in a.tensors:  # eh_proj's halves are byte slices of its Q8_0 rows: nothing lost
        assert a.tensors[name].type_name == b.tensors[name].type_name
        np.testing.assert_array_equal(np.asarray(a.tensors[name].raw()), np.asarray(b.tensors[name].raw()))
    for key in a.metadata:
        if key.startswith("qwen3-mtp."):
            assert b.metadata[key] == a.metadata[key], key


def test_embedded_nextn_defects_are_named(hf_qwen3_nextn, tmp_path):
    quiet(hf_qwen3_nextn, tmp_path / "emb.gguf", keep_nextn=True)
    bad = rewrite_gguf(tmp_path / "emb.gguf", tmp_path / "bad.gguf",
                       drop_tensors=["blk.2.nextn.hnorm.weight"],
                       reshape={"blk.2.nextn.eh_proj.weight": np.zeros((H, H), np.float32)})
    assert cli_errors(bad) == (1, ["tensor blk.2.nextn.eh_proj.weight has dim[0]=256, expected 512",
                                   "required tensor is missing: blk.2.nextn.hnorm.weight"])
    r = cli("quantize", bad, "--type", "Q8_0", "--mtp-out", tmp_path / "m.gguf", "--only-support")
    assert r.exit_code == 1 and "blk.2.nextn.eh_proj.weight has dim[0]=256" in r.stderr


DSV4_NAMES = ["hc_head_base", "hc_head_fn", "hc_head_scale", "e_proj", "h_proj", "enorm", "hnorm",
              "norm", "hc_attn_fn", "hc_attn_scale", "hc_attn_base", "attn_norm", "attn_q_a",
              "attn_q_a_norm", "attn_q_b", "attn_kv", "attn_kv_a_norm", "attn_sinks", "attn_output_a",
              "attn_output_b", "hc_ffn_fn", "hc_ffn_scale", "hc_ffn_base", "ffn_norm", "ffn_gate_inp",
              "exp_probs_b", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_shexp",
              "ffn_up_shexp", "ffn_down_shexp"]


def test_dsv4_mtp_has_ds4s_32_tensors_and_the_checkpoint_values(dsv4_mtp):
    path, expected = dsv4_mtp
    f = open_gguf(path)
    assert f.architecture == "deepseek4-mtp" and len(f.tensors) == 32
    assert sorted(f.tensors) == sorted(f"mtp.0.{n}.bias" if n == "exp_probs_b" else f"mtp.0.{n}.weight"
                                       for n in DSV4_NAMES)
    shapes = {n.split(".")[2]: tuple(t.ggml_shape) for n, t in f.tensors.items()}
    assert shapes["hc_head_fn"] == (1024, 4) and shapes["hc_attn_fn"] == (1024, 24)
    assert shapes["attn_q_b"] == (64, 128) and shapes["attn_output_a"] == (64, 64)
    assert shapes["attn_output_b"] == (64, 256) and shapes["ffn_gate_exps"] == (256, 256, 4)
    assert shapes["ffn_down_exps"] == (256, 256, 4) and shapes["exp_probs_b"] == (4,)
    types = {n.split(".")[2]: t.type_name for n, t in f.tensors.items()}
    assert types["e_proj"] == types["attn_q_a"] == types["ffn_down_shexp"] == "Q8_0"
    assert types["ffn_gate_exps"] == "Q4_K" and types["hc_attn_fn"] == "F16"
    assert types["ffn_gate_inp"] == types["attn_norm"] == types["hc_head_scale"] == "F32"
    p = "mtp.0."
    checks = {"e_proj.weight": "e_proj.weight", "attn_q_a.weight": "attn.wq_a.weight",
              "ffn_down_shexp.weight": "ffn.shared_experts.w2.weight", "hc_attn_fn.weight": "hc_attn_fn",
              "attn_norm.weight": "attn_norm.weight", "exp_probs_b.bias": "ffn.gate.bias",
              "attn_sinks.weight": "attn.attn_sink", "hc_head_fn.weight": "hc_head_fn"}
    for ours, theirs in checks.items():
        t, want = f.tensors[p + ours], expected[p + theirs]
        if t.type_name in ("F32", "F16"):
            np.testing.assert_array_equal(t.to_float32(), formats.dequantize(
                formats.quantize(want, t.type_name), t.type_name, want.shape))
        else:
            np.testing.assert_array_equal(np.asarray(t.raw()), formats.quantize(want, t.type_name))
    for role, proj in (("ffn_gate_exps", "w1"), ("ffn_up_exps", "w3"), ("ffn_down_exps", "w2")):
        want = np.stack([expected[f"{p}ffn.experts.{e}.{proj}.weight"] for e in range(4)])
        np.testing.assert_array_equal(np.asarray(f.tensors[p + role + ".weight"].raw()),
                                      formats.quantize(want, "Q4_K"))
    assert errors(path) == []


def test_dsv4_mtp_defects_in_ds4s_words(dsv4_mtp, tmp_path):
    path, _ = dsv4_mtp
    f = open_gguf(path)
    cases = {
        "missing": (dict(drop_tensors=["mtp.0.hnorm.weight"]),
                    ["required tensor is missing: mtp.0.hnorm.weight"]),
        "type": (dict(retype={"mtp.0.e_proj.weight": "Q4_0"}),
                 ["tensor mtp.0.e_proj.weight has type Q4_0, expected Q8_0"]),
        "plain": (dict(retype={"mtp.0.hc_head_fn.weight": "Q8_0"}),
                  ["tensor mtp.0.hc_head_fn.weight has type Q8_0, expected F16 or F32"]),
        "routed": (dict(retype={"mtp.0.ffn_down_exps.weight": "Q8_0"}),
                   ["tensor mtp.0.ffn_down_exps.weight has type 8 (Q8_0), expected a routed expert quant type"]),
        "gate_up": (dict(retype={"mtp.0.ffn_up_exps.weight": "Q2_K"}),
                    ["MTP routed gate/up experts use different quant types"]),
        "ndim": (dict(reshape={"mtp.0.attn_sinks.weight": np.zeros((2, 2), np.float32)}),
                 ["tensor mtp.0.attn_sinks.weight has 2 dimensions, expected 1"]),
        "dim": (dict(reshape={"mtp.0.attn_kv_a_norm.weight": np.ones(32, np.float32)}),
                ["tensor mtp.0.attn_kv_a_norm.weight has dim[0]=32, expected 64"]),
    }
    for case, (kw, want) in cases.items():
        bad = rewrite_gguf(path, tmp_path / f"{case}.gguf", **kw)
        assert cli_errors(bad) == (1, want), case
    # several defects at once: all of them, in one run, exit code 1
    bad = rewrite_gguf(path, tmp_path / "many.gguf", drop_tensors=["mtp.0.hnorm.weight"],
                       retype={"mtp.0.e_proj.weight": "Q4_0", "mtp.0.ffn_up_exps.weight": "Q2_K"})
    r = cli("inspect", bad)
    assert r.exit_code == 1
    for line in ("error: tensor mtp.0.e_proj.weight has type Q4_0, expected Q8_0",
                 "error: required tensor is missing: mtp.0.hnorm.weight",
                 "error: MTP routed gate/up experts use different quant types"):
        assert line in r.stdout.splitlines(), line
    assert r.stderr.strip().endswith("(and 2 more errors)")
    assert f.tensors  # the original stays valid
    assert errors(path) == []


def test_dense_mtp_key_and_shape_defects(qwen3_pair, tmp_path):
    _, path = qwen3_pair
    bad = rewrite_gguf(path, tmp_path / "k.gguf", drop_keys=["qwen3-mtp.embedding_length"],
                       set_keys={"qwen3-mtp.context_length": (4096, V.INT32, None)},
                       retype={"mtp.0.enorm.weight": "F16"},
                       reshape={"mtp.0.attn_q.weight": np.zeros((256, H), np.float32)})
    assert cli_errors(bad) == (1, [
        "metadata key has a non-integer type: qwen3-mtp.context_length",
        "required metadata key is missing: qwen3-mtp.embedding_length",
        "tensor mtp.0.enorm.weight has type F16, expected F32",
        "tensor mtp.0.attn_q.weight has dim[1]=256, expected 384",
    ])


def test_mismatched_target_pair_is_reported(qwen3_pair, hf_llama, gguf_llama_f32, tmp_path):
    _, path = qwen3_pair
    errs = errors(path, gguf_llama_f32)
    assert "the MTP head was made for a qwen3 model, but " f"{gguf_llama_f32} is llama" in errs
    assert f"the MTP head was made for a target with head dim 96, but {gguf_llama_f32} has 64" in errs
    assert any(e.startswith("tensor mtp.0.attn_q.weight has dim[1]=384, expected 256") for e in errs)
    # an HF directory works as the target too
    assert any("vocabulary size 416, but" in e for e in errors(path, hf_llama))
    r = cli("inspect", path, "--target", gguf_llama_f32)
    assert r.exit_code == 1
    # a target that is not a model file cannot be read: exit 2
    r = cli("inspect", path, "--target", tmp_path / "none.gguf")
    assert r.exit_code == 2 and "none.gguf" in r.stderr


def test_ds4_mtp_file_without_our_keys_is_checked_from_its_tensors(dsv4_mtp, tmp_path):
    path, _ = dsv4_mtp
    f = open_gguf(path)
    ours = [k for k in f.metadata if k.startswith("deepseek4-mtp.")]
    bare = rewrite_gguf(path, tmp_path / "bare.gguf", drop_keys=ours, arch="deepseek4")
    doc = inspect_file(str(bare))
    assert doc["kind"] == "mtp-support" and doc["valid"]
    assert [x["message"] for x in doc["findings"]] == [
        "general.architecture is 'deepseek4'; an MTP support file has '<target architecture>-mtp'"]
    # internal consistency without keys: a projection that disagrees with the norms is caught
    bad = rewrite_gguf(bare, tmp_path / "bad.gguf",
                       reshape={"mtp.0.attn_kv.weight": np.zeros((32, 256), np.float32)},
                       retype={"mtp.0.attn_kv.weight": "Q8_0"})
    assert cli_errors(bad) == (1, ["tensor mtp.0.attn_kv.weight has dim[1]=32, expected 64"])
    s = open_support(bare)
    assert s.hparams.dims.n_embd == 256 and s.hparams.dims.hc == 4 and s.hparams.dims.n_expert == 4
