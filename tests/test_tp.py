"""Tensor parallelism over MPI (ds4tools.tp): two ranks on one machine through the tp extra's
mpiexec. Greedy output at TP = 2 must be token-identical to one process; the fault cases are
bounded in time. Skipped where mpi4py / mpiexec are not installed (pip install -e ".[tp]")."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from ds4tools.tp import frames
from ds4tools.tp.shard import TPError, plan_heads, split_even

try:
    import mpi4py  # noqa: F401
    MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if not os.path.isfile(MPIEXEC):
        MPIEXEC = shutil.which("mpiexec")
except ImportError:
    MPIEXEC = None

needs_mpi = pytest.mark.skipif(MPIEXEC is None, reason="mpi4py / mpiexec not installed "
                                                       "(pip install -e '.[tp]')")

PROMPT = "def fibonacci(n):"
CLI = [sys.executable, "-m", "ds4tools.cli", "run"]


def _env(**extra):
    env = dict(os.environ)
    env.pop("DS4TOOLS_TP_RUNDIR", None)
    env.setdefault("NUMBA_NUM_THREADS", "1")
    env.update(extra)
    return env


# a bound on whole runs, generous for a cold numba cache (the fault cases have their own 10 s)
RUN_TIMEOUT = 300


def _run(args, timeout=RUN_TIMEOUT, env=None, cmd=None):
    p = subprocess.run((cmd or CLI) + args, capture_output=True, timeout=timeout, env=env or _env())
    return p.returncode, p.stdout.decode("utf-8", "replace"), p.stderr.decode("utf-8", "replace")


def _tokens(args, timeout=RUN_TIMEOUT, cmd=None, env=None):
    code, out, err = _run(args + ["--json"], timeout, env, cmd)
    assert code == 0, err
    return json.loads(out), err


_ONE_PROCESS = {}


def _one_process(args):
    """One process's greedy output for ``args`` (cached: several cases compare with it)."""
    key = tuple(args)
    if key not in _ONE_PROCESS:
        _ONE_PROCESS[key] = _tokens(args)[0]
    return _ONE_PROCESS[key]


GREEDY = ["-p", PROMPT, "-n", "32", "--temp", "0"]


# --- no MPI needed -------------------------------------------------------------------------------


def test_frame_layout_round_trip():
    data = frames.encode(frames.VERIFY, 7, 40, [5, 6, 7])
    assert len(data) == 16 + 8 * 3
    assert data[:16] == bytes([3, 1, 0, 0, 7, 0, 0, 0, 40, 0, 0, 0, 3, 0, 0, 0])
    f = frames.decode(data, len(data))
    assert (f.kind, f.seq, f.arg) == (frames.VERIFY, 7, 40)
    assert f.tokens.tolist() == [5, 6, 7] and f.positions.tolist() == [40, 41, 42]
    c = frames.decode(frames.encode(frames.COMMIT, 8, 42), 16)
    assert (c.kind, c.arg, c.tokens) == (frames.COMMIT, 42, None)
    with pytest.raises(ValueError):
        frames.decode(data[:-4], len(data) - 4)


def test_head_plans():
    assert split_even(5, 2) == [(0, 3), (3, 5)]
    p = plan_heads(4, 2, 2)                      # GQA, kv heads split with their groups
    assert (p.q, p.kv, p.replicated_kv) == ([(0, 2), (2, 4)], [(0, 1), (1, 2)], False)
    p = plan_heads(3, 1, 2)                      # the demo: one kv head, replicated
    assert (p.q, p.kv, p.replicated_kv) == ([(0, 2), (2, 3)], [(0, 1), (0, 1)], True)
    with pytest.raises(TPError):
        plan_heads(6, 2, 4)                      # a rank's heads would span two kv heads
    assert plan_heads(4, 2, 3).kv == [(0, 1), (1, 2), (1, 2)]
    with pytest.raises(TPError):
        plan_heads(2, 1, 3)


# --- two ranks -----------------------------------------------------------------------------------


@needs_mpi
@pytest.mark.parametrize("mode", [[], ["--dspark"], ["--lookup", "4"]], ids=["plain", "dspark", "lookup"])
def test_tp2_greedy_matches_one_process(mode):
    one = _one_process(GREEDY)  # speculative greedy output is plain greedy output
    two, err = _tokens(GREEDY + mode + ["--tp", "2", "--stats"])
    assert two["tokens"] == one["tokens"]
    tp = two["stats"]["tensor_parallel"]
    assert tp["ranks"] == 2 and tp["shards"]["kv_replicated"] and tp["mtp_disabled"] is None
    assert tp["comm_seconds_per_step"] > 0
    if mode:
        assert tp["frames"]["VERIFY"] > 0 and tp["frames"]["COMMIT"] > 0
    assert "tp communication:" in err


@needs_mpi
def test_tp2_split_kv_heads_llama(gguf_llama_f32):
    """4 query heads over 2 kv heads: each rank keeps one kv head and its group."""
    args = ["-m", str(gguf_llama_f32), "-p", "hello world", "-n", "16", "--temp", "0"]
    one, _ = _tokens(args)
    two, _ = _tokens(args + ["--tp", "2"])
    assert two["tokens"] == one["tokens"]
    assert two["stats"]["tensor_parallel"]["shards"]["kv_heads"] == [1, 1]


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    """Synthetic glm4moe files (tests/glm4moe_model.py): 8 experts top-3, a shared expert, a
    leading dense layer, GQA 4/2; Q8_0, and Q4_K (the one-call grouped path in one process)."""
    from tests.glm4moe_model import Glm4MoeConfig, write_model
    d = tmp_path_factory.mktemp("tp-moe")
    write_model(d / "q8.gguf", Glm4MoeConfig(), "Q8_0", 0)
    write_model(d / "q4k.gguf", Glm4MoeConfig(n_embd=256, n_ff=256, n_ff_exp=256, head_dim=64,
                                              n_rot=32), "Q4_K", 0)
    return d


