"""`ds4tools quantize`: HF conversion, llama.cpp's mixes and rules, options, streaming output."""
import json
import os

import numpy as np
import pytest
from click.testing import CliRunner
from gguf import GGUFReader, GGUFValueType, LlamaFileType

from ds4tools import formats
from ds4tools.checkpoint import interleave_rope_rows
from ds4tools.cli import main
from ds4tools.errors import InvalidContentError, UsageError
from ds4tools.mixes import TypeChooser, resolve_target
from ds4tools.quantize import QuantizeOptions, build_plan, open_source, quantize_model
from ds4tools.quantize.convert import llama3_rope_factors
from tests.fixtures import hf_models


def run(src, out, type_name, **kw):
    notes = []
    result = quantize_model(src, out, QuantizeOptions(type_name, progress=False, **kw), report=notes.append)
    return result, notes


def read(path):
    r = GGUFReader(path)
    fields = {k: f for k, f in r.fields.items() if not k.startswith("GGUF.")}
    return r, {k: f.contents() for k, f in fields.items()}, {t.name: t for t in r.tensors}


def hf_source_values(folder):
    """Every converted tensor's float32 values as the quantizer must see them (GGUF names)."""
    src = open_source(folder)
    return {t.name: t.load_float32() for t in src.tensors}


def stored_bytes(t):
    return np.asarray(t.data).view(np.uint8).reshape(-1)


# --- conversion ----------------------------------------------------------------------------


