"""Bit-identity: a token's logits do not depend on how it was batched.

Speculative verification forwards k drafted tokens at once and compares with what plain
decoding would have produced one token at a time; that is only lossless if the two give the
same bits. Checked for k = 1..32, across prefill chunk boundaries, for both matmul paths, both
cache types, after truncate + re-decode, and after snapshot / restore.
"""
import numpy as np
import pytest
from numba import njit

from ds4tools import formats
from ds4tools.engine import Engine, KVCache
from ds4tools.engine import kernels
from ds4tools.engine.transformer import (PARALLEL_WHEN_IDLE_FROM_BYTES, SINGLE_THREAD_BELOW_BYTES,
                                          Transformer, _local_ranks, one_thread_for)
from tests.reference_model import RefConfig, write_random_model

CFG = RefConfig("qwen3", n_vocab=300, n_embd=256, n_layer=2, n_head=4, n_head_kv=2, head_dim=64, n_ff=512)
LLAMA = RefConfig("llama", n_vocab=300, n_embd=256, n_layer=2, n_head=4, n_head_kv=4, head_dim=64, n_ff=512)
N = 72
TOKENS = np.random.default_rng(11).integers(0, 300, N)

# (architecture, weight format, int8 path, cache type, threads): "one" runs the short batches on
# one thread (Transformer.single_thread), "par" the parallel kernels on all threads.
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
    eng.model.single_thread = threads == "one"  # (by default: by size and load)
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
    whole = eng.forward(TOKENS, 0, hidden_layers=(1,), want_final_hidden=True)  # one chunk of 72
    np.testing.assert_array_equal(whole.logits, single)
    for chunk in (1, 5, 17, 32, 128):
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


def test_small_models_take_one_thread_unless_the_cores_are_free(monkeypatch):
    tiny, mid, big = (PARALLEL_WHEN_IDLE_FROM_BYTES - 1, PARALLEL_WHEN_IDLE_FROM_BYTES,
                      SINGLE_THREAD_BELOW_BYTES)
    assert one_thread_for(tiny, 2, 0.0, 2)  # kernels shorter than starting a parallel region
    assert not one_thread_for(mid, 2, 0.3, 2)  # idle cores: split the matmuls
    assert one_thread_for(mid, 2, 1.0, 2)  # one core busy: two threads would wait on it
    assert not one_thread_for(mid, 4, 3.0, 8)
    assert one_thread_for(mid, 2, None, 2)  # load unknown: as before
    assert not one_thread_for(big, 2, 8.0, 2)  # large models always take their threads
    monkeypatch.setenv("MPI_LOCALNRANKS", "2")  # two ranks of 2 threads on 2 idle CPUs
    assert _local_ranks() == 2 and one_thread_for(mid, 2 * _local_ranks(), 0.0, 2)
    monkeypatch.delenv("MPI_LOCALNRANKS")
    assert _local_ranks() == 1


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


def _attention(q, cache_k, cache_v, limits, f16=False):
    from ds4tools.formats._numeric import FP16_TO_FP32
    out = np.empty_like(q)
    if f16:
        kernels.attention_f16(q, cache_k, cache_v, limits, np.float32(0.125), out, FP16_TO_FP32)
    else:
        kernels.attention_f32(q, cache_k, cache_v, limits, np.float32(0.125), out)
    return out


def _to_f16(a):
    return formats.quantize(a.reshape(-1, a.shape[-1]), "F16").view(np.uint16).reshape(a.shape)


