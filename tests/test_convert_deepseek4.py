"""`ds4tools quantize` on a DeepSeek V4 Hugging Face checkpoint (``DeepseekV4ForCausalLM``): FP8
E4M3 block-scaled dense matrices and FP4 E2M1 experts decoded to llama.cpp's ``deepseek4``
layout, the mixes (llama.cpp's and ds4's 2-bit preset), ``--mtp-out`` writing the MTP layer as
ds4's support file, and the bad inputs. The engine runs every file; where llama-cpp-python is
installed llama.cpp loads the converted file, its logits match, and its quantizer produces the
same bytes."""
import json
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner
from gguf import GGUFReader

from ds4tools.cli import main
from ds4tools.engine import Engine
from ds4tools.errors import InvalidContentError, UsageError
from ds4tools.quantize import QuantizeOptions, quantize_model
from tests import deepseek4_model
from tests.fixtures import hf_moe_models as M
from tests.reference_model import byte_level_tokenizer_metadata

try:
    import llama_cpp as _llama_cpp
except ImportError:  # the checks against llama.cpp skip, saying why
    _llama_cpp = None
needs_llama_cpp = pytest.mark.skipif(_llama_cpp is None, reason="llama-cpp-python is not installed: "
                                     "the checks against llama.cpp itself need it (optional)")

IDS = [5, 17, 42, 99, 7, 250, 3, 64, 128, 11, 5, 17]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return M.build_deepseek4(tmp_path_factory.mktemp("dsv4") / "hf")


@pytest.fixture(scope="module")
def converted(ckpt, tmp_path_factory):
    d = tmp_path_factory.mktemp("dsv4-out")
    out = {}
    for t in ("F32", "Q8_0"):
        out[t] = run(ckpt[0], d / f"{t}.gguf", t)[0].output
    return out


def run(src, out, type_name, **kw):
    notes = []
    r = quantize_model(src, out, QuantizeOptions(type_name, progress=False, **kw), report=notes.append)
    return r, notes


def read(path):
    r = GGUFReader(path)
    md = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    return md, {t.name: t for t in r.tensors}


def values(t) -> np.ndarray:
    shape = tuple(int(s) for s in reversed(t.shape))
    return np.asarray(t.data).reshape(shape)


def stored(t) -> np.ndarray:
    return np.asarray(t.data).view(np.uint8).reshape(-1)


def cfg_of(folder) -> dict:
    return json.loads((folder / "config.json").read_text())


def model_weights(decoded: dict, n_layer: int) -> dict:
    """The decoded weights of the model itself (no MTP layer)."""
    return {n: a for n, a in decoded.items()
            if not n.startswith("mtp.") and not n.startswith(f"blk.{n_layer}.")}


# --- the file -------------------------------------------------------------------------------------


def test_names_shapes_keys_and_decoded_values(ckpt, converted):
    folder, decoded = ckpt
    cfg = cfg_of(folder)
    n = cfg["num_hidden_layers"]
    md, t = read(converted["F32"])
    want = model_weights(decoded, n)
    assert set(t) == set(want)
    for name, a in want.items():
        got = values(t[name])
        assert got.shape == a.shape, name
        if name.endswith("tid2eid.weight"):
            assert t[name].tensor_type.name == "I32"
        assert np.array_equal(got, a), name  # the FP8 / FP4 / BF16 storage decoded exactly
    assert "blk.0.exp_probs_b.bias" not in t  # the hash layer's unused bias is left out
    a = "deepseek4"
    assert md["general.architecture"] == a and md[f"{a}.block_count"] == n
    assert f"{a}.nextn_predict_layers" not in md
    for key, v in {"embedding_length": cfg["hidden_size"], "attention.head_count_kv": 1,
                   "attention.key_length": cfg["head_dim"], "rope.dimension_count": cfg["qk_rope_head_dim"],
                   "attention.q_lora_rank": cfg["q_lora_rank"],
                   "attention.sliding_window": cfg["sliding_window"],
                   "expert_gating_func": 4, "attention.output_group_count": cfg["o_groups"],
                   "attention.output_lora_rank": cfg["o_lora_rank"],
                   "attention.compress_ratios": cfg["compress_ratios"],
                   "attention.indexer.top_k": cfg["index_topk"], "hyper_connection.count": cfg["hc_mult"],
                   "hyper_connection.sinkhorn_iterations": cfg["hc_sinkhorn_iters"],
                   "hash_layer_count": cfg["num_hash_layers"], "expert_shared_count": 1,
                   "embedding_length_out": cfg["hidden_size"] * cfg["hc_mult"],
                   "rope.scaling.type": "yarn", "expert_weights_norm": True}.items():
        assert md[f"{a}.{key}"] == v, key
    assert md[f"{a}.swiglu_clamp_exp"] == pytest.approx([cfg["swiglu_limit"]] * n)
    assert md["general.file_type"] == 0


