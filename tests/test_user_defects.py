"""Issue #18, defects 2-9, 11 and 12: each as a test that failed before its fix.

Tiny models only (tests/reference_model.py's random GGUFs, tests/spec_toys.py's toy target):
the whole file runs in seconds."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from click.testing import CliRunner
from gguf import GGUFValueType as V

from ds4tools.cli import main
from ds4tools.engine import Engine
from ds4tools.engine.generate import GenerationStats, decode
from ds4tools.engine.sampling import Sampler
from ds4tools.engine.speculative import SpecStats, speculative_decode
from ds4tools.engine.speculative.config import SpecConfig
from ds4tools.gguf_io import open_gguf
from tests.reference_model import RefConfig, write_random_model
from tests.spec_toys import ToyDrafter, ToyTarget

CFG = RefConfig("qwen3", n_vocab=300, n_embd=64, n_layer=2, n_head=4, n_head_kv=2, head_dim=16, n_ff=96)
# ffn_down rows of 172 columns: no 32-block type takes them (stories260K's shape)
ODD = RefConfig("llama", n_vocab=300, n_embd=64, n_layer=1, n_head=4, n_head_kv=2, head_dim=16, n_ff=172)
PROMPT = "the model reads a token"
NULL_ID = 0xFFFFFFFF


def cli(*args):
    r = CliRunner().invoke(main, [str(a) for a in args])
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    return r


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("defects") / "tiny-qwen3.gguf"
    write_random_model(path, CFG, seed=21, default_type="Q8_0")
    return path


@pytest.fixture(scope="module")
def odd_source(tmp_path_factory):
    """An F32 llama GGUF like stories260K: 172-column ffn_down, unset sep / pad token ids."""
    path = tmp_path_factory.mktemp("defects-odd") / "odd-f32.gguf"
    write_random_model(path, ODD, seed=3, extra_metadata={
        "tokenizer.ggml.seperator_token_id": NULL_ID, "tokenizer.ggml.padding_token_id": NULL_ID})
    return path


def _quantize(src, out, type_name="Q8_0", **options):
    from ds4tools.quantize import QuantizeOptions, quantize_model
    notes = []
    quantize_model(src, out, QuantizeOptions(type_name, progress=False, **options), report=notes.append)
    return notes


# --- 2. a special token id of 0xFFFFFFFF is llama.cpp's "unset": a warning ------------------------


def test_unset_special_token_ids_are_warnings(odd_source, tmp_path):
    for path in (odd_source, tmp_path / "q.gguf"):
        if path != odd_source:
            _quantize(odd_source, path)  # the metadata is copied: the same verdict
        r = cli("inspect", path)
        assert r.exit_code == 0, r.output
        for k in ("seperator", "padding"):
            assert (f"warning: key 'tokenizer.ggml.{k}_token_id' is {NULL_ID} (-1, unset): "
                    f"llama.cpp ignores it") in r.stdout.splitlines()


# --- 3. --seed -1 is a random seed, reported ---------------------------------------------------


def test_seed_minus_one_draws_a_reported_seed(model):
    args = ("run", "-m", model, "-p", PROMPT, "-n", 6, "--temp", 1.5, "--top-k", 0, "--min-p", 0)
    r = cli(*args, "--seed", -1, "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    seed = doc["stats"]["seed"]
    assert isinstance(seed, int) and seed >= 0
    again = json.loads(cli(*args, "--seed", seed, "--json").stdout)
    assert again["tokens"] == doc["tokens"]  # the reported seed repeats the run
    r = cli(*args, "--seed", -1, "--stats")
    assert r.exit_code == 0 and any(line.startswith("seed: ") for line in r.stderr.splitlines())
    eng = Engine(model)
    # (end-of-generation does not stop it: a random seed may draw that token first)
    assert len(list(eng.generate(PROMPT, 3, temperature=1.0, seed=-1, stop_at_eog=False))) == 3
    assert eng.last_stats.seed >= 0
    r = cli(*args, "--seed", -2)
    assert r.exit_code == 2
    assert r.stderr == "ds4tools: --seed -2: must be -1 (a random seed) or a non-negative integer\n"


# --- 4. a value of 0 is a given flag, not "off" -----------------------------------------------------


@pytest.mark.parametrize("flags, message", [
    (["--lookup", "0"], "ds4tools: --lookup 0: must be in 1..64"),
    (["--mtp-draft", "0"], "ds4tools: --mtp-draft and --mtp-margin apply to MTP drafting"),
    (["--dspark-block-size", "0"], "ds4tools: --dspark-block-size 0: must be at least 1"),
    # implies --dspark, as documented: this model has no draft to go with it
    (["--dspark-confidence", "0"], "ds4tools: --dspark needs the DSpark draft: --mtp DRAFT.gguf"),
])
def test_zero_valued_speculative_flags_are_not_ignored(model, flags, message):
    r = cli("run", "-m", model, "-p", PROMPT, "-n", 2, "--temp", 0, *flags)
    assert r.exit_code == 2, r.output
    assert r.stderr.startswith(message) and r.stderr.count("\n") == 1


def test_dspark_confidence_zero_implies_dspark():
    c = SpecConfig(dspark_confidence=0.0)
    assert c.active and c.resolved(temperature=0.0).dspark
    assert SpecConfig(lookup=0).active and SpecConfig(mtp_margin=0.0).active
    assert not SpecConfig().active


# --- 5. prefill and total exclude the first-call cost of the kernels --------------------------


def _slow_first_forward(eng, delay=0.3):
    """The model's first forward takes ``delay`` longer: what loading the compiled kernels
    from numba's cache costs a fresh process."""
    real, calls = eng.model.forward, []

    def forward(*a, **k):
        if not calls:
            time.sleep(delay)
        calls.append(1)
        return real(*a, **k)
    eng.model.forward = forward


