"""llama.cpp itself (through llama-cpp-python, when its library has DFlash / DSpark): it loads our
DSpark draft GGUF, reads its target layers, block size and mask token as written, refuses a broken
one, and captures for ``dflash.target_layers`` id k the *input* of target layer k (the output of
layer k - 1), which is why we store DeepSpec's ids + 1.

llama.cpp runs in a child process: a crash in its kernels must not take the test session down."""
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.fixtures.support_models import build_tiny_dspark_qwen3, rewrite_gguf

_SYMBOL = "_Z30llama_model_target_layer_ids_nPK11llama_model"


def _llama_cpp_with_dflash() -> bool:
    try:
        import llama_cpp
        return hasattr(llama_cpp.llama_cpp._lib, _SYMBOL)
    except (ImportError, OSError, AttributeError):
        return False


pytestmark = pytest.mark.skipif(not _llama_cpp_with_dflash(),
                                reason="llama-cpp-python with DFlash / DSpark support is not installed")

_PRELUDE = textwrap.dedent("""
    import ctypes, json, sys
    import numpy as np
    import llama_cpp
    lib = llama_cpp.llama_cpp._lib
    def fn(name, restype, *argtypes):
        f = getattr(lib, name)
        f.restype, f.argtypes = restype, list(argtypes)
        return f
""")


def run_child(body: str, *args) -> dict:
    code = _PRELUDE + textwrap.dedent(body)
    r = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                       timeout=300, cwd=Path(__file__).resolve().parents[1])
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert lines, f"llama.cpp child failed (rc {r.returncode}): {r.stderr[-2000:]}"
    return json.loads(lines[-1][len("RESULT "):])


_LOAD = """
    llama_cpp.llama_backend_init()
    m = llama_cpp.llama_model_load_from_file(sys.argv[1].encode(), llama_cpp.llama_model_default_params())
    out = {"loaded": bool(m)}
    if m:
        n = fn("_Z30llama_model_target_layer_ids_nPK11llama_model", ctypes.c_uint32, ctypes.c_void_p)(m)
        ids = fn("_Z28llama_model_target_layer_idsPK11llama_model", ctypes.POINTER(ctypes.c_int32),
                 ctypes.c_void_p)(m)
        out["target_layers"] = [ids[i] for i in range(n)]
        buf = ctypes.create_string_buffer(64)
        llama_cpp.llama_model_meta_val_str(m, b"dflash.block_size", buf, 64)
        out["block_size"] = buf.value.decode()
        vocab = llama_cpp.llama_model_get_vocab(m)
        out["n_vocab"] = llama_cpp.llama_vocab_n_tokens(vocab)
        out["mask"] = fn("llama_vocab_mask", ctypes.c_int32, ctypes.c_void_p)(vocab)
    print("RESULT " + json.dumps(out))
"""


def test_llama_cpp_loads_the_draft_as_written(hf_qwen3, tmp_path):
    # layers 0 and 1 (dflash 1, 2): the numbering check needs an id past 1; llama.cpp loads such
    # a draft (it would abort only when drafting, on the missing input of layer 2), so the
    # writer is told to write it anyway
    folder, _ = build_tiny_dspark_qwen3(tmp_path / "draft", hf_qwen3, target_layer_ids=(0, 1))
    from ds4tools.quantize import QuantizeOptions, quantize_model
    out = tmp_path / "draft.gguf"
    quantize_model(folder, None, QuantizeOptions("Q8_0", dspark_out=str(out), target=str(hf_qwen3),
                                                 progress=False, dspark_allow_output_layer=True),
                   report=lambda m: None)
    cfg = json.loads((folder / "config.json").read_text())
    got = run_child(_LOAD, out)
    assert got == {"loaded": True, "target_layers": [1, 2], "block_size": "4", "n_vocab": 416,
                   "mask": cfg["mask_token_id"]}
    broken = rewrite_gguf(out, tmp_path / "broken.gguf", drop_tensors=["fc.weight"])
    assert run_child(_LOAD, broken) == {"loaded": False}