@needs_mpi
def test_tp2_greedy_matches_one_process_moe(moe_models):
    args = ["-m", str(moe_models / "q8.gguf"), "-p", "hello world", "-n", "24", "--temp", "0"]
    one, _ = _tokens(args)
    two, _ = _tokens(args + ["--tp", "2", "--lookup", "3"])
    assert two["tokens"] == one["tokens"]
    assert two["stats"]["tensor_parallel"]["shards"]["experts"] == [4, 4]


@needs_mpi
@pytest.mark.parametrize("model,ranks", [("demo", 2), ("q8", 3), ("q4k", 2)])
def test_sharded_logits_are_bit_identical(moe_models, model, ranks):
    """Logits, a raw layer output and the final hidden state: prefill, a verify batch after a
    truncation, single tokens."""
    if model == "demo":
        from ds4tools.demo import demo_model_path
        path = str(demo_model_path(progress=False))
    else:
        path = str(moe_models / f"{model}.gguf")
    script = os.path.join(os.path.dirname(__file__), "tp_logits_check.py")
    p = subprocess.run([MPIEXEC, "-n", str(ranks), sys.executable, script, path],
                       capture_output=True, timeout=RUN_TIMEOUT, env=_env())
    assert p.returncode == 0, p.stderr.decode()
    doc = json.loads(p.stdout.decode().strip().splitlines()[-1])
    assert doc["identical"] == [True] * 4


@needs_mpi
def test_mtp_falls_back_under_tp():
    one = _one_process(GREEDY)
    two, err = _tokens(GREEDY + ["--glm-mtp", "--tp", "2"])
    assert two["tokens"] == one["tokens"]
    lines = [l for l in err.splitlines() if "MTP is disabled under tensor parallelism" in l]
    assert len(lines) == 1
    assert "MTP is disabled" in two["stats"]["tensor_parallel"]["mtp_disabled"]
    assert "speculative" not in two["stats"]


@needs_mpi
def test_joins_an_existing_mpi_world():
    one = _one_process(GREEDY)
    two, _ = _tokens(GREEDY, cmd=[MPIEXEC, "-n", "2"] + CLI)
    assert two["tokens"] == one["tokens"] and two["stats"]["tensor_parallel"]["ranks"] == 2


@needs_mpi
def test_a_rank_that_cannot_open_the_model_stops_all(tmp_path):
    from ds4tools.demo import demo_model_path
    model = str(demo_model_path(progress=False))
    args = ["-m", model, "-p", PROMPT, "-n", "4", "--temp", "0"]
    cmd = ([MPIEXEC, "-n", "1"] + CLI + args + [":", "-n", "1", "-env", "DS4TOOLS_TP_MODEL",
                                                str(tmp_path / "missing.gguf")] + CLI + args)
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, timeout=RUN_TIMEOUT, env=_env())
    err = p.stderr.decode()
    assert p.returncode != 0
    assert "rank 1:" in err and "missing.gguf: no such file" in err
    assert time.monotonic() - t0 < 30


def _start_long_run(rundir):
    env = _env(DS4TOOLS_TP_RUNDIR=str(rundir))
    p = subprocess.Popen(CLI + ["-p", PROMPT, "-n", "1000", "--ctx", "1024", "--temp", "0",
                                "--tp", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    os.set_blocking(p.stdout.fileno(), False)
    got, t0 = b"", time.monotonic()
    while time.monotonic() - t0 < 60:  # generating: output has come, both ranks are known
        try:
            got += os.read(p.stdout.fileno(), 4096) or b""
        except BlockingIOError:
            pass
        if len(got) > 20 and all((rundir / f"{r}.pid").exists() for r in (0, 1)):
            break
        if p.poll() is not None:
            pytest.fail(f"the run ended early: {p.stderr.read().decode()}")
        time.sleep(0.05)
    pids = {r: int((rundir / f"{r}.pid").read_text().split()[0]) for r in (0, 1)}
    return p, pids


def _gone(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:  # a zombie has exited too
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


@needs_mpi
@pytest.mark.parametrize("victim", [1, 0], ids=["worker", "leader"])
def test_a_killed_rank_stops_every_rank(tmp_path, victim):
    p, pids = _start_long_run(tmp_path)
    os.kill(pids[victim], 9)
    t0 = time.monotonic()
    try:
        code = p.wait(10)
    except subprocess.TimeoutExpired:
        p.kill()
        pytest.fail("the run did not end within 10 s of a lost rank")
    assert time.monotonic() - t0 < 10
    assert code != 0
    lines = [l for l in p.stderr.read().decode().splitlines() if "was lost" in l]
    assert len(lines) == 1 and f"rank {victim} (pid {pids[victim]}" in lines[0]
    deadline = time.monotonic() + 5
    while not all(_gone(pid) for pid in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_gone(pid) for pid in pids.values())


def test_engine_does_not_import_mpi():
    code = ("import sys, ds4tools.engine, ds4tools.tp, ds4tools.tp.launch, ds4tools.cli; "
            "print('mpi4py' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    assert out.stdout.strip() == b"False"