# head_dim 64 / 128: scores from the cache rows below 16 query rows, from transposed key blocks
# from 16; 80: always from the rows; 72: the scalar kernel. GQA groups of 1, 2 and 3 heads.
@pytest.mark.parametrize("hd,group", [(64, 2), (128, 1), (64, 3), (80, 2), (72, 2)])
@pytest.mark.parametrize("f16", [False, True], ids=["f32", "f16"])
def test_attention_row_bits_do_not_depend_on_the_batch(hd, group, f16):
    rng = np.random.default_rng(21)
    n_kv, n_ctx, k = 2, 70, 40
    cache_k, cache_v = rng.standard_normal((2, n_kv, n_ctx, hd)).astype(np.float32)
    if f16:
        cache_k, cache_v = _to_f16(cache_k), _to_f16(cache_v)
    q = rng.standard_normal((k, n_kv * group, hd)).astype(np.float32)
    limits = rng.integers(1, n_ctx + 1, k)
    limits[:5] = [1, 16, 17, 47, n_ctx]
    full = _attention(q, cache_k, cache_v, limits, f16)
    for step in (1, 2, 7, 16, 17):
        for t0 in range(0, k, step):
            part = _attention(q[t0:t0 + step].copy(), cache_k, cache_v, limits[t0:t0 + step].copy(), f16)
            np.testing.assert_array_equal(part, full[t0:t0 + step], err_msg=f"rows {t0}+{step}")
    # what a row sees is only its own prefix: garbage in the rows above it changes nothing
    if not f16:
        for step in (1, 16):
            for t0 in (0, 16):
                lim = limits[t0:t0 + step]
                dirty_k, dirty_v = cache_k.copy(), cache_v.copy()
                dirty_k[:, lim.max():] = np.nan
                dirty_v[:, lim.max():] = np.inf
                np.testing.assert_array_equal(_attention(q[t0:t0 + step].copy(), dirty_k, dirty_v, lim.copy()),
                                              full[t0:t0 + step])


@pytest.mark.parametrize("hd", [64, 80, 128])
def test_attention_register_shapes_give_the_same_bits(hd, monkeypatch):
    # the scores and value sums compiled fresh (uncached) with AVX-512's register shapes (where
    # this host has them) and with AVX2's (keys in runs, one output vector per pass): each
    # lane's sum runs in the same order, so the bits must agree
    rng = np.random.default_rng(7)
    n_keys, n_blk = 40, 3  # 3 blocks of 16 keys (the last one ragged for the values)
    q = rng.standard_normal(2 * hd).astype(np.float32)
    keys = rng.standard_normal(n_blk * 16 * hd).astype(np.float32)
    p = rng.standard_normal(2 * 48).astype(np.float32)

    def run():
        qk1, qk2, pv1, pv2 = kernels._qk_rows1, kernels._qk_rows2, kernels._pv1, kernels._pv2

        @njit
        def go(q, keys, p, s, acc):
            qk1(q, 0, keys, 0, 3, hd, np.float32(0.3), s, 0, 48)
            qk2(q, 0, keys, 0, 3, hd, np.float32(0.3), s, 96, 48)
            pv1(p, 0, 48, keys, 0, 0, n_keys, hd, acc, 0, True)
            pv2(p, 0, 48, keys, 0, 0, n_keys - 1, hd, acc, 2 * hd, True)
            pv2(p, 0, 48, keys, 0, 8, n_keys, hd, acc, 2 * hd, False)
        s = np.zeros(4 * 48, np.float32)
        acc = np.zeros(6 * hd, np.float32)
        go(q, keys, p, s, acc)
        return s, acc

    monkeypatch.setattr(kernels, "WIDE_SHAPES", True)
    wide = run()
    monkeypatch.setattr(kernels, "WIDE_SHAPES", False)
    narrow = run()
    np.testing.assert_array_equal(wide[0], narrow[0])
    np.testing.assert_array_equal(wide[1], narrow[1])
    assert np.isfinite(wide[1]).all() and np.abs(wide[0]).sum() > 0


