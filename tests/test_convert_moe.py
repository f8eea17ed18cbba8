"""`ds4tools quantize` on mixture-of-experts Hugging Face checkpoints: DeepSeek V3 (deepseek2),
GLM-4.5 (glm4moe) and GLM-5 (glm-dsa), with FP8 block-scaled weights, NextN layers embedded,
left out or split with --mtp-out, and the bad inputs. Where llama-cpp-python is installed the
files are also loaded and run by llama.cpp itself, and its quantizer must produce the same bytes."""
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from click.testing import CliRunner
from gguf import GGUFReader, LlamaFileType

from ds4tools import formats
from ds4tools.cli import main
from ds4tools.errors import UsageError
from ds4tools.quantize import QuantizeOptions, open_source, quantize_model
from ds4tools.quantize.convert_moe import decode_fp8_block_scaled
from ds4tools.support.fp8 import E4M3_VALUES
from tests.fixtures import hf_models
from tests.fixtures import hf_moe_models as M

try:
    import llama_cpp as _llama_cpp
except ImportError:  # the checks against llama.cpp skip, saying why
    _llama_cpp = None
needs_llama_cpp = pytest.mark.skipif(_llama_cpp is None, reason="llama-cpp-python is not installed: "
                                     "the checks against llama.cpp itself need it (optional)")

ARCHS = ("deepseek2", "glm4moe", "glm-dsa")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-moe")
    out = {a: M.BUILDERS[a](root / a) for a in ARCHS}
    out["deepseek2-fp8"] = M.build_deepseek3(root / "deepseek2-fp8", fp8=True)
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
    """An F32 GGUF tensor in numpy order."""
    return np.asarray(t.data, np.float32).reshape(tuple(int(s) for s in reversed(t.shape)))


def stored(t) -> np.ndarray:
    return np.asarray(t.data).view(np.uint8).reshape(-1)


def cfg_of(folder) -> dict:
    return json.loads((folder / "config.json").read_text())


# --- what the files hold ----------------------------------------------------------------------


def expected_tensors(arch: str, cfg: dict, blocks) -> dict:
    """GGUF name -> ggml shape (ne0 first) of every tensor llama.cpp loads for these blocks."""
    E, H, ff, fe, X = (cfg["hidden_size"], cfg["num_attention_heads"], cfg["intermediate_size"],
                       cfg["moe_intermediate_size"], cfg["n_routed_experts"])
    n = cfg["num_hidden_layers"]
    out = {}
    for L in blocks:
        b = f"blk.{L}."
        out[b + "attn_norm.weight"] = (E,)
        if arch == "glm4moe":
            hd, kv = cfg["head_dim"], cfg["num_key_value_heads"]
            out[b + "post_attention_norm.weight"] = (E,)
            for p, rows in (("q", H * hd), ("k", kv * hd), ("v", kv * hd)):
                out[b + f"attn_{p}.weight"] = (E, rows)
                out[b + f"attn_{p}.bias"] = (rows,)
            out[b + "attn_q_norm.weight"] = out[b + "attn_k_norm.weight"] = (hd,)
            out[b + "attn_output.weight"] = (H * hd, E)
        else:
            ql, kvl = cfg["q_lora_rank"], cfg["kv_lora_rank"]
            nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
            out[b + "ffn_norm.weight"] = (E,)
            out[b + "attn_q_a.weight"] = (E, ql)
            out[b + "attn_q_a_norm.weight"] = (ql,)
            out[b + "attn_q_b.weight"] = (ql, H * (nope + rope))
            out[b + "attn_kv_a_mqa.weight"] = (E, kvl + rope)
            out[b + "attn_kv_a_norm.weight"] = (kvl,)
            out[b + "attn_k_b.weight"] = (nope, kvl, H)
            out[b + "attn_v_b.weight"] = (kvl, v, H)
            out[b + "attn_output.weight"] = (H * v, E)
            if arch == "glm-dsa":
                ih, idim = cfg["index_n_heads"], cfg["index_head_dim"]
                out[b + "indexer.attn_q_b.weight"] = (ql, ih * idim)
                out[b + "indexer.attn_k.weight"] = (E, idim)
                out[b + "indexer.k_norm.weight"] = out[b + "indexer.k_norm.bias"] = (idim,)
                out[b + "indexer.proj.weight"] = (E, ih)
        if L < cfg["first_k_dense_replace"]:
            out[b + "ffn_gate.weight"] = out[b + "ffn_up.weight"] = (E, ff)
            out[b + "ffn_down.weight"] = (ff, E)
        else:
            sh = fe * cfg["n_shared_experts"]
            out[b + "ffn_gate_inp.weight"] = (E, X)
            out[b + "exp_probs_b.bias"] = (X,)
            out[b + "ffn_gate_exps.weight"] = out[b + "ffn_up_exps.weight"] = (E, fe, X)
            out[b + "ffn_down_exps.weight"] = (fe, E, X)
            out[b + "ffn_gate_shexp.weight"] = out[b + "ffn_up_shexp.weight"] = (E, sh)
            out[b + "ffn_down_shexp.weight"] = (sh, E)
        if L >= n:
            out[b + "nextn.eh_proj.weight"] = (2 * E, E)
            for p in ("enorm", "hnorm", "shared_head_norm"):
                out[b + f"nextn.{p}.weight"] = (E,)
    return out


