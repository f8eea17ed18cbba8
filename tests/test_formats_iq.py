"""IQ4_NL and IQ2_XXS specifics: the exact helpers, the derived search tables, decoding of every
code, byte equality with ggml on inputs that steer its data-dependent searches, and IQ2_XXS's
int8 kernels (fused k <= 2 and tiles: the same bits on every route)."""
import itertools
import zlib

import numpy as np
import pytest
from numba import njit
from gguf import GGMLQuantizationType, quants as gq

from ds4tools import formats
from ds4tools.formats import _int8dot, iq2_xxs, iq4_nl, legacy
from ds4tools.formats._numeric import FP16_TO_FP32
from ds4tools.formats.activations import quantize_activations
from tests.oracle import ggml_quantize


def _literal_best_index_int8(values, x):
    """ggml's best_index_int8, step by step in float32."""
    x = np.float32(x)
    if x <= values[0]:
        return 0
    if x >= values[-1]:
        return len(values) - 1
    lo, hi = 0, len(values) - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if x < values[mid]:
            hi = mid
        else:
            lo = mid
    return hi - 1 if np.float32(x - values[hi - 1]) < np.float32(values[hi] - x) else hi


def test_iq4_nl_midpoint_count_equals_ggml_binary_search():
    xs = [np.linspace(-300, 300, 60001, dtype=np.float32)]
    for m in iq4_nl.MIDPOINTS:  # every float32 within 8 ulps of each decision point
        below = above = np.float32(m)
        for _ in range(8):
            below = np.nextafter(below, np.float32(-np.inf), dtype=np.float32)
            above = np.nextafter(above, np.float32(np.inf), dtype=np.float32)
            xs.append(np.array([below, above], np.float32))
        xs.append(np.array([m], np.float32))
    xs.append(np.array([0.0, -0.0, 1e-30, -1e-30, 3e38, -3e38, np.inf, -np.inf, np.nan], np.float32))
    for x in np.concatenate(xs):
        assert iq4_nl.best_index(iq4_nl.MIDPOINTS, x) == _literal_best_index_int8(iq4_nl.KVALUES, x), x


def _ggml_nearest_int(v):
    s = np.array([np.float32(v) + np.float32(12582912.0)], np.float32)
    return int((s.view(np.int32)[0] & 0x7FFFFF) - 0x400000)


def test_iq2_xxs_nearest_int_matches_ggml_bit_trick_everywhere():
    vals = [0.0, -0.0, 0.5, 1.5, 2.5, -0.5, -1.5, 4194303.0, -4194303.0, 4194304.0, 5e6, -5e6,
            12582912.0, -12582912.0, -12582911.0, 1e9, -1e9, 3e38, -3e38]
    rng = np.random.default_rng(3)
    vals += list((rng.standard_normal(2000) * 10.0 ** rng.integers(-3, 12, 2000)).astype(np.float32))
    for v in np.array(vals, np.float32):
        assert iq2_xxs.nearest_int(v) == _ggml_nearest_int(v), v
    assert iq2_xxs.nearest_int(np.float32(np.inf)) == -4194304
    assert iq2_xxs.nearest_int(np.float32(np.nan)) == 0


def test_iq2_xxs_neighbour_lists_as_ggml_derives_them():
    code_map, neighbours = iq2_xxs.search_tables()
    grid = 2 * iq2_xxs.GRID_LEVELS.astype(np.int64) + 1
    assert (code_map[iq2_xxs.GRID_CODES] == np.arange(256)).all()
    on_grid = set(iq2_xxs.GRID_CODES.tolist())
    rng = np.random.default_rng(0)
    all_codes = [sum(l << (2 * i) for i, l in enumerate(ls)) for ls in itertools.product(range(3), repeat=8)]
    off = [c for c in all_codes if c not in on_grid]
    assert len(off) == 3 ** 8 - 256
    for code in rng.choice(off, 200, replace=False):
        entry = code_map[code]
        assert entry < 0
        count = neighbours[-entry - 1, 0]
        listed = neighbours[-entry:-entry + count]  # rows of 8 levels
        levels = np.array([(code >> (2 * i)) & 3 for i in range(8)])
        d2 = ((grid - (2 * levels + 1)) ** 2).sum(axis=1)
        two = np.unique(d2)[:2]
        expect = sorted((d, j) for j, d in enumerate(d2) if d <= two[1])
        assert listed.tolist() == [iq2_xxs.GRID_LEVELS[j].tolist() for _, j in expect]


