"""Lying or broken support inputs: clear one-line errors, the right exit code, no huge loops or
allocations, no output file left behind."""
import json
import time

import pytest
from click.testing import CliRunner
from gguf import GGUFValueType as V

from ds4tools.cli import main
from ds4tools.gguf_io import open_gguf
from ds4tools.inspect import inspect_file
from ds4tools.quantize import QuantizeOptions, quantize_model
from tests.fixtures.support_models import (build_tiny_dspark_qwen3, build_tiny_dsv4,
                                           build_tiny_dsv4_target, rewrite_gguf)


def cli(*args):
    r = CliRunner().invoke(main, [str(a) for a in args])
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    return r


def errors(path):
    doc = inspect_file(str(path))
    return [x["message"] for x in doc["findings"] if x["level"] == "error"]


@pytest.fixture(scope="module")
def draft(hf_qwen3, tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    folder, _ = build_tiny_dspark_qwen3(d / "draft", hf_qwen3)
    quantize_model(folder, None, QuantizeOptions("Q8_0", dspark_out=str(d / "draft.gguf"),
                                                 target=str(hf_qwen3), progress=False), report=lambda m: None)
    return d / "draft.gguf"


def test_lying_block_count_is_one_error_not_a_billion(draft, tmp_path):
    bad = rewrite_gguf(draft, tmp_path / "b.gguf", set_keys={"dflash.block_count": (10 ** 9, V.UINT32, None)})
    start = time.perf_counter()
    assert errors(bad) == ["dflash.block_count is 1000000000, but the file has tensors for 2 block(s)"]
    assert time.perf_counter() - start < 10


def test_lying_stage_number_in_a_dspark_file(tmp_path):
    folder, _ = build_tiny_dsv4(tmp_path / "ckpt", "dspark-v4")
    target = build_tiny_dsv4_target(tmp_path / "t")
    quantize_model(folder, None, QuantizeOptions("Q8_0", dspark_out=str(tmp_path / "d.gguf"), target=str(target),
                                                 progress=False), report=lambda m: None)
    f = open_gguf(tmp_path / "d.gguf")
    import numpy as np
    stray = {"mtp.1000000.attn_norm.weight": np.ones(256, np.float32)}
    from ds4tools.gguf_io import GGUFStreamWriter
    with GGUFStreamWriter(tmp_path / "x.gguf", f.architecture) as w:
        for key, value in f.metadata.items():
            if key != "general.architecture":
                w.add_key(key, value, *f.value_type(key))
        for name, t in f.tensors.items():
            w.add_tensor_info(name, t.shape, t.type_name)
        w.add_tensor_info("mtp.1000000.attn_norm.weight", (256,), "F32")
        w.begin()
        for name, t in f.tensors.items():
            w.write_tensor(name, t.raw())
        w.write_tensor("mtp.1000000.attn_norm.weight", stray["mtp.1000000.attn_norm.weight"])
    start = time.perf_counter()
    errs = errors(tmp_path / "x.gguf")
    assert errs[0] == "the mtp.* stages are not numbered 0..1000000: the file has stage(s) 0, 1, 2, 1000000"
    assert time.perf_counter() - start < 10


def test_lying_nextn_count(hf_qwen3_nextn, tmp_path):
    quantize_model(hf_qwen3_nextn, tmp_path / "m.gguf", QuantizeOptions("Q8_0", keep_nextn=True, progress=False),
                   report=lambda m: None)
    bad = rewrite_gguf(tmp_path / "m.gguf", tmp_path / "b.gguf",
                       set_keys={"qwen3.nextn_predict_layers": (2 ** 31, V.UINT32, None)})
    assert ("qwen3.nextn_predict_layers is 2147483648: more than the model's 3 blocks / 40 tensors "
            "can hold") in errors(bad)
    r = cli("quantize", bad, "--type", "Q8_0", "--mtp-out", tmp_path / "x.gguf", "--only-support")
    assert r.exit_code == 1 and not (tmp_path / "x.gguf").exists()


def _edit_safetensors(folder, edit):
    from tests.fixtures.support_models import save_raw_safetensors
    raw = (folder / "model.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        entries[name] = (info["dtype"], info["shape"], raw[8 + n + a:8 + n + b])
    edit(entries)
    save_raw_safetensors(folder / "model.safetensors", entries)


@pytest.mark.parametrize("case,edit,msg", [
    ("no-scale", lambda e: e.pop("mtp.0.attn.wq_a.scale"), "FP8 tensor 'mtp.0.attn.wq_a.weight' has no"),
    ("no-tensor", lambda e: e.pop("mtp.0.attn.wkv.weight"), "tensor 'mtp.0.attn.wkv.weight' is missing"),
    ("fp4-scale", lambda e: e.update({"mtp.0.ffn.experts.1.w2.scale": ("F8_E8M0", [256, 4], bytes(1024))}),
     "tensor 'mtp.0.ffn.experts.1.w2.weight': FP4 scale has shape [256, 4], expected [256, 8]"),
    ("int-weight", lambda e: e.update({"mtp.0.e_proj.weight": ("I32", [256, 256], bytes(256 * 256 * 4))}),
     "tensor 'mtp.0.e_proj.weight' has dtype I32"),
])
def test_broken_dsv4_checkpoints(tmp_path, case, edit, msg):
    folder, _ = build_tiny_dsv4(tmp_path / "ckpt", "mtp")
    _edit_safetensors(folder, edit)
    r = cli("quantize", folder, "--type", "Q8_0", "--mtp-out", tmp_path / "m.gguf", "--only-support")
    assert r.exit_code == 1 and msg in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "m.gguf").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".m.gguf")]


def test_lying_expert_count_in_config(tmp_path):
    folder, _ = build_tiny_dsv4(tmp_path / "ckpt", "mtp")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(cfg, n_routed_experts=10 ** 6)))
    start = time.perf_counter()
    r = cli("quantize", folder, "--type", "Q8_0", "--mtp-out", tmp_path / "m.gguf", "--only-support")
    assert r.exit_code == 1 and ("tensor 'mtp.0.ffn.gate.weight' has shape [4, 256], but the layout "
                                 "expects [1000000, 256] for mtp.0.ffn_gate_inp.weight") in r.stderr, r.stderr
    assert time.perf_counter() - start < 30


def test_lying_expert_count_with_a_matching_router_allocates_nothing(tmp_path):
    n = 20_000  # 20k experts of 256 x 256 would need 5 GiB of float32
    folder, _ = build_tiny_dsv4(tmp_path / "ckpt", "mtp")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(cfg, n_routed_experts=n)))

    def edit(e):  # a router and bias that agree with the lie
        e["mtp.0.ffn.gate.weight"] = ("BF16", [n, 256], bytes(2 * 256 * n))
        e["mtp.0.ffn.gate.bias"] = ("F32", [n], bytes(4 * n))
    _edit_safetensors(folder, edit)
    r = cli("quantize", folder, "--type", "Q8_0", "--mtp-out", tmp_path / "m.gguf", "--only-support")
    assert r.exit_code == 1 and "tensor 'mtp.0.ffn.experts.4.w1.weight' is missing" in r.stderr, r.stderr
