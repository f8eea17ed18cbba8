"""The engine's CUDA backend on a real NVIDIA GPU, at sizes the simulator cannot run.

The same checks as tests/cuda/test_engine_cuda.py (which CI runs under numba's simulator), on
models with real row lengths (1024 and 2816 wide, every format the engine runs, a 4096-token
vocabulary): logits equal to the CPU's exact path to float32 rounding; a token's logits
bit-identical alone or in verify batches of 2..16 rows; truncate + re-decode; greedy
speculative decoding equal to plain decoding; glm4moe, deepseek2 and glm-dsa models against
the CPU and in batches. Skipped where no GPU is present (CI).
"""
import numpy as np
import pytest

cuda = pytest.importorskip("numba.cuda", reason="numba-cuda (the cuda extra) is not installed")
from numba import config  # noqa: E402

if config.ENABLE_CUDASIM or not cuda.is_available():
    pytest.skip("no CUDA GPU here (tests/cuda runs these checks under the simulator)",
                allow_module_level=True)

from ds4tools.engine.generate import decode  # noqa: E402
from ds4tools.engine.hparams import hparams_from_metadata  # noqa: E402
from ds4tools.engine.sampling import Sampler  # noqa: E402
from ds4tools.engine.speculative import speculative_decode  # noqa: E402
from ds4tools.engine.speculative.lookup import PromptLookupDrafter  # noqa: E402
from ds4tools.engine.transformer import Transformer  # noqa: E402
from ds4tools.engine.weights import load_weights  # noqa: E402
from ds4tools.gguf_io.reader import open_gguf  # noqa: E402
from tests.reference_model import RefConfig, config_metadata, random_weights, write_gguf  # noqa: E402

CFG = RefConfig("qwen3", n_vocab=4096, n_embd=1024, n_layer=2, n_head=16, n_head_kv=4,
                head_dim=64, n_ff=2816)
FORMATS = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K",
           "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ2_XXS"]
TOKENS = np.random.default_rng(1).integers(0, CFG.n_vocab, 40)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cuda-gpu")


def _model(model_dir, fmt, device, cache_type="f32"):
    path = model_dir / f"{fmt}.gguf"
    if not path.exists():
        w = random_weights(CFG, np.random.default_rng(5))
        write_gguf(path, CFG.arch, config_metadata(CFG, n_ctx=256), w, None, fmt)
    f = open_gguf(str(path))
    hp = hparams_from_metadata(f.metadata, n_vocab_tensor=CFG.n_vocab)
    return Transformer(hp, load_weights(f.tensors, hp, int8="none"), n_ctx=128,
                       cache_type=cache_type, device=device)


@pytest.mark.parametrize("fmt", FORMATS)
def test_logits_equal_the_cpu_exact_path(model_dir, fmt):
    want = _model(model_dir, fmt, "cpu").forward(TOKENS, 0).logits
    got = _model(model_dir, fmt, "cuda").forward(TOKENS, 0).logits
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3 * np.abs(want).max())


@pytest.mark.parametrize("fmt, cache_type", [("Q4_K", "f32"), ("Q8_0", "f16"), ("IQ2_XXS", "f32")])
def test_verify_batches_give_single_token_bits(model_dir, fmt, cache_type):
    gpu = _model(model_dir, fmt, "cuda", cache_type)
    single = np.stack([gpu.forward([t], i).logits[0] for i, t in enumerate(TOKENS[:24])])
    for k in (2, 3, 5, 8, 9, 16):
        gpu.cache.truncate(8)
        batch = gpu.forward(TOKENS[8:8 + k], 8).logits
        np.testing.assert_array_equal(batch.view(np.uint32), single[8:8 + k].view(np.uint32))


def test_speculative_greedy_equals_plain(model_dir):
    gpu = _model(model_dir, "Q4_K", "cuda")
    prompt = [int(t) for t in TOKENS[:6]] * 3
    plain = list(decode(gpu, prompt, 24, Sampler(0.0), np.random.default_rng(0)))
    spec = list(speculative_decode(gpu, PromptLookupDrafter(4), prompt, 24, Sampler(0.0),
                                   np.random.default_rng(0), calibrate=False))
    assert spec == plain


