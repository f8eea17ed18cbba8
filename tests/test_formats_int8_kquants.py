"""The K-quants' int8-activation matmul (Q8_K activations, ggml's vec_dot_q*_K_q8_K) against a
numpy reference built from the same quantized activations and the weights' integer quants and
sub-block scales decoded here, independently of the kernels."""
import numpy as np
import pytest

from ds4tools import formats
from ds4tools.formats.activations import quantize_activations

KQUANTS = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
N_OUT = 33


def _f16(b, off):
    return (b[:, :, off] | (b[:, :, off + 1] << 8)).astype(np.uint16).view(np.float16).astype(np.float64)


def _decode_ints(raw, name, n_in):
    """Per row and super-block: d, dmin (0 where none), integer quants q (rows, nsb, 256) with
    any offset subtracted, integer scales per value (rows, nsb, 256) and mins per 16 values
    (rows, nsb, 16), such that w = d * scale * q - dmin * min."""
    f = formats.FORMATS[name]
    rows, nsb = raw.shape[0], n_in // 256
    b = raw.reshape(rows, nsb, f.type_size).astype(np.int64)
    e = np.arange(256)
    zero = np.zeros((rows, nsb))
    if name == "Q2_K":
        sc = b[:, :, e // 16]
        q = (b[:, :, 16 + 32 * (e // 128) + e % 32] >> (2 * ((e % 128) // 32))) & 3
        return _f16(b, 80), _f16(b, 82), q, sc & 0xF, b[:, :, 0:16] >> 4
    if name == "Q3_K":
        q = (b[:, :, 32 + 32 * (e // 128) + e % 32] >> (2 * ((e % 128) // 32))) & 3
        q = q - 4 * (((b[:, :, e % 32] >> (e // 32)) & 1) == 0)
        j = np.arange(16)
        lo = np.where(j < 8, b[:, :, 96 + j % 8] & 0xF, b[:, :, 96 + j % 8] >> 4)
        hi = (b[:, :, 104 + j % 4] >> (2 * (j // 4))) & 3
        sc16 = (lo | (hi << 4)) - 32
        return _f16(b, 108), zero, q, sc16[:, :, e // 16], np.zeros((rows, nsb, 16), np.int64)
    if name in ("Q4_K", "Q5_K"):
        s = b[:, :, 4:16]
        j = np.arange(8)
        lo4 = np.minimum(j, 3)  # indices valid for both branches; selected with np.where
        sc8 = np.where(j < 4, s[:, :, lo4] & 63, (s[:, :, j % 4 + 8] & 0xF) | ((s[:, :, j % 4] >> 6) << 4))
        m8 = np.where(j < 4, s[:, :, lo4 + 4] & 63, (s[:, :, j % 4 + 8] >> 4) | ((s[:, :, j % 4 + 4] >> 6) << 4))
        qs = 48 if name == "Q5_K" else 16
        jj = e // 32
        q = (b[:, :, qs + 32 * (jj // 2) + e % 32] >> (4 * (jj % 2))) & 0xF
        if name == "Q5_K":
            q = q + 16 * ((b[:, :, 16 + e % 32] >> jj) & 1)
        return _f16(b, 0), _f16(b, 2), q, sc8[:, :, jj], np.repeat(m8, 2, axis=2)
    h, quarter, l = e // 128, (e % 128) // 32, e % 32
    ql = b[:, :, 64 * h + l + 32 * (quarter & 1)]
    q = (((ql >> (4 * (quarter >> 1))) & 0xF) | (((b[:, :, 128 + 32 * h + l] >> (2 * quarter)) & 3) << 4)) - 32
    sc = b[:, :, 192 + e // 16]
    sc = np.where(sc > 127, sc - 256, sc)
    return _f16(b, 208), zero, q, sc, np.zeros((rows, nsb, 16), np.int64)


def _reference(raw, name, act, n_in):
    """ggml's sum over super-blocks of d_x * (d_w * sum(scale * q * q_x) - dmin * sum(m * bsums)),
    integer parts exact, the rest in float64."""
    d, dmin, q, sc, m = _decode_ints(raw, name, n_in)
    k, nsb = act.q.shape[0], n_in // 256
    qx = act.q.astype(np.int64).reshape(k, nsb, 256)
    isum = np.einsum("rse,tse->trs", sc * q, qx)
    msum = np.einsum("rsj,tsj->trs", m, act.sums.astype(np.int64).reshape(k, nsb, 16))
    return (act.d.astype(np.float64)[:, None, :] * (d[None] * isum - dmin[None] * msum)).sum(axis=2)


def _case(name, n_in, seed):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((N_OUT, n_in)).astype(np.float32) * np.float32(0.5)
    w[5] = 0.0  # a row of zeros
    w[7, :n_in // 2] *= np.float32(30.0)  # uneven scales across super-blocks
    raw = formats.quantize(w, name)
    x = rng.standard_normal((17, n_in)).astype(np.float32)
    x[3] = 0.0  # an activation row of zeros
    x[9] *= np.float32(1e3)
    return w, raw, x


@pytest.mark.parametrize("name", KQUANTS)
@pytest.mark.parametrize("n_in", [256, 512, 768])
def test_int8_matmul_matches_integer_reference(name, n_in):
    w, raw, x = _case(name, n_in, 100 + n_in)
    f = formats.FORMATS[name]
    assert f.act_type == "Q8_K" and f.has_int8_matmul
    # the integer decoding reproduces the format's own dequantization
    d, dmin, q, sc, m = _decode_ints(raw, name, n_in)
    wq = d[..., None] * sc * q - dmin[..., None] * np.repeat(m, 16, axis=2)
    np.testing.assert_allclose(wq.reshape(N_OUT, n_in), formats.dequantize(raw, name, w.shape),
                               rtol=1e-6, atol=1e-6)
    act = quantize_activations(x, "Q8_K")
    ref = _reference(raw, name, act, n_in)
    out = np.empty((x.shape[0], N_OUT), np.float32)
    f._cpu_matmul_q8(raw, act, out)
    scale = np.abs(ref).max(axis=1, keepdims=True) + 1e-30
    assert (np.abs(out - ref) / scale).max() < 1e-5
    np.testing.assert_array_equal(out[3], 0.0)
    np.testing.assert_array_equal(out[:, 5], 0.0)
    # the public wrapper quantizes the same way, and the result is close to the f32 product
    y = formats.matmul(raw, name, w.shape, x, int8=True)
    np.testing.assert_array_equal(y, out)
    exact = x.astype(np.float64) @ formats.dequantize(raw, name, w.shape).T.astype(np.float64)
    assert np.abs(y - exact).max() < 2e-2 * np.abs(exact).max()


@pytest.mark.parametrize("name", KQUANTS)
def test_int8_matmul_batch_and_row_invariance(name):
    n_in = 768
    w, raw, x = _case(name, n_in, 7)
    full = formats.matmul(raw, name, w.shape, x, int8=True)
    for k in range(1, 18):
        for t0 in sorted({0, 17 - k, (17 - k) // 2}):
            np.testing.assert_array_equal(formats.matmul(raw, name, w.shape, x[t0:t0 + k], int8=True),
                                          full[t0:t0 + k])
    for r0, r1 in [(0, 1), (1, 2), (3, 20), (16, 33), (32, 33)]:
        np.testing.assert_array_equal(formats.matmul(raw[r0:r1], name, (r1 - r0, n_in), x, int8=True),
                                      full[:, r0:r1])
    np.testing.assert_array_equal(formats.matmul(raw, name, w.shape, x[4], int8=True), full[4])
    empty = np.empty((0, N_OUT), np.float32)
    formats.FORMATS[name]._cpu_matmul_q8(raw, quantize_activations(x[:0], "Q8_K"), empty)


@pytest.mark.parametrize("name", KQUANTS)
def test_f32_matmul_batch_invariance(name):
    n_in = 512
    w, raw, x = _case(name, n_in, 8)
    full = formats.matmul(raw, name, w.shape, x)
    exact = x.astype(np.float64) @ formats.dequantize(raw, name, w.shape).T.astype(np.float64)
    assert (np.abs(full - exact) / (np.abs(exact).max(axis=1, keepdims=True) + 1e-30)).max() < 1e-5
    for k in (1, 2, 3, 4, 5, 8, 9, 16, 17):
        for t0 in sorted({0, 17 - k}):
            np.testing.assert_array_equal(formats.matmul(raw, name, w.shape, x[t0:t0 + k]), full[t0:t0 + k])


def test_int8_matmul_long_rows_bit_identical_for_any_k():
    """Rows long enough for several runs of super-blocks at larger k (the run length depends on
    k): a token's result is still the same bits whatever k."""
    n_in = 256 * 30
    rng = np.random.default_rng(11)
    for name in KQUANTS:
        w = rng.standard_normal((9, n_in)).astype(np.float32)
        raw = formats.quantize(w, name)
        x = rng.standard_normal((16, n_in)).astype(np.float32)
        full = formats.matmul(raw, name, w.shape, x, int8=True)
        for k in (1, 2, 3, 7):
            np.testing.assert_array_equal(formats.matmul(raw, name, w.shape, x[5:5 + k], int8=True),
                                          full[5:5 + k], err_msg=f"{name} k={k}")


def _k_runner(name, vnni, avx2):
    """A fresh (uncached) serial copy of the K-quant int8 kernel, compiled with the VNNI / AVX2
    integer routes allowed or not (where the host has them; else the generic route)."""
    from numba import njit

    from ds4tools.formats import _int8dot
    kind = KQUANTS.index(name)
    saved = _int8dot.USE_VNNI, _int8dot.USE_AVX2
    _int8dot.USE_VNNI, _int8dot.USE_AVX2 = vnni, avx2
    try:
        unpack = getattr(_int8dot, "UNPACK_K_" + name)
        aff, paired = _int8dot.K_AFFINE[kind], _int8dot.K_PAIRED[kind]
        d42, d41 = ((_int8dot.DOT_K_4x2_PAIR, _int8dot.DOT_K_4x1_PAIR) if paired else
                    (_int8dot.DOT_K_4x2_AFF, _int8dot.DOT_K_4x1_AFF) if aff else
                    (_int8dot.DOT_K_4x2_SYM, _int8dot.DOT_K_4x1_SYM))
        ksum = _int8dot.KSUM
        ts = formats.FORMATS[name].type_size

        @njit
        def run(raw, lut, xq, dx, dxs, run_groups, out):
            n_out = raw.shape[0]
            k, n_in = xq.shape
            nsb = raw.shape[1] // ts
            n_groups = (nsb + 1) // 2 if paired else nsb
            w = np.empty((4, n_in), np.uint8)
            dw = np.empty((4, 16 * n_groups), np.float32)
            m = np.empty((4, 16 * n_groups), np.float32)
            corr = np.empty((4, 16 * n_groups), np.int32)
            acc = np.empty((4 * k, 16), np.float32)
            for r0 in range(0, n_out, 4):
                for i in range(4):
                    unpack(raw[min(r0 + i, n_out - 1)], lut, w[i], dw[i], m[i], corr[i], nsb)
                acc[:, :] = 0
                for g0 in range(0, n_groups, run_groups):
                    g1 = min(n_groups, g0 + run_groups)
                    for t in range(0, k - 1, 2):
                        d42(w, dw, m, corr, xq, dx, dxs, acc, g0, g1, t)
                    if k % 2:
                        d41(w, dw, m, corr, xq, dx, dxs, acc, g0, g1, k - 1)
                for i in range(min(4, n_out - r0)):
                    for t in range(k):
                        out[t, r0 + i] = ksum(acc, t * 4 + i)

        run.compile("(uint8[:, ::1], float32[::1], uint8[:, ::1], float32[:, ::1], float32[:, ::1],"
                    " int64, float32[:, ::1])")
        return run
    finally:
        _int8dot.USE_VNNI, _int8dot.USE_AVX2 = saved


@pytest.mark.parametrize("name", KQUANTS)
def test_int8_integer_routes_bit_identical(name):
    """VNNI (vpdpbusd), AVX2 (vpmaddubsw + vpmaddwd) and the generic IR give the same bits as
    the format's kernel, whatever the run length. The AVX2 tiles add the pair sums of several
    chunks as int16 (_dot_chunks), so some weight rows and activation rows are +-1: quants and
    Q8_K values at their ends, the tightest sums."""
    from ds4tools.formats import kquants
    from ds4tools.formats._numeric import FP16_TO_FP32
    n_in = 256 * 5
    w, _, x = _case(name, n_in, 21)
    w[::3] = np.sign(w[::3]) + (w[::3] == 0)
    raw = formats.quantize(w, name)
    x = x[:7]
    x[:2] = np.sign(x[:2]) + (x[:2] == 0)
    ref = formats.matmul(raw, name, w.shape, x, int8=True)
    kind = KQUANTS.index(name)
    act = quantize_activations(x, "Q8_K")
    k = x.shape[0]
    if kquants.K_PAIRED[kind]:  # groups of two super-blocks (5 -> 3 groups, the last half empty)
        xq = np.empty((k, 512 * 3), np.uint8)
        dx, dxs = np.empty((k, 16 * 3), np.float32), np.empty((k, 16 * 3), np.float32)
        kquants._prep_act_k_pair(act.q, act.d, act.sums, xq, dx, dxs, False)
    else:
        xq = np.empty((k, n_in), np.uint8)
        dx = np.empty((k, n_in // 256), np.float32)
        dxs = np.empty((k, n_in // 16 if kquants.K_AFFINE[kind] else 1), np.float32)
        kquants._prep_act_k(act.q, act.d, act.sums, 0 if kquants.K_AFFINE[kind] else 128, xq, dx,
                            dxs)
    for vnni, avx2 in ((True, True), (False, True), (False, False)):
        run = _k_runner(name, vnni, avx2)
        for run_groups in (1, 2, 5):
            out = np.empty((k, N_OUT), np.float32)
            run(raw, FP16_TO_FP32, xq, dx, dxs, run_groups, out)
            np.testing.assert_array_equal(out, ref, err_msg=f"vnni={vnni} avx2={avx2} run={run_groups}")


@pytest.mark.parametrize("name", KQUANTS)
def test_int8_fused_k_kernels_avx2_route_bit_identical(name):
    """The fused kernels of 4 and 8 tokens (FUSED_K4, FUSED_K8) compiled for the AVX2 route
    give the tiles' bits (the generic route on a host without AVX2). That route adds up to
    32767 // K_PAIR_BOUND vpmaddubsw pair sums as int16 before a vpmaddwd, so the weights here
    reach their quants' ends (rows of +-1) and the activations Q8_K's ends (-127 and 127:
    rows of +-1 again): the tightest sums."""
    from numba import njit

    from ds4tools.formats import _int8dot, kquants
    from ds4tools.formats._numeric import FP16_TO_FP32
    n_in = 256 * 3  # Q4_K, Q5_K: one whole pair and a half-empty one
    kind = KQUANTS.index(name)
    rng = np.random.default_rng(41)
    w = rng.standard_normal((N_OUT, n_in)).astype(np.float32)
    w[::2] = np.sign(w[::2])
    raw = formats.quantize(w, name).reshape(N_OUT, -1)
    x = rng.standard_normal((12, n_in)).astype(np.float32)
    x[:6] = np.sign(x[:6])
    act = quantize_activations(x, "Q8_K")
    assert act.q.min() == -127 and act.q.max() == 127  # (ggml's Q8_K: -127 / max)
    ref = formats.matmul(raw, name, w.shape, x, int8=True)  # 12 tokens: the tiles

    def runner(kernel, k):
        @njit
        def run(raw, xq, dx, dxs, out):
            n = raw.shape[0]
            for r in range(n):
                v = kernel(raw, FP16_TO_FP32, xq, dx, dxs, 0, r, n)
                for t in range(k):
                    out[t, r] = v[t]
        return run

    saved = _int8dot.USE_VNNI, _int8dot.USE_AVX2
    _int8dot.USE_VNNI, _int8dot.USE_AVX2 = False, True
    try:
        for t0, k in ((0, 8), (8, 4)):
            xq, dx, dxs = kquants._layout_k(kind, act.q[t0:t0 + k], act.d[t0:t0 + k],
                                            act.sums[t0:t0 + k], True)
            got = np.empty((k, N_OUT), np.float32)
            runner(getattr(_int8dot, f"FUSED_K{k}_{name}"), k)(raw, xq, dx, dxs, got)
            np.testing.assert_array_equal(got.view(np.int32), ref[t0:t0 + k].view(np.int32),
                                          err_msg=f"k={k}")
    finally:
        _int8dot.USE_VNNI, _int8dot.USE_AVX2 = saved


@pytest.mark.parametrize("name", KQUANTS)
def test_int8_tile_shapes_and_passes_bit_identical(name, monkeypatch):
    """Every way a batch can run gives the same bits: passes through the fused kernels
    (FUSED_PASSES, AVX2 hosts: up to TILES_FROM tokens), the tiles of 4 rows x 2 tokens and of
    4 x 1 (TWO_TOKEN_TILES off, AVX2 hosts), over a batch past TILES_FROM and one token."""
    from ds4tools.formats import kquants
    w, raw, _ = _case(name, 512, 72)
    x = np.random.default_rng(73).standard_normal((kquants.TILES_FROM + 3, 512)).astype(np.float32)
    single = formats.matmul(raw, name, w.shape, x[5], int8=True)
    got = []
    for passes, two in ((False, True), (False, False), (True, True), (True, False)):
        monkeypatch.setattr(kquants, "FUSED_PASSES", passes)
        monkeypatch.setattr(kquants, "TWO_TOKEN_TILES", two)
        for tiles_from in (kquants.TILES_FROM, 10**6):  # (passes for every k)
            monkeypatch.setattr(kquants, "TILES_FROM", tiles_from)
            got.append(formats.matmul(raw, name, w.shape, x, int8=True))
            f = formats.FORMATS[name]
            out = np.empty((x.shape[0], N_OUT), np.float32)  # and from activations quantized apart
            f._cpu_matmul_q8(raw.reshape(N_OUT, -1), quantize_activations(x, "Q8_K"), out)
            got.append(out)
    for g in got:
        np.testing.assert_array_equal(g.view(np.int32), got[0].view(np.int32))
    np.testing.assert_array_equal(got[0][5].view(np.int32), single.view(np.int32))


@pytest.mark.parametrize("name", KQUANTS)
def test_int8_matmul_long_batches_match_single_tokens(name):
    # prefill batches span several of the kernel's token blocks (32 tokens) with a ragged end
    w, raw, _ = _case(name, 512, 70)
    x = np.random.default_rng(71).standard_normal((70, 512)).astype(np.float32)
    full = formats.matmul(raw, name, w.shape, x, int8=True)
    for t in (0, 31, 32, 33, 63, 64, 69):
        np.testing.assert_array_equal(formats.matmul(raw, name, w.shape, x[t], int8=True), full[t])
    np.testing.assert_array_equal(formats.matmul(raw, name, w.shape, x[30:67], int8=True), full[30:67])



@pytest.mark.parametrize("name", KQUANTS)
def test_int8_natural_kernels_bit_identical(name, monkeypatch):
    """The stored-order kernels (_kquant_avx2: a few tokens on AVX2 hosts without VNNI; the
    generic IR elsewhere when switched on) give the group-layout kernels' bits for k = 1..4."""
    from ds4tools.formats import kquants
    n_in = 256 * 5  # an odd number of super-blocks: Q4_K's and Q5_K's last pair is half empty
    w, raw, x = _case(name, n_in, 31)
    monkeypatch.setattr(kquants, "NATURAL_FEW", False)
    full = formats.matmul(raw, name, w.shape, x, int8=True)  # 17 tokens: the tiles
    few = {k: formats.matmul(raw, name, w.shape, x[:k], int8=True) for k in (1, 2, 3, 4)}
    monkeypatch.setattr(kquants, "NATURAL_TOKENS", (4,) * 5)
    monkeypatch.setattr(kquants, "NATURAL_FEW", True)
    for t0, k in ((0, 1), (9, 1), (3, 2), (8, 3), (5, 4), (0, 4)):
        np.testing.assert_array_equal(formats.matmul(raw, name, w.shape, x[t0:t0 + k], int8=True),
                                      full[t0:t0 + k], err_msg=f"k={k} t0={t0}")
    for k, ref in few.items():  # the group kernels of few tokens agree too
        np.testing.assert_array_equal(ref, full[:k])
