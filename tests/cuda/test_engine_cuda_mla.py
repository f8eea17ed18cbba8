"""deepseek2 (multi-head latent attention over a latent cache) and glm-dsa (the same attention
over the positions the DSA indexer selects) on the CUDA backend (simulated).

The same checks as test_engine_cuda.py's for llama / qwen3 / glm4moe: logits equal the CPU's
exact path to float32 rounding (deepseek2: the low-rank q path with sigmoid-routed, grouped
experts, and the V2-Lite layout with YaRN over an fp16 latent cache; glm-dsa: rows that select
top_k positions, a shared indexer layer, an fp16 cache); a token's logits keep their bits
however it was batched; truncate and snapshot / restore give back the same bits; the NextN layer
drafts on the device without changing greedy output.
"""
import numpy as np
import pytest
from numba import config

from ds4tools.engine import deepseek2, glm_dsa
from ds4tools.engine.backends.cuda.backend import DeviceDSACache, DeviceLatentCache
from ds4tools.engine.generate import decode
from ds4tools.engine.sampling import Sampler
from ds4tools.engine.speculative import speculative_decode
from ds4tools.engine.speculative.load import mtp_from_nextn
from ds4tools.engine.speculative.mtp import MtpDrafter
from ds4tools.gguf_io.reader import open_gguf
from tests.deepseek2_model import Deepseek2Config, write_model
from tests.glm_dsa_model import GlmDsaConfig
from tests.glm_dsa_model import write_model as write_dsa_model

assert config.ENABLE_CUDASIM == 1

PROMPT = [3, 17, 5, 9]
# rows of 32 (Q8_0's block) everywhere; a dense layer, a MoE layer and a NextN layer
V3 = Deepseek2Config(n_vocab=24, n_embd=32, n_layer=2, n_nextn=1, n_head=2, n_lora_q=32,
                     n_lora_kv=32, n_nope=32, n_rot=16, n_v=32, n_ff=32, n_ff_exp=32, n_expert=4,
                     n_expert_used=2, n_group=2, n_group_used=1, n_ctx=64)
LITE = Deepseek2Config(n_vocab=24, n_embd=32, n_layer=2, n_head=2, n_lora_q=0, n_lora_kv=32,
                       n_nope=32, n_rot=16, n_v=32, n_ff=32, n_ff_exp=32, n_expert=4,
                       n_expert_used=2, n_expert_shared=2, gating=1, selection_bias=False,
                       normalize_weights=False, weights_scale=0.0, n_group=0, n_group_used=0,
                       yarn=True, yarn_orig_ctx=16, n_ctx=64)
# name -> (config, matrix format, cache type)
MODELS = {"v3-Q8_0": (V3, "Q8_0", "f32"), "lite-yarn-F32-f16cache": (LITE, "F32", "f16")}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cuda-mla")


def _model(model_dir, name, device):
    cfg, fmt, cache_type = MODELS[name]
    path = model_dir / f"{name}.gguf"
    if not path.exists():
        write_model(path, cfg, fmt, seed=11)
    f = open_gguf(str(path))
    hp = deepseek2.read_hparams(f.metadata, n_vocab_tensor=cfg.n_vocab)
    weights = deepseek2.load_weights(f.tensors, hp, int8="none")
    return deepseek2.Deepseek2Transformer(hp, weights, n_ctx=32, cache_type=cache_type, chunk=8,
                                          device=device), f


@pytest.mark.parametrize("name", list(MODELS))
def test_logits_equal_the_cpu_exact_path(model_dir, name):
    cpu, _ = _model(model_dir, name, "cpu")
    gpu, _ = _model(model_dir, name, "cuda")
    assert isinstance(gpu.cache, DeviceLatentCache)
    want = cpu.forward(PROMPT, 0).logits
    got = gpu.forward(PROMPT, 0).logits
    tol = dict(rtol=1e-4, atol=1e-4 * np.abs(want).max())
    np.testing.assert_allclose(got, want, **tol)
    # a decode step on the cache the prefill left
    np.testing.assert_allclose(gpu.forward([7], len(PROMPT)).logits,
                               cpu.forward([7], len(PROMPT)).logits, **tol)


