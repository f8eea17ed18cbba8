"""The speculative loop on a toy second-order Markov target: greedy output identical to plain
decoding, sampled output distributed exactly as plain sampling (chi-square), and the stop and
strict-mode rules."""
import numpy as np
import pytest

from ds4tools.engine.generate import decode
from ds4tools.engine.sampling import Sampler
from ds4tools.engine.speculative import PromptLookupDrafter, SpecStats, speculative_decode
from tests.spec_toys import ToyDrafter, ToyTarget
from tests.stats_util import chisq_test

GREEDY = Sampler(temperature=0.0)
SAMPLED = Sampler(temperature=0.9, top_k=4, top_p=1.0, min_p=0.0)


def plain(target, prompt, n, sampler=GREEDY, seed=0, eog=frozenset()):
    return list(decode(target, prompt, n, sampler, np.random.default_rng(seed), eog))


def spec(target, drafter, prompt, n, sampler=GREEDY, seed=0, eog=frozenset(), strict=False):
    st = SpecStats(method=drafter.name)
    out = list(speculative_decode(target, drafter, prompt, n, sampler, np.random.default_rng(seed),
                                  eog, spec=st, strict=strict, calibrate=False))
    return out, st


@pytest.mark.parametrize("mode", ["same", "other", "onehot"])
@pytest.mark.parametrize("strict", [False, True])
def test_greedy_is_token_identical_to_plain(mode, strict):
    t = ToyTarget(vocab=12, seed=3)
    prompt = [1, 5, 2]
    ref = plain(t, prompt, 300)
    out, st = spec(t, ToyDrafter(t, mode, k=5), prompt, 300, strict=strict)
    assert out == ref
    assert st.steps > 0 and st.drafted > 0
    if mode == "same":
        assert st.accepted == st.drafted  # the target's own table: every draft kept
        assert st.tau > 5.5


def test_greedy_with_prompt_lookup_and_stats_add_up():
    t = ToyTarget(vocab=5, seed=4, sharpness=3.0)   # sharp: greedy output settles into a loop
    prompt = [0, 1, 2, 3, 4, 0, 1]
    ref = plain(t, prompt, 200)
    out, st = spec(t, PromptLookupDrafter(6), prompt, 200)
    assert out == ref
    assert st.accepted > 0
    # every step commits its accepted drafts plus one token; the last commit may be cut short
    assert len(out) <= 1 + st.steps + st.accepted
    assert sum(st.accepted_hist) == st.steps
    # tau counts committed tokens: 1 + accepted / steps, less a bonus token -n cut off (#18)
    assert st.tau == pytest.approx((len(out) - 1) / st.steps)
    assert st.committed in (st.steps + st.accepted, st.steps + st.accepted - 1)
    assert st.accept_per_position[0] >= st.accept_per_position[-1]


def test_eog_inside_an_accepted_block_stops_there():
    t = ToyTarget(vocab=12, seed=3)
    prompt = [1, 5, 2]
    ref = plain(t, prompt, 300)
    eog = ref[40]
    cut = ref.index(eog)
    out, _ = spec(t, ToyDrafter(t, "same", k=6), prompt, 300, eog=frozenset({eog}))
    assert out == ref[:cut]


@pytest.mark.parametrize("n", [1, 2, 7, 13])
def test_max_tokens_inside_a_block_truncates_the_commit(n):
    t = ToyTarget(vocab=12, seed=3)
    out, _ = spec(t, ToyDrafter(t, "same", k=6), [1, 5, 2], n)
    assert out == plain(t, [1, 5, 2], n)


def test_strict_refused_when_sampling():
    t = ToyTarget()
    with pytest.raises(ValueError, match="lossless only at temperature 0"):
        spec(t, ToyDrafter(t, "same"), [1, 2], 10, sampler=SAMPLED, strict=True)


def test_strict_greedy_falls_back_to_one_token():
    t = ToyTarget(vocab=12, seed=3)
    out, st = spec(t, ToyDrafter(t, "other", k=4), [1, 5, 2], 200, strict=True)
    assert out == plain(t, [1, 5, 2], 200)
    assert st.strict_fallbacks > 0
    assert st.accepted == sum(i * n for i, n in enumerate(st.accepted_hist))


def _transition_counts(tokens, V):
    seq = np.asarray(tokens)
    nxt = np.zeros((V * V, V), np.int64)
    np.add.at(nxt, (seq[:-2] * V + seq[1:-1], seq[2:]), 1)
    pairs = np.zeros((V * V, V * V), np.int64)
    idx = np.arange(2, len(seq) - 1, 2)          # non-overlapping pairs: independent given state
    np.add.at(pairs, (seq[idx - 2] * V + seq[idx - 1], seq[idx] * V + seq[idx + 1]), 1)
    return nxt, pairs


def _exact(t: ToyTarget, sampler):
    V = t.vocab
    p = np.zeros((V, V, V))
    for a in range(V):
        for b in range(V):
            p[a, b] = sampler.distribution(t.logits_after(a, b))
    joint = np.einsum("abx,bxy->abxy", p, p)  # p(x | a, b) * p(y | b, x)
    return p.reshape(V * V, V), joint.reshape(V * V, V * V)


@pytest.mark.parametrize("mode,cut", [("same", False), ("other", False), ("onehot", False),
                                      ("disjoint", False), ("other", True)])
def test_sampled_output_follows_the_target_distribution(mode, cut):
    V = 6
    t = ToyTarget(vocab=V, seed=11)
    drafter = ToyDrafter(t, mode, k=4, cut=cut, seed=5)
    out, st = spec(t, drafter, [0, 1], 100_000, sampler=SAMPLED, seed=123)
    assert len(out) == 100_000 and st.drafted > 0
    if mode == "same":
        assert st.accepted == st.verified
    if mode == "disjoint":
        assert st.accepted == 0
    seq = [0, 1] + out
    nxt, pairs = _transition_counts(seq, V)
    p_next, p_pair = _exact(t, SAMPLED)
    _, _, pv1 = chisq_test(nxt, p_next)
    _, _, pv2 = chisq_test(pairs, p_pair)
    assert pv1 > 0.01 and pv2 > 0.01, (pv1, pv2, st.tau)
