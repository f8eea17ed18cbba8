import os

# The CUDA-simulator tests need NUMBA_ENABLE_CUDASIM set before numba is imported, so they run
# in their own pytest process (tests/test_cuda_simulator.py starts it); never collect them here.
collect_ignore = ["cuda"]

os.environ.setdefault("NUMBA_NUM_THREADS", str(min(2, os.cpu_count() or 1)))
# pytest-xdist's workers share the cores: OpenMP workers that spin long between parallel
# regions would take the CPU time the other workers' kernels need (see ds4tools/__init__.py)
os.environ.setdefault("GOMP_SPINCOUNT", "1000")


# --- tiny Hugging Face checkpoints and their GGUF conversions (tests/fixtures/hf_models.py) ---
# Session-scoped: built once, shared by the quantize, inspect, engine and support-GGUF tests.
# Treat them as read-only.
import pytest  # noqa: E402

from tests.fixtures import hf_models  # noqa: E402


@pytest.fixture(scope="session")
def hf_llama(tmp_path_factory):
    """LlamaForCausalLM, 4 layers, hidden 256, GQA 4/2, Llama-3-style BPE (F32 safetensors)."""
    return hf_models.build_tiny_llama(tmp_path_factory.mktemp("hf") / "tiny-llama")


@pytest.fixture(scope="session")
def hf_llama_sharded(tmp_path_factory):
    """The same model as hf_llama, stored as BF16 in 3 shards with an index."""
    return hf_models.build_tiny_llama(tmp_path_factory.mktemp("hf") / "tiny-llama-sharded",
                                      shards=3, dtype="BF16")


@pytest.fixture(scope="session")
def hf_llama_spm(tmp_path_factory):
    """LlamaForCausalLM, 2 layers, with a Llama-2-style (SentencePiece-like) tokenizer, F16."""
    return hf_models.build_spm_llama(tmp_path_factory.mktemp("hf") / "tiny-llama-spm")


@pytest.fixture(scope="session")
def hf_qwen3(tmp_path_factory):
    """Qwen3ForCausalLM, 2 layers, head_dim 96, q/k norms, Qwen2-style BPE, padded vocab."""
    return hf_models.build_tiny_qwen3(tmp_path_factory.mktemp("hf") / "tiny-qwen3")


@pytest.fixture(scope="session")
def hf_qwen3_nextn(tmp_path_factory):
    """hf_qwen3 plus one NextN/MTP layer (model.layers.2.*, num_nextn_predict_layers = 1)."""
    return hf_models.build_tiny_qwen3(tmp_path_factory.mktemp("hf") / "tiny-qwen3-nextn", nextn=True)


def _convert(src, out, type_name):
    from ds4tools.quantize import QuantizeOptions, quantize_model
    quantize_model(src, out, QuantizeOptions(type_name, progress=False), report=lambda msg: None)
    return out


@pytest.fixture(scope="session")
def gguf_llama_f32(hf_llama, tmp_path_factory):
    """hf_llama converted to an F32 GGUF (llama.cpp's `llama` layout)."""
    return _convert(hf_llama, tmp_path_factory.mktemp("gguf") / "tiny-llama-f32.gguf", "F32")


@pytest.fixture(scope="session")
def gguf_qwen3_f32(hf_qwen3, tmp_path_factory):
    """hf_qwen3 converted to an F32 GGUF (llama.cpp's `qwen3` layout)."""
    return _convert(hf_qwen3, tmp_path_factory.mktemp("gguf") / "tiny-qwen3-f32.gguf", "F32")


@pytest.fixture(scope="session")
def spec_files(hf_qwen3_nextn, tmp_path_factory):
    """A Q8_0 qwen3 target (hf_qwen3_nextn) with its support files for speculative decoding:
    target.gguf, mtp.gguf (its NextN layer, ds4 layout), target-nextn.gguf (the NextN layer
    embedded), draft.gguf (a synthetic 2-layer DSpark draft, block 4, llama.cpp layout, reading
    the embedding and target layer 0)."""
    from ds4tools.quantize import QuantizeOptions, quantize_model
    from tests.fixtures import support_models
    d = tmp_path_factory.mktemp("spec-files")
    quiet = lambda msg: None  # noqa: E731
    quantize_model(hf_qwen3_nextn, d / "target.gguf",
                   QuantizeOptions("Q8_0", mtp_out=str(d / "mtp.gguf"), progress=False), report=quiet)
    quantize_model(hf_qwen3_nextn, d / "target-nextn.gguf",
                   QuantizeOptions("Q8_0", keep_nextn=True, progress=False), report=quiet)
    draft_dir, _ = support_models.build_tiny_dspark_qwen3(d / "dspark-hf", hf_qwen3_nextn, n_layers=2,
                                                          block_size=4, target_layer_ids=(-1, 0))
    quantize_model(draft_dir, None, QuantizeOptions("Q8_0", dspark_out=str(d / "draft.gguf"),
                                                    target=str(hf_qwen3_nextn), progress=False),
                   report=quiet)
    return d
