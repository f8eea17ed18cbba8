"""The CUDA backend's row ops (simulated) against the CPU kernels, and their batch invariance.

Every op is checked against ds4tools.engine.kernels on the same inputs (float32 tolerance; the
cache writes bit for bit), then row by row: a row computed inside a k=5 launch must have the
very bits it has in a k=1 launch of its own (speculative verification relies on it). The
simulator runs one Python thread per CUDA thread, so the shapes are tiny.
"""
import numpy as np
import pytest
from numba import config, cuda

from ds4tools.engine import kernels as cpu
from ds4tools.engine.backends.cuda import ops
from ds4tools.formats._numeric import FP16_TO_FP32

assert config.ENABLE_CUDASIM == 1

N = 64
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
N_CTX = 16


def rng(seed=0):
    return np.random.default_rng(seed)


def normal(shape, seed=0, scale=1.0):
    return (rng(seed).standard_normal(shape) * scale).astype(np.float32)


def bits(a):
    return np.ascontiguousarray(a).view(np.uint32)


def assert_close(got, want, rtol):
    """Element-wise within rtol of each value, or of the largest one where values cancel."""
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * float(np.abs(want).max()))


# --- launch helpers: host arrays in, host arrays out -------------------------------------------


def gpu_rmsnorm(x, w, eps, in_place=False):
    d_x = cuda.to_device(x)
    d_out = d_x if in_place else cuda.device_array_like(x)
    ops.rmsnorm(d_x, cuda.to_device(w), eps, d_out)
    return d_out.copy_to_host()


def gpu_swiglu(gate, up, in_place=False):
    d_gate = cuda.to_device(gate)
    d_out = d_gate if in_place else cuda.device_array_like(gate)
    ops.swiglu(d_gate, cuda.to_device(up), d_out)
    return d_out.copy_to_host()


def gpu_rope(x, positions, cos, sin, neox):
    d_x = cuda.to_device(x)
    ops.rope(d_x, cuda.to_device(positions), cuda.to_device(cos), cuda.to_device(sin), neox)
    return d_x.copy_to_host()


def gpu_attention(q, cache_k, cache_v, limits, scale, f16=False):
    d_out = cuda.device_array_like(q)
    lut = cuda.to_device(FP16_TO_FP32) if f16 else None
    ops.attention(cuda.to_device(q), cuda.to_device(cache_k), cuda.to_device(cache_v),
                  cuda.to_device(limits), scale, d_out, f16_lut=lut)
    return d_out.copy_to_host()


def cpu_attention(q, cache_k, cache_v, limits, scale, f16=False):
    out = np.empty_like(q)
    if f16:
        cpu.attention_f16(q, cache_k, cache_v, limits, np.float32(scale), out, FP16_TO_FP32)
    else:
        cpu.attention_f32(q, cache_k, cache_v, limits, np.float32(scale), out)
    return out


def caches(n_ctx, f16, seed=3, loud_key=None):
    """Random key and value caches, float32 or fp16 bit patterns (filled by the CPU's store);
    key row loud_key, if given, 4x larger (its scores stand out, up or down)."""
    k_rows = normal((n_ctx, KV_HEADS, HEAD_DIM), seed)
    if loud_key is not None:
        k_rows[loud_key] *= 4.0
    v_rows = normal((n_ctx, KV_HEADS, HEAD_DIM), seed + 1)
    dtype = np.uint16 if f16 else np.float32
    cache_k = np.zeros((KV_HEADS, n_ctx, HEAD_DIM), dtype)
    cache_v = np.zeros((KV_HEADS, n_ctx, HEAD_DIM), dtype)
    store = cpu.store_kv_f16 if f16 else cpu.store_kv_f32
    store(cache_k, cache_v, k_rows, v_rows, np.arange(n_ctx, dtype=np.int64))
    return cache_k, cache_v


# --- against the CPU kernels -------------------------------------------------------------------


@pytest.mark.parametrize("n", [N, 100])
def test_rmsnorm_matches_cpu(n):
    x = normal((3, n), 1)
    x[1] *= 1e-3  # a small row: the scale must come from the row's own values
    w = normal(n, 2)
    want = np.empty_like(x)
    cpu.rmsnorm(x, w, 1e-6, want)
    assert_close(gpu_rmsnorm(x, w, 1e-6), want, 1e-6)
    np.testing.assert_array_equal(bits(gpu_rmsnorm(x, w, 1e-6, in_place=True)),
                                  bits(gpu_rmsnorm(x, w, 1e-6)))