def test_engine_logits_equal_a_gguf_written_from_the_decoded_weights(ckpt, converted, tmp_path):
    folder, decoded = ckpt
    cfg = cfg_of(folder)
    c4 = _config4(cfg)
    direct = tmp_path / "direct.gguf"
    w = model_weights(decoded, c4.n_layer)
    types = {n: "I32" if a.dtype == np.int32 else "F32" for n, a in w.items()}
    meta = deepseek4_model.metadata(c4) | byte_level_tokenizer_metadata(c4.n_vocab)
    deepseek4_model.write_gguf_i32(direct, meta, w, types)
    got = Engine(converted["F32"], n_ctx=64, exact=True).forward(IDS, 0, logits="all").logits
    want = Engine(direct, n_ctx=64, exact=True).forward(IDS, 0, logits="all").logits
    assert np.isfinite(got).all() and np.abs(got).max() > 0
    np.testing.assert_array_equal(got, want)


def _config4(cfg):
    import dataclasses
    return dataclasses.replace(
        deepseek4_model.Deepseek4Config(), n_vocab=cfg["vocab_size"], n_embd=cfg["hidden_size"],
        n_ff_exp=cfg["moe_intermediate_size"])


def test_quantized_files_greedy_decode_with_ds4tools_run(converted):
    for t in ("F32", "Q8_0"):
        r = CliRunner().invoke(main, ["run", "-m", str(converted[t]), "-p", "hello world", "-n", "6",
                                      "--temp", "0", "--ctx", "64", "--json"])
        assert r.exit_code == 0, r.output
        out = json.loads(r.stdout.strip().splitlines()[-1])
        assert len(out["tokens"]) == 6


def test_q8_0_logits_close_to_f32(converted):
    a = Engine(converted["F32"], n_ctx=64, exact=True).forward(IDS, 0, logits="all").logits
    b = Engine(converted["Q8_0"], n_ctx=64, exact=True).forward(IDS, 0, logits="all").logits
    assert np.abs(a - b).max() < 0.1 * np.abs(a).max()


@pytest.fixture(scope="module")
def q2_file(ckpt, tmp_path_factory):
    return run(ckpt[0], tmp_path_factory.mktemp("dsv4-q2") / "q2.gguf", "DS4_Q2")[0].output


def test_ds4_2bit_preset_assigns_ds4s_types(ckpt, q2_file, tmp_path):
    md, t = read(q2_file)
    types = {n: x.tensor_type.name for n, x in t.items()}
    assert types["blk.1.ffn_gate_exps.weight"] == types["blk.1.ffn_up_exps.weight"] == "IQ2_XXS"
    assert types["blk.1.ffn_down_exps.weight"] == "Q2_K"
    for n in ("blk.1.attn_q_a.weight", "blk.1.attn_q_b.weight", "blk.1.attn_kv.weight",
              "blk.1.attn_output_a.weight", "blk.1.attn_output_b.weight", "blk.1.ffn_gate_shexp.weight",
              "output.weight"):
        assert types[n] == "Q8_0", n
    for n in ("token_embd.weight", "blk.1.hc_attn_fn.weight", "output_hc_fn.weight",
              "blk.1.attn_compressor_kv.weight", "blk.1.attn_compressor_ape.weight",
              "blk.1.indexer.attn_q_b.weight", "blk.1.indexer.proj.weight", "blk.1.ffn_gate_inp.weight"):
        assert types[n] == "F16", n
    assert types["blk.0.ffn_gate_tid2eid.weight"] == "I32" and types["blk.1.attn_norm.weight"] == "F32"
    logits = Engine(q2_file, n_ctx=64).forward(IDS, 0, logits="last").logits
    assert np.isfinite(logits).all()
    # ds4's file name for the recipe names the same preset
    r2, _ = run(ckpt[0], tmp_path / "q2b.gguf", "IQ2XXS-w2Q2K-AProjQ8-SExpQ8-OutQ8")
    _, t2 = read(r2.output)
    assert all(np.array_equal(stored(t2[n]), stored(t[n])) for n in t)


# --- the MTP layer --------------------------------------------------------------------------------


