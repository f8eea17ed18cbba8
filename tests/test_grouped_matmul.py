"""The grouped (mixture-of-experts) matmul: bit-identical to a per-row loop of formats.matmul,
whatever rows share the call, and it never reads an expert no row is routed to."""
import numpy as np
import pytest

from ds4tools import formats
from ds4tools.formats.activations import quantize_activations
from ds4tools.formats.grouped import grouped_matmul

N_EXPERT, N_OUT, N_IN = 6, 40, 512
FORMATS = ["Q8_0", "Q5_0", "Q4_1", "Q4_K", "IQ4_NL", "IQ2_XXS", "F16"]


def _experts(fmt, seed=0, n_expert=N_EXPERT, n_out=N_OUT, n_in=N_IN):
    f = formats.get_format(fmt)
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n_expert, n_out, n_in)).astype(np.float32)
    imatrix = np.ones(n_in, np.float32) if f.requires_imatrix else None
    raw = formats.quantize(w, fmt, imatrix=imatrix)
    assert raw.shape == (n_expert, n_out, f.row_bytes(n_in))
    return raw


def _reference(raw, fmt, x, ids, int8):
    k, n_used = ids.shape
    n_out, n_in = raw.shape[1], x.shape[1]
    ref = np.empty((k, n_used, n_out), np.float32)
    for t in range(k):
        for j in range(n_used):
            ref[t, j] = formats.matmul(raw[ids[t, j]], fmt, (n_out, n_in), x[t:t + 1], int8=int8)[0]
    return ref


def _ids(rng, k, n_used, pool):
    ids = rng.choice(pool, size=(k, n_used))
    if k > 1:
        ids[0, :] = pool[0]  # the same expert in every slot of a row
    return ids


@pytest.mark.parametrize("int8", [True, False])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("k", [1, 9])
def test_grouped_equals_per_row_matmul(fmt, int8, k):
    raw = _experts(fmt)
    rng = np.random.default_rng(k)
    x = rng.standard_normal((k, N_IN)).astype(np.float32)
    pool = np.array([4, 1, 5])  # experts 0, 2 and 3 unused
    ids = _ids(rng, k, 3, pool)
    got = grouped_matmul(raw, fmt, N_OUT, N_IN, x, ids, int8=int8)
    np.testing.assert_array_equal(got, _reference(raw, fmt, x, ids, int8))


@pytest.mark.parametrize("fmt", ["Q5_0", "Q8_0"])
@pytest.mark.parametrize("k", [1, 3])
def test_per_head_matrices_in_one_call(fmt, k):
    # latent attention's attn_k_b: 16 heads of 256 x 64 (Q5_0 / Q8_0 rows too short for int8),
    # row t * 16 + h multiplied by head h's matrix, on the float32 path (one compiled call)
    raw = _experts(fmt, 5, n_expert=16, n_out=257, n_in=64)  # an odd row count: the pair code
    rng = np.random.default_rng(6)
    x = rng.standard_normal((k * 16, 64)).astype(np.float32)
    ids = np.tile(np.arange(16), k).reshape(k * 16, 1)
    got = grouped_matmul(raw, fmt, 257, 64, x, ids, int8=False)
    np.testing.assert_array_equal(got, _reference(raw, fmt, x, ids, False))


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_rows_result_does_not_depend_on_its_batch(fmt):
    raw = _experts(fmt, 1)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((9, N_IN)).astype(np.float32)
    ids = rng.integers(0, N_EXPERT, (9, 2))
    full = grouped_matmul(raw, fmt, N_OUT, N_IN, x, ids)
    for t in range(9):
        alone = grouped_matmul(raw, fmt, N_OUT, N_IN, x[t:t + 1], ids[t:t + 1])
        np.testing.assert_array_equal(alone[0], full[t])


@pytest.mark.parametrize("int8", [True, False])
@pytest.mark.parametrize("fmt", FORMATS)
def test_unused_experts_are_never_read(fmt, int8):
    raw = _experts(fmt, 3)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((9, N_IN)).astype(np.float32)
    ids = _ids(rng, 9, 2, np.array([2, 5]))
    want = grouped_matmul(raw, fmt, N_OUT, N_IN, x, ids, int8=int8)
    poisoned = raw.copy()
    for e in (0, 1, 3, 4):
        poisoned[e] = 0xFF  # all-ones fp16 / fp32 scales and values: NaN wherever decoded
    assert not np.isfinite(formats.matmul(poisoned[0], fmt, (N_OUT, N_IN), x, int8=int8)).all()
    got = grouped_matmul(poisoned, fmt, N_OUT, N_IN, x, ids, int8=int8)
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got, want)


def test_shared_activations_and_out_buffer():
    fmt = "IQ4_NL"
    raw = _experts(fmt, 5)
    rng = np.random.default_rng(6)
    x = rng.standard_normal((4, N_IN)).astype(np.float32)
    ids = rng.integers(0, N_EXPERT, (4, 3))
    act = quantize_activations(x, formats.get_format(fmt).act_type)
    out = np.full((4, 3, N_OUT), np.nan, np.float32)
    res = grouped_matmul(raw.reshape(-1), fmt, N_OUT, N_IN, x, ids, out=out, act=act)
    assert res is out
    np.testing.assert_array_equal(out, grouped_matmul(raw, fmt, N_OUT, N_IN, x, ids))


