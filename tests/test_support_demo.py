"""Support GGUFs of the bundled demo model (ds4tools/data/demo): its target's NextN layer as an
MTP support file and its DeepSpec DSpark draft as llama.cpp's dflash draft, both validated
against the converted target (for the draft: every target layer it reads is one llama.cpp
exposes) and compared with the checkpoint's values."""
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

import ds4tools
from ds4tools import formats
from ds4tools.gguf_io import open_gguf
from ds4tools.inspect import inspect_file
from ds4tools.quantize import QuantizeOptions, quantize_model
from ds4tools.support import open_support

DEMO = Path(ds4tools.__file__).parent / "data" / "demo"
pytestmark = pytest.mark.skipif(
    not (DEMO / "target" / "model.safetensors").exists() or not (DEMO / "dspark" / "model.safetensors").exists(),
    reason="the demo model (ds4tools/data/demo) is not installed yet")


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    d = tmp_path_factory.mktemp("demo-support")
    quiet = lambda m: None  # noqa: E731
    quantize_model(DEMO / "target", d / "target.gguf",
                   QuantizeOptions("Q8_0", mtp_out=str(d / "mtp.gguf"), progress=False), report=quiet)
    # written as ds4tools.demo writes it: the writer's check that llama.cpp can capture every
    # target layer the draft reads is on
    quantize_model(DEMO / "dspark", None, QuantizeOptions("Q8_0", dspark_out=str(d / "draft.gguf"),
                                                          target=str(DEMO / "target"), progress=False),
                   report=quiet)
    return d


def _valid(path, target):
    doc = inspect_file(str(path), target=str(target))
    assert doc["valid"], doc["findings"]
    return doc


def _close(t, values):
    got = t.to_float32()
    if t.type_name == "Q8_0":
        np.testing.assert_array_equal(np.asarray(t.raw()), formats.quantize(values, "Q8_0"))
    else:
        np.testing.assert_array_equal(got, values.astype(np.float32))


def test_demo_mtp_support_file(demo):
    doc = _valid(demo / "mtp.gguf", demo / "target.gguf")
    assert doc["kind"] == "mtp-support" and doc["architecture"] == "qwen3-mtp"
    w = {k: v.astype(np.float32) for k, v in load_file(str(DEMO / "target" / "model.safetensors")).items()}
    f = open_gguf(demo / "mtp.gguf")
    L = f.metadata["qwen3-mtp.nextn_layer_index"]
    H = f.metadata["qwen3-mtp.embedding_length"]
    eh = w[f"model.layers.{L}.eh_proj.weight"]
    _close(f.tensors["mtp.0.e_proj.weight"], eh[:, :H])
    _close(f.tensors["mtp.0.h_proj.weight"], eh[:, H:])
    _close(f.tensors["mtp.0.norm.weight"], w[f"model.layers.{L}.shared_head.norm.weight"])
    _close(f.tensors["mtp.0.attn_q.weight"], w[f"model.layers.{L}.self_attn.q_proj.weight"])
    s = open_support(demo / "mtp.gguf", target=demo / "target.gguf")
    assert s.hparams.dims.n_layer == L


def test_demo_dspark_draft(demo):
    # Valid for llama.cpp too: it reads target layers 1, 3, 4 (dflash ids 2, 4, 5), whose
    # outputs are the inputs of layers 2, 4, 5 that llama.cpp's qwen3 graph exposes; the last
    # layer's output (dflash id 6) is not among them.
    doc = _valid(demo / "draft.gguf", demo / "target.gguf")
    assert doc["kind"] == "dspark-draft"
    assert not [x for x in doc["findings"] if x["level"] == "error"], doc["findings"]
    assert inspect_file(str(demo / "draft.gguf"))["valid"]
    import json
    cfg = json.loads((DEMO / "dspark" / "config.json").read_text())
    f = open_gguf(demo / "draft.gguf")
    assert cfg["target_layer_ids"] == [1, 3, 4]
    assert list(f.metadata["dflash.target_layers"]) == [2, 4, 5]
    assert list(f.metadata["dflash.target_layers"]) == [i + 1 for i in cfg["target_layer_ids"]]
    assert f.metadata["dflash.block_size"] == cfg["block_size"]
    assert f.metadata["tokenizer.ggml.mask_token_id"] == cfg["mask_token_id"]
    w = {k: v.astype(np.float32) for k, v in load_file(str(DEMO / "dspark" / "model.safetensors")).items()}
    _close(f.tensors["fc.weight"], w["fc.weight"])
    _close(f.tensors["markov_w1.weight"], w["markov_head.markov_w1.weight"])
    _close(f.tensors["conf_proj.bias"], w["confidence_head.proj.bias"])
    s = open_support(demo / "draft.gguf", target=demo / "target.gguf", runtime="ds4tools")
    assert s.hparams.target_layers == cfg["target_layer_ids"] and s.hparams.markov_rank == cfg["markov_rank"]
