"""Bit-identity: a token's logits do not depend on how it was batched.

Speculative verification forwards k drafted tokens at once and compares with what plain
decoding would have produced one token at a time; that is only lossless if the two give the
same bits. Checked for k = 1..32, across prefill chunk boundaries, for both matmul paths, both
cache types, after truncate + re-decode, and after snapshot / restore.
"""
import numpy as np
import pytest

from ds4tools import formats
from ds4tools.engine import Engine, KVCache
from ds4tools.engine import kernels
from ds4tools.engine.transformer import Transformer
from tests.reference_model import RefConfig, write_random_model

CFG = RefConfig("qwen3", n_vocab=300, n_embd=256, n_layer=2, n_head=4, n_head_kv=2, head_dim=64, n_ff=512)
LLAMA = RefConfig("llama", n_vocab=300, n_embd=256, n_layer=2, n_head=4, n_head_kv=4, head_dim=64, n_ff=512)
N = 72
TOKENS = np.random.default_rng(11).integers(0, 300, N)

# (architecture, weight format, int8 path, cache type, threads): the tiny test models would run
# single-threaded (Transformer.single_thread); "par" forces the parallel kernels on all threads.
SETUPS = [
    ("qwen3", "Q8_0", False, "f32", "par"),
    ("qwen3", "IQ4_NL", True, "f32", "par"),  # a format with ggml's int8-activation path
    ("llama", "Q4_K", False, "f16", "one"),
    ("llama", "F16", False, "f32", "par"),
]
INT8_FORMATS = [n for n, f in formats.FORMATS.items() if f.has_int8_matmul]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("bitexact")


def _engine(model_dir, arch, fmt, int8, cache_type, threads="one", **kw):
    cfg = CFG if arch == "qwen3" else LLAMA
    path = model_dir / f"{arch}-{fmt}.gguf"
    if not path.exists():
        write_random_model(path, cfg, seed=9, default_type=fmt)
    eng = Engine(path, exact=not int8, int8="all", cache_type=cache_type, **kw)
    if int8:
        assert all(lin.int8 for lin in eng.weights.linears())
    assert eng.model.single_thread  # small: one thread by default
    eng.model.single_thread = threads == "one"
    return eng


def _one_at_a_time(eng, tokens):
    eng.cache.clear()
    return np.stack([eng.forward([t], i).logits[0] for i, t in enumerate(tokens)])


@pytest.mark.parametrize("setup", SETUPS, ids=["-".join(map(str, s)) for s in SETUPS])
def test_batched_equals_single_for_every_k(model_dir, setup):
    eng = _engine(model_dir, *setup)
    single = _one_at_a_time(eng, TOKENS[:40])
    start = 8
    for k in range(1, 33):
        eng.forward(TOKENS[:start], 0, logits="none")
        rows = eng.forward(TOKENS[start:start + k], start).logits
        np.testing.assert_array_equal(rows, single[start:start + k], err_msg=f"k={k}")
        assert eng.cache.length == start + k


@pytest.mark.parametrize("setup", SETUPS[:2], ids=["-".join(map(str, s)) for s in SETUPS[:2]])
def test_prefill_chunks_do_not_matter(model_dir, setup):
    eng = _engine(model_dir, *setup)
    single = _one_at_a_time(eng, TOKENS)
    whole = eng.forward(TOKENS, 0, hidden_layers=(1,), want_final_hidden=True)  # chunks of 32: 32+32+8
    np.testing.assert_array_equal(whole.logits, single)
    for chunk in (1, 5, 17):
        other = Transformer(eng.hparams, eng.weights, n_ctx=eng.n_ctx, cache_type=eng.model.cache_type,
                            chunk=chunk)
        other.single_thread = not other.single_thread  # and the other threading
        res = other.forward(TOKENS, 0, hidden_layers=(1,), want_final_hidden=True)
        np.testing.assert_array_equal(res.logits, single, err_msg=f"chunk={chunk}")
        np.testing.assert_array_equal(res.hidden[1], whole.hidden[1])
        np.testing.assert_array_equal(res.final_hidden, whole.final_hidden)


@pytest.mark.parametrize("setup", SETUPS, ids=["-".join(map(str, s)) for s in SETUPS])
def test_truncate_and_redecode_equals_fresh_prefill(model_dir, setup):
    eng = _engine(model_dir, *setup)
    other = np.random.default_rng(12).integers(0, 300, 20)
    fresh = eng.forward(np.concatenate([TOKENS[:30], other]), 0).logits[30:]
    eng.forward(TOKENS[:50], 0, logits="none")      # a draft of 20 tokens we reject...
    eng.cache.truncate(30)
    assert eng.cache.length == 30
    redo = eng.forward(other, 30).logits             # ...and the tokens that really follow
    np.testing.assert_array_equal(redo, fresh)
    # writing below the length truncates implicitly
    eng.forward(TOKENS[:50], 0, logits="none")
    np.testing.assert_array_equal(eng.forward(other, 30).logits, fresh)
    assert eng.cache.length == 50


def test_snapshot_restore(model_dir):
    eng = _engine(model_dir, *SETUPS[0])
    eng.forward(TOKENS[:30], 0, logits="none")
    snap = eng.cache.snapshot()
    expect = eng.forward(TOKENS[30:34], 30).logits
    eng.forward(TOKENS[40:60], 10, logits="none")    # overwrite rows 10..29 and go on
    eng.cache.restore(snap)
    assert eng.cache.length == 30
    np.testing.assert_array_equal(eng.forward(TOKENS[30:34], 30).logits, expect)