def test_bad_input_is_a_value_error():
    raw = _experts("Q8_0")
    x = np.zeros((2, N_IN), np.float32)
    with pytest.raises(ValueError, match="expert_ids"):
        grouped_matmul(raw, "Q8_0", N_OUT, N_IN, x, np.array([[0], [N_EXPERT]]))
    with pytest.raises(ValueError, match="expert_ids"):
        grouped_matmul(raw, "Q8_0", N_OUT, N_IN, x, np.array([[0.0], [1.0]]))
    with pytest.raises(ValueError, match="x must"):
        grouped_matmul(raw, "Q8_0", N_OUT, N_IN, x[:, :32], np.array([[0], [1]]))
    with pytest.raises(ValueError, match="raw3d"):
        grouped_matmul(raw[:, :, :-1], "Q8_0", N_OUT, N_IN, x, np.array([[0], [1]]))
    with pytest.raises(ValueError, match="out"):
        grouped_matmul(raw, "Q8_0", N_OUT, N_IN, x, np.array([[0], [1]]), out=np.empty((2, 2, N_OUT), np.float32))


# --- the K-quants' one-call kernel (formats.grouped.grouped_kq) --------------------------------

K_FORMATS = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]


@pytest.mark.parametrize("fmt", K_FORMATS)
@pytest.mark.parametrize("k", [1, 3, 45])
def test_k_quants_one_call_equals_per_row_matmul(fmt, k):
    # k = 45 over 3 experts: ~45 rows each, past the fused kernels (4) and a token block (32);
    # an odd expert count and a last weight tile cut short (N_OUT = 40 is not a multiple of 16)
    raw = _experts(fmt, 7)
    rng = np.random.default_rng(k + 10)
    x = rng.standard_normal((k, N_IN)).astype(np.float32)
    ids = _ids(rng, k, 3, np.array([5, 0, 3]))
    got = grouped_matmul(raw, fmt, N_OUT, N_IN, x, ids)
    np.testing.assert_array_equal(got, _reference(raw, fmt, x, ids, True))


@pytest.mark.parametrize("fmt", ["Q4_K", "Q6_K"])
def test_gate_and_up_in_one_call(fmt):
    from ds4tools.formats.grouped import grouped_kq, kq_kind, prepare_rows, sort_pairs
    gate, up = _experts(fmt, 8), _experts(fmt, 9)
    rng = np.random.default_rng(11)
    k, n_used = 7, 2
    x = rng.standard_normal((k, N_IN)).astype(np.float32)
    ids = rng.integers(0, N_EXPERT, (k, n_used))
    order = np.empty(k * n_used, np.int64)
    starts = np.empty(N_EXPERT + 1, np.int64)
    experts = np.empty(N_EXPERT, np.int64)
    n = sort_pairs(ids, N_EXPERT, order, starts, experts)
    assert list(experts[:n]) == sorted(set(ids.ravel().tolist()))
    assert sorted(order.tolist()) == list(range(k * n_used))
    kind = kq_kind(fmt)
    act = quantize_activations(x, "Q8_K")
    bufs = prepare_rows(kind, act, order // n_used, int(np.diff(starts[:n + 1]).max()))
    g = np.empty((k * n_used, N_OUT), np.float32)
    u = np.empty_like(g)
    grouped_kq(kind, gate, up, 2, *bufs, starts, experts, n, g, u)
    want_g = grouped_matmul(gate, fmt, N_OUT, N_IN, x, ids).reshape(k * n_used, N_OUT)
    want_u = grouped_matmul(up, fmt, N_OUT, N_IN, x, ids).reshape(k * n_used, N_OUT)
    np.testing.assert_array_equal(g, want_g[order])
    np.testing.assert_array_equal(u, want_u[order])


@pytest.mark.parametrize("fmt,int8", [("Q4_K", True), ("Q6_K", True), ("Q5_0", False),
                                      ("Q8_0", False)])
@pytest.mark.parametrize("k", [1, 6])
def test_expert_matrices_one_call_path(fmt, int8, k):
    # the engine's ExpertMatrices.matmul runs these formats through one compiled call (float
    # rows or a SharedInput's Q8_K rows): the per-row bits, and the count of experts it read
    from ds4tools.engine.moe import ExpertMatrices
    from ds4tools.engine.weights import SharedInput
    raw = _experts(fmt, 7)
    m = ExpertMatrices("t", raw, fmt, N_EXPERT, N_OUT, N_IN, int8=int8)
    assert (m.kq_kind is not None) == int8 and (m.legacy_kind is not None) == (not int8)
    rng = np.random.default_rng(k)
    x = rng.standard_normal((k, N_IN)).astype(np.float32)
    ids = _ids(rng, k, 2, np.array([3, 0, 5]))
    ref = _reference(raw, fmt, x, ids, int8)
    for inp in (x, SharedInput(x)):
        out = np.empty((k, 2, N_OUT), np.float32)
        m.matmul(inp, ids, out)
        np.testing.assert_array_equal(out, ref)
        assert m.last_read == np.unique(ids).size
    with pytest.raises(ValueError, match="out of range"):
        m.matmul(x, np.full((k, 2), N_EXPERT), np.empty((k, 2, N_OUT), np.float32))


@pytest.mark.parametrize("fmt", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("k", [1, 5, 9])
def test_k_quant_float_rows_in_one_call(fmt, k):
    # _KQuant._cpu_matmul_int8 quantizes, lays out and multiplies in one compiled call: the
    # bits of the three steps run one by one
    f = formats.get_format(fmt)
    raw = _experts(fmt, 8, n_expert=1)[0]
    x = np.random.default_rng(k).standard_normal((k, N_IN)).astype(np.float32)
    got = np.empty((k, N_OUT), np.float32)
    f._cpu_matmul_int8(raw, x, got)
    ref = np.empty((k, N_OUT), np.float32)
    f._cpu_matmul_q8(raw, quantize_activations(x, "Q8_K"), ref)
    np.testing.assert_array_equal(got, ref)