def expected_keys(arch: str, cfg: dict, n_blocks: int) -> dict:
    k = {"block_count": n_blocks, "context_length": cfg["max_position_embeddings"],
         "embedding_length": cfg["hidden_size"], "feed_forward_length": cfg["intermediate_size"],
         "attention.head_count": cfg["num_attention_heads"], "expert_count": cfg["n_routed_experts"],
         "expert_used_count": cfg["num_experts_per_tok"], "expert_gating_func": 2,
         "expert_group_count": cfg["n_group"], "expert_group_used_count": cfg["topk_group"],
         "leading_dense_block_count": cfg["first_k_dense_replace"],
         "expert_feed_forward_length": cfg["moe_intermediate_size"],
         "expert_shared_count": cfg["n_shared_experts"], "expert_weights_norm": True,
         "vocab_size": cfg["vocab_size"]}
    if arch == "glm4moe":
        k.update({"attention.head_count_kv": cfg["num_key_value_heads"],
                  "attention.key_length": cfg["head_dim"], "attention.value_length": cfg["head_dim"],
                  "rope.dimension_count": int(cfg["head_dim"] * cfg["partial_rotary_factor"])})
    else:
        kvl, rope = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
        k.update({"attention.head_count_kv": 1, "attention.q_lora_rank": cfg["q_lora_rank"],
                  "attention.kv_lora_rank": kvl, "attention.key_length": kvl + rope,
                  "attention.value_length": kvl,
                  "attention.key_length_mla": cfg["qk_nope_head_dim"] + rope,
                  "attention.value_length_mla": cfg["v_head_dim"], "rope.dimension_count": rope})
    if arch == "deepseek2":
        sc = cfg["rope_scaling"]
        k.update({"rope.scaling.type": "yarn", "rope.scaling.original_context_length":
                  sc["original_max_position_embeddings"]})
    if arch == "glm-dsa":
        k.update({"attention.indexer.head_count": cfg["index_n_heads"],
                  "attention.indexer.key_length": cfg["index_head_dim"],
                  "attention.indexer.top_k": cfg["index_topk"]})
    return {f"{arch}.{key}": v for key, v in k.items()}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("type_name", ["F32", "Q8_0", "Q4_K_M"])
