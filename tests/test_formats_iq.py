"""IQ4_NL and IQ2_XXS specifics: the exact helpers, the derived search tables, decoding of every
code, and byte equality with ggml on inputs that steer its data-dependent searches."""
import itertools
import zlib

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants as gq

from ds4tools import formats
from ds4tools.formats import iq2_xxs, iq4_nl
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