def _assert_equals_the_cpu_and_keeps_its_bits_in_batches(make, model_dir, start, stop):
    """The MoE families' check: ``make(model_dir, device)``'s prefill logits on the GPU equal
    the CPU's exact path, and after a rollback to ``start`` the tokens start..stop-1 decoded one
    at a time give the prefill's bits."""
    want = make(model_dir, "cpu").forward(TOKENS, 0).logits
    gpu = make(model_dir, "cuda")
    got = gpu.forward(TOKENS, 0).logits
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3 * np.abs(want).max())
    gpu.cache.truncate(start)
    single = np.stack([gpu.forward([t], i).logits[0]
                       for i, t in enumerate(TOKENS[start:stop], start)])
    np.testing.assert_array_equal(got[start:stop].view(np.uint32), single.view(np.uint32))


def _glm4moe(model_dir, device):
    from ds4tools.engine import glm4moe
    from tests import glm4moe_model as g
    cfg = g.Glm4MoeConfig(n_vocab=4096, n_embd=1024, n_layer=3, n_head=16, n_head_kv=4,
                          head_dim=64, n_rot=32, n_ff=2816, n_ff_exp=512, n_expert=16,
                          n_expert_used=4, n_ctx=256)
    path = model_dir / "glm4moe-q4_k.gguf"
    if not path.exists():
        w = g.random_weights(cfg, np.random.default_rng(2))
        types = {n: ("F32" if a.ndim == 1 or "ffn_gate_inp" in n else "Q4_K") for n, a in w.items()}
        write_gguf(path, g.ARCH, g.metadata(cfg), w, types)
    f = open_gguf(str(path))
    hp = glm4moe.read_hparams(f.metadata, n_vocab_tensor=cfg.n_vocab)
    return glm4moe.Glm4MoeTransformer(hp, glm4moe.load_weights(f.tensors, hp, int8="none"),
                                      n_ctx=128, device=device)


def test_glm4moe_equals_the_cpu_and_keeps_its_bits_in_batches(model_dir):
    _assert_equals_the_cpu_and_keeps_its_bits_in_batches(_glm4moe, model_dir, 8, 16)


def _deepseek2(model_dir, device):
    from ds4tools.engine import deepseek2
    from tests.deepseek2_model import Deepseek2Config, write_model
    # DeepSeek V3's attention widths (latent 512 + rope 64, 128-wide heads), 16 heads, experts
    cfg = Deepseek2Config(n_vocab=4096, n_embd=1024, n_layer=3, n_head=16, n_lora_q=512,
                          n_lora_kv=512, n_nope=128, n_rot=64, n_v=128, n_ff=2816, n_ff_exp=512,
                          n_expert=16, n_expert_used=4, n_group=4, n_group_used=2, n_ctx=256)
    path = model_dir / "deepseek2-q8_0.gguf"
    if not path.exists():
        write_model(path, cfg, "Q8_0", seed=3)
    f = open_gguf(str(path))
    hp = deepseek2.read_hparams(f.metadata, n_vocab_tensor=cfg.n_vocab)
    return deepseek2.Deepseek2Transformer(hp, deepseek2.load_weights(f.tensors, hp, int8="none"),
                                          n_ctx=128, device=device)


def test_deepseek2_equals_the_cpu_and_keeps_its_bits_in_batches(model_dir):
    _assert_equals_the_cpu_and_keeps_its_bits_in_batches(_deepseek2, model_dir, 8, 16)


def _glm_dsa(model_dir, device):
    from ds4tools.engine import glm_dsa
    from tests.glm_dsa_model import GlmDsaConfig, write_model
    # GLM-5's attention widths, an indexer keeping 16 of the 40 positions, a shared indexer layer
    cfg = GlmDsaConfig(n_vocab=4096, n_embd=1024, n_layer=3, n_head=16, n_lora_q=512,
                       n_lora_kv=512, n_nope=128, n_rot=64, n_v=128, n_ff=2816, n_ff_exp=512,
                       n_expert=16, n_expert_used=4, idx_head=8, idx_dim=128, idx_top_k=16,
                       idx_types=(True, False, True), n_ctx=256)
    path = model_dir / "glm-dsa-q8_0.gguf"
    if not path.exists():
        write_model(path, cfg, "Q8_0", seed=4)
    f = open_gguf(str(path))
    hp = glm_dsa.read_hparams(f.metadata, n_vocab_tensor=cfg.n_vocab)
    return glm_dsa.GlmDsaTransformer(hp, glm_dsa.load_weights(f.tensors, hp, int8="none"),
                                     n_ctx=128, device=device)


def test_glm_dsa_equals_the_cpu_and_keeps_its_bits_in_batches(model_dir):
    _assert_equals_the_cpu_and_keeps_its_bits_in_batches(_glm_dsa, model_dir, 20, 28)