def test_each_family_converts_with_llama_cpp_names_shapes_types_and_keys(ckpts, arch, type_name, tmp_path):
    folder = ckpts[arch]
    cfg = cfg_of(folder)
    r, _ = run(folder, tmp_path / "m.gguf", type_name, keep_nextn=True)
    md, tensors = read(r.output)
    n = cfg["num_hidden_layers"]
    want = expected_tensors(arch, cfg, range(n + 1))
    want.update({"token_embd.weight": (cfg["hidden_size"], cfg["vocab_size"]),
                 "output_norm.weight": (cfg["hidden_size"],),
                 "output.weight": (cfg["hidden_size"], cfg["vocab_size"])})
    assert {name: tuple(int(s) for s in t.shape) for name, t in tensors.items()} == want
    keys = expected_keys(arch, cfg, n + 1)
    keys[f"{arch}.nextn_predict_layers"] = 1
    for key, value in keys.items():
        assert md[key] == value, key
    assert md["general.architecture"] == arch
    assert md[f"{arch}.expert_weights_scale"] == pytest.approx(cfg["routed_scaling_factor"])
    assert md["general.file_type"] == int(LlamaFileType["ALL_F32" if type_name == "F32" else "MOSTLY_" + type_name])
    types = {name: t.tensor_type.name for name, t in tensors.items()}
    for name, t in types.items():
        if len(want[name]) == 1 or "ffn_gate_inp" in name:
            assert t == "F32", name  # norms, biases, the router: never quantized
        elif type_name in ("F32", "Q8_0"):
            assert t == type_name, name
    if type_name == "Q4_K_M":
        assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == "Q4_K"
        assert types["blk.1.ffn_gate_exps.weight"] == "Q4_K"
        assert types["blk.1.ffn_down_exps.weight"] == "Q5_0"  # rows of 64: Q4_K's fallback
        assert types[f"blk.{n}.ffn_down_exps.weight"] == "Q8_0"  # last layer: Q6_K, falling back


def test_f32_values_are_the_checkpoint_values_in_llama_cpp_layout(ckpts, tmp_path):
    folder = ckpts["deepseek2"]
    cfg, w = cfg_of(folder), hf_models.load_weights(folder)
    r, _ = run(folder, tmp_path / "m.gguf", "F32", keep_nextn=True)
    _, t = read(r.output)
    H, nope, v, kvl = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]
    kv_b = w["model.layers.1.self_attn.kv_b_proj.weight"].reshape(H, nope + v, kvl)
    k_b, v_b = values(t["blk.1.attn_k_b.weight"]), values(t["blk.1.attn_v_b.weight"])
    assert np.array_equal(k_b, kv_b[:, :nope, :].transpose(0, 2, 1))
    assert np.array_equal(v_b, kv_b[:, nope:, :])
    for proj in ("gate", "up", "down"):
        stacked = values(t[f"blk.2.ffn_{proj}_exps.weight"])
        for x in range(cfg["n_routed_experts"]):
            assert np.array_equal(stacked[x], w[f"model.layers.2.mlp.experts.{x}.{proj}_proj.weight"])
    assert np.array_equal(values(t["blk.1.exp_probs_b.bias"]), w["model.layers.1.mlp.gate.e_score_correction_bias"])
    assert np.array_equal(values(t["blk.2.nextn.eh_proj.weight"]), w["model.layers.2.eh_proj.weight"])
    assert np.array_equal(values(t["blk.2.nextn.shared_head_norm.weight"]), w["model.layers.2.shared_head.norm.weight"])


def test_quantized_experts_are_formats_bytes_of_the_stacked_tensor(ckpts, tmp_path):
    """Expert by expert quantization gives the bytes of the whole 3-D tensor (ggml works by row)."""
    folder = ckpts["glm4moe"]
    r32, _ = run(folder, tmp_path / "f32.gguf", "F32")
    r8, _ = run(folder, tmp_path / "q8.gguf", "Q8_0")
    _, t32 = read(r32.output)
    _, t8 = read(r8.output)
    for name in ("blk.1.ffn_gate_exps.weight", "blk.1.ffn_down_exps.weight", "blk.1.attn_q.weight"):
        want = formats.quantize(values(t32[name]), "Q8_0")
        assert np.array_equal(stored(t8[name]), want.reshape(-1)), name