_CAPTURE = """
    from ds4tools.gguf_io import open_gguf
    from tests.reference_model import RefConfig, reference_forward
    path = sys.argv[1]
    llm = llama_cpp.Llama(model_path=path, n_ctx=64, n_batch=64, n_ubatch=64, verbose=False)
    ctx = llm._ctx.ctx
    set_inp = fn("_Z30llama_set_embeddings_layer_inpP13llama_contextjb", None, ctypes.c_void_p,
                 ctypes.c_uint32, ctypes.c_bool)
    get_inp = fn("_Z30llama_get_embeddings_layer_inpP13llama_contextj", ctypes.POINTER(ctypes.c_float),
                 ctypes.c_void_p, ctypes.c_uint32)
    for il in (0, 1):
        set_inp(ctx, il, True)
    toks = [5, 17, 42, 99, 3, 250]
    llm.eval(toks)
    f = open_gguf(path)
    md = f.metadata
    E = md["qwen3.embedding_length"]
    cfg = RefConfig("qwen3", md["qwen3.vocab_size"], E, md["qwen3.block_count"],
                    md["qwen3.attention.head_count"], md["qwen3.attention.head_count_kv"],
                    md["qwen3.attention.key_length"], md["qwen3.feed_forward_length"],
                    rms_eps=md["qwen3.attention.layer_norm_rms_epsilon"], rope_base=md["qwen3.rope.freq_base"])
    w = {n: t.to_float32() for n, t in f.tensors.items()}
    _, hidden, _ = reference_forward(w, cfg, toks, hidden_layers=(0, 1))
    outputs = {-1: w["token_embd.weight"][toks], 0: hidden[0], 1: hidden[1]}
    result = {}
    for il in (0, 1):
        got = np.ctypeslib.as_array(get_inp(ctx, il), shape=(len(toks), E)).copy()
        scale = float(np.abs(outputs[il - 1]).max())
        result[str(il)] = {str(k): float(np.abs(got - v).max()) / scale for k, v in outputs.items()}
    print("RESULT " + json.dumps(result))
"""


def test_llama_cpp_target_layer_k_is_the_output_of_layer_k_minus_1(gguf_qwen3_f32):
    """dflash.target_layers holds k = DeepSpec id + 1: llama.cpp captures the input of layer k."""
    got = run_child(_CAPTURE, gguf_qwen3_f32)
    for k in ("0", "1"):
        errs = got[k]  # max error relative to the values, against each candidate
        closest = min(errs, key=errs.get)
        # float32 with an f16 KV cache against a float64 reference: close for one, far for the others
        assert closest == str(int(k) - 1) and errs[closest] < 1e-2, got
        assert all(v > 0.3 for c, v in errs.items() if c != closest), got


_LOAD_MODEL = """
    llama_cpp.llama_backend_init()
    m = llama_cpp.llama_model_load_from_file(sys.argv[1].encode(), llama_cpp.llama_model_default_params())
    print("RESULT " + json.dumps({"loaded": bool(m)}))
"""


def test_stock_qwen3_loader_refuses_an_embedded_nextn_layer(hf_qwen3_nextn, tmp_path):
    """As docs/support-gguf.md says: --keep-nextn files are for ds4tools' engine, not stock llama.cpp."""
    from ds4tools.quantize import QuantizeOptions, quantize_model
    quantize_model(hf_qwen3_nextn, tmp_path / "plain.gguf", QuantizeOptions("F32", progress=False),
                   report=lambda m: None)
    quantize_model(hf_qwen3_nextn, tmp_path / "nextn.gguf", QuantizeOptions("F32", keep_nextn=True, progress=False),
                   report=lambda m: None)
    assert run_child(_LOAD_MODEL, tmp_path / "plain.gguf") == {"loaded": True}
    assert run_child(_LOAD_MODEL, tmp_path / "nextn.gguf") == {"loaded": False}