def test_batched_equals_single_token_bits_and_the_cache_rolls_back(model_dir):
    gpu, _ = _model(model_dir, "v3-Q8_0", "cuda")
    tokens = [3, 17, 11]
    batched = gpu.forward(tokens, 0).logits
    gpu.cache.clear()
    single = np.stack([gpu.forward([t], i).logits[0] for i, t in enumerate(tokens)])
    np.testing.assert_array_equal(batched.view(np.uint32), single.view(np.uint32))
    gpu.cache.truncate(1)
    again = gpu.forward(tokens[1:], 1).logits
    np.testing.assert_array_equal(again.view(np.uint32), single[1:].view(np.uint32))
    snap = gpu.cache.snapshot()
    gpu.forward([1], 2)
    gpu.cache.restore(snap)
    np.testing.assert_array_equal(gpu.forward([tokens[-1]], 2).logits.view(np.uint32),
                                  single[2:].view(np.uint32))


def test_nextn_drafts_on_the_device_are_lossless(model_dir):
    """--glm-mtp on a deepseek2 file: its NextN layer (latent attention + experts, a one-layer
    latent cache of its own) drafts on the device; greedy output equals plain decoding."""
    gpu, f = _model(model_dir, "v3-Q8_0", "cuda")
    drafter = MtpDrafter(gpu, mtp_from_nextn(f, gpu.hp, "none", gpu), max_draft=2)
    prompt = [3, 4, 5, 6]
    plain = list(decode(gpu, prompt, 2, Sampler(0.0), np.random.default_rng(0)))
    spec = list(speculative_decode(gpu, drafter, prompt, 2, Sampler(0.0), np.random.default_rng(0),
                                   calibrate=False))
    assert isinstance(drafter.mtp.cache, DeviceLatentCache)
    assert spec == plain and len(plain) == 2


# --- glm-dsa: latent attention over the positions the DSA indexer selects -----------------------

# top_k 3 below a 6-token sequence: rows past the third select; layer 1 shares layer 0's choice;
# a NextN layer with its own indexer; Q8_0 matrices over an fp16 cache (the f32 latent cache is
# deepseek2's above)
DSA = GlmDsaConfig(n_vocab=24, n_embd=32, n_layer=2, n_nextn=1, n_head=2, n_lora_q=32,
                   n_lora_kv=32, n_nope=32, n_rot=16, n_v=32, n_ff=32, n_ff_exp=32, n_expert=4,
                   n_expert_used=2, idx_head=2, idx_dim=32, idx_top_k=3, idx_types=(True, False),
                   yarn=True, yarn_orig_ctx=16, n_ctx=64)


def _glm_dsa(model_dir, device):
    path = model_dir / "glm-dsa-q8_0.gguf"
    if not path.exists():
        write_dsa_model(path, DSA, "Q8_0", seed=12)
    f = open_gguf(str(path))
    hp = glm_dsa.read_hparams(f.metadata, n_vocab_tensor=DSA.n_vocab)
    weights = glm_dsa.load_weights(f.tensors, hp, int8="none")
    return glm_dsa.GlmDsaTransformer(hp, weights, n_ctx=32, cache_type="f16", chunk=8,
                                      device=device), f


def test_glm_dsa_logits_equal_the_cpu_and_batches_keep_their_bits(model_dir):
    cpu, _ = _glm_dsa(model_dir, "cpu")
    gpu, _ = _glm_dsa(model_dir, "cuda")
    assert isinstance(gpu.cache, DeviceDSACache)
    tokens = PROMPT + [11, 2]
    want = cpu.forward(tokens, 0).logits
    got = gpu.forward(tokens, 0).logits
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    # the rows past top_k select: decoded one at a time after a rollback, the same bits
    gpu.cache.truncate(3)
    single = np.stack([gpu.forward([t], i).logits[0] for i, t in enumerate(tokens[3:], 3)])
    np.testing.assert_array_equal(got[3:].view(np.uint32), single.view(np.uint32))


def test_glm_dsa_nextn_drafts_on_the_device_are_lossless(model_dir):
    gpu, f = _glm_dsa(model_dir, "cuda")
    drafter = MtpDrafter(gpu, mtp_from_nextn(f, gpu.hp, "none", gpu), max_draft=2)
    assert isinstance(drafter.mtp.cache, DeviceDSACache)  # the NextN layer has its own indexer
    prompt = [3, 4, 5, 6]
    plain = list(decode(gpu, prompt, 2, Sampler(0.0), np.random.default_rng(0)))
    spec = list(speculative_decode(gpu, drafter, prompt, 2, Sampler(0.0), np.random.default_rng(0),
                                   calibrate=False))
    assert spec == plain and len(plain) == 2
