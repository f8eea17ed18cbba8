"""The engine on the CUDA backend (simulated): the same decoder as on the CPU, on device arrays.

Logits equal the CPU's exact (float32) path to float32 rounding, for each architecture the
backend runs and a spread of formats; a token's logits are bit-identical however it was batched
(so greedy speculation is lossless on the device); truncate + re-decode and snapshot / restore
give back the same bits. The simulator runs one Python thread per CUDA thread, so the models
are tiny and the sequences short.
"""
import numpy as np
import pytest
from numba import config

from ds4tools.engine.backends import get_backend
from ds4tools.engine.backends.cuda.backend import DeviceKVCache, DeviceLinear
from ds4tools.engine.generate import decode
from ds4tools.engine.hparams import hparams_from_metadata
from ds4tools.engine.sampling import Sampler
from ds4tools.engine.speculative import speculative_decode
from ds4tools.engine.speculative.dspark import DSparkDrafter, DSparkWeights
from ds4tools.engine.speculative.lookup import PromptLookupDrafter
from ds4tools.engine.speculative.mtp import MtpDrafter, MtpHeadWeights
from ds4tools.engine.transformer import Transformer
from ds4tools.engine.weights import Linear, load_layer, load_weights
from ds4tools.gguf_io.reader import open_gguf
from tests.reference_model import RefConfig, config_metadata, random_weights, write_gguf

assert config.ENABLE_CUDASIM == 1

QWEN3 = RefConfig("qwen3", n_vocab=24, n_embd=32, n_layer=1, n_head=2, n_head_kv=1, head_dim=16, n_ff=32)
QWEN3_2L = RefConfig("qwen3", n_vocab=24, n_embd=32, n_layer=2, n_head=2, n_head_kv=1, head_dim=16, n_ff=32)
LLAMA = RefConfig("llama", n_vocab=20, n_embd=32, n_layer=1, n_head=2, n_head_kv=2, head_dim=16, n_ff=32)
PROMPT = [3, 17, 5, 9]

