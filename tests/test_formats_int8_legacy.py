"""The int8-activation matmuls of the 32-element formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1).

Each is checked against a numpy reference built from the same quantized activations
(activations.quantize_activations) and the integer weights decoded here from the raw bytes:
exact integer block dots times the scales, so only the float summation order differs. Also:
close to the exact float product, zero rows and blocks give exact zeros, and a (row, token)
result is bit-identical whatever the batch size, the slice of tokens or of weight rows, and
whichever integer route (VNNI or generic IR) computed it.
"""
import numpy as np
import pytest
from numba import njit

from ds4tools import formats
from ds4tools.formats import _int8dot
from ds4tools.formats.activations import quantize_activations

FORMATS = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]


def _decode(raw, name, n_out, n_in):
    """(q int64 (n_out, nb, 32), d float64 (n_out, nb), m float64 (n_out, nb)): w = d * q + m."""
    ts = formats.FORMATS[name].type_size
    b = raw.reshape(n_out, n_in // 32, ts)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float64)
    m = np.zeros_like(d)
    if name == "Q8_0":
        return b[..., 2:34].copy().view(np.int8).astype(np.int64), d, m
    off = 2
    if name in ("Q4_1", "Q5_1"):
        m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
        off = 4
    qh = None
    if name in ("Q5_0", "Q5_1"):
        qh = b[..., off:off + 4].copy().view(np.uint32)[..., 0].astype(np.int64)
        off += 4
    nib = b[..., off:off + 16].astype(np.int64)
    q = np.concatenate([nib & 15, nib >> 4], axis=-1)
    if qh is not None:
        q |= ((qh[..., None] >> np.arange(32)) & 1) << 4
    q -= {"Q4_0": 8, "Q5_0": 16}.get(name, 0)
    return q, d, m


def _case(name, n_out, n_in, k, seed):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n_out, n_in)).astype(np.float32)
    w[1] = 0.0                  # a zero row
    w[4, 32:96] = 0.0           # zero blocks
    w[6] += 3.0                 # an offset row (matters for Q4_1 / Q5_1)
    raw = formats.quantize(w, name)
    x = rng.standard_normal((k, n_in)).astype(np.float32)
    x[2] = 0.0                  # a zero activation row
    x[3, :64] = 0.0             # zero activation blocks
    return w, raw, x


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("n_out,n_in", [(33, 32 * 21), (67, 32 * 5), (9, 32 * 147)])
def test_int8_matmul_matches_integer_reference(name, n_out, n_in):
    w, raw, x = _case(name, n_out, n_in, 7, seed=n_out + n_in)
    q, d, m = _decode(raw, name, n_out, n_in)
    wd = formats.dequantize(raw, name, w.shape)
    np.testing.assert_array_equal((d[..., None] * q + m[..., None]).reshape(n_out, n_in)
                                  .astype(np.float32), wd)  # the decoder above is right
    got = formats.matmul(raw, name, w.shape, x, int8=True)

    act = quantize_activations(x, "Q8_0")
    qx = act.q.astype(np.int64).reshape(len(x), n_in // 32, 32)
    dx = act.d.astype(np.float64)
    xsum = qx.sum(-1)
    np.testing.assert_array_equal(xsum, act.sums)
    isum = np.einsum("rbj,tbj->trb", q, qx)                           # exact integer block dots
    terms = isum * d[None] * dx[:, None] + m[None] * (dx * xsum)[:, None]
    ref = terms.sum(-1)
    scale = np.abs(terms).sum(-1) + 1e-30
    assert (np.abs(got - ref) <= 1e-5 * scale).all(), np.max(np.abs(got - ref) / scale)

    exact = x.astype(np.float64) @ wd.T.astype(np.float64)
    assert np.abs(got - exact).max() <= 2e-2 * np.abs(exact).max()

    assert (got[:, 1] == 0).all() and (got[2] == 0).all()  # zero row, zero activations


@pytest.mark.parametrize("name", FORMATS)
def test_int8_matmul_batch_and_slice_invariance(name):
    n_out, n_in, k_max = 33, 32 * 19, 17
    w, raw, x = _case(name, n_out, n_in, k_max, seed=5)
    full = formats.matmul(raw, name, w.shape, x, int8=True)
    for k in range(1, k_max + 1):
        for t0 in sorted({0, (k_max - k) // 2, k_max - k}):
            got = formats.matmul(raw, name, w.shape, x[t0:t0 + k], int8=True)
            np.testing.assert_array_equal(got, full[t0:t0 + k], err_msg=f"k={k} t0={t0}")
    rows = raw.reshape(n_out, -1)
    for r0, r1 in ((0, 1), (1, 2), (3, 10), (5, 33), (32, 33)):
        got = formats.matmul(rows[r0:r1], name, (r1 - r0, n_in), x[4:9], int8=True)
        np.testing.assert_array_equal(got, full[4:9, r0:r1], err_msg=f"rows {r0}:{r1}")
    one = formats.matmul(raw, name, w.shape, x[7], int8=True)  # a 1-D activation
    np.testing.assert_array_equal(one, full[7])
    # long rows (several runs of groups in the kernel): still the same bits for any k
    w, raw, x = _case(name, 9, 32 * 147, 5, seed=6)
    full = formats.matmul(raw, name, w.shape, x, int8=True)
    for k in (1, 2, 3):
        np.testing.assert_array_equal(formats.matmul(raw, name, w.shape, x[1:1 + k], int8=True),
                                      full[1:1 + k])


def _tiles(vnni, avx2, variant):
    """Fresh (uncached) wrappers around the dot tiles, compiled with the VNNI / AVX2 integer
    routes allowed or not (where the host has them; else both compile the generic route)."""
    saved = _int8dot.USE_VNNI, _int8dot.USE_AVX2
    _int8dot.USE_VNNI, _int8dot.USE_AVX2 = vnni, avx2
    try:
        dot22 = getattr(_int8dot, "DOT_2x2_" + variant)
        dot21 = getattr(_int8dot, "DOT_2x1_" + variant)

        @njit
        def run(u, dw, m, x, xs, dx, dxs, ng, run_groups, out):
            k = x.shape[0]
            acc = np.empty((2 * k, 16), np.float32)
            for r in range(0, u.shape[0], 2):
                acc[:, :] = 0
                for g0 in range(0, ng, run_groups):
                    g1 = min(ng, g0 + run_groups)
                    for t in range(0, k - 1, 2):
                        a, b, c, d = dot22(u[r:r + 2], dw[r:r + 2], m[r:r + 2], x, xs, dx, dxs,
                                           acc, g0, g1, 0, t)
                        out[t, r], out[t + 1, r], out[t, r + 1], out[t + 1, r + 1] = a, b, c, d
                    a, b = dot21(u[r:r + 2], dw[r:r + 2], m[r:r + 2], x, xs, dx, dxs, acc,
                                 g0, g1, 0, k - 1)
                    out[k - 1, r], out[k - 1, r + 1] = a, b

        run.compile("(uint8[:, ::1], float32[:, ::1], float32[:, ::1], int8[:, ::1], int32[:, ::1],"
                    " float32[:, ::1], float32[:, ::1], int64, int64, float32[:, ::1])")
        return run
    finally:
        _int8dot.USE_VNNI, _int8dot.USE_AVX2 = saved


@pytest.mark.parametrize("variant", ["Q8", "SYM", "AFF"])
def test_integer_routes_agree_bit_for_bit(variant):
    rng = np.random.default_rng(3)
    ng, rows, toks = 3, 4, 5
    nb = ng * _int8dot.GROUP_BLOCKS
    offset = {"Q8": 128, "SYM": 16, "AFF": 0}[variant]
    u = rng.integers(0, 256 if variant == "Q8" else 32, (rows, nb * 32)).astype(np.uint8)
    x = rng.integers(-127, 128, (toks, nb * 32)).astype(np.int8)
    # the group layout is a permutation: value 4c + e of block 16g + i at 512g + 64c + 4i + e
    def natural(a):
        n = a.shape[0]
        a = a.reshape(n, ng, 8, 16, 4).transpose(0, 1, 3, 2, 4)
        return a.reshape(n, nb, 32).astype(np.int64)

    uu, xx = natural(u), natural(x)
    xcorr = (offset * xx.sum(-1)).astype(np.int32)
    dw = rng.random((rows, nb)).astype(np.float32)
    m = rng.standard_normal((rows, nb)).astype(np.float32) * (variant == "AFF")
    dx = rng.random((toks, nb)).astype(np.float32)
    dxs = rng.standard_normal((toks, nb)).astype(np.float32)
    outs = []
    for vnni, avx2, run_groups in ((True, True, ng), (False, True, 1), (False, False, 2)):
        out = np.zeros((toks, rows), np.float32)
        _tiles(vnni, avx2, variant)(u, dw, m, x, xcorr, dx, dxs, ng, run_groups, out)
        outs.append(out)
    np.testing.assert_array_equal(outs[0], outs[1])  # routes and runs of groups: same bits
    np.testing.assert_array_equal(outs[0], outs[2])
    # and they are the exact integer dots
    isum = np.einsum("rbj,tbj->trb", uu - offset, xx)
    dw64, dx64, dxs64 = (a.astype(np.float64) for a in (dw, dx, dxs))
    terms = isum * dw64[None] * dx64[:, None] + m[None] * dxs64[:, None]
    assert (np.abs(outs[0] - terms.sum(-1)) <= 1e-5 * np.abs(terms).sum(-1)).all()


@pytest.mark.parametrize("kind", range(4))
def test_float_row_decoder_is_bit_identical(kind):
    # the exact path's vector-IR decoder against the plain one (which dequantize uses)
    from ds4tools.formats import legacy
    from ds4tools.formats._numeric import FP16_TO_FP32
    rng = np.random.default_rng(kind)
    nb = 23
    raw = rng.integers(0, 256, nb * legacy.TYPE_SIZE[kind], dtype=np.uint8)
    blocks = raw.reshape(nb, -1)
    specials = np.array([0x0000, 0x8000, 0x0001, 0x03FF, 0x7BFF, 0xFBFF, 0x3C00], np.uint16)
    blocks[:7, 0:2] = specials.view(np.uint8).reshape(7, 2)   # zeros, subnormals, extremes
    blocks[7:, 1] &= 0x7B                                      # the rest finite
    a = np.zeros(nb * 32, np.float32)
    b = np.ones(nb * 32, np.float32)
    legacy._decode_row(kind, raw, FP16_TO_FP32, a, legacy.HALF)
    legacy._decode_row_f32(kind, raw, FP16_TO_FP32, b)
    np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL"])
def test_fused_one_and_two_token_kernels_equal_the_tiles_on_every_route(name, monkeypatch):
    # k <= 2 runs fused kernels of FUSED_ROWS rows (no scratch, no padded groups): on the VNNI,
    # AVX2 and generic routes each (row, token) must equal what the k >= 3 tiles compute, bit for bit
    from ds4tools.formats import legacy
    from ds4tools.formats._numeric import FP16_TO_FP32
    kind = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL"].index(name)
    rng = np.random.default_rng(3)
    for n_in in (32 * 7, 32 * 16, 32 * 45):  # a partial group, one group, several groups
        n_out = 6
        raw = formats.quantize(rng.standard_normal((n_out, n_in)).astype(np.float32), name)
        x = rng.standard_normal((3, n_in)).astype(np.float32)
        ref = np.empty((3, n_out), np.float32)
        formats.FORMATS[name]._cpu_matmul_q8(raw, quantize_activations(x, "Q8_0"), ref)  # k = 3: tiles
        prepared = {}  # the activations as matmul_q8_tiles lays them out for k = 1 and k = 2
        monkeypatch.setattr(legacy, "_matmul_q8", lambda kind_, raw_, lut, xq, xc, dx, dxs, out, p:
                            prepared.__setitem__(xq.shape[0], (xq, xc, dx, dxs)))
        legacy.matmul_q8_tiles(kind, raw, quantize_activations(x[:1], "Q8_0"), np.empty((1, n_out), np.float32))
        legacy.matmul_q8_tiles(kind, raw, quantize_activations(x[1:], "Q8_0"), np.empty((2, n_out), np.float32))
        monkeypatch.undo()
        for vnni, avx2 in ((True, True), (False, True), (False, False)):
            monkeypatch.setattr(_int8dot, "USE_VNNI", vnni)
            monkeypatch.setattr(_int8dot, "USE_AVX2", avx2)
            one, two = getattr(_int8dot, "FUSED1_" + name), getattr(_int8dot, "FUSED2_" + name)
            R = _int8dot.FUSED_ROWS

            @njit
            def run(raw, xq1, xc1, dx1, dxs1, xq2, xc2, dx2, dxs2, out):
                n = raw.shape[0]
                for r0 in range(0, n, R):
                    v = one(raw, FP16_TO_FP32, xq1, xc1, dx1, dxs1, 0, r0, n)
                    w = two(raw, FP16_TO_FP32, xq2, xc2, dx2, dxs2, 0, r0, n)
                    for i in range(min(R, n - r0)):
                        out[0, r0 + i], out[1, r0 + i], out[2, r0 + i] = v[i], w[2 * i], w[2 * i + 1]

            got = np.empty((3, n_out), np.float32)
            run(raw, *prepared[1], *prepared[2], got)
            monkeypatch.undo()
            np.testing.assert_array_equal(got.view(np.int32), ref.view(np.int32), err_msg=f"{vnni} {avx2} {n_in}")


@pytest.mark.parametrize("name", FORMATS + ["IQ4_NL", "Q4_K", "Q6_K"])
def test_int8_matmul_fused_passes_bit_identical(name, monkeypatch):
    """FUSED_PASSES (AVX2 hosts without VNNI): 19 tokens in passes of 8, 8 and 3 through the
    fused kernels give the tiles' bits (IQ4_NL keeps its tiles either way)."""
    from ds4tools.formats import kquants, legacy
    w, raw, x = _case(name, 9, 256 * 5, 19, seed=12)
    monkeypatch.setattr(legacy, "FUSED_PASSES", False)
    monkeypatch.setattr(kquants, "FUSED_PASSES", False)
    tiles = formats.matmul(raw, name, w.shape, x, int8=True)
    monkeypatch.setattr(legacy, "FUSED_PASSES", True)
    monkeypatch.setattr(kquants, "FUSED_PASSES", True)
    monkeypatch.setattr(kquants, "NATURAL_FEW", False)
    np.testing.assert_array_equal(formats.matmul(raw, name, w.shape, x, int8=True).view(np.int32),
                                  tiles.view(np.int32))
    f = formats.FORMATS[name]
    out = np.empty((19, 9), np.float32)  # and from activations quantized apart
    f._cpu_matmul_q8(raw, quantize_activations(x, f.act_type), out)
    np.testing.assert_array_equal(out.view(np.int32), tiles.view(np.int32))


@pytest.mark.parametrize("name", FORMATS)
def test_int8_matmul_long_batches_match_single_tokens(name):
    # prefill batches span several of the kernel's token blocks (32 tokens) with a ragged end
    w, raw, x = _case(name, 7, 32 * 40, 70, seed=8)
    full = formats.matmul(raw, name, w.shape, x, int8=True)
    for t in (0, 31, 32, 33, 63, 64, 69):
        np.testing.assert_array_equal(formats.matmul(raw, name, w.shape, x[t], int8=True), full[t])
    np.testing.assert_array_equal(formats.matmul(raw, name, w.shape, x[30:67], int8=True), full[30:67])


def test_q8_0_float_row_decoder_is_bit_identical():
    # the exact Q8_0 path's vector-IR decoder against the plain one (which dequantize uses)
    from ds4tools.formats import legacy
    from ds4tools.formats._int8dot import DECODE_F32_Q8_0
    from ds4tools.formats._numeric import FP16_TO_FP32
    rng = np.random.default_rng(8)
    nb = 23
    raw = rng.integers(0, 256, nb * 34, dtype=np.uint8)
    blocks = raw.reshape(nb, 34)
    specials = np.array([0x0000, 0x8000, 0x0001, 0x03FF, 0x7BFF, 0xFBFF, 0x3C00], np.uint16)
    blocks[:7, 0:2] = specials.view(np.uint8).reshape(7, 2)   # zeros, subnormals, extremes
    blocks[7:, 1] &= 0x7B                                      # the rest finite
    a = np.zeros(nb * 32, np.float32)
    b = np.ones(nb * 32, np.float32)
    legacy._q8_0_decode_row(raw, FP16_TO_FP32, a, legacy.QK)

    @njit
    def decode(raw, lut, out):
        DECODE_F32_Q8_0(raw, lut, out, out.shape[0] // 32)

    decode(raw, FP16_TO_FP32, b)
    np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