def test_cache_types_agree_closely(model_dir):
    f32 = _engine(model_dir, "qwen3", "Q8_0", False, "f32")
    f16 = _engine(model_dir, "qwen3", "Q8_0", False, "f16")
    a = f32.forward(TOKENS[:40], 0).logits
    b = f16.forward(TOKENS[:40], 0).logits
    assert f16.cache.k.dtype == np.uint16
    assert np.abs(a - b).max() / np.abs(a).max() < 1e-2
    assert not np.array_equal(a, b)


@pytest.mark.parametrize("fmt", INT8_FORMATS)
def test_int8_matmul_batch_identity_per_format(fmt):
    f = formats.FORMATS[fmt]
    rng = np.random.default_rng(13)
    w = rng.standard_normal((48, 512)).astype(np.float32)
    raw = formats.quantize(w, fmt, imatrix=np.ones(512, np.float32) if f.requires_imatrix else None)
    x = rng.standard_normal((32, 512)).astype(np.float32)
    full = formats.matmul(raw, fmt, w.shape, x, int8=True)
    for k in (1, 3, 32):
        for t0 in range(0, 32, k):
            np.testing.assert_array_equal(formats.matmul(raw, fmt, w.shape, x[t0:t0 + k], int8=True),
                                          full[t0:t0 + k])


# --- the attention kernel's visibility limits (used by the drafters) -------------------------


def test_attention_limits_match_numpy():
    rng = np.random.default_rng(14)
    n_kv, n_ctx, hd, n_head, k = 2, 16, 8, 4, 5
    cache_k = rng.standard_normal((n_kv, n_ctx, hd)).astype(np.float32)
    cache_v = rng.standard_normal((n_kv, n_ctx, hd)).astype(np.float32)
    q = rng.standard_normal((k, n_head, hd)).astype(np.float32)
    limits = np.array([1, 7, 16, 9, 9], np.int64)  # causal rows and a block that sees all of [0, 9)
    out = np.empty_like(q)
    kernels.attention_f32(q, cache_k, cache_v, limits, np.float32(0.3), out)
    for t in range(k):
        for h in range(n_head):
            g = h // 2
            s = cache_k[g, :limits[t]].astype(np.float64) @ q[t, h] * 0.3
            p = np.exp(s - s.max())
            p /= p.sum()
            np.testing.assert_allclose(out[t, h], p @ cache_v[g, :limits[t]], rtol=1e-5, atol=1e-6)
    # fp16 cache: the same code on decoded rows
    k16 = formats.quantize(cache_k.reshape(-1, hd), "F16").view(np.uint16).reshape(cache_k.shape)
    v16 = formats.quantize(cache_v.reshape(-1, hd), "F16").view(np.uint16).reshape(cache_v.shape)
    from ds4tools.formats._numeric import FP16_TO_FP32
    out16 = np.empty_like(q)
    kernels.attention_f16(q, k16, v16, limits, np.float32(0.3), out16, FP16_TO_FP32)
    expect = np.empty_like(q)
    kernels.attention_f32(q, FP16_TO_FP32[k16], FP16_TO_FP32[v16], limits, np.float32(0.3), expect)
    np.testing.assert_array_equal(out16, expect)


def test_kv_cache_rules():
    c = KVCache(2, 2, 8, 4)
    with pytest.raises(ValueError, match="cannot truncate"):
        c.truncate(1)
    c.length = 5
    c.truncate(3)
    assert c.length == 3
    with pytest.raises(ValueError, match="unknown cache type"):
        KVCache(1, 1, 4, 4, "q8")


def test_rope_tables_yarn_as_ggml_defines_it():
    # ggml's rope_yarn, restated in float64: theta blends the interpolated and extrapolated
    # angles with a ramp over the dimension pairs, and cos/sin are scaled by mscale.
    n_rot, base, scale, n_orig, beta_fast, beta_slow = 64, 10000.0, 0.25, 512, 32.0, 1.0
    cos, sin = kernels.rope_tables(40, n_rot, base, freq_scale=scale, yarn=(n_orig, beta_fast, beta_slow, 1.0, 1.0))

    def corr_dim(n_turns):
        return n_rot * np.log(n_orig / (n_turns * 2 * np.pi)) / (2 * np.log(base))
    low, high = max(0.0, np.floor(corr_dim(beta_fast))), min(n_rot - 1.0, np.ceil(corr_dim(beta_slow)))
    mscale = 1.0 + 0.1 * np.log(1.0 / scale)
    for p in (0, 1, 7, 39):
        for i in (0, 5, 13, 20, 31):
            extrap = p * base ** (-2.0 * i / n_rot)
            ramp = 1.0 - min(1.0, max(0.0, (i - low) / max(0.001, high - low)))
            theta = extrap * scale * (1 - ramp) + extrap * ramp
            assert cos[p, i] == np.float32(np.cos(theta) * mscale)
            assert sin[p, i] == np.float32(np.sin(theta) * mscale)
    # without YaRN: plain (linearly scaled) angles
    cos, sin = kernels.rope_tables(8, n_rot, base, freq_scale=0.5)
    assert cos[3, 2] == np.float32(np.cos(3 * base ** (-4.0 / n_rot) * 0.5))


def test_exp_f32_accuracy():
    from numba import njit

    @njit
    def run(x, out):
        for i in range(x.shape[0]):
            out[i] = kernels.exp_f32(x[i])
    x = np.linspace(-87.0, 88.0, 200001).astype(np.float32)
    out = np.empty_like(x)
    run(x, out)
    ref = np.exp(x.astype(np.float64))
    assert (np.abs(out - ref) / ref).max() < 1e-6
    run(np.array([-1e4, 0.0], np.float32), out[:2])
    assert out[0] < 1e-37 and out[1] == 1.0
