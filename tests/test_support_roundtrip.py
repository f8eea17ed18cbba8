"""Every tensor of every written support layout is the checkpoint's values at its stored type:
its bytes are what ds4tools.formats (byte-identical to ggml) makes of the checkpoint's values, and
it dequantizes to them within the type's error."""
import numpy as np
import pytest

from ds4tools import formats
from ds4tools.gguf_io import open_gguf
from ds4tools.gguf_io.imatrix import synthetic_imatrix
from ds4tools.quantize import QuantizeOptions, quantize_model
from ds4tools.support.dsv4_block import HF_BLOCK_NAMES, HF_EXPERT_PROJ
from tests.fixtures.support_models import build_tiny_dspark_qwen3, build_tiny_dsv4, build_tiny_dsv4_target

#: relative RMS error each stored type may add (F32 none)
RMS_LIMIT = {"F32": 0.0, "F16": 1e-3, "Q8_0": 0.01, "Q4_K": 0.12, "IQ2_XXS": 0.4}


def check(t, want: np.ndarray) -> None:
    assert tuple(t.shape) == want.shape, t.name
    weights = None
    if formats.get_format(t.type_name).requires_imatrix:  # ds4's stand-in when none is given
        weights = synthetic_imatrix(want)
    np.testing.assert_array_equal(np.asarray(t.raw()).reshape(-1),
                                  formats.quantize(want, t.type_name, imatrix=weights).reshape(-1),
                                  err_msg=t.name)
    got = t.to_float32()
    rms = float(np.sqrt(np.mean((got - want) ** 2)))
    assert rms <= RMS_LIMIT[t.type_name] * float(np.sqrt(np.mean(want ** 2))) + 1e-12, (t.name, rms)


def dsv4_source(name: str, expected: dict) -> np.ndarray:
    """The checkpoint values a DeepSeek V4 support tensor was made from."""
    _, stage, rest = name.split(".", 2)
    p = f"mtp.{stage}."
    role = rest.rsplit(".", 1)[0]
    if role in HF_EXPERT_PROJ:
        n = 0
        while f"{p}ffn.experts.{n}.{HF_EXPERT_PROJ[role]}.weight" in expected:
            n += 1
        return np.stack([expected[f"{p}ffn.experts.{e}.{HF_EXPERT_PROJ[role]}.weight"] for e in range(n)])
    if role in HF_BLOCK_NAMES:
        return expected[p + HF_BLOCK_NAMES[role]]
    if role.startswith("hc_head_"):
        return expected[p + role]
    return expected[p + rest]  # e_proj, enorm..., main_proj, markov_head.*, confidence_head.proj


@pytest.mark.parametrize("kind,n_tensors,type_name", [
    ("mtp", 32, "Q8_0"), ("dspark-v4", 81, "Q8_0"), ("dspark-v41", 78, "Q8_0"),
    ("dspark-v4", 81, "IQ2_XXS"),  # routed experts at IQ2_XXS, dense tensors Q8_0
])
def test_every_dsv4_tensor(tmp_path, kind, n_tensors, type_name):
    folder, expected = build_tiny_dsv4(tmp_path / "ckpt", kind)
    out = tmp_path / "out.gguf"
    if kind == "mtp":
        opts = QuantizeOptions(type_name, mtp_out=str(out), only_support=True, progress=False)
    else:
        target = build_tiny_dsv4_target(tmp_path / "target", v41=kind.endswith("41"))
        opts = QuantizeOptions(type_name, dspark_out=str(out), target=str(target), progress=False)
    quantize_model(folder, None, opts, report=lambda m: None)
    f = open_gguf(out)
    assert len(f.tensors) == n_tensors
    for name, t in f.tensors.items():
        check(t, dsv4_source(name, expected))
        if "_exps." in name:
            assert t.type_name == ("IQ2_XXS" if type_name == "IQ2_XXS" else "Q4_K" if kind == "mtp" else "Q8_0")


LLAMA_CPP_NAMES = {"fc.weight": "fc.weight", "enc.output_norm.weight": "hidden_norm.weight",
                   "output_norm.weight": "norm.weight", "markov_w1.weight": "markov_head.markov_w1.weight",
                   "markov_w2.weight": "markov_head.markov_w2.weight",
                   "conf_proj.weight": "confidence_head.proj.weight",
                   "conf_proj.bias": "confidence_head.proj.bias"}
LAYER = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
         "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
         "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm",
         "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


@pytest.mark.parametrize("type_name", ["Q8_0", "F16"])
def test_every_llama_cpp_draft_tensor(hf_qwen3, tmp_path, type_name):
    folder, weights = build_tiny_dspark_qwen3(tmp_path / "draft", hf_qwen3)
    out = tmp_path / "draft.gguf"
    quantize_model(folder, None, QuantizeOptions(type_name, dspark_out=str(out), target=str(hf_qwen3),
                                                 progress=False), report=lambda m: None)
    f = open_gguf(out)
    assert len(f.tensors) == 29
    for name, t in f.tensors.items():
        if name.startswith("blk."):
            _, i, role, _ = name.split(".")
            source = f"layers.{i}.{LAYER[role]}.weight"
        else:
            source = LLAMA_CPP_NAMES[name]
        check(t, weights[source])
        if weights[source].ndim == 1 or name.startswith("conf_proj"):
            assert t.type_name == "F32", name
        else:
            assert t.type_name == type_name, name