# name -> (config, format, biases, tied output, cache type). The K-quants and IQ formats need
# rows of 256, too slow for whole models on the simulator: tests/cuda/test_engine_matmul.py
# checks their kernels.
MODELS = {
    "qwen3-Q8_0": (QWEN3, "Q8_0", False, False, "f32"),
    "llama-Q4_0-bias-f16cache": (LLAMA, "Q4_0", True, False, "f16"),
    "llama-F16-tied": (LLAMA, "F16", False, True, "f32"),
    "qwen3-Q5_1-2layers": (QWEN3_2L, "Q5_1", False, False, "f32"),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cuda-engine")


def _model(model_dir, name, device):
    cfg, fmt, biases, tied, cache_type = MODELS[name]
    path = model_dir / f"{name}.gguf"
    if not path.exists():
        w = random_weights(cfg, np.random.default_rng(5), tied=tied, biases=biases)
        write_gguf(path, cfg.arch, config_metadata(cfg, n_ctx=64), w, None, fmt)
    f = open_gguf(str(path))
    hp = hparams_from_metadata(f.metadata, n_vocab_tensor=cfg.n_vocab)
    weights = load_weights(f.tensors, hp, int8="none")
    return Transformer(hp, weights, n_ctx=32, cache_type=cache_type, chunk=8, device=device)


@pytest.mark.parametrize("name", list(MODELS))
def test_logits_equal_the_cpu_exact_path(model_dir, name):
    cpu = _model(model_dir, name, "cpu")
    gpu = _model(model_dir, name, "cuda")
    assert isinstance(gpu.weights.output, DeviceLinear) and isinstance(gpu.cache, DeviceKVCache)
    want = cpu.forward(PROMPT, 0).logits
    got = gpu.forward(PROMPT, 0).logits
    assert isinstance(got, np.ndarray) and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    # a decode step on the cache the prefill left
    np.testing.assert_allclose(gpu.forward([7], len(PROMPT)).logits,
                               cpu.forward([7], len(PROMPT)).logits,
                               rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("name", ["qwen3-Q8_0", "llama-Q4_0-bias-f16cache"])
def test_batched_equals_single_token_bits(model_dir, name):
    gpu = _model(model_dir, name, "cuda")
    tokens = PROMPT + [11]
    batched = gpu.forward(tokens, 0).logits
    gpu.cache.clear()
    single = np.stack([gpu.forward([t], i).logits[0] for i, t in enumerate(tokens)])
    np.testing.assert_array_equal(batched.view(np.uint32), single.view(np.uint32))
    # roll back two positions and decode them again in one batch: the same bits
    gpu.cache.truncate(3)
    again = gpu.forward(tokens[3:], 3).logits
    np.testing.assert_array_equal(again.view(np.uint32), single[3:].view(np.uint32))
    # a snapshot taken now gives back these rows after other tokens overwrote them
    snap = gpu.cache.snapshot()
    gpu.forward([1, 1], 3)
    gpu.cache.restore(snap)
    np.testing.assert_array_equal(gpu.forward([tokens[-1]], 4).logits.view(np.uint32),
                                  single[4:].view(np.uint32))


def test_hidden_rows_come_back_as_numpy(model_dir):
    cpu = _model(model_dir, "qwen3-Q8_0", "cpu")
    gpu = _model(model_dir, "qwen3-Q8_0", "cuda")
    want = cpu.forward(PROMPT, 0, hidden_layers=[0], want_final_hidden=True, logits="last")
    got = gpu.forward(PROMPT, 0, hidden_layers=[0], want_final_hidden=True, logits="last")
    assert got.logits.shape == (1, QWEN3.n_vocab)
    for a, b in ((got.hidden[0], want.hidden[0]), (got.final_hidden, want.final_hidden)):
        assert isinstance(a, np.ndarray)
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())


def test_speculative_greedy_equals_plain_on_the_device(model_dir):
    gpu = _model(model_dir, "qwen3-Q8_0", "cuda")
    prompt = [3, 4, 5, 3, 4, 5, 3]  # repeats: prompt lookup proposes drafts
    plain = list(decode(gpu, prompt, 5, Sampler(0.0), np.random.default_rng(0)))
    spec = list(speculative_decode(gpu, PromptLookupDrafter(3), prompt, 5, Sampler(0.0),
                                   np.random.default_rng(0), calibrate=False))
    assert spec == plain and len(plain) == 5


def _draft_layer(model_dir, cpu):
    """A decoder layer of the target's shape with other random weights (a draft's layer)."""
    path = model_dir / "draft-layer.gguf"
    if not path.exists():
        w = random_weights(QWEN3, np.random.default_rng(77))
        write_gguf(path, "qwen3", config_metadata(QWEN3, n_ctx=64), w, None, "Q8_0")
    return load_layer(open_gguf(str(path)).tensors, "blk.0.", cpu.hp, "none")


def _mtp_weights(model_dir, cpu):
    rng = np.random.default_rng(3)
    H = QWEN3.n_embd
    ones = np.ones(H, np.float32)
    eh = (rng.standard_normal((H, 2 * H)) / np.sqrt(2 * H)).astype(np.float32)
    return MtpHeadWeights(ones, ones, ones, _draft_layer(model_dir, cpu),
                          eh_proj=Linear.from_float("eh_proj", eh, "Q8_0"), source="synthetic")


def _dspark_weights(model_dir, cpu, confidence_head):
    rng = np.random.default_rng(4)
    H, V, rank = QWEN3.n_embd, QWEN3.n_vocab, 4

    def mat(n_out, n_in):
        return Linear.from_float("m", (rng.standard_normal((n_out, n_in)) / np.sqrt(n_in))
                                 .astype(np.float32), "F32")
    ones = np.ones(H, np.float32)
    conf = (0.3 * rng.standard_normal(H + rank)).astype(np.float32) if confidence_head else None
    return DSparkWeights(mat(H, 2 * H), ones, [_draft_layer(model_dir, cpu)], ones, mat(V, rank),
                         mat(V, rank), conf, 0.1, cpu.hp, block_size=3, markov_rank=rank,
                         mask_token_id=V - 1, target_layers=(-1, 0), source="synthetic")


@pytest.mark.parametrize("drafter", ["mtp", "dspark"])
def test_model_drafters_on_the_device_are_lossless_and_match_the_cpu(model_dir, drafter):
    """The MTP head and the DSpark block run on the target's device: greedy output equals
    plain decoding there, and the drafts equal the CPU drafter's (same weights)."""
    cpu = _model(model_dir, "qwen3-Q8_0", "cpu")
    gpu = _model(model_dir, "qwen3-Q8_0", "cuda")

    def make(model):
        if drafter == "mtp":
            return MtpDrafter(model, _mtp_weights(model_dir, cpu), max_draft=2)
        return DSparkDrafter(model, _dspark_weights(model_dir, cpu, True), confidence=0.0)
    prompt = [3, 4, 5, 6]
    plain = list(decode(gpu, prompt, 3, Sampler(0.0), np.random.default_rng(0)))
    runs = {}
    for name, model in (("cuda", gpu), ("cpu", cpu)):
        d = make(model)
        proposals = []
        d.propose = (lambda f: lambda *a: proposals.append(f(*a)) or proposals[-1])(d.propose)
        runs[name] = (list(speculative_decode(model, d, prompt, 3, Sampler(0.0),
                                              np.random.default_rng(0), calibrate=False)),
                      [p.tokens for p in proposals])
    assert runs["cuda"][0] == plain
    assert runs["cpu"][0] == plain  # float32 rounding apart, the CPU target decodes the same
    assert runs["cuda"][1] == runs["cpu"][1] and runs["cuda"][1]


def test_get_backend_knows_its_devices():
    assert get_backend("cuda").name == "cuda"
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        get_backend("tpu")


def test_run_on_the_device_prints_what_the_cpu_prints(tmp_path):
    """`ds4tools run --device cuda` end to end (tokenizer, warm-up, streaming): at greedy, the
    text of the CPU's exact path."""
    from click.testing import CliRunner
    from ds4tools.cli import main
    from tests.reference_model import write_random_model
    cfg = RefConfig("llama", n_vocab=300, n_embd=32, n_layer=1, n_head=2, n_head_kv=2,
                    head_dim=16, n_ff=32)
    path = tmp_path / "tiny.gguf"
    write_random_model(path, cfg, seed=8, default_type="Q8_0", n_ctx=64)
    args = ["run", "-m", str(path), "-p", "a token", "-n", "3", "--temp", "0", "--ctx", "16"]
    gpu = CliRunner().invoke(main, args + ["--device", "cuda"])
    cpu = CliRunner().invoke(main, args + ["--exact"])
    assert gpu.exit_code == 0 and cpu.exit_code == 0, gpu.stderr + cpu.stderr
    assert gpu.stdout == cpu.stdout and gpu.stdout.strip()
    # a clone (a serving slot) has its own cache on the device but reads the same uploads
    from ds4tools.engine import Engine
    eng = Engine(path, device="cuda", n_ctx=16)
    twin = eng.clone()
    assert twin.model.weights.layers[0].wq.raw is eng.model.weights.layers[0].wq.raw
    assert twin.cache is not eng.cache and isinstance(twin.cache, DeviceKVCache)


# --- glm4moe: the mixture-of-experts block on the device ------------------------------------------


def _glm4moe(model_dir, device, fmt):
    from ds4tools.engine import glm4moe
    from tests import glm4moe_model as g
    # a leading dense layer, then a MoE layer (sigmoid scoring, selection bias, normalised and
    # scaled weights, a shared expert), q/k/v biases, rope over half the head, a NextN layer
    cfg = g.Glm4MoeConfig(n_vocab=24, n_embd=32, n_layer=2, n_head=2, n_head_kv=1, head_dim=16,
                          n_rot=8, n_ff=32, n_ff_exp=32, n_expert=4, n_expert_used=2, n_ctx=64)
    path = model_dir / f"glm4moe-{fmt}.gguf"
    if not path.exists():
        w = g.random_weights(cfg, np.random.default_rng(2))
        types = {n: ("F32" if a.ndim == 1 or "ffn_gate_inp" in n else fmt) for n, a in w.items()}
        write_gguf(path, g.ARCH, g.metadata(cfg), w, types)
    f = open_gguf(str(path))
    hp = glm4moe.read_hparams(f.metadata, n_vocab_tensor=cfg.n_vocab)
    weights = glm4moe.load_weights(f.tensors, hp, int8="none")
    return glm4moe.Glm4MoeTransformer(hp, weights, n_ctx=32, chunk=8, device=device), f


@pytest.mark.parametrize("fmt", ["Q8_0"])
def test_glm4moe_logits_equal_the_cpu_and_batches_keep_their_bits(model_dir, fmt):
    cpu, _ = _glm4moe(model_dir, "cpu", fmt)
    gpu, _ = _glm4moe(model_dir, "cuda", fmt)
    want = cpu.forward(PROMPT, 0).logits
    got = gpu.forward(PROMPT, 0).logits
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    gpu.cache.truncate(1)
    single = np.stack([gpu.forward([t], i).logits[0] for i, t in enumerate(PROMPT[1:], 1)])
    np.testing.assert_array_equal(got[1:].view(np.uint32), single.view(np.uint32))


def test_glm4moe_nextn_drafts_on_the_device_are_lossless(model_dir):
    """--glm-mtp on the device: the model file's NextN layer (attention + experts) drafts."""
    from ds4tools.engine.speculative.load import mtp_from_nextn
    gpu, f = _glm4moe(model_dir, "cuda", "Q8_0")
    drafter = MtpDrafter(gpu, mtp_from_nextn(f, gpu.hp, "none", gpu), max_draft=2)
    prompt = [3, 4, 5, 6]
    plain = list(decode(gpu, prompt, 2, Sampler(0.0), np.random.default_rng(0)))
    spec = list(speculative_decode(gpu, drafter, prompt, 2, Sampler(0.0), np.random.default_rng(0),
                                   calibrate=False))
    assert spec == plain