def test_mtp_out_writes_ds4s_support_file_that_drafts_losslessly(ckpt, tmp_path):
    folder = ckpt[0]
    model, mtp = tmp_path / "m.gguf", tmp_path / "mtp.gguf"
    r, _ = run(folder, model, "Q8_0", mtp_out=str(mtp))
    assert r.summary.count("\n") == 1 and model.exists() and mtp.exists()
    _, t = read(mtp)
    assert {"mtp.0.e_proj.weight", "mtp.0.hc_head_fn.weight", "mtp.0.ffn_gate_exps.weight"} <= set(t)
    assert not [n for n in read(model)[1] if n.startswith("blk.4.")]
    res = CliRunner().invoke(main, ["inspect", str(mtp), "--target", str(model)])
    assert res.exit_code == 0, res.output
    outs = []
    for extra in ([], ["--mtp", str(mtp), "--mtp-draft", "2"]):
        res = CliRunner().invoke(main, ["run", "-m", str(model), "-p", "hello world", "-n", "8",
                                        "--temp", "0", "--ctx", "64", "--json", *extra])
        assert res.exit_code == 0, res.output
        outs.append(json.loads(res.stdout.strip().splitlines()[-1])["tokens"])
    assert outs[0] == outs[1]
    with pytest.raises(UsageError, match="already exists"):
        run(folder, tmp_path / "m2.gguf", "Q8_0", mtp_out=str(mtp))
    assert not (tmp_path / "m2.gguf").exists()
    only = tmp_path / "only"
    only.mkdir()
    run(folder, None, "Q8_0", mtp_out=str(only / "mtp.gguf"), only_support=True)
    assert list(only.iterdir()) == [only / "mtp.gguf"]
    assert (only / "mtp.gguf").read_bytes() == mtp.read_bytes()
    r, _ = run(folder, tmp_path / "dry.gguf", "Q8_0", mtp_out=str(tmp_path / "dry-mtp.gguf"), dry_run=True)
    assert "blk.1.ffn_gate_exps.weight" in r.summary and "mtp.0.e_proj.weight" in r.summary
    assert not (tmp_path / "dry.gguf").exists() and not (tmp_path / "dry-mtp.gguf").exists()


def test_keep_nextn_is_refused(ckpt, tmp_path):
    with pytest.raises(InvalidContentError, match="does not embed the MTP layer"):
        run(ckpt[0], tmp_path / "m.gguf", "Q8_0", keep_nextn=True)


# --- bad inputs: one line ------------------------------------------------------------------------


def cli_fails(folder, tmp_path, *extra):
    out = tmp_path / "o.gguf"
    r = CliRunner().invoke(main, ["quantize", str(folder), "-o", str(out), "--type", "Q8_0",
                                  *map(str, extra)])
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert "Traceback" not in r.output
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("ds4tools: ")
    assert not out.exists()
    return r.exit_code, lines[0]


def test_missing_tensors(tmp_path):
    d, _ = M.build_deepseek4(tmp_path / "a", drop=("layers.2.attn.compressor.wkv.weight",
                                                     "layers.2.attn.compressor.wkv.scale"))
    code, line = cli_fails(d, tmp_path)
    assert code == 1 and "tensor 'layers.2.attn.compressor.wkv.weight' is missing" in line
    d, _ = M.build_deepseek4(tmp_path / "b", drop=("layers.1.ffn.experts.3.w3.weight",
                                                     "layers.1.ffn.experts.3.w3.scale"))
    code, line = cli_fails(d, tmp_path)
    assert code == 1 and "expert tensor 'layers.1.ffn.experts.3.w3.weight' is missing" in line
    no_experts = tuple(f"layers.3.ffn.experts.{x}.{p}.{s}" for x in range(8)
                       for p in ("w1", "w2", "w3") for s in ("weight", "scale"))
    d, _ = M.build_deepseek4(tmp_path / "e", drop=no_experts)
    code, line = cli_fails(d, tmp_path)
    assert code == 1 and "tensor 'layers.3.ffn.experts.0.w1.weight' is missing" in line
    d, _ = M.build_deepseek4(tmp_path / "c", drop=("layers.0.attn.wkv.scale",))
    code, line = cli_fails(d, tmp_path)
    assert code == 1 and "its block scales 'layers.0.attn.wkv.scale' are missing" in line


def test_wrong_scale_shapes(tmp_path):
    d, _ = M.build_deepseek4(tmp_path / "a")
    _rewrite(d, "layers.0.attn.wq_b.scale", np.full((2, 1), 127, np.uint8))
    code, line = cli_fails(d, tmp_path)
    assert code == 1 and "tensor 'layers.0.attn.wq_b.weight'" in line
    assert "FP8 scale 'layers.0.attn.wq_b.scale' has shape [2, 1], expected [1, 1]" in line
    d, _ = M.build_deepseek4(tmp_path / "b")
    _rewrite(d, "layers.1.ffn.experts.0.w2.scale", np.full((256, 4), 127, np.uint8))
    code, line = cli_fails(d, tmp_path)
    assert code == 1 and "tensor 'layers.1.ffn.experts.0.w2.weight'" in line
    assert "FP4 scale 'layers.1.ffn.experts.0.w2.scale' has shape [256, 4], expected [256, 8]" in line