def test_rmsnorm_per_head_on_a_reshaped_array():
    k = 2
    x = normal((k, HEADS, HEAD_DIM), 4)
    w = normal(HEAD_DIM, 5)
    want = np.empty((k * HEADS, HEAD_DIM), np.float32)
    cpu.rmsnorm(x.reshape(k * HEADS, HEAD_DIM), w, 1e-5, want)
    d_x = cuda.to_device(x).reshape(k * HEADS, HEAD_DIM)
    ops.rmsnorm(d_x, cuda.to_device(w), 1e-5, d_x)
    assert_close(d_x.copy_to_host(), want, 1e-6)


def test_add_bias_and_add_into_match_cpu_exactly():
    x, y, bias = normal((3, N), 6), normal((3, N), 7), normal(N, 8)
    want = x.copy()
    cpu.add_bias(want, bias)
    cpu.add_into(want, y)
    d_x = cuda.to_device(x)
    ops.add_bias(d_x, cuda.to_device(bias))
    ops.add_into(d_x, cuda.to_device(y))
    np.testing.assert_array_equal(bits(d_x.copy_to_host()), bits(want))


def test_swiglu_matches_cpu():
    gate = normal((3, N), 9, scale=4.0)
    gate[0, :4] = [-100.0, 100.0, 0.0, -0.0]  # the exp clamp, both sides
    up = normal((3, N), 10)
    want = np.empty_like(gate)
    cpu.swiglu(gate, up, want)
    assert_close(gpu_swiglu(gate, up), want, 1e-6)
    np.testing.assert_array_equal(bits(gpu_swiglu(gate, up, in_place=True)),
                                  bits(gpu_swiglu(gate, up)))


@pytest.mark.parametrize("neox", [False, True])
def test_rope_matches_cpu(neox):
    n_rot = 8  # < HEAD_DIM: dims 8.. pass through untouched
    cos, sin = cpu.rope_tables(32, n_rot, 10000.0)
    x = normal((3, HEADS, HEAD_DIM), 11)
    positions = np.array([0, 5, 31], np.int64)
    want = x.copy()
    cpu.rope(want, positions, cos, sin, neox)
    got = gpu_rope(x, positions, cos, sin, neox)
    assert_close(got, want, 1e-6)
    np.testing.assert_array_equal(bits(got[:, :, n_rot:]), bits(x[:, :, n_rot:]))
    np.testing.assert_array_equal(bits(got[0]), bits(x[0]))  # position 0: no rotation


def test_store_kv_f32_matches_cpu():
    k_rows, v_rows = normal((3, KV_HEADS, HEAD_DIM), 12), normal((3, KV_HEADS, HEAD_DIM), 13)
    positions = np.array([4, 0, 9], np.int64)
    fill = normal((KV_HEADS, N_CTX, HEAD_DIM), 14)  # rows not written must keep their bits
    want_k, want_v = fill.copy(), fill.copy() + 1
    cpu.store_kv_f32(want_k, want_v, k_rows, v_rows, positions)
    d_k, d_v = cuda.to_device(fill), cuda.to_device(fill + 1)
    ops.store_kv_f32(d_k, d_v, cuda.to_device(k_rows), cuda.to_device(v_rows),
                     cuda.to_device(positions))
    np.testing.assert_array_equal(bits(d_k.copy_to_host()), bits(want_k))
    np.testing.assert_array_equal(bits(d_v.copy_to_host()), bits(want_v))


def test_store_kv_f16_bit_identical_to_cpu():
    k_rows = normal((3, KV_HEADS, HEAD_DIM), 15)
    v_rows = normal((3, KV_HEADS, HEAD_DIM), 16, scale=1e-5)  # fp16 subnormals
    special = np.array([np.inf, -np.inf, np.nan, 65504.0, 65520.0, 65519.0, -0.0, 2.0 ** -25,
                        2.0 ** -24 * 1.5, 2.0 ** -24 * 2.5, 1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11,
                        6.1e-5, 1e-8, -3e4, 1e30], np.float32)
    k_rows[0, 0] = special
    v_rows[1, 1] = special[::-1]
    positions = np.array([2, 7, 15], np.int64)
    want_k = np.full((KV_HEADS, N_CTX, HEAD_DIM), 0x1234, np.uint16)
    want_v = want_k.copy()
    d_k, d_v = cuda.to_device(want_k), cuda.to_device(want_v)
    cpu.store_kv_f16(want_k, want_v, k_rows, v_rows, positions)
    ops.store_kv_f16(d_k, d_v, cuda.to_device(k_rows), cuda.to_device(v_rows),
                     cuda.to_device(positions))
    np.testing.assert_array_equal(d_k.copy_to_host(), want_k)
    np.testing.assert_array_equal(d_v.copy_to_host(), want_v)


