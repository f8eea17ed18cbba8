"""llama.cpp's DSpark draft GGUF (architecture dflash with a Markov head), written from a tiny
DeepSpec Qwen3DSparkModel checkpoint for the tiny qwen3 target, read back and validated in
llama.cpp's words."""
import json

import numpy as np
import pytest
from click.testing import CliRunner
from gguf import GGUFValueType as V

from ds4tools import formats
from ds4tools.cli import main
from ds4tools.errors import InvalidContentError
from ds4tools.gguf_io import open_gguf
from ds4tools.inspect import inspect_file
from ds4tools.quantize import QuantizeOptions, quantize_model
from ds4tools.support import open_support
from tests.fixtures import hf_models
from tests.fixtures.support_models import build_tiny_dspark_qwen3, rewrite_gguf


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
def draft(hf_qwen3, tmp_path_factory):
    d = tmp_path_factory.mktemp("dflash")
    folder, weights = build_tiny_dspark_qwen3(d / "draft", hf_qwen3, with_copies=True)
    notes = []
    quantize_model(folder, None, QuantizeOptions("Q8_0", dspark_out=str(d / "draft.gguf"),
                                                 target=str(hf_qwen3), progress=False),
                   report=notes.append)
    return dict(path=d / "draft.gguf", folder=folder, weights=weights, notes=notes, dir=d)


LAYER = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm",
         "ffn_norm", "ffn_gate", "ffn_down", "ffn_up"]


def test_keys_layer_numbering_and_tokenizer(draft, gguf_qwen3_f32):
    f = open_gguf(draft["path"])
    cfg = json.loads((draft["folder"] / "config.json").read_text())
    md = f.metadata
    assert f.architecture == "dflash"
    # DeepSpec's ids name layer outputs; llama.cpp captures layer inputs: id + 1
    assert list(md["dflash.target_layers"]) == [0, 1] and f.value_type("dflash.target_layers") == (V.ARRAY, V.INT32)
    assert md["dflash.block_size"] == 4 and md["dflash.target_hidden_size"] == 256
    assert md["dflash.mask_token_id"] == md["tokenizer.ggml.mask_token_id"] == cfg["mask_token_id"]
    assert md["dflash.sample_from_anchor"] is True and md["dflash.has_confidence_head"] is True
    assert md["dflash.block_count"] == 2 and md["dflash.embedding_length"] == 256
    assert md["dflash.attention.head_count"] == 4 and md["dflash.attention.head_count_kv"] == 2
    assert md["dflash.attention.key_length"] == 96 and md["dflash.feed_forward_length"] == 320
    assert md["dflash.vocab_size"] == 416
    target = open_gguf(gguf_qwen3_f32)  # the tokenizer is the target's, as llama.cpp expects
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
                "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.eos_token_id"):
        assert md[key] == target.metadata[key], key
    assert any("embed_tokens.weight left out" in n for n in draft["notes"])


def test_tensors_names_shapes_and_values(draft):
    f, w = open_gguf(draft["path"]), draft["weights"]
    names = ["markov_w1.weight", "markov_w2.weight", "conf_proj.weight", "conf_proj.bias", "fc.weight",
             "enc.output_norm.weight", "output_norm.weight"]
    names += [f"blk.{i}.{r}.weight" for i in range(2) for r in LAYER]
    assert sorted(f.tensors) == sorted(names)
    shapes = {n: tuple(t.ggml_shape) for n, t in f.tensors.items()}
    assert shapes["fc.weight"] == (512, 256) and shapes["markov_w1.weight"] == (32, 416)
    assert shapes["conf_proj.weight"] == (288, 1) and shapes["conf_proj.bias"] == (1,)
    assert shapes["blk.1.attn_q.weight"] == (256, 384) and shapes["blk.1.attn_k_norm.weight"] == (96,)
    source = {"fc.weight": "fc.weight", "enc.output_norm.weight": "hidden_norm.weight",
              "output_norm.weight": "norm.weight", "markov_w1.weight": "markov_head.markov_w1.weight",
              "markov_w2.weight": "markov_head.markov_w2.weight",
              "conf_proj.weight": "confidence_head.proj.weight", "conf_proj.bias": "confidence_head.proj.bias",
              "blk.1.attn_q.weight": "layers.1.self_attn.q_proj.weight",
              "blk.0.ffn_norm.weight": "layers.0.post_attention_layernorm.weight",
              "blk.0.ffn_down.weight": "layers.0.mlp.down_proj.weight"}
    for ours, theirs in source.items():
        t, values = f.tensors[ours], w[theirs]
        if ours.startswith("conf_proj") or values.ndim == 1:
            assert t.type_name == "F32"
            np.testing.assert_array_equal(t.to_float32(), values)
        else:
            assert t.type_name == "Q8_0"
            np.testing.assert_array_equal(np.asarray(t.raw()), formats.quantize(values, "Q8_0"))