def test_llama_conversion_keys_names_and_values(hf_llama, gguf_llama_f32):
    cfg = json.loads((hf_llama / "config.json").read_text())
    r, md, tensors = read(gguf_llama_f32)
    assert md["general.architecture"] == "llama"
    expect = {
        "llama.block_count": 4, "llama.context_length": 2048, "llama.embedding_length": 256,
        "llama.feed_forward_length": 512, "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": 2, "llama.attention.key_length": 64,
        "llama.rope.dimension_count": 64, "general.file_type": int(LlamaFileType.ALL_F32),
        "general.quantization_version": 2, "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "llama-bpe", "tokenizer.ggml.bos_token_id": cfg["bos_token_id"],
        "tokenizer.ggml.eos_token_id": cfg["eos_token_id"], "tokenizer.ggml.add_bos_token": True,
    }
    for k, v in expect.items():
        assert md[k] == v, k
    assert md["llama.rope.freq_base"] == pytest.approx(500000.0)
    assert md["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)
    assert r.fields["llama.block_count"].types == [GGUFValueType.UINT32]
    assert r.fields["llama.rope.freq_base"].types == [GGUFValueType.FLOAT32]
    assert r.fields["tokenizer.ggml.token_type"].types == [GGUFValueType.ARRAY, GGUFValueType.INT32]
    assert md["tokenizer.chat_template"] == hf_models.LLAMA3_CHAT_TEMPLATE
    assert len(md["tokenizer.ggml.tokens"]) == cfg["vocab_size"]
    assert md["tokenizer.ggml.tokens"][cfg["bos_token_id"]] == "<|begin_of_text|>"
    assert md["tokenizer.ggml.token_type"][cfg["bos_token_id"]] == 3  # CONTROL
    tok = json.loads((hf_llama / "tokenizer.json").read_text())
    assert md["tokenizer.ggml.merges"][:3] == [" ".join(m) for m in tok["model"]["merges"][:3]]

    names = {"token_embd.weight", "output_norm.weight", "output.weight"}
    for i in range(4):
        names |= {f"blk.{i}.{n}.weight" for n in ("attn_norm", "attn_q", "attn_k", "attn_v",
                                                 "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")}
    assert set(tensors) == names
    assert list(tensors["blk.0.attn_k.weight"].shape) == [256, 128]  # ggml order
    assert list(tensors["token_embd.weight"].shape) == [256, cfg["vocab_size"]]

    hf = hf_models.load_weights(hf_llama)
    np.testing.assert_array_equal(tensors["blk.1.ffn_down.weight"].data, hf["model.layers.1.mlp.down_proj.weight"])
    np.testing.assert_array_equal(tensors["output.weight"].data, hf["lm_head.weight"])
    # q/k rows are reordered for llama.cpp's rotary embedding, v is not
    q = hf["model.layers.2.self_attn.q_proj.weight"]
    assert not np.array_equal(tensors["blk.2.attn_q.weight"].data, q)
    np.testing.assert_array_equal(tensors["blk.2.attn_q.weight"].data, interleave_rope_rows(q, 4))
    np.testing.assert_array_equal(tensors["blk.2.attn_k.weight"].data,
                                  interleave_rope_rows(hf["model.layers.2.self_attn.k_proj.weight"], 2))
    np.testing.assert_array_equal(tensors["blk.2.attn_v.weight"].data, hf["model.layers.2.self_attn.v_proj.weight"])


def test_interleave_rope_rows_turns_rotate_half_into_adjacent_pairs():
    """HF rotates pairs (i, i + d/2) of each head; llama.cpp's `llama` rope rotates (2i, 2i+1).
    After the row reorder, llama.cpp's rotation of W x equals the reordered HF rotation."""
    rng = np.random.default_rng(0)
    n_head, hd, n_in, pos, theta = 3, 8, 5, 7, 10000.0
    w, x = rng.standard_normal((n_head * hd, n_in)), rng.standard_normal(n_in)
    ang = pos / theta ** (np.arange(0, hd, 2) / hd)
    cos, sin = np.cos(ang), np.sin(ang)

    def hf_rope(v):
        v = v.reshape(n_head, hd)
        a, b = v[:, :hd // 2], v[:, hd // 2:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], 1).reshape(-1)

    def llama_cpp_rope(v):
        v = v.reshape(n_head, hd // 2, 2)
        a, b = v[..., 0], v[..., 1]
        return np.stack([a * cos - b * sin, a * sin + b * cos], -1).reshape(-1)

    p = interleave_rope_rows(w, n_head)
    np.testing.assert_allclose(llama_cpp_rope(p @ x), interleave_rope_rows(hf_rope(w @ x)[:, None], n_head)[:, 0])


def test_qwen3_conversion_head_dim_padding_and_nextn(hf_qwen3, hf_qwen3_nextn, gguf_qwen3_f32, tmp_path):
    cfg = json.loads((hf_qwen3 / "config.json").read_text())
    _, md, tensors = read(gguf_qwen3_f32)
    assert md["general.architecture"] == "qwen3"
    assert md["qwen3.attention.key_length"] == 96 and md["qwen3.attention.value_length"] == 96
    assert md["tokenizer.ggml.pre"] == "qwen2"
    assert md["tokenizer.ggml.add_bos_token"] is False
    assert "tokenizer.ggml.bos_token_id" not in md
    assert md["tokenizer.ggml.padding_token_id"] == 0
    tokens, types = md["tokenizer.ggml.tokens"], md["tokenizer.ggml.token_type"]
    assert len(tokens) == cfg["vocab_size"] == 416
    assert tokens[-1] == "[PAD415]" and types[-1] == 5  # UNUSED padding past the tokenizer
    assert list(tensors["blk.0.attn_q_norm.weight"].shape) == [96]
    assert list(tensors["blk.1.attn_output.weight"].shape) == [384, 256]
    hf = hf_models.load_weights(hf_qwen3)
    # qwen3 uses llama.cpp's NEOX rope: no row reorder
    np.testing.assert_array_equal(tensors["blk.1.attn_q.weight"].data, hf["model.layers.1.self_attn.q_proj.weight"])

    _, notes = run(hf_qwen3_nextn, tmp_path / "n.gguf", "F32")
    assert any("left out 15 NextN/MTP tensors (layer 2); the MTP support GGUF carries them" in n
               for n in notes)
    _, md2, tensors2 = read(tmp_path / "n.gguf")
    assert set(tensors2) == set(tensors)  # the MTP layer is not converted here
    assert md2["qwen3.block_count"] == 2


def test_sharded_bf16_checkpoint_converts_like_the_single_file(hf_llama, hf_llama_sharded, tmp_path):
    _, _, t1 = read(run(hf_llama_sharded, tmp_path / "s.gguf", "F32")[0].output)
    hf = hf_models.load_weights(hf_llama_sharded)  # bf16 values, read by the test's own reader
    assert len(list(hf_llama_sharded.glob("*.safetensors"))) == 3
    np.testing.assert_array_equal(t1["blk.3.ffn_up.weight"].data, hf["model.layers.3.mlp.up_proj.weight"])
    ref = hf_models.load_weights(hf_llama)["model.layers.3.mlp.up_proj.weight"]
    assert 0 < np.abs(t1["blk.3.ffn_up.weight"].data - ref).max() < 0.01  # bf16 rounding only


def test_rope_scaling_keys_and_llama3_frequencies(tmp_path):
    linear = hf_models.build_tiny_llama(tmp_path / "lin", num_hidden_layers=1,
                                        rope_scaling={"type": "linear", "factor": 4.0})
    _, md, _ = read(run(linear, tmp_path / "lin.gguf", "F16")[0].output)
    assert md["llama.rope.scaling.type"] == "linear" and md["llama.rope.scaling.factor"] == 4.0
    l3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
    llama3 = hf_models.build_tiny_llama(tmp_path / "l3", num_hidden_layers=1, rope_scaling=l3)
    _, md, tensors = read(run(llama3, tmp_path / "l3.gguf", "Q8_0")[0].output)
    f = tensors["rope_freqs.weight"]
    assert f.tensor_type.name == "F32" and list(f.shape) == [32]
    np.testing.assert_array_equal(f.data, llama3_rope_factors(64, 500000.0, l3))
    assert f.data[0] == 1.0 and f.data[-1] == 8.0  # short wavelengths kept, long ones stretched
    bad = hf_models.build_tiny_llama(tmp_path / "dyn", num_hidden_layers=1,
                                     rope_scaling={"type": "dynamic", "factor": 2.0})
    with pytest.raises(InvalidContentError, match="rope scaling type 'dynamic' is not supported"):
        run(bad, tmp_path / "dyn.gguf", "F16")


def test_tied_embeddings_have_no_output_tensor_and_follow_the_output_rule(tmp_path):
    tied = hf_models.build_tiny_qwen3(tmp_path / "tied", tie_word_embeddings=True)
    result, _ = run(tied, tmp_path / "t.gguf", "Q4_K_M")
    _, _, tensors = read(result.output)
    assert "output.weight" not in tensors
    assert tensors["token_embd.weight"].tensor_type.name == "Q6_K"  # llama.cpp: tied -> output's type


# --- quantization: values and mixes ---------------------------------------------------------

CASES = [("hf_llama", "Q8_0"), ("hf_llama", "Q4_K_M"), ("hf_llama", "Q6_K"), ("hf_llama", "Q4_0"),
         ("hf_qwen3", "Q4_K_M"), ("hf_qwen3", "Q2_K"), ("hf_qwen3", "Q5_K_S"), ("hf_qwen3", "IQ4_NL"),
         ("hf_llama", "Q3_K_M"), ("hf_llama", "BF16")]


@pytest.mark.parametrize("model,type_name", CASES)
def test_each_tensor_is_what_formats_gives_for_the_source_values(request, tmp_path, model, type_name):
    folder = request.getfixturevalue(model)
    result, _ = run(folder, tmp_path / "out.gguf", type_name)
    values = hf_source_values(folder)
    _, md, tensors = read(result.output)
    assert md["general.file_type"] == result.plan.target.ftype
    assert set(tensors) == set(values)
    for e in result.plan.entries:
        t = tensors[e.name]
        assert t.tensor_type.name == e.out_type
        want = formats.quantize(values[e.name], e.out_type)
        assert np.array_equal(stored_bytes(t), want.reshape(-1)), e.name
        np.testing.assert_array_equal(formats.dequantize(stored_bytes(t), e.out_type, e.shape),
                                      formats.dequantize(want, e.out_type, e.shape))
        if len(e.shape) == 1:
            assert e.out_type == "F32"  # norms stay F32


def test_q4_k_m_rules_on_llama(hf_llama, tmp_path):
    types = {e.name: e.out_type for e in run(hf_llama, tmp_path / "o.gguf", "Q4_K_M")[0].plan.entries}
    assert types["output.weight"] == "Q6_K"
    assert types["token_embd.weight"] == "Q4_K"
    # use_more_bits(i, 4) holds for layers 2 and 3: attn_v and ffn_down get Q6_K there
    assert [types[f"blk.{i}.attn_v.weight"] for i in range(4)] == ["Q4_K", "Q4_K", "Q6_K", "Q6_K"]
    assert [types[f"blk.{i}.ffn_down.weight"] for i in range(4)] == ["Q4_K", "Q4_K", "Q6_K", "Q6_K"]
    assert types["blk.0.attn_q.weight"] == types["blk.3.ffn_up.weight"] == "Q4_K"


def test_fallbacks_for_rows_a_format_cannot_take(hf_qwen3, tmp_path):
    result, _ = run(hf_qwen3, tmp_path / "o.gguf", "Q4_K_M")
    entries = {e.name: e for e in result.plan.entries}
    assert entries["blk.0.attn_output.weight"].out_type == "Q5_0"  # 384 columns: Q4_K -> Q5_0
    assert entries["blk.1.ffn_down.weight"].out_type == "Q8_0"  # Q6_K -> Q8_0 on 320 columns
    assert "not a multiple of Q4_K's block 256" in entries["blk.0.attn_output.weight"].note
    assert result.plan.n_fallback == 4
    table = result.plan.table()
    assert "note: blk.0.attn_output.weight: row length 384" in table
    assert "4 of 25 tensors fell back" in table


def test_mix_names_and_aliases():
    avail = list(formats.FORMATS)
    assert resolve_target("q4_k", avail).name == "Q4_K_M"
    assert resolve_target("Q8_0", avail).ftype == int(LlamaFileType.MOSTLY_Q8_0)
    assert resolve_target("IQ2_XXS", avail).is_mix
    with pytest.raises(UsageError, match="unknown type or mix"):
        resolve_target("Q7_K", avail)
    with pytest.raises(UsageError, match="not implemented here"):
        resolve_target("IQ3_M", avail)


def test_mix_counters_follow_llama_cpp_for_q3_k_m_and_70b_rule():
    names = [f"blk.{i}.attn_v.weight" for i in range(80)] + ["output.weight"]
    chooser = TypeChooser(resolve_target("Q3_K_M", list(formats.FORMATS)), "llama", 80, 64, 8, names=names)
    got = [chooser.choose(f"blk.{i}.attn_v.weight", (8192, 1024)).type_name for i in range(80)]
    assert got == ["Q5_K", "Q5_K"] + ["Q5_K"] * 78  # 70B: Q4_K on attn_v is bumped to Q5_K
    chooser = TypeChooser(resolve_target("Q3_K_M", list(formats.FORMATS)), "llama", 32, 32, 8, names=names[:32])
    got = [chooser.choose(f"blk.{i}.attn_v.weight", (4096, 1024)).type_name for i in range(32)]
    assert got == ["Q5_K", "Q5_K"] + ["Q4_K"] * 30


def test_iq2_xxs_needs_an_imatrix_and_uses_it(hf_llama, tmp_path):
    from ds4tools.gguf_io.imatrix import Imatrix, save_imatrix
    with pytest.raises(UsageError, match="needs an importance matrix: pass --imatrix"):
        run(hf_llama, tmp_path / "x.gguf", "IQ2_XXS")
    assert not os.path.exists(tmp_path / "x.gguf")
    values = hf_source_values(hf_llama)
    rng = np.random.default_rng(3)
    entries = {n: rng.uniform(0.1, 2.0, v.shape[-1]).astype(np.float32)
               for n, v in values.items() if v.ndim == 2}
    save_imatrix(Imatrix(entries, ["corpus"], 10), tmp_path / "imatrix.gguf")
    result, _ = run(hf_llama, tmp_path / "x.gguf", "IQ2_XXS", imatrix=str(tmp_path / "imatrix.gguf"))
    r, md, tensors = read(result.output)
    assert md["quantize.imatrix.file"] == str(tmp_path / "imatrix.gguf")
    assert md["quantize.imatrix.entries_count"] == len(entries)
    plan = {e.name: e for e in result.plan.entries}
    assert plan["blk.1.attn_q.weight"].out_type == "IQ2_XXS"
    assert plan["token_embd.weight"].out_type == "Q2_K" and plan["output.weight"].out_type == "Q5_K"
    assert plan["blk.0.attn_v.weight"].out_type == "Q2_K"  # gqa 2 < 4
    for name in ("blk.1.attn_q.weight", "blk.0.ffn_down.weight", "token_embd.weight"):
        e = plan[name]
        want = formats.quantize(values[name], e.out_type, imatrix=entries[name])
        assert np.array_equal(stored_bytes(tensors[name]), want.reshape(-1)), name

    # llama.cpp exempts the embeddings from needing an imatrix; IQ2_XXS's quantizer still needs
    # importance weights, so an embedding without an entry gets the synthetic ones
    from ds4tools.gguf_io.imatrix import synthetic_imatrix
    del entries["token_embd.weight"]
    save_imatrix(Imatrix(entries, ["corpus"], 10), tmp_path / "partial.gguf")
    result, _ = run(hf_llama, tmp_path / "y.gguf", "IQ2_XXS", imatrix=str(tmp_path / "partial.gguf"),
                    token_embedding_type="IQ2_XXS")
    e = {x.name: x for x in result.plan.entries}["token_embd.weight"]
    assert e.out_type == "IQ2_XXS" and e.imatrix == "synthetic"
    assert "synthetic imatrix" in result.plan.table()
    emb = values["token_embd.weight"]
    want = formats.quantize(emb, "IQ2_XXS", imatrix=synthetic_imatrix(emb))
    assert np.array_equal(stored_bytes(read(result.output)[2]["token_embd.weight"]), want.reshape(-1))


# --- options ---------------------------------------------------------------------------------


def test_tensor_type_overrides_first_match_wins_and_embedding_options(hf_llama, tmp_path):
    result, _ = run(hf_llama, tmp_path / "o.gguf", "Q4_K_M",
                    tensor_types=[r"\.(1|3)\.attn_k=q8_0", r"attn_k=Q5_0", r"ffn_up=Q5_K"],
                    output_tensor_type="Q8_0", token_embedding_type="q6_k")
    t = {e.name: e for e in result.plan.entries}
    assert [t[f"blk.{i}.attn_k.weight"].out_type for i in range(4)] == ["Q5_0", "Q8_0", "Q5_0", "Q8_0"]
    assert t["blk.0.ffn_up.weight"].out_type == "Q5_K"
    assert t["blk.0.attn_k.weight"].reason == "--tensor-type attn_k"
    assert t["output.weight"].out_type == "Q8_0" and t["token_embd.weight"].out_type == "Q6_K"
    _, _, tensors = read(result.output)
    assert tensors["blk.1.attn_k.weight"].tensor_type.name == "Q8_0"


def test_pure_gives_every_weight_the_type(hf_llama, tmp_path):
    result, _ = run(hf_llama, None, "Q4_K_M", pure=True, dry_run=True)
    types = {e.out_type for e in result.plan.entries if len(e.shape) == 2}
    assert types == {"Q4_K"}
    result, notes = run(hf_llama, None, "F16", tensor_types=["ffn=Q8_0"], dry_run=True)
    assert {e.out_type for e in result.plan.entries if len(e.shape) == 2} == {"F16"}
    assert "warning: --tensor-type applies only to quantized targets (as in llama.cpp); " \
           "ignored for F16" in notes


def test_dry_run_prints_the_plan_and_writes_nothing(hf_qwen3, tmp_path):
    out = tmp_path / "never.gguf"
    r = CliRunner().invoke(main, ["quantize", str(hf_qwen3), "-o", str(out), "--type", "Q4_K_M", "--dry-run"])
    assert r.exit_code == 0, r.output
    assert not out.exists() and os.listdir(tmp_path) == []
    assert "blk.1.attn_v.weight" in r.stdout and "F32 -> Q6_K" in r.stdout
    assert "total: 25 tensors, 1,296,000 weights" in r.stdout
    assert "bits per weight" in r.stdout and "tensor" in r.stdout.splitlines()[0]


def test_cli_summary_line_overwrite_and_refusals(hf_llama, gguf_llama_f32, tmp_path):
    out = tmp_path / "m.gguf"
    args = ["quantize", str(gguf_llama_f32), "-o", str(out), "--type", "Q8_0", "--threads", "1"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith(f"{out}: 39 tensors, 9.76 MiB -> 2.60 MiB, 8.52 bits per weight, ")
    assert last.endswith(" s")
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2 and "already exists (pass --overwrite" in r.stderr
    assert CliRunner().invoke(main, args + ["--overwrite"]).exit_code == 0
    r = CliRunner().invoke(main, ["quantize", str(out), "-o", str(out), "--type", "Q8_0", "--overwrite"])
    assert r.exit_code == 2 and r.stderr.strip() == f"ds4tools: {out}: refusing to write over an input file"
    r = CliRunner().invoke(main, ["quantize", str(hf_llama), "-o", str(tmp_path / "x.gguf"), "--type", "Q9_9"])
    assert r.exit_code == 2 and "--type Q9_9: unknown type or mix" in r.stderr
    r = CliRunner().invoke(main, ["quantize", str(hf_llama), "--type", "Q8_0"])
    assert r.exit_code == 2 and "-o OUT.gguf" in r.stderr
    r = CliRunner().invoke(main, ["quantize", str(hf_llama), "-o", str(tmp_path / "y.gguf"),
                                  "--type", "Q8_0", "--tensor-type", "attn(=Q8_0"])
    assert r.exit_code == 2 and "bad regular expression" in r.stderr
    assert sorted(os.listdir(tmp_path)) == ["m.gguf"]  # no temporary files left behind


def test_device_cuda_without_a_gpu_is_a_usage_error(hf_llama, tmp_path):
    from numba import cuda
    if cuda.is_available():
        pytest.skip("a CUDA device (or the simulator) is available here")
    r = CliRunner().invoke(main, ["quantize", str(hf_llama), "-o", str(tmp_path / "c.gguf"),
                                  "--type", "Q8_0", "--device", "cuda"])
    assert r.exit_code == 2 and r.stderr.startswith("ds4tools: --device cuda: ")
    assert not (tmp_path / "c.gguf").exists()


def test_requantizing_a_quantized_gguf_warns_and_copies_same_type(gguf_qwen3_f32, tmp_path):
    q8 = run(gguf_qwen3_f32, tmp_path / "q8.gguf", "Q8_0")[0].output
    result, notes = run(q8, tmp_path / "q4.gguf", "Q4_0")
    assert any("are already quantized" in n and "dequantized and requantized" in n for n in notes)
    _, _, src = read(q8)
    _, _, out = read(result.output)
    e = {x.name: x for x in result.plan.entries}
    name = "blk.0.attn_q.weight"
    assert e[name].action == "quantize" and e[name].out_type == "Q4_0"
    deq = formats.dequantize(stored_bytes(src[name]), "Q8_0", e[name].shape)
    assert np.array_equal(stored_bytes(out[name]), formats.quantize(deq, "Q4_0").reshape(-1))
    same, _ = run(q8, tmp_path / "q8b.gguf", "Q8_0")  # same type: bytes copied as stored
    _, _, again = read(same.output)
    assert all(x.action == "copy" for x in same.plan.entries)
    assert all(np.array_equal(stored_bytes(again[n]), stored_bytes(src[n])) for n in src)


def test_split_gguf_input_is_read_as_one_model(gguf_qwen3_f32, tmp_path):
    import gguf
    r = GGUFReader(gguf_qwen3_f32)
    w = gguf.GGUFWriter(tmp_path / "split.gguf", "qwen3", split_max_tensors=10)
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture":
            continue
        sub = f.types[1] if f.types[0] == GGUFValueType.ARRAY else None
        w.add_key_value(k, f.contents(), f.types[0], sub)
    for t in r.tensors:
        w.add_tensor(t.name, np.array(t.data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    shards = sorted(os.listdir(tmp_path))
    assert shards == ["split-00001-of-00003.gguf", "split-00002-of-00003.gguf", "split-00003-of-00003.gguf"]
    result, _ = run(tmp_path / shards[1], tmp_path / "joined.gguf", "Q8_0")
    _, md, tensors = read(result.output)
    assert len(tensors) == 25 and "split.count" not in md
    direct, _ = run(gguf_qwen3_f32, tmp_path / "direct.gguf", "Q8_0")
    _, _, ref = read(direct.output)
    assert all(np.array_equal(stored_bytes(tensors[n]), stored_bytes(ref[n])) for n in ref)


def test_output_is_streamed_through_a_temp_file_and_removed_on_failure(hf_llama, tmp_path, monkeypatch):
    from ds4tools.quantize import pipeline
    calls = []
    real = pipeline._produce

    def failing(e, *a):
        calls.append(e.name)
        if len(calls) == 3:
            assert [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]  # written beside OUT
            assert not (tmp_path / "o.gguf").exists()
            raise InvalidContentError("boom")
        return real(e, *a)

    monkeypatch.setattr(pipeline, "_produce", failing)
    with pytest.raises(InvalidContentError):
        run(hf_llama, tmp_path / "o.gguf", "Q8_0")
    assert os.listdir(tmp_path) == []


# --- llama.cpp itself (optional: llama-cpp-python is not in the test extra) ------------------

try:
    import llama_cpp as _llama_cpp
except ImportError:  # the optional checks below skip, saying why
    _llama_cpp = None
needs_llama_cpp = pytest.mark.skipif(_llama_cpp is None, reason="llama-cpp-python is not installed: "
                                     "the checks against llama.cpp itself need it (optional)")


def _llama_cpp_quantize(src, dst, mix):
    import ctypes
    p = _llama_cpp.llama_model_quantize_default_params()
    p.ftype = int(LlamaFileType["MOSTLY_" + mix])
    p.nthread = 1
    assert _llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(p)) == 0


@needs_llama_cpp
@pytest.mark.parametrize("model,mix", [("gguf_llama_f32", "Q4_K_M"), ("gguf_llama_f32", "Q3_K_M"),
                                       ("gguf_llama_f32", "Q5_K_M"), ("gguf_qwen3_f32", "Q4_K_S"),
                                       ("gguf_qwen3_f32", "Q2_K"), ("gguf_qwen3_f32", "Q6_K"),
                                       ("gguf_llama_f32", "IQ4_NL"), ("gguf_qwen3_f32", "Q5_1")])
def test_byte_identical_to_llama_quantize(request, tmp_path, model, mix):
    src = request.getfixturevalue(model)
    _llama_cpp_quantize(src, tmp_path / "ref.gguf", mix)
    ours, _ = run(src, tmp_path / "ours.gguf", mix)
    _, _, ref = read(tmp_path / "ref.gguf")
    _, _, got = read(ours.output)
    assert set(ref) == set(got)
    for name in ref:
        assert got[name].tensor_type == ref[name].tensor_type, name
        assert np.array_equal(stored_bytes(got[name]), stored_bytes(ref[name])), name


@needs_llama_cpp
@pytest.mark.parametrize("model", ["hf_llama", "hf_qwen3", "hf_llama_spm"])
def test_llama_cpp_tokenizes_like_the_hf_tokenizer(request, tmp_path, model):
    from tokenizers import Tokenizer
    folder = request.getfixturevalue(model)
    out = run(folder, tmp_path / "m.gguf", "F16")[0].output
    llm = _llama_cpp.Llama(model_path=str(out), verbose=False, n_ctx=128)
    hf = Tokenizer.from_file(str(folder / "tokenizer.json"))
    texts = [hf_models.corpus_text(12, seed=99), "Hello world, naïve café 12345 🙂",
             "  leading   and trailing  \n\n\tx += 1", "Straße über 日本語 don't we'll I'm",
             "<|im_start|>user\nhi<|im_end|>"]
    for text in texts:
        assert llm.tokenize(text.encode(), add_bos=True, special=True) == hf.encode(text).ids, text


@needs_llama_cpp
@pytest.mark.parametrize("model", ["hf_llama", "hf_qwen3"])
def test_llama_cpp_logits_match_a_reference_forward_pass(request, tmp_path, model):
    from tests.fixtures.reference_forward import hf_forward
    folder = request.getfixturevalue(model)
    out = run(folder, tmp_path / "m.gguf", "F32")[0].output
    cfg = json.loads((folder / "config.json").read_text())
    ids = [5, 17, 42, 99, 7, 250, 3, 64, 128, 11]
    llm = _llama_cpp.Llama(model_path=str(out), verbose=False, n_ctx=64, logits_all=True, n_threads=1)
    llm.eval(ids)
    got = np.array(llm.scores[:len(ids)], dtype=np.float64)
    want = hf_forward(hf_models.load_weights(folder), cfg, ids)
    np.testing.assert_allclose(got, want, atol=2e-3, rtol=1e-3)