def test_glm4moe_has_no_rope_permutation_and_keeps_its_biases(ckpts, tmp_path):
    folder = ckpts["glm4moe"]
    w = hf_models.load_weights(folder)
    r, _ = run(folder, tmp_path / "m.gguf", "F32")
    _, t = read(r.output)
    assert np.array_equal(values(t["blk.0.attn_q.weight"]), w["model.layers.0.self_attn.q_proj.weight"])
    assert np.array_equal(values(t["blk.0.attn_k.bias"]), w["model.layers.0.self_attn.k_proj.bias"])
    assert np.array_equal(values(t["blk.1.post_attention_norm.weight"]),
                          w["model.layers.1.post_attention_layernorm.weight"])


# --- FP8 ------------------------------------------------------------------------------------


def test_fp8_block_decode_is_exact_on_a_small_block():
    codes = np.array([[0x00, 0x38, 0xB8, 0x7E], [0x01, 0x40, 0x30, 0xFE], [0x08, 0x3C, 0x44, 0x50]], np.uint8)
    # 0x38 = 1.0, 0xB8 = -1.0, 0x7E = 448, 0x01 = 2^-9, 0x40 = 2, 0x30 = 0.5, 0x08 = 2^-6
    scale = np.array([[0.5, 3.0], [0.25, 2.0]], np.float32)  # blocks of 2 rows x 2 columns
    got = decode_fp8_block_scaled(codes, scale, block=(2, 2))
    want = E4M3_VALUES[codes] * np.repeat(np.repeat(scale, 2, 0), 2, 1)[:3, :4]
    assert np.array_equal(got, want)
    assert got[0, 1] == 0.5 and got[0, 3] == 448 * 3.0 and got[1, 3] == -448 * 3.0
    assert got[1, 0] == 2.0 ** -9 * 0.5 and got[2, 2] == 3.0 * 2.0
    with pytest.raises(ValueError, match=r"expected \[2, 2\]"):
        decode_fp8_block_scaled(codes, scale[:1], block=(2, 2))


def test_fp8_checkpoint_converts_to_the_decoded_values(ckpts, tmp_path):
    folder = ckpts["deepseek2-fp8"]
    st = open_source(folder, keep_nextn=True)
    by_name = {t.name: t for t in st.tensors}
    assert by_name["blk.1.attn_q_a.weight"].type_name == "F8_E4M3"
    assert by_name["blk.1.ffn_gate_exps.weight"].type_name == "F8_E4M3"
    r, _ = run(folder, tmp_path / "m.gguf", "F32", keep_nextn=True)
    _, t = read(r.output)
    from ds4tools.checkpoint import HFCheckpoint
    ck = HFCheckpoint(folder)

    def decoded(name):
        return decode_fp8_block_scaled(ck.tensors[name].load_raw(),
                                       ck.tensors[name + "_scale_inv"].load_float32())
    assert np.array_equal(values(t["blk.1.attn_q_a.weight"]), decoded("model.layers.1.self_attn.q_a_proj.weight"))
    assert np.array_equal(values(t["blk.1.ffn_up_exps.weight"])[3], decoded("model.layers.1.mlp.experts.3.up_proj.weight"))
    kv_b = decoded("model.layers.1.self_attn.kv_b_proj.weight").reshape(4, 64, 128)
    assert np.array_equal(values(t["blk.1.attn_v_b.weight"]), kv_b[:, 32:, :])
    # close to the float weights the FP8 was made from (E4M3 keeps 3 mantissa bits)
    plain = hf_models.load_weights(ckpts["deepseek2"])  # same seed and shapes, stored as F32
    a, b = values(t["blk.1.attn_q_a.weight"]), plain["model.layers.1.self_attn.q_a_proj.weight"]
    assert np.abs(a - b).max() <= 0.07 * np.abs(b).max()
    assert "weight_scale_inv" not in " ".join(t)


