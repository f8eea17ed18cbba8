"""Sampler: the distribution plain decoding draws from, and seeded, reproducible draws."""
import numpy as np
import pytest

from ds4tools.engine.sampling import Sampler, draw

LOGITS = np.array([1.0, 3.0, 2.0, 3.0, -1.0, 0.5, 2.5, -4.0], np.float32)


def softmax(x):
    e = np.exp(np.asarray(x, np.float64) - np.max(x))
    return e / e.sum()


def test_greedy_is_one_hot_on_the_lowest_argmax():
    s = Sampler(temperature=0.0)
    p = s.distribution(LOGITS)
    assert p[1] == 1.0 and p.sum() == 1.0  # ids 1 and 3 tie at 3.0: the lower id wins
    assert s.sample(LOGITS, np.random.default_rng(0)) == 1


def test_plain_temperature_is_softmax_of_scaled_logits():
    s = Sampler(temperature=0.7, top_k=0, top_p=1.0, min_p=0.0)
    np.testing.assert_allclose(s.distribution(LOGITS), softmax(LOGITS.astype(np.float64) / 0.7), rtol=1e-12)


def test_top_k_keeps_the_k_best_and_breaks_ties_by_id():
    s = Sampler(temperature=1.0, top_k=2, top_p=1.0, min_p=0.0)
    p = s.distribution(LOGITS)
    assert set(np.flatnonzero(p)) == {1, 3}
    s = Sampler(temperature=1.0, top_k=1, top_p=1.0, min_p=0.0)
    assert np.flatnonzero(s.distribution(LOGITS)).tolist() == [1]
    s = Sampler(temperature=1.0, top_k=3, top_p=1.0, min_p=0.0)
    np.testing.assert_allclose(s.distribution(LOGITS)[[1, 3, 6]], softmax(LOGITS[[1, 3, 6]]), rtol=1e-12)


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    p_full = softmax(LOGITS)
    order = np.lexsort((np.arange(8), -LOGITS))
    cum = np.cumsum(p_full[order])
    for top_p in (0.05, 0.3, 0.5, 0.8, 0.95, 0.999):
        keep = order[: int(np.argmax(cum >= top_p)) + 1]
        p = Sampler(temperature=1.0, top_k=0, top_p=top_p, min_p=0.0).distribution(LOGITS)
        assert set(np.flatnonzero(p)) == set(keep.tolist()), top_p
        np.testing.assert_allclose(p[keep], softmax(LOGITS[keep]), rtol=1e-12)


def test_min_p_is_relative_to_the_best_token():
    p = Sampler(temperature=1.0, top_k=0, top_p=1.0, min_p=0.3).distribution(LOGITS)
    full = softmax(LOGITS)
    assert set(np.flatnonzero(p)) == set(np.flatnonzero(full >= 0.3 * full.max()).tolist())


def test_filters_use_untempered_probabilities_then_temperature():
    # llama.cpp's order: top-k, top-p, min-p on the raw logits, temperature on the survivors
    s = Sampler(temperature=2.0, top_k=0, top_p=0.6, min_p=0.0)
    kept = np.flatnonzero(Sampler(temperature=1.0, top_k=0, top_p=0.6, min_p=0.0).distribution(LOGITS))
    p = s.distribution(LOGITS)
    assert set(np.flatnonzero(p)) == set(kept.tolist())
    np.testing.assert_allclose(p[kept], softmax(LOGITS[kept] / 2.0), rtol=1e-12)


def test_seeded_sampling_is_deterministic_and_follows_the_distribution():
    s = Sampler(temperature=1.3, top_k=5, top_p=0.97, min_p=0.01)
    logits = np.random.default_rng(1).standard_normal(50).astype(np.float32)
    a = [s.sample(logits, rng) for rng in [np.random.default_rng(7)] for _ in range(200)]
    b = [s.sample(logits, rng) for rng in [np.random.default_rng(7)] for _ in range(200)]
    assert a == b
    p = s.distribution(logits)
    rng = np.random.default_rng(8)
    n = 40000
    counts = np.bincount([draw(p, rng) for _ in range(n)], minlength=50)
    assert set(np.flatnonzero(counts)) <= set(np.flatnonzero(p))
    support = p > 0
    chi2 = (((counts - n * p) ** 2)[support] / (n * p[support])).sum()
    assert chi2 < 30  # 5 categories at most: 4 degrees of freedom, p-value ~ 5e-6


def test_distribution_is_a_pure_function():
    s = Sampler(temperature=0.9, top_k=4, top_p=0.9, min_p=0.02)
    logits = np.random.default_rng(2).standard_normal(1000).astype(np.float32)
    a, b = s.distribution(logits), s.distribution(logits.copy())
    np.testing.assert_array_equal(a, b)
    assert abs(a.sum() - 1.0) < 1e-12 and a.dtype == np.float64


@pytest.mark.parametrize("kw, message", [
    (dict(temperature=-1.0), "temperature must not be negative"),
    (dict(top_p=0.0), "top-p must be in"),
    (dict(min_p=1.5), "min-p must be in"),
    (dict(temperature=float("nan")), "temperature must be a finite number"),
])
def test_bad_settings(kw, message):
    with pytest.raises(ValueError, match=message):
        Sampler(**kw)


def test_distribution_kernel_equals_the_candidate_filters():
    """The compiled distribution (fast paths without sorting) equals the filters spelled out by
    ``Sampler.candidates``: same support, same probabilities to float64 rounding."""
    rng = np.random.default_rng(0)
    for trial in range(2000):
        n = int(rng.integers(2, 300))
        lg = (rng.standard_normal(n) * rng.uniform(0.1, 5)).astype(np.float32)
        if trial % 3 == 0:
            lg = np.round(lg)  # ties
        s = Sampler(float(rng.uniform(0.2, 2)), int(rng.choice([0, 1, 3, 40, 1000])),
                    float(rng.choice([1.0, 0.9, 0.5, 0.1])), float(rng.choice([0, 0.05, 0.3])))
        ids = s.candidates(lg)
        ref = np.zeros(n)
        z = (lg[ids].astype(np.float64) - float(lg[ids[0]])) / s.temperature
        ref[ids] = np.exp(z) / np.exp(z).sum()
        got = s.distribution(lg)
        np.testing.assert_array_equal(got > 0, ref > 0)
        np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-15)