def test_validates_clean_and_opens_for_the_engine(draft, hf_qwen3, gguf_qwen3_f32):
    assert errors(draft["path"]) == []
    assert errors(draft["path"], hf_qwen3) == [] and errors(draft["path"], gguf_qwen3_f32) == []
    doc = inspect_file(str(draft["path"]))
    assert doc["kind"] == "dspark-draft" and doc["findings"] == []
    mask = open_gguf(draft["path"]).metadata["tokenizer.ggml.mask_token_id"]
    assert doc["summary"] == [
        f"mtp/dspark: stages=2 block=4 markov_rank=32 noise_token={mask} target_layers=-1,0",
        "dflash.target_layers=0,1 (llama.cpp reads the input of each listed layer: output id + 1)"]
    s = open_support(draft["path"], target=gguf_qwen3_f32)
    hp = s.hparams
    assert (s.kind, hp.layout, hp.block_size, hp.markov_rank, hp.mask_token_id) == \
        ("dspark-draft", "llama.cpp", 4, 32, mask)
    assert hp.target_layers == [-1, 0] and hp.sample_from_anchor
    assert (hp.draft.n_layer, hp.draft.n_head, hp.draft.head_dim, hp.draft.n_ff) == (2, 4, 96, 320)
    assert s.tensor("fc").name == "fc.weight" and s.tensor("attn_q", layer=1).name == "blk.1.attn_q.weight"
    assert s.tensor("conf_proj_bias").name == "conf_proj.bias"


def test_gguf_target_and_the_dspark_architecture_name(draft, gguf_qwen3_f32, tmp_path):
    r = cli("quantize", draft["folder"], "--dspark-out", tmp_path / "g.gguf", "--target", gguf_qwen3_f32)
    assert r.exit_code == 0, r.output
    a, b = open_gguf(draft["path"]), open_gguf(tmp_path / "g.gguf")
    assert a.metadata["tokenizer.ggml.tokens"] == b.metadata["tokenizer.ggml.tokens"]
    # one llama.cpp version names the architecture "dspark": read it the same way
    keys = {k.replace("dflash.", "dspark.", 1): (v, *a.value_type(k)) for k, v in a.metadata.items()
            if k.startswith("dflash.")}
    renamed = rewrite_gguf(draft["path"], tmp_path / "dspark.gguf", arch="dspark",
                           drop_keys=[k for k in a.metadata if k.startswith("dflash.")], set_keys=keys)
    doc = inspect_file(str(renamed))
    assert doc["kind"] == "dspark-draft" and doc["findings"] == []
    assert open_support(renamed).hparams.block_size == 4


@pytest.mark.parametrize("case,change,want", [
    ("no-layers", dict(drop_keys=["dflash.target_layers"]),
     ["DFlash model requires 'target_layers' in GGUF metadata"]),
    ("no-block", dict(drop_keys=["dflash.block_size"]),
     ["DSpark draft requires 'dflash.block_size' in GGUF metadata"]),
    ("no-fc", dict(drop_tensors=["fc.weight"]), ["tensor 'fc.weight' not found"]),
    ("shape", dict(reshape={"output_norm.weight": np.ones(128, np.float32)}),
     ["tensor 'output_norm.weight' has wrong shape; expected   256, got   128,     1,     1,     1"]),
    ("fc-width", dict(reshape={"fc.weight": np.zeros((256, 768), np.float32)}),
     ["tensor 'fc.weight' has wrong shape; expected   512,   256, got   768,   256,     1,     1"]),
    ("no-rms", dict(drop_keys=["dflash.attention.layer_norm_rms_epsilon"]),
     ["key not found in model: dflash.attention.layer_norm_rms_epsilon"]),
    ("no-mask", dict(drop_keys=["tokenizer.ggml.mask_token_id"]),
     ["tokenizer.ggml.mask_token_id is missing: llama.cpp's drafter takes its mask token from "
      "the vocabulary and would draft with token -1"]),
])
def test_llama_cpp_messages(draft, tmp_path, case, change, want):
    bad = rewrite_gguf(draft["path"], tmp_path / f"{case}.gguf", **change)
    assert cli_errors(bad) == (1, want)