# --- NextN: left out, embedded, split --------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_nextn_is_left_out_by_default(ckpts, arch, tmp_path):
    r, notes = run(ckpts[arch], tmp_path / "m.gguf", "Q8_0")
    md, t = read(r.output)
    assert md[f"{arch}.block_count"] == 2 and f"{arch}.nextn_predict_layers" not in md
    assert not [n for n in t if n.startswith("blk.2.")]
    assert any("left out" in n and "NextN" in n for n in notes)


@pytest.mark.parametrize("arch", ARCHS)
def test_mtp_out_splits_trunk_and_mtp_only_files(ckpts, arch, tmp_path):
    folder = ckpts[arch]
    full, _ = run(folder, tmp_path / "full.gguf", "Q8_0", keep_nextn=True)
    r, _ = run(folder, tmp_path / "trunk.gguf", "Q8_0", mtp_out=str(tmp_path / "mtp.gguf"))
    assert r.summary.count("\n") == 1 and "trunk.gguf" in r.summary and "mtp.gguf" in r.summary
    md_f, t_f = read(full.output)
    md_t, t_t = read(tmp_path / "trunk.gguf")
    md_m, t_m = read(tmp_path / "mtp.gguf")
    for md in (md_t, md_m):
        assert md[f"{arch}.block_count"] == 3 and md[f"{arch}.nextn_predict_layers"] == 1
        assert md["tokenizer.ggml.tokens"] == md_f["tokenizer.ggml.tokens"]
    assert not [n for n in t_t if n.startswith("blk.2.")]
    assert set(t_m) == {n for n in t_f if n.startswith("blk.2.")} | {
        "token_embd.weight", "output_norm.weight", "output.weight"}
    # the two halves are the embedded file's tensors, byte for byte (with a mix the rules
    # count each file's own tensors, as llama-quantize does: see the llama.cpp test below)
    for part in (t_t, t_m):
        for name, t in part.items():
            assert t.tensor_type == t_f[name].tensor_type, name
            assert np.array_equal(stored(t), stored(t_f[name])), name


def test_inspect_accepts_the_split_files(ckpts, tmp_path):
    run(ckpts["deepseek2"], tmp_path / "t.gguf", "Q8_0", mtp_out=str(tmp_path / "m.gguf"))
    r = CliRunner().invoke(main, ["inspect", str(tmp_path / "t.gguf")])
    assert r.exit_code == 0, r.output
    assert "deepseek2.nextn_predict_layers is 1 but the NextN tensors are not in this file" in r.output
    r = CliRunner().invoke(main, ["inspect", str(tmp_path / "m.gguf")])
    assert r.exit_code == 0 and "error" not in r.output, r.output


def test_mtp_out_only_support_dry_run_and_refusals(ckpts, tmp_path):
    folder = ckpts["glm-dsa"]
    r, _ = run(folder, None, "Q8_0", mtp_out=str(tmp_path / "mtp.gguf"), only_support=True)
    assert (tmp_path / "mtp.gguf").exists() and list(tmp_path.iterdir()) == [tmp_path / "mtp.gguf"]
    with pytest.raises(UsageError, match="already exists"):
        run(folder, tmp_path / "t.gguf", "Q8_0", mtp_out=str(tmp_path / "mtp.gguf"))
    assert not (tmp_path / "t.gguf").exists()
    with pytest.raises(UsageError, match="use one of them"):
        run(folder, tmp_path / "t.gguf", "Q8_0", mtp_out=str(tmp_path / "m2.gguf"), keep_nextn=True)
    r, _ = run(folder, tmp_path / "t.gguf", "Q8_0", mtp_out=str(tmp_path / "m3.gguf"), dry_run=True)
    assert "blk.2.nextn.eh_proj.weight" in r.summary and not (tmp_path / "t.gguf").exists()
    no_nextn = M.build_glm_dsa(tmp_path / "plain", num_nextn_predict_layers=0)
    code, line = cli_fails(no_nextn, tmp_path, "--mtp-out", tmp_path / "m4.gguf")
    assert code == 1 and "no NextN layer" in line


# --- bad inputs: one line, exit codes as documented ---------------------------------------------


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


