"""The acceptance rules alone: greedy prefix matching, and rejection sampling that commits
exactly the target's distribution whatever the draft's q."""
import numpy as np
import pytest

from ds4tools.engine.sampling import Sampler
from ds4tools.engine.speculative.acceptance import accept_greedy, accept_sampled
from tests.stats_util import chi2_sf, chisq_test


def test_chi2_sf_known_values():
    assert chi2_sf(3.841458820694124, 1) == pytest.approx(0.05, abs=1e-9)
    assert chi2_sf(18.307038053275146, 10) == pytest.approx(0.05, abs=1e-9)
    assert chi2_sf(124.34211340400407, 100) == pytest.approx(0.05, abs=1e-7)


def test_greedy_longest_prefix_then_correction():
    V = 5
    rows = np.zeros((4, V), np.float32)
    for i, t in enumerate([2, 3, 1, 4]):
        rows[i, t] = 1.0
    assert accept_greedy(rows, [2, 3, 1]) == (3, 4)   # all kept, bonus from the last row
    assert accept_greedy(rows, [2, 0, 1]) == (1, 3)   # second rejected: correction = row 1
    assert accept_greedy(rows, [4, 3, 1]) == (0, 2)
    assert accept_greedy(rows[:1], []) == (0, 2)


def test_greedy_ties_go_to_the_lowest_id_like_plain_decoding():
    rows = np.array([[1.0, 3.0, 3.0], [0.0, 0.0, 0.0]], np.float32)
    assert accept_greedy(rows, [2]) == (0, 1)
    assert accept_greedy(rows, [1]) == (1, 0)


def _first_token_counts(p0, p1, q0, draft_from_q, n, seed):
    """Commit one step with a single draft; histogram of the first committed token."""
    rng = np.random.default_rng(seed)
    V = p0.shape[0]
    counts = np.zeros(V, np.int64)
    p = np.stack([p0, p1])
    for _ in range(n):
        d = draft_from_q(rng)
        m, nxt = accept_sampled(p, [d], None if q0 is None else q0[None, :], rng)
        counts[d if m == 1 else nxt] += 1
    return counts


@pytest.mark.parametrize("case", ["random", "equal", "onehot", "disjoint"])
def test_rejection_sampling_commits_the_target_distribution(case):
    V = 8
    rng = np.random.default_rng(42)
    p0 = rng.dirichlet(np.ones(V))
    p1 = rng.dirichlet(np.ones(V))
    if case == "random":
        q0 = rng.dirichlet(np.ones(V))
    elif case == "equal":
        q0 = p0.copy()
    elif case == "disjoint":
        p0[:4] = 0
        p0 /= p0.sum()
        q0 = np.r_[np.full(4, 0.25), np.zeros(4)]
    else:
        q0 = None
    if q0 is None:
        draft = lambda r: 3  # noqa: E731  (a deterministic drafter: q is one-hot on it)
    else:
        draft = lambda r: int(r.choice(V, p=q0))  # noqa: E731
    counts = _first_token_counts(p0, p1, q0, draft, 100_000, seed=7)
    stat, df, pval = chisq_test(counts[None, :], p0[None, :])
    assert pval > 0.01, (case, stat, df, counts / counts.sum(), p0)


def test_two_drafts_joint_distribution():
    """Two drafts from q, committed tokens (first two) follow p0 x p_1(x) jointly."""
    V = 4
    rng = np.random.default_rng(3)
    p0 = rng.dirichlet(np.ones(V))
    p_after = rng.dirichlet(np.ones(V), size=V)       # target row after draft 1 = x
    p_final = rng.dirichlet(np.ones(V), size=(V, V))
    q0 = rng.dirichlet(np.ones(V))
    q1 = rng.dirichlet(np.ones(V), size=V)
    counts = np.zeros((V, V), np.int64)
    for _ in range(100_000):
        d1 = int(rng.choice(V, p=q0))
        d2 = int(rng.choice(V, p=q1[d1]))
        p = np.stack([p0, p_after[d1], p_final[d1, d2]])
        m, nxt = accept_sampled(p, [d1, d2], np.stack([q0, q1[d1]]), rng)
        if m == 0:
            # the second token then comes from the target's row after the correction
            second = int(rng.choice(V, p=p_after[nxt]))
            counts[nxt, second] += 1
        elif m == 1:
            counts[d1, nxt] += 1
        else:
            counts[d1, d2] += 1
    joint = p0[:, None] * p_after
    stat, df, pval = chisq_test(counts.reshape(1, -1), joint.reshape(1, -1))
    assert pval > 0.01, (stat, df)


def test_zero_probability_draft_under_its_own_q_is_a_bug_report():
    p = np.full((2, 3), 1 / 3)
    q = np.array([[1.0, 0.0, 0.0]])
    with pytest.raises(ValueError, match="zero probability under its own q"):
        accept_sampled(p, [1], q, np.random.default_rng(0))


def test_sampler_distribution_is_what_plain_sampling_draws_from():
    s = Sampler(temperature=0.7, top_k=3, top_p=0.9, min_p=0.05)
    logits = np.random.default_rng(0).standard_normal(16).astype(np.float32)
    p = s.distribution(logits)
    rng = np.random.default_rng(1)
    counts = np.bincount([s.sample(logits, rng) for _ in range(20000)], minlength=16)
    assert chisq_test(counts[None], p[None])[2] > 0.01