def test_config_problems(tmp_path):
    d, _ = M.build_deepseek4(tmp_path / "a")
    cfg = cfg_of(d)
    for over, msg in (({"compress_ratios": [0, 4]}, "'compress_ratios' must list an integer per layer"),
                      ({"compress_ratios": [0, 8, 128, 4, 0]}, "compress_ratios holds 8"),
                      ({"scoring_func": "tanh"}, "scoring_func 'tanh' is not supported"),
                      ({"hc_mult": None}, "lacks 'hc_mult'"),
                      ({"num_experts_per_tok": 9}, "num_experts_per_tok (9) is larger")):
        (d / "config.json").write_text(json.dumps({**cfg, **over}))
        code, line = cli_fails(d, tmp_path)
        assert code == 1 and msg in line, line


def _rewrite(folder, name, raw):
    """Replace one stored tensor of the fixture's safetensors (its dtype kept)."""
    path = folder / "model.safetensors"
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    body = data[8 + n:]
    entries = {}
    for k, v in header.items():
        if k == "__metadata__":
            continue
        a, b = v["data_offsets"]
        entries[k] = (v["dtype"], v["shape"], body[a:b])
    entries[name] = (entries[name][0], list(raw.shape), raw.tobytes())
    from tests.fixtures.support_models import save_raw_safetensors
    save_raw_safetensors(path, entries)


# --- llama.cpp itself --------------------------------------------------------------------------

LOGITS_CHILD = """
import json, sys
import numpy as np
import llama_cpp as L
path, toks, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
L.llama_backend_init()
mp = L.llama_model_default_params()
mp.use_extra_bufts = False
model = L.llama_model_load_from_file(path.encode(), mp)
assert model, "llama.cpp could not load the file"
cp = L.llama_context_default_params()
cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_threads, cp.n_threads_batch = 64, 64, 64, 1, 1
cp.type_k = cp.type_v = L.GGML_TYPE_F32
cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED
ctx = L.llama_init_from_model(model, cp)
assert ctx
n = len(toks)
batch = L.llama_batch_init(n, 0, 1)
for i, t in enumerate(toks):
    batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = t, i, 1, 1
    batch.seq_id[i][0] = 0
batch.n_tokens = n
assert L.llama_decode(ctx, batch) == 0
n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
rows = np.stack([np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(n_vocab,)).copy()
                 for i in range(n)])
np.save(out, rows)
"""


@needs_llama_cpp
def test_llama_cpp_loads_the_converted_file_and_its_logits_match(converted, tmp_path):
    out = tmp_path / "logits.npy"
    p = subprocess.run([sys.executable, "-c", LOGITS_CHILD, str(converted["F32"]), json.dumps(IDS),
                        str(out)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-1500:]
    got = np.load(out)
    want = Engine(converted["F32"], n_ctx=64, exact=True).forward(IDS, 0, logits="all").logits
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3 * np.abs(want).max())
    assert (got.argmax(1) == want.argmax(1)).all()


@needs_llama_cpp
def test_llama_cpp_runs_the_ds4_q2_file(q2_file, tmp_path):
    out = tmp_path / "logits.npy"
    p = subprocess.run([sys.executable, "-c", LOGITS_CHILD, str(q2_file), json.dumps(IDS), str(out)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-1500:]
    got = np.load(out)
    want = Engine(q2_file, n_ctx=64).forward(IDS, 0, logits="all").logits  # the int8 path
    assert np.abs(got - want).max() < 0.05 * np.abs(want).max()
    assert (got.argmax(1) == want.argmax(1)).all()


def llama_quantize(src, dst, mix):
    import ctypes
    from gguf import LlamaFileType
    p = _llama_cpp.llama_model_quantize_default_params()
    p.ftype = int(LlamaFileType["MOSTLY_" + mix])
    p.nthread = 1
    assert _llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(p)) == 0


@needs_llama_cpp
@pytest.mark.parametrize("mix", ["Q8_0", "Q4_K_M"])
def test_mixes_byte_identical_to_llama_quantize(ckpt, converted, mix, tmp_path):
    llama_quantize(converted["F32"], tmp_path / "ref.gguf", mix)
    ours = converted[mix] if mix in converted else run(ckpt[0], tmp_path / "ours.gguf", mix)[0].output
    _, ref = read(tmp_path / "ref.gguf")
    _, got = read(ours)
    assert set(ref) == set(got)
    for name in ref:
        assert got[name].tensor_type == ref[name].tensor_type, name
        assert np.array_equal(stored(got[name]), stored(ref[name])), name