@pytest.mark.parametrize("k", [1, 20])
def test_attention_nan_propagates_to_the_rows_that_see_it(k):
    rng = np.random.default_rng(22)
    n_kv, n_ctx, hd = 2, 40, 64
    cache_k, cache_v = rng.standard_normal((2, n_kv, n_ctx, hd)).astype(np.float32)
    q = rng.standard_normal((k, 4, hd)).astype(np.float32)
    limits = np.arange(n_ctx - k + 1, n_ctx + 1)
    clean = _attention(q, cache_k, cache_v, limits)
    bad_q = q.copy()
    bad_q[0, 1, 3] = np.nan
    out = _attention(bad_q, cache_k, cache_v, limits)
    assert np.isnan(out[0, 1]).all()
    np.testing.assert_array_equal(out[1:], clean[1:])
    np.testing.assert_array_equal(out[0, [0, 2, 3]], clean[0, [0, 2, 3]])
    for cache, cols in ((cache_k, slice(None)), (cache_v, 5)):  # a NaN in kv head 1, row 30:
        cache[1, 30, 5] = np.nan                               # heads 2, 3 (a key: whole rows)
        out = _attention(q, cache_k, cache_v, limits)
        cache[1, 30, 5] = 0.0
        sees = limits > 30
        assert np.isnan(out[sees, 2:][..., cols]).all()
        np.testing.assert_array_equal(out[~sees], clean[~sees])
        np.testing.assert_array_equal(out[:, :2], clean[:, :2])
    short = np.minimum(limits, 30)  # rows that stop before row 30 are untouched by it
    clean = _attention(q, cache_k, cache_v, short)
    cache_k[1, 30:] = np.nan
    np.testing.assert_array_equal(_attention(q, cache_k, cache_v, short), clean)


def test_swiglu_in_place_and_batch_identity():
    rng = np.random.default_rng(23)
    k, n = 70, 300  # serial below 64 rows, row-parallel from there; rows longer than a chunk
    gate = (4 * rng.standard_normal((k, n))).astype(np.float32)
    up = rng.standard_normal((k, n)).astype(np.float32)
    gate[3, :4] = [np.nan, np.inf, -np.inf, -100.0]
    out = np.empty_like(gate)
    kernels.swiglu(gate, up, out)
    g = gate[4:].astype(np.float64)
    np.testing.assert_allclose(out[4:], g / (1 + np.exp(-g)) * up[4:], rtol=1e-5, atol=1e-6)
    assert np.isnan(out[3, 0]) and abs(out[3, 3]) < 1e-30
    in_place = gate.copy()
    kernels.swiglu(in_place, up, in_place)
    np.testing.assert_array_equal(in_place, out)
    for step in (1, 3, 64):
        for t0 in range(0, k, step):
            part = np.empty_like(gate[t0:t0 + step])
            kernels.swiglu(gate[t0:t0 + step].copy(), up[t0:t0 + step].copy(), part)
            np.testing.assert_array_equal(part, out[t0:t0 + step])


def test_rmsnorm_batch_identity():
    # serial below kernels._RMSNORM_PAR_FROM values, row-parallel from there: the same bits
    rng = np.random.default_rng(29)
    k, n = 300, 256
    x = (3 * rng.standard_normal((k, n))).astype(np.float32)
    w = rng.standard_normal(n).astype(np.float32)
    x[7, 5] = np.nan
    assert k * n >= kernels._RMSNORM_PAR_FROM
    out = np.empty_like(x)
    kernels.rmsnorm(x, w, 1e-6, out)
    ref = x.astype(np.float64) / np.sqrt((x.astype(np.float64) ** 2).mean(axis=1, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(np.delete(out, 7, 0), np.delete(ref, 7, 0), rtol=1e-5, atol=1e-6)
    assert np.isnan(out[7]).all() and np.isfinite(np.delete(out, 7, 0)).all()
    for t in (0, 7, 150, 299):
        row = np.empty((1, n), np.float32)
        kernels.rmsnorm(x[t:t + 1].copy(), w, 1e-6, row)
        np.testing.assert_array_equal(row[0], out[t])
    in_place = x.copy()
    kernels.rmsnorm(in_place, w, 1e-6, in_place)
    np.testing.assert_array_equal(in_place, out)


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

    @njit
    def softmax_exp(s, nv, inv):  # attention's 16-lane exp: e**(s - max) in place, 1 / sum
        kernels._softmax1(s, 0, 0, nv, inv, 0)
    x = np.linspace(-87.0, 0.0, 10001).astype(np.float32)
    n = len(x)
    s = np.concatenate([x, [np.nan] * 15]).astype(np.float32)  # NaN past n: not seen
    inv = np.empty(1, np.float32)
    softmax_exp(s, n, inv)
    ref = np.exp(x.astype(np.float64))
    assert (np.abs(s[:n] - ref) / ref).max() < 1e-6
    assert (s[n:] == 0).all() and abs(inv[0] * ref.sum() - 1) < 1e-5