def _random_blocks(fmt: str, n_blocks: int, seed: int) -> np.ndarray:
    f = formats.FORMATS[fmt]
    raw = np.random.default_rng(seed).integers(0, 256, (n_blocks, f.type_size), dtype=np.uint8)
    scales = np.random.default_rng(seed + 1).standard_normal(n_blocks).astype(np.float16)
    raw[:, :2] = scales.view(np.uint8).reshape(-1, 2)
    return raw


@pytest.mark.parametrize("name", ["IQ4_NL", "IQ2_XXS"])
def test_decoding_arbitrary_blocks_matches_gguf_py(name):
    f = formats.FORMATS[name]
    raw = _random_blocks(name, 2048, 9)  # every grid index, sign pattern and block scale
    ours = formats.dequantize(raw, name, (raw.shape[0], f.block_size))
    ref = gq.dequantize(raw, GGMLQuantizationType[name])
    np.testing.assert_array_equal(ours.view(np.uint32), np.asarray(ref, np.float32).view(np.uint32))


def _awkward_rows(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows and weights that reach ggml's rarely taken paths: zero weights on large values
    (the parity flip lands on a large element), whole zero-weight blocks, lone spikes,
    negative-only blocks, and a wide dynamic range."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((8, n)).astype(np.float32)
    x[0, ::7] *= 50.0
    x[1] = -np.abs(x[1])
    x[2, rng.random(n) < 0.97] = 0.0
    x[3] *= np.float32(10.0) ** rng.integers(-6, 6, n).astype(np.float32)
    x[4, :32] = 0.0
    x[4, 32:40] = [-3, 1e-3, 2e-3, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3]
    x[5] = np.round(x[5] * 2) / 2
    x[6, 1::2] = -x[6, ::2]
    x[7] = (rng.standard_normal(n) * 1e-3).astype(np.float32)
    x[7, rng.integers(0, n, 4)] = 40.0
    w = (rng.random(n) ** 3 * 5).astype(np.float32)
    w[rng.random(n) < 0.3] = 0.0
    w[64:96] = 0.0  # a whole block without importance
    w[::11] = 0.0
    return x, w


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("name", ["IQ4_NL", "IQ2_XXS"])
def test_bytes_equal_ggml_on_awkward_inputs(name, seed):
    x, w = _awkward_rows(512, zlib.crc32(f"{name}{seed}".encode()))
    np.testing.assert_array_equal(formats.quantize(x, name, imatrix=w), ggml_quantize(x, name, w))
    if not formats.FORMATS[name].requires_imatrix:
        np.testing.assert_array_equal(formats.quantize(x, name), ggml_quantize(x, name))


def test_iq4_nl_single_block_rows():
    x = np.random.default_rng(4).standard_normal((5, 32)).astype(np.float32)
    np.testing.assert_array_equal(formats.quantize(x, "IQ4_NL"), ggml_quantize(x, "IQ4_NL"))


def test_iq2_xxs_requires_an_imatrix_like_ggml():
    f = formats.FORMATS["IQ2_XXS"]
    assert f.requires_imatrix and f.uses_imatrix
    with pytest.raises(ValueError, match=r"IQ2_XXS requires an importance matrix"):
        formats.quantize(np.ones((1, 256), np.float32), "IQ2_XXS")


def test_iq4_nl_int8_matmul_is_close_and_batch_invariant():
    rng = np.random.default_rng(8)
    w = rng.standard_normal((48, 256)).astype(np.float32)
    raw = formats.quantize(w, "IQ4_NL")
    x = rng.standard_normal((9, 256)).astype(np.float32)
    exact = formats.matmul(raw, "IQ4_NL", w.shape, x)
    fast = formats.matmul(raw, "IQ4_NL", w.shape, x, int8=True)
    assert np.abs(fast - exact).max() <= 2e-2 * np.abs(exact).max()
    for k in (1, 4, 9):
        part = formats.matmul(raw, "IQ4_NL", w.shape, x[:k], int8=True)
        np.testing.assert_array_equal(part.view(np.uint32), fast[:k].view(np.uint32))


def test_iq2_xxs_int8_matmul_is_close_and_batch_invariant():
    rng = np.random.default_rng(10)
    w = rng.standard_normal((40, 512)).astype(np.float32)
    raw = formats.quantize(w, "IQ2_XXS", imatrix=rng.random(512).astype(np.float32) + 0.1)
    x = rng.standard_normal((9, 512)).astype(np.float32)
    x[3] = 0.0  # an all-zero token: Q8_K's zero scale
    exact = formats.matmul(raw, "IQ2_XXS", w.shape, x)
    fast = formats.matmul(raw, "IQ2_XXS", w.shape, x, int8=True)
    assert np.abs(fast - exact).max() <= 2e-2 * np.abs(exact).max()
    assert (fast[3] == 0).all()
    for k in (1, 4, 9):
        part = formats.matmul(raw, "IQ2_XXS", w.shape, x[:k], int8=True)
        np.testing.assert_array_equal(part.view(np.uint32), fast[:k].view(np.uint32))


def _iq2_raw(n_out, n_in, seed, specials=True):
    """Random IQ2_XXS rows (every grid index, sign pattern and block scale) with finite fp16
    scales, and with ``specials`` a few NaN, infinite, zero and subnormal ones."""
    raw = _random_blocks("IQ2_XXS", n_out * n_in // 256, seed)
    d = raw[:, :2].copy().view(np.uint16)[:, 0]
    d &= 0xBBFF  # finite, |d| < 1
    if specials:
        d[[1, 5]] = [0x7E00, 0x7C01]  # a quiet and a signalling NaN
        d[[7, 9, 11, 13]] = [0x7C00, 0x0000, 0x8000, 0x0003]  # inf, +-0, a subnormal
    raw[:, :2] = d.view(np.uint8).reshape(-1, 2)
    return raw.reshape(n_out, -1)


def _iq2_reference(raw, x):
    """float64 sum of the int8 path's terms: Q8_K activations times the decoded weights."""
    n_out, n_in = raw.shape[0], x.shape[1]
    wd = formats.dequantize(raw, "IQ2_XXS", (n_out, n_in)).astype(np.float64)
    act = quantize_activations(x, "Q8_K")
    xd = act.q.astype(np.float64) * np.repeat(act.d.astype(np.float64), 256, axis=1)
    with np.errstate(invalid="ignore"):  # inf * 0 in the rows with special scales
        return xd @ wd.T, np.abs(xd) @ np.abs(wd).T


def _canonical_nan(a: np.ndarray) -> np.ndarray:
    return np.where(np.isnan(a), np.float32(np.nan), a).astype(np.float32)


@pytest.mark.parametrize("n_out,n_in", [(33, 256 * 5), (6, 256), (9, 512), (5, 256 * 12)])
def test_iq2_xxs_int8_fused_and_tiles_match_reference_and_each_other(n_out, n_in):
    # k = 1, 2 take the fused kernels (4 rows at a time, the activations in the slot order),
    # k >= 3 the tiles (rows unpacked to scratch): each (row, token) must have the same bits
    # for every k, token slice and row slice; rows not a multiple of 4, an odd number of
    # super-blocks (a half group), NaN / inf / zero / subnormal scales
    rng = np.random.default_rng(n_out * n_in)
    raw = _iq2_raw(n_out, n_in, n_out + n_in, specials=n_in // 256 * n_out > 13)
    x = rng.standard_normal((17, n_in)).astype(np.float32)
    x[3] = 0.0
    x[4, :256] = 0.0
    full = formats.matmul(raw, "IQ2_XXS", (n_out, n_in), x, int8=True)
    ref, scale = _iq2_reference(raw, x)
    finite = np.isfinite(ref)
    assert (np.isnan(full) == np.isnan(ref)).all()
    assert (np.abs(full - ref)[finite] <= 1e-5 * scale[finite] + 1e-30).all()
    # a NaN's payload is not part of the contract (which NaN operand an add propagates is up to
    # the compiler's operand order; the engine stops on any non-finite logit): NaNs compare as one
    full = _canonical_nan(full)
    for k in range(1, 18):
        for t0 in sorted({0, (17 - k) // 2, 17 - k}):
            got = _canonical_nan(formats.matmul(raw, "IQ2_XXS", (n_out, n_in), x[t0:t0 + k], int8=True))
            np.testing.assert_array_equal(got.view(np.uint32), full[t0:t0 + k].view(np.uint32),
                                          err_msg=f"k={k} t0={t0}")
    for r0, r1 in ((0, 1), (1, 3), (2, min(7, n_out)), (n_out - 1, n_out)):
        for t0, t1 in ((5, 6), (6, 8), (2, 9)):
            got = _canonical_nan(formats.matmul(raw[r0:r1], "IQ2_XXS", (r1 - r0, n_in), x[t0:t1], int8=True))
            np.testing.assert_array_equal(got.view(np.uint32), full[t0:t1, r0:r1].view(np.uint32))


def _iq2_prepared(raw, x):
    """The activations as matmul_q8_tiles hands them to _matmul_q8, per k (len(x))."""
    got = {}
    orig = legacy._matmul_q8
    legacy._matmul_q8 = lambda kind, raw_, lut, xq, xc, dx, dxs, out, passes: got.update(
        a=(xq, xc, dx, dxs))
    try:
        legacy.matmul_q8_tiles(_int8dot.KIND_IQ2_XXS, raw, quantize_activations(x, "Q8_K"),
                               np.empty((len(x), raw.shape[0]), np.float32))
    finally:
        legacy._matmul_q8 = orig
    return got["a"]


# (VNNI, AVX2, VBMI + GFNI, gathers of grid points): where this host has them; the last but one
# is an AVX2 host's route (no VNNI, no VBMI, grid points loaded one by one)
ROUTES = [(True, True, True, True), (True, True, False, True), (False, True, True, True),
          (False, True, False, False), (False, False, False, True)]


def _slot_positions():
    # byte of value j of block i within a group of 512: (slot order, group layout)
    i, j = np.meshgrid(np.arange(16), np.arange(32), indexing="ij")
    return (64 * (j % 8) + 4 * i + j // 8).ravel(), (64 * (j // 4) + 4 * i + j % 4).ravel()


def _slot_to_group(u):
    slot, group = _slot_positions()
    out = np.empty_like(u).reshape(u.shape[0], -1, 512)
    out[:, :, group] = u.reshape(u.shape[0], -1, 512)[:, :, slot]
    return out.reshape(u.shape)


def _group_to_slot(u):
    slot, group = _slot_positions()
    out = np.empty_like(u).reshape(u.shape[0], -1, 512)
    out[:, :, slot] = u.reshape(u.shape[0], -1, 512)[:, :, group]
    return out.reshape(u.shape)


@pytest.mark.parametrize("vnni,avx2,vbmi,gather", ROUTES)
def test_iq2_xxs_routes_give_the_same_bits(vnni, avx2, vbmi, gather, monkeypatch):
    # fresh (uncached) wrappers compiled with the VNNI / AVX2 dot routes and IQ2_XXS's VBMI
    # unpacking allowed or not (where this host has them; else they compile the portable IR):
    # the fused kernels and the unpacker must give the tiles' bits on every route
    n_out, n_in = 7, 256 * 5
    raw = _iq2_raw(n_out, n_in, 4)
    x = np.random.default_rng(5).standard_normal((3, n_in)).astype(np.float32)
    ref = formats.matmul(raw, "IQ2_XXS", (n_out, n_in), x, int8=True)  # k = 3: tiles, cached
    ng = -(-n_in // 512)
    u0 = np.zeros((n_out, 512 * ng), np.uint8)
    dw0 = np.zeros((n_out, 16 * ng), np.float32)
    tail = np.zeros(132, np.uint8)
    m = np.zeros(16 * ng, np.float32)
    for r in range(n_out):
        legacy._unpack_row_q8(_int8dot.KIND_IQ2_XXS, raw[r], FP16_TO_FP32, u0[r], dw0[r], m, tail)
    host_order = _int8dot.iq2_xxs_slot_order()
    monkeypatch.setattr(_int8dot, "USE_VNNI", vnni)
    monkeypatch.setattr(_int8dot, "USE_AVX2", avx2)
    monkeypatch.setattr(_int8dot, "USE_VBMI", vbmi)
    monkeypatch.setattr(_int8dot, "USE_GATHER", gather)
    # the route's order (the slot order only with VBMI and GFNI): the activations follow it
    route_order = _int8dot.iq2_xxs_slot_order()
    p1, p2 = _iq2_prepared(raw, x[:1]), _iq2_prepared(raw, x[1:])
    if host_order != route_order:  # the cached unpacker's bytes in the route's order
        u0 = _slot_to_group(u0) if host_order else _group_to_slot(u0)
    one, two, unpack = _int8dot.FUSED1_IQ2_XXS, _int8dot.FUSED2_IQ2_XXS, _int8dot.UNPACK_IQ2_XXS
    R = _int8dot.FUSED_ROWS

    @njit
    def run(raw, xq1, xc1, dx1, dxs1, xq2, xc2, dx2, dxs2, out, u, dw):
        n = raw.shape[0]
        for r0 in range(0, n, R):
            v = one(raw, FP16_TO_FP32, xq1, xc1, dx1, dxs1, 0, r0, n)
            w = two(raw, FP16_TO_FP32, xq2, xc2, dx2, dxs2, 0, r0, n)
            for i in range(min(R, n - r0)):
                out[0, r0 + i], out[1, r0 + i], out[2, r0 + i] = v[i], w[2 * i], w[2 * i + 1]
        m = np.zeros(dw.shape[1], np.float32)
        ng = raw.shape[1] // 132
        for r in range(n):
            unpack(raw[r], FP16_TO_FP32, u[r], dw[r], m, ng)

    got = np.empty((3, n_out), np.float32)
    u = np.zeros_like(u0)
    dw = np.zeros_like(dw0)
    run(raw, *p1, *p2, got, u, dw)
    np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32))
    full = 512 * (n_in // 512)  # the whole groups (the half group goes through the tail)
    np.testing.assert_array_equal(u[:, :full], u0[:, :full])
    np.testing.assert_array_equal(dw[:, :full // 32].view(np.uint32),
                                  dw0[:, :full // 32].view(np.uint32))


def test_q8_k_activations_match_ggml_rounding():
    # ggml's quantize_row_q8_K: iscale = -127 / (signed value of largest magnitude),
    # q = min(127, nearest_int(iscale * x)), d = 1 / iscale
    x = np.random.default_rng(11).standard_normal((3, 512)).astype(np.float32)
    act = quantize_activations(x, "Q8_K")
    qx, dx = act.q, act.d
    for t in range(3):
        for b in range(2):
            blk = x[t, 256 * b:256 * (b + 1)]
            vmax = blk[np.argmax(np.abs(blk))]
            iscale = np.float32(-127.0) / vmax
            expect = np.minimum(127, np.rint(iscale * blk)).astype(np.int8)
            np.testing.assert_array_equal(qx[t, 256 * b:256 * (b + 1)], expect)
            assert dx[t, b] == np.float32(1.0) / iscale
    np.testing.assert_array_equal(act.sums, qx.reshape(3, 32, 16).astype(np.int32).sum(-1))


def test_q8_0_activations_match_ggml_rounding():
    # ggml's quantize_row_q8_0_ref: d = amax / 127 stored as fp16, q = roundf(x / d)
    x = np.random.default_rng(12).standard_normal((3, 96)).astype(np.float32)
    x[1, 32:64] = 0.0  # a zero block: zero scale and quants
    act = quantize_activations(x, "Q8_0")
    for t in range(3):
        for b in range(3):
            blk = x[t, 32 * b:32 * (b + 1)]
            d = np.abs(blk).max() / np.float32(127.0)
            inv = np.float32(1.0) / d if d else np.float32(0.0)
            v = blk * inv
            expect = (np.sign(v) * np.floor(np.abs(v) + np.float32(0.5))).astype(np.int8)
            np.testing.assert_array_equal(act.q[t, 32 * b:32 * (b + 1)], expect)
            assert act.d[t, b] == np.float32(np.float16(d))
    np.testing.assert_array_equal(act.sums, act.q.reshape(3, 3, 32).astype(np.int32).sum(-1))


@pytest.mark.parametrize("scale", [1e30, 3.4e38, 1e-20, 1e-38, 1e-44])
@pytest.mark.parametrize("name", ["IQ4_NL", "IQ2_XXS"])
def test_bytes_equal_ggml_at_the_edges_of_float32(name, scale):
    # sums of squares overflow to inf (scales become inf / inf = NaN) or values are subnormal:
    # every NaN-driven comparison and NaN's fp16 sign must still come out as in ggml
    rng = np.random.default_rng(21)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    x = (x / np.abs(x).max() * np.float32(scale)).astype(np.float32)
    w = rng.random(256).astype(np.float32)
    np.testing.assert_array_equal(formats.quantize(x, name, imatrix=w), ggml_quantize(x, name, w))
    if not formats.FORMATS[name].requires_imatrix:
        np.testing.assert_array_equal(formats.quantize(x, name), ggml_quantize(x, name))