def test_missing_expert_tensor(tmp_path):
    d = M.build_deepseek3(tmp_path / "m", drop=("model.layers.1.mlp.experts.2.up_proj.weight",))
    code, line = cli_fails(d, tmp_path)
    assert code == 1
    assert "expert tensor 'model.layers.1.mlp.experts.2.up_proj.weight' is missing" in line


def test_expert_count_mismatch_with_config(tmp_path):
    d = M.build_glm4moe(tmp_path / "m")
    cfg = cfg_of(d)
    cfg["n_routed_experts"] = 2  # the checkpoint stores 4
    cfg["num_experts_per_tok"] = 1
    (d / "config.json").write_text(json.dumps(cfg))
    code, line = cli_fails(d, tmp_path)
    assert code == 1 and "is expert 2, but config.json has n_routed_experts = 2" in line
    cfg["n_routed_experts"] = 8  # the router and the stored experts have 4
    (d / "config.json").write_text(json.dumps(cfg))
    code, line = cli_fails(d, tmp_path)
    assert code == 1 and "n_routed_experts = 8" in line


def test_top_k_larger_than_the_expert_count(tmp_path):
    d = M.build_deepseek3(tmp_path / "m", num_experts_per_tok=5)
    code, line = cli_fails(d, tmp_path)
    assert code == 1
    assert "num_experts_per_tok (5) is larger than the expert count n_routed_experts (4)" in line


def test_indexer_top_k_of_zero(tmp_path):
    d = M.build_glm_dsa(tmp_path / "m", index_topk=0)
    code, line = cli_fails(d, tmp_path)
    assert code == 1 and "index_topk is 0" in line


def test_other_config_problems(tmp_path):
    d = M.build_glm_dsa(tmp_path / "m")
    cfg = cfg_of(d)
    for over, msg in (({"index_head_dim": None}, "lacks 'index_head_dim'"),
                      ({"n_group": 3}, "not a multiple of n_group"),
                      ({"scoring_func": "tanh"}, "scoring_func 'tanh' is not supported")):
        (d / "config.json").write_text(json.dumps({**cfg, **over}))
        code, line = cli_fails(d, tmp_path)
        assert code == 1 and msg in line, line
    odd = M.build_glm_dsa(tmp_path / "odd", index_head_dim=48)  # llama.cpp's glm-dsa trap
    notes = []
    open_source(odd, report=notes.append)
    assert any("index_head_dim 48 is not twice the rotary dimensions (32)" in n for n in notes)


# --- llama.cpp itself --------------------------------------------------------------------------

CHILD = textwrap.dedent("""
    import json, sys
    import numpy as np
    import llama_cpp as L
    path, toks, load_mtp = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3] == "1"
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.use_extra_bufts = False  # its AMX / repacked buffers crash in some VMs
    mp.load_mtp = load_mtp
    model = L.llama_model_load_from_file(path.encode(), mp)
    assert model, "llama.cpp could not load the file"
    if not toks:
        print("OK")
        sys.exit(0)
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_threads, cp.n_threads_batch = 64, 64, 64, 1, 1
    cp.type_k = cp.type_v = L.GGML_TYPE_F32  # no F16 rounding in the cache
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
    assert np.isfinite(rows).all() and np.abs(rows).max() > 0
    print("OK")
""")