@pytest.mark.parametrize("f16", [False, True], ids=["f32", "f16"])
@pytest.mark.parametrize("limits", [
    [1],                      # one key: the output is that key's value
    [1, 4, 9, 16],            # causal-like, every length
    [12, 12, 12],             # a bidirectional block: several rows, one limit
    [16, 3, 16, 1, 7],
])
def test_attention_matches_cpu(f16, limits):
    limits = np.array(limits, np.int64)
    q = normal((len(limits), HEADS, HEAD_DIM), 17, scale=2.0)
    cache_k, cache_v = caches(N_CTX, f16)
    got = gpu_attention(q, cache_k, cache_v, limits, 0.25, f16)
    assert_close(got, cpu_attention(q, cache_k, cache_v, limits, 0.25, f16), 1e-5)
    if limits[0] == 1:  # softmax of one score is exactly 1
        values = FP16_TO_FP32[cache_v] if f16 else cache_v
        group = HEADS // KV_HEADS
        for h in range(HEADS):
            np.testing.assert_array_equal(got[0, h], values[h // group, 0])


@pytest.mark.parametrize("f16", [False, True], ids=["f32", "f16"])
def test_attention_over_several_key_tiles(f16):
    # more keys than threads per block: the running softmax rescales earlier tiles, and a late
    # large score moves the maximum
    n_ctx = 2 * ops.ATTENTION_THREADS + 5
    limits = np.array([n_ctx, ops.ATTENTION_THREADS + 1, 2 * ops.ATTENTION_THREADS], np.int64)
    q = normal((3, HEADS, HEAD_DIM), 18, scale=2.0)
    cache_k, cache_v = caches(n_ctx, f16, seed=19, loud_key=ops.ATTENTION_THREADS + 3)
    got = gpu_attention(q, cache_k, cache_v, limits, 0.5, f16)
    assert_close(got, cpu_attention(q, cache_k, cache_v, limits, 0.5, f16), 1e-5)


def test_attention_rejects_uneven_heads():
    q = cuda.device_array((1, 3, HEAD_DIM), np.float32)
    cache = cuda.device_array((2, N_CTX, HEAD_DIM), np.float32)
    with pytest.raises(ValueError):
        ops.attention(q, cache, cache, cuda.to_device(np.array([1], np.int64)), 1.0, q)


# --- batch invariance: a row's bits do not depend on its batch ---------------------------------

K = 5


def test_rmsnorm_batch_invariant():
    x, w = normal((K, N + 36), 20), normal(N + 36, 21)
    batch = gpu_rmsnorm(x, w, 1e-6)
    for t in range(K):
        np.testing.assert_array_equal(bits(batch[t]), bits(gpu_rmsnorm(x[t:t + 1], w, 1e-6)[0]))


def test_swiglu_batch_invariant():
    gate, up = normal((K, N), 22, scale=3.0), normal((K, N), 23)
    batch = gpu_swiglu(gate, up)
    for t in range(K):
        alone = gpu_swiglu(gate[t:t + 1], up[t:t + 1])[0]
        np.testing.assert_array_equal(bits(batch[t]), bits(alone))


@pytest.mark.parametrize("neox", [False, True])
def test_rope_batch_invariant(neox):
    cos, sin = cpu.rope_tables(16, 12, 10000.0)
    x = normal((K, HEADS, HEAD_DIM), 24)
    positions = np.array([3, 4, 5, 6, 15], np.int64)
    batch = gpu_rope(x, positions, cos, sin, neox)
    for t in range(K):
        alone = gpu_rope(x[t:t + 1], positions[t:t + 1], cos, sin, neox)[0]
        np.testing.assert_array_equal(bits(batch[t]), bits(alone))


@pytest.mark.parametrize("f16", [False, True], ids=["f32", "f16"])
def test_attention_batch_invariant(f16):
    # drafted rows verify together: consecutive limits, plus a shared-limit pair
    limits = np.array([9, 10, 11, 11, 16], np.int64)
    q = normal((K, HEADS, HEAD_DIM), 25, scale=2.0)
    cache_k, cache_v = caches(N_CTX, f16, seed=26)
    batch = gpu_attention(q, cache_k, cache_v, limits, 0.25, f16)
    for t in range(K):
        alone = gpu_attention(q[t:t + 1], cache_k, cache_v, limits[t:t + 1], 0.25, f16)[0]
        np.testing.assert_array_equal(bits(batch[t]), bits(alone))
    # and in another company: the batch reversed
    order = np.arange(K)[::-1].copy()
    reversed_batch = gpu_attention(q[order], cache_k, cache_v, limits[order], 0.25, f16)
    np.testing.assert_array_equal(bits(reversed_batch[order]), bits(batch))