@pytest.mark.parametrize("spec", [None, SpecConfig(lookup=4)])
def test_prefill_excludes_the_first_call_cost(model, spec):
    eng = Engine(model, spec=spec)
    _slow_first_forward(eng)
    list(eng.generate(PROMPT, 4, temperature=0))
    st = eng.last_stats
    assert st.prefill_seconds < 0.15 and st.total_seconds < 0.15, st
    assert st.warmup_seconds >= 0.3
    list(eng.generate(PROMPT, 4, temperature=0))
    assert eng.last_stats.warmup_seconds == 0.0  # once per setting


# --- 6. r and the measured speedup are against plain decoding at the same positions -----------


class SlowToy(ToyTarget):
    """A toy target whose forward costs more as the context grows, as attention does; a verify
    of k tokens costs what one token does (so r = 1)."""
    BASE, SLOPE = 2e-4, 2e-5

    def forward(self, tokens, start_pos, **kw):
        time.sleep(self.BASE + self.SLOPE * start_pos)
        return super().forward(tokens, start_pos, **kw)


def test_costs_are_measured_against_plain_decoding_at_the_same_positions():
    greedy = Sampler(temperature=0.0)
    prompt, n = [1, 5, 2], 200
    plain = GenerationStats()
    list(decode(SlowToy(vocab=8, seed=3), prompt, n, greedy, np.random.default_rng(0), stats=plain))
    target = SlowToy(vocab=8, seed=3)
    st = SpecStats()
    stats = GenerationStats()
    list(speculative_decode(target, ToyDrafter(target, "same", k=3), prompt, n, greedy,
                            np.random.default_rng(0), stats=stats, spec=st))
    true_speedup = (plain.decode_seconds / plain.decode_tokens) / (stats.decode_seconds / stats.decode_tokens)
    assert st.measured_speedup == pytest.approx(true_speedup, rel=0.35), (st.measured_speedup, true_speedup)
    assert 0.7 < st.verify_cost_ratio() < 1.4
    assert st.calibration_seconds > 0