def llama_cpp_runs(path, tokens=(5, 17, 42, 99, 7, 250, 3, 64), load_mtp=False):
    r = subprocess.run([sys.executable, "-c", CHILD, str(path), json.dumps(list(tokens)),
                        "1" if load_mtp else "0"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, f"llama.cpp failed (rc {r.returncode}): {r.stderr[-1500:]}"


@needs_llama_cpp
@pytest.mark.parametrize("arch", ARCHS)
def test_llama_cpp_loads_and_runs_every_variant(ckpts, arch, tmp_path):
    folder = ckpts[arch]
    for type_name in ("F32", "Q4_K_M"):
        r, _ = run(folder, tmp_path / f"{type_name}.gguf", type_name, keep_nextn=True)
        llama_cpp_runs(r.output, load_mtp=True)  # the NextN tensors' shapes checked too
        llama_cpp_runs(r.output)
    r, _ = run(folder, tmp_path / "plain.gguf", "Q8_0")
    llama_cpp_runs(r.output)
    run(folder, tmp_path / "trunk.gguf", "Q8_0", mtp_out=str(tmp_path / "mtp.gguf"))
    llama_cpp_runs(tmp_path / "trunk.gguf")
    llama_cpp_runs(tmp_path / "mtp.gguf", tokens=(), load_mtp=True)  # an MTP-only file loads


@needs_llama_cpp
def test_llama_cpp_runs_the_fp8_checkpoint(ckpts, tmp_path):
    r, _ = run(ckpts["deepseek2-fp8"], tmp_path / "m.gguf", "Q8_0")
    llama_cpp_runs(r.output)


def llama_quantize(src, dst, mix):
    import ctypes
    p = _llama_cpp.llama_model_quantize_default_params()
    p.ftype = int(LlamaFileType["MOSTLY_" + mix])
    p.nthread = 1
    assert _llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(p)) == 0


def assert_same_tensors(ref_path, got_path):
    _, ref = read(ref_path)
    _, got = read(got_path)
    assert set(ref) == set(got)
    for name in ref:
        assert got[name].tensor_type == ref[name].tensor_type, name
        assert np.array_equal(stored(got[name]), stored(ref[name])), name


@needs_llama_cpp
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mix", ["Q4_K_M", "Q8_0"])
def test_mixes_byte_identical_to_llama_quantize(ckpts, arch, mix, tmp_path):
    f32, _ = run(ckpts[arch], tmp_path / "f32.gguf", "F32", keep_nextn=True)
    llama_quantize(f32.output, tmp_path / "ref.gguf", mix)
    ours, _ = run(ckpts[arch], tmp_path / "ours.gguf", mix, keep_nextn=True)
    assert_same_tensors(tmp_path / "ref.gguf", ours.output)


@needs_llama_cpp
def test_split_files_byte_identical_to_llama_quantize(ckpts, tmp_path):
    folder = ckpts["glm4moe"]  # GQA: its attn_v counters differ between the files
    run(folder, tmp_path / "t32.gguf", "F32", mtp_out=str(tmp_path / "m32.gguf"))
    run(folder, tmp_path / "t.gguf", "Q4_K_M", mtp_out=str(tmp_path / "m.gguf"))
    for part in ("t", "m"):
        llama_quantize(tmp_path / f"{part}32.gguf", tmp_path / f"{part}-ref.gguf", "Q4_K_M")
        assert_same_tensors(tmp_path / f"{part}-ref.gguf", tmp_path / f"{part}.gguf")


LOGITS_CHILD = CHILD.replace("assert np.isfinite(rows).all() and np.abs(rows).max() > 0",
                             "np.save(sys.argv[4], rows)")
assert LOGITS_CHILD != CHILD


@needs_llama_cpp
@pytest.mark.parametrize("arch", ARCHS)
def test_llama_cpp_logits_match_the_hf_forward_pass(arch, tmp_path):
    """What llama.cpp computes from the converted file is what the Hugging Face model computes
    (MLA with the split kv_b, the rotary layouts, sigmoid routing with the bias and the groups,
    shared experts, GLM's biases and q/k norms). No YaRN here: the reference leaves it out."""
    folder = M.BUILDERS[arch](tmp_path / arch, rope_scaling=None, max_position_embeddings=4096)
    cfg = cfg_of(folder)
    r, _ = run(folder, tmp_path / "m.gguf", "F32")
    ids = [5, 17, 42, 99, 7, 250, 3, 64, 128, 11]
    out = tmp_path / "logits.npy"
    p = subprocess.run([sys.executable, "-c", LOGITS_CHILD, str(r.output), json.dumps(ids), "0", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-1500:]
    got = np.load(out).astype(np.float64)
    want = M.moe_forward(hf_models.load_weights(folder), cfg, ids)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