def test_several_defects_and_mismatched_targets(draft, hf_llama, hf_qwen3, tmp_path):
    bad = rewrite_gguf(draft["path"], tmp_path / "many.gguf",
                       drop_keys=["dflash.target_layers", "dflash.block_size"], drop_tensors=["fc.weight"])
    r = cli("inspect", bad)
    assert r.exit_code == 1
    for line in ("error: DFlash model requires 'target_layers' in GGUF metadata",
                 "error: DSpark draft requires 'dflash.block_size' in GGUF metadata",
                 "error: tensor 'fc.weight' not found"):
        assert line in r.stdout.splitlines()
    errs = errors(draft["path"], hf_llama)
    assert errs[0] == f"the draft's vocabulary has 416 tokens, but {hf_llama} has 384"
    far = rewrite_gguf(draft["path"], tmp_path / "far.gguf",
                       set_keys={"dflash.target_layers": ([1, 3], V.ARRAY, V.INT32)})
    assert errors(far, hf_qwen3) == [
        f"dflash.target_layers 3 reads the output of target layer 2, but {hf_qwen3} has "
        f"2 layers"]
    r = cli("inspect", far, "--target", hf_qwen3)
    assert r.exit_code == 1 and "target layer 2" in r.stdout
    # on a 1-layer target, layer 0 is the last: llama.cpp cannot capture its output
    one = hf_models.build_tiny_qwen3(tmp_path / "one", num_hidden_layers=1)
    assert errors(draft["path"], one) == [
        f"target layer 0 (dflash.target_layers 1) is the output of the last of {one}'s 1 layers: "
        f"llama.cpp's qwen3 graph captures only the inputs of layers 0..0 and aborts on it "
        f"(GGML_ASSERT layer input tensor is null); a draft for llama.cpp reads layers up to -1"]


def test_converter_refusals(draft, hf_qwen3, hf_llama, tmp_path):
    base = ["quantize", draft["folder"], "--dspark-out", tmp_path / "x.gguf"]
    for extra, code, msg in (
            (["--target", hf_qwen3, "--layout", "ds4"], 2, "llama.cpp's layout"),
            (["--target", hf_qwen3, "--dspark-block-size", "5"], 2, "may only be lowered"),
            (["--target", hf_qwen3, "--dspark-target-layers", "1,0"], 2, "not strictly increasing"),
            (["--target", hf_llama], 1, "vocabulary size is 416, but the target")):
        r = cli(*base, *extra)
        assert r.exit_code == code and msg in r.stderr, (extra, r.stderr)
        assert not (tmp_path / "x.gguf").exists()
    cfg = json.loads((draft["folder"] / "config.json").read_text())
    gated = tmp_path / "gated"
    gated.mkdir()
    for p in draft["folder"].iterdir():
        (gated / p.name).write_bytes(p.read_bytes())
    (gated / "config.json").write_text(json.dumps(dict(cfg, markov_head_type="gated")))
    r = cli("quantize", gated, "--dspark-out", tmp_path / "y.gguf", "--target", hf_qwen3)
    assert r.exit_code == 1 and "markov_head_type 'gated' is not supported" in r.stderr
    r = cli("quantize", draft["folder"], "--dspark-out", tmp_path / "z.gguf", "--target", hf_qwen3,
            "--dspark-block-size", "2")
    assert r.exit_code == 0 and open_gguf(tmp_path / "z.gguf").metadata["dflash.block_size"] == 2


def test_the_last_layer_is_refused_for_llama_cpp(draft, hf_qwen3, gguf_qwen3_f32, tmp_path):
    """llama.cpp's qwen3 / llama graphs expose the inputs of layers 0..n-1 only: a draft reading
    the last layer's output (dflash id n) aborts there. The writer refuses it, naming the layer;
    `inspect --target` reports such a file (written anyway for ds4tools' engine) as invalid, and
    the engine, which reads any layer's output, still loads it."""
    r = cli("quantize", draft["folder"], "--dspark-out", tmp_path / "x.gguf", "--target", hf_qwen3,
            "--dspark-target-layers", "0,1")
    assert r.exit_code == 1 and r.stderr.count("\n") == 1, r.stderr
    assert "target layer 1 (dflash.target_layers 2) is the output of the last of" in r.stderr
    assert "llama.cpp's qwen3 graph captures only the inputs of layers 0..1" in r.stderr
    assert not (tmp_path / "x.gguf").exists()
    quantize_model(draft["folder"], None, QuantizeOptions(
        "Q8_0", dspark_out=str(tmp_path / "y.gguf"), target=str(hf_qwen3), progress=False,
        dspark_target_layers=[0, 1], dspark_allow_output_layer=True), report=lambda m: None)
    want = (f"target layer 1 (dflash.target_layers 2) is the output of the last of {gguf_qwen3_f32}'s "
            f"2 layers")
    errs = errors(tmp_path / "y.gguf", gguf_qwen3_f32)
    assert len(errs) == 1 and errs[0].startswith(want), errs
    assert errors(tmp_path / "y.gguf") == []  # alone, the file is well formed
    r = cli("inspect", tmp_path / "y.gguf", "--target", gguf_qwen3_f32)
    assert r.exit_code == 1 and want in r.stderr
    with pytest.raises(InvalidContentError, match="dflash.target_layers 2"):
        open_support(tmp_path / "y.gguf", target=gguf_qwen3_f32)
    s = open_support(tmp_path / "y.gguf", target=gguf_qwen3_f32, runtime="ds4tools")
    assert s.hparams.target_layers == [0, 1]
    assert [p.only for p in s.problems if p.level == "error"] == ["llama.cpp"]
