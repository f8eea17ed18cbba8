"""MTP and DSpark drafters on tiny synthetic qwen3 models (random weights): greedy speculative
output is token-identical to plain greedy decoding for every setting, and after any partial
accept the target's cache holds exactly the committed tokens, whose next logits equal a fresh
prefill's bit for bit. (Acceptance itself is tested on the trained demo model.)"""
import numpy as np
import pytest

from ds4tools.engine import Engine
from ds4tools.engine.generate import decode
from ds4tools.engine.sampling import Sampler
from ds4tools.engine.speculative import PromptLookupDrafter, SpecStats, speculative_decode
from ds4tools.engine.speculative.dspark import DSparkDrafter
from ds4tools.engine.speculative.load import mtp_from_nextn, open_support_for
from ds4tools.engine.speculative.mtp import MtpDrafter

GREEDY = Sampler(temperature=0.0)


@pytest.fixture(scope="module")
def files(spec_files):
    return spec_files


@pytest.fixture(scope="module")
def engine(files):
    return Engine(str(files / "target.gguf"), n_ctx=512)


PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n"


def _plain(eng, ids, n):
    return list(decode(eng.model, ids, n, GREEDY, np.random.default_rng(0), frozenset()))


def _spec(eng, drafter, ids, n, strict=False):
    st = SpecStats(method=drafter.name)
    out = list(speculative_decode(eng.model, drafter, ids, n, GREEDY, np.random.default_rng(0),
                                  frozenset(), spec=st, strict=strict, calibrate=False))
    return out, st


def _check_rollback(eng, ids, out):
    """The cache holds prompt + all emitted tokens but the last (the pending anchor) at most;
    forwarding the next token gives the logits of a fresh prefill, bit for bit."""
    seq = ids + out
    n = eng.cache.length
    assert n <= len(seq) - 1
    tail = eng.forward(seq[n:], n, logits="last").logits[-1].copy()
    fresh = eng.forward(seq, 0, logits="last").logits[-1]
    np.testing.assert_array_equal(tail.view(np.uint32), fresh.view(np.uint32))


@pytest.mark.parametrize("n_draft", [1, 2, 3, 4])
@pytest.mark.parametrize("margin", [0.0, 0.5])
def test_mtp_greedy_identical(engine, files, n_draft, margin):
    ids = engine.prompt_tokens(PROMPT)
    _, head = open_support_for(files / "mtp.gguf", files / "target.gguf", engine.hparams, "none")
    drafter = MtpDrafter(engine.model, head, max_draft=n_draft, margin=margin)
    ref = _plain(engine, ids, 64)
    out, st = _spec(engine, drafter, ids, 64)
    assert out == ref
    assert st.steps > 0 and st.drafted > 0
    _check_rollback(engine, ids, out)


def test_mtp_from_embedded_nextn_matches_the_support_file(files):
    eng = Engine(str(files / "target-nextn.gguf"), n_ctx=512)
    ids = eng.prompt_tokens(PROMPT)
    head = mtp_from_nextn(eng.gguf, eng.hparams, "none")
    out, st = _spec(eng, MtpDrafter(eng.model, head, max_draft=3), ids, 48)
    assert out == _plain(eng, ids, 48)
    assert st.drafted > 0


@pytest.mark.parametrize("block", [2, 3, 4])
@pytest.mark.parametrize("cut", [0.0, 0.3, 0.7])
@pytest.mark.parametrize("strict", [False, True])
def test_dspark_greedy_identical(engine, files, block, cut, strict):
    ids = engine.prompt_tokens(PROMPT)
    kind, w = open_support_for(files / "draft.gguf", files / "target.gguf", engine.hparams, "none")
    assert kind == "dspark"
    drafter = DSparkDrafter(engine.model, w, block_size=block, confidence=cut)
    ref = _plain(engine, ids, 64)
    out, st = _spec(engine, drafter, ids, 64, strict=strict)
    assert out == ref
    assert st.steps > 0
    if cut == 0.0:
        assert st.drafted == sum(min(block, 64) for _ in range(st.steps)) or st.drafted > 0
    _check_rollback(engine, ids, out)


def test_lookup_partial_accepts_roll_back_exactly(engine):
    # a repetitive prompt: the copy drafter gets partial accepts on a random model
    ids = engine.prompt_tokens("ab ab ab ab ab ab ab ab ab ab ab ab")
    out, st = _spec(engine, PromptLookupDrafter(5), ids, 80)
    assert out == _plain(engine, ids, 80)
    assert st.accepted > 0 and st.accepted < st.verified
    _check_rollback(engine, ids, out)


class _CheckedCommits:
    """Wraps a drafter: at every commit with a partial accept, the target's cache must hold
    exactly the committed tokens, and the verify row that chose the next token must equal, bit
    for bit, the last row of a fresh prefill of those tokens (on a separate cache)."""

    def __init__(self, drafter, eng, prompt):
        self.d, self.eng, self.committed, self.checked = drafter, eng, list(prompt), 0
        self.name = drafter.name
        self.hidden_layers, self.wants_final_hidden = drafter.hidden_layers, drafter.wants_final_hidden

    def start(self, prompt, prefill):
        self.d.start(prompt, prefill)

    def propose(self, *a):
        return self.d.propose(*a)

    def commit(self, anchor, proposal, m, verify):
        self.committed += [anchor] + list(proposal.tokens[:m])
        if 0 < m < len(proposal):
            model = self.eng.model
            assert model.cache.length == len(self.committed)
            fresh = model.forward(self.committed, 0, logits="last", cache=model.new_cache()).logits[-1]
            np.testing.assert_array_equal(verify.logits[m].view(np.uint32), fresh.view(np.uint32))
            self.checked += 1
        self.d.commit(anchor, proposal, m, verify)


@pytest.mark.parametrize("which", ["lookup", "mtp", "dspark"])
def test_every_partial_accept_leaves_exactly_the_committed_state(engine, files, which):
    ids = engine.prompt_tokens("ab ab ab ab ab ab ab ab ab ab ab ab" if which == "lookup" else PROMPT)
    if which == "lookup":
        inner = PromptLookupDrafter(5)
    elif which == "mtp":
        inner = MtpDrafter(engine.model, open_support_for(files / "mtp.gguf", files / "target.gguf",
                                                          engine.hparams, "none")[1], max_draft=4)
    else:
        inner = DSparkDrafter(engine.model, open_support_for(files / "draft.gguf", files / "target.gguf",
                                                             engine.hparams, "none")[1])
    drafter = _CheckedCommits(inner, engine, ids)
    out, st = _spec(engine, drafter, ids, 64)
    assert out == _plain(engine, ids, 64)
    if which == "lookup":
        assert drafter.checked > 0  # the random-weight heads rarely get partial accepts