def test_plain_cost_curve_interpolates_and_extrapolates():
    from ds4tools.engine.speculative.stats import PlainCostCurve
    c = PlainCostCurve()
    c.add(10, 1.0, 2.0)
    c.add(20, 2.0, 3.0)
    assert c.total_forward([10, 15, 20, 30]) == pytest.approx(1.0 + 1.5 + 2.0 + 3.0)
    assert c.total_step([5]) == pytest.approx(2.0)
    assert PlainCostCurve().total_step([1, 2]) == 0.0


# --- 7. signals and killed runs leave no temporary file ----------------------------------------

_SLOW_QUANTIZE = textwrap.dedent("""
    import sys, time
    from ds4tools.quantize import pipeline
    real = pipeline._produce
    def slow(*a):
        out = real(*a)
        open(sys.argv[1], "w").close()  # the temporary output exists and is being written
        # short sleeps, as a real run's Python steps: a signal that lands on one of numba's
        # threads does not cut the main thread's sleep short; its handler runs after it
        for _ in range(600):
            time.sleep(0.1)
        return out
    pipeline._produce = slow
    from ds4tools.cli import main
    main(sys.argv[2:], prog_name="ds4tools")
""")


def test_sigterm_and_sigint_remove_the_temporary_file(odd_source, tmp_path):
    for sig, code, line in ((signal.SIGTERM, 143, "ds4tools: terminated"),
                            (signal.SIGINT, 130, "ds4tools: interrupted")):
        out_dir = tmp_path / sig.name
        out_dir.mkdir()
        marker = tmp_path / f"{sig.name}.started"
        # the child as a terminal starts it: SIGINT at its default (a background shell job or a
        # pytest-xdist worker ignores SIGINT, and a child inherits that; Python then installs no
        # KeyboardInterrupt handler)
        p = subprocess.Popen([sys.executable, "-c", _SLOW_QUANTIZE, str(marker), "quantize",
                              str(odd_source), "-o", str(out_dir / "o.gguf"), "--type", "Q8_0"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        deadline = time.monotonic() + 60
        while not marker.exists() and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), p.communicate(timeout=10)
        assert [n for n in os.listdir(out_dir) if n.endswith(".tmp")]
        p.send_signal(sig)
        _, err = p.communicate(timeout=30)
        assert p.returncode == code, err
        assert err.splitlines()[-1] == line and "Traceback" not in err and "Aborted" not in err
        assert os.listdir(out_dir) == []


def test_a_killed_runs_temporary_is_cleared_by_the_next_run(odd_source, tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".o.gguf.{dead.pid}.k1ll3d_x.tmp"  # what kill -9 leaves
    live = tmp_path / f".o.gguf.{os.getppid()}.running.tmp"  # a run still writing
    other = tmp_path / f".o.gguf.7.{dead.pid}.abc.tmp"  # the output "o.gguf.7"'s
    for f in (stale, live, other):
        f.write_bytes(b"partial")
    _quantize(odd_source, tmp_path / "o.gguf")
    assert not stale.exists()
    assert live.exists() and other.exists()
    assert (tmp_path / "o.gguf").exists()


# --- 8, 9. fallbacks are reported; imatrix counts are UINT32 -------------------------------------


def test_type_fallbacks_are_reported_in_a_real_run(odd_source, tmp_path):
    r = cli("quantize", odd_source, "-o", tmp_path / "o.gguf", "--type", "Q8_0")
    assert r.exit_code == 0, r.output
    notes = [x for x in r.stderr.splitlines() if x.startswith("note: blk.0.ffn_down.weight: ")]
    assert notes == ["note: blk.0.ffn_down.weight: written as F16: row length 172 is not a multiple "
                     "of Q8_0's block 32; llama.cpp has no fallback for Q8_0 and stops, F16 is used here"]


def test_imatrix_counts_are_uint32(odd_source, tmp_path):
    from ds4tools.gguf_io.imatrix import Imatrix, save_imatrix
    f = open_gguf(odd_source)
    entries = {n: np.ones(t.shape[-1], np.float32) for n, t in f.tensors.items() if len(t.shape) == 2}
    f.close()
    save_imatrix(Imatrix(entries, ["corpus"], 10), tmp_path / "imatrix.gguf")
    _quantize(odd_source, tmp_path / "o.gguf", imatrix=str(tmp_path / "imatrix.gguf"))
    with open_gguf(tmp_path / "o.gguf") as out:
        for key in ("quantize.imatrix.entries_count", "quantize.imatrix.chunks_count"):
            assert out.value_type(key)[0] == V.UINT32, key
        assert out.metadata["quantize.imatrix.chunks_count"] == 10


# --- 11. interrupted runs, a cut multi-byte character, --target on a plain model ------------------


def test_an_interrupted_json_run_says_interrupted(model, monkeypatch):
    from ds4tools.engine import tokenizer
    real, calls = tokenizer.StreamDecoder.feed, []

    def feed(self, token_id):  # Ctrl-C while the third token is handled
        calls.append(token_id)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(self, token_id)
    monkeypatch.setattr(tokenizer.StreamDecoder, "feed", feed)
    r = cli("run", "-m", model, "-p", PROMPT, "-n", 8, "--temp", 0, "--json")
    assert r.exit_code == 130
    doc = json.loads(r.stdout)
    assert doc["stats"]["stop_reason"] == "interrupted" and len(doc["tokens"]) == 2
    eng = Engine(model)
    gen = eng.generate(PROMPT, 8, temperature=0)
    next(gen)
    gen.close()  # a caller that breaks off
    assert eng.last_stats.stop_reason == "interrupted"


def test_a_character_cut_by_n_is_flagged(model, monkeypatch):
    from ds4tools.engine import api
    eng = Engine(model)
    byte_id = {eng.tokenizer.token_bytes(i): i for i in range(eng.tokenizer.n_vocab)}
    script = [byte_id[b"a"], byte_id[b"\xc3"]]  # "a", then the first byte of "é"

    def scripted(model, prompt, max_tokens, sampler, rng, eog_ids=frozenset(), stats=None):
        stats = stats if stats is not None else GenerationStats()
        try:
            for t in script[:max_tokens]:
                stats.generated_tokens += 1
                yield t
            stats.stop_reason = "length"
        finally:
            stats.stop_reason = stats.stop_reason or "interrupted"
    monkeypatch.setattr(api, "decode", scripted)
    r = cli("run", "-m", model, "-p", PROMPT, "-n", 2, "--temp", 0, "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["tokens"] == script and doc["text"] == "a"
    assert doc["stats"]["text_truncated"] is True
    r = cli("run", "-m", model, "-p", PROMPT, "-n", 2, "--temp", 0)
    assert r.stdout == "a\n"
    assert "generation stopped inside a multi-byte UTF-8 character" in r.stderr
    r = cli("run", "-m", model, "-p", PROMPT, "-n", 1, "--temp", 0, "--json")
    assert json.loads(r.stdout)["stats"]["text_truncated"] is False


def test_target_on_a_plain_model_is_a_usage_error(model):
    r = cli("inspect", model, "--target", model)
    assert r.exit_code == 2
    assert r.stderr.startswith(f"ds4tools: {model}: --target {model}: this is not a support GGUF")
    assert r.stderr.count("\n") == 1 and r.stdout == ""


# --- 12. tau counts only committed tokens ----------------------------------------------------


def test_tau_counts_only_committed_tokens():
    greedy = Sampler(temperature=0.0)
    t = ToyTarget(vocab=12, seed=3)
    st = SpecStats()
    out = list(speculative_decode(t, ToyDrafter(t, "same", k=4), [1, 5, 2], 2, greedy,
                                  np.random.default_rng(0), spec=st, calibrate=False))
    # one token from the prefill, one step: its draft is accepted, its bonus token cut by -n
    assert len(out) == 2 and st.steps == 1 and st.accepted == 1
    assert st.tau == 1.0 and st.committed == 1
    for n in (7, 23, 40):
        st = SpecStats()
        out = list(speculative_decode(t, ToyDrafter(t, "same", k=4), [1, 5, 2], n, greedy,
                                      np.random.default_rng(0), spec=st, calibrate=False))
        assert st.tau == pytest.approx((len(out) - 1) / st.steps)
