"""``ds4tools run --tp N``: start N ranks through mpiexec, or join the MPI world this process was
started in (``mpiexec -n N ds4tools run ...``, a hostfile across machines).

Started by ``--tp N`` outside MPI, this process supervises: it runs the mpiexec next to the
Python it runs on (the ``tp`` extra's mpich), forwards the leader's output, and when a rank is
lost (MPICH then stops every other rank itself) prints one line naming it and exits 1.
"""
from __future__ import annotations

import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from ..errors import UsageError
from .session import TPSession, world_size_from_env, worker_main

#: how MPICH's mpiexec starts the report of a process that died (on its stdout)
BANNER = b"\n" + b"=" * 83 + b"\n=   BAD TERMINATION"


def find_mpiexec() -> str:
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.path.isfile(here) and os.access(here, os.X_OK):
        return here
    found = shutil.which("mpiexec")
    if found is None:
        raise UsageError("--tp needs MPI: pip install 'ds4tools[tp]' (mpi4py and mpich), "
                         "which installs mpiexec next to python")
    return found


def _die_with_parent():  # pragma: no cover - runs in the child before exec
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def _pump(fd, out) -> bytes | None:
    """Copy the child's stdout to ``out`` as it comes, up to MPICH's failure report (returned)."""
    held = b""
    while True:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        data = held + chunk
        i = data.find(BANNER)
        if i >= 0:
            out.write(data[:i])
            out.flush()
            rest = data[i:]
            while True:
                more = os.read(fd, 65536)
                if not more:
                    return rest
                rest += more
        keep = 0
        for j in range(min(len(BANNER) - 1, len(data)), 0, -1):
            if data.endswith(BANNER[:j]):
                keep = j
                break
        out.write(data[:len(data) - keep])
        out.flush()
        held = data[len(data) - keep:]
    out.write(held)
    out.flush()
    return None


class _FirstToEnd:
    """Watches this machine's ranks (their pid files in the run directory) and keeps the first
    one to end. MPICH kills every other rank as soon as one is lost, with the same signal, and
    its report may name any of them; the one that ended first is the one that was lost."""

    def __init__(self, rundir: str, n: int):
        self.rundir, self.n = rundir, n
        self.since = time.time() - 1.0  # older pid files are another run's (a reused rundir)
        self.first: tuple[int, int] | None = None  # (rank, pid)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="ds4tools-tp-watch", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        fds: dict[int, tuple[int, int]] = {}  # pidfd -> (rank, pid)
        known: set[int] = set()
        poller = select.poll()
        try:
            while not self._done.is_set():
                for rank in range(self.n):
                    if rank in known:
                        continue
                    path = os.path.join(self.rundir, f"{rank}.pid")
                    try:
                        if os.stat(path).st_mtime < self.since:
                            continue
                        with open(path) as fh:
                            pid = int(fh.read().split()[0])
                    except (OSError, ValueError, IndexError):
                        continue  # not written yet (or a rank on another machine)
                    known.add(rank)
                    try:
                        fd = os.pidfd_open(pid)
                    except ProcessLookupError:
                        self.first = (rank, pid)
                        return
                    except (OSError, AttributeError):
                        continue
                    fds[fd] = (rank, pid)
                    poller.register(fd, select.POLLIN)
                ready = poller.poll(50) if fds else (self._done.wait(0.05) and [])
                ended = sorted(fds[fd] for fd, _ in ready or [])
                if len(ended) == 1:
                    self.first = ended[0]
                if ended:
                    return  # several at once: the order is lost, MPICH's report decides
        finally:
            for fd in fds:
                os.close(fd)

    def stop(self) -> tuple[int, int] | None:
        self._done.set()
        self._thread.join(1.0)
        return self.first


def _lost_rank_line(banner: bytes, rundir: str, first: tuple[int, int] | None = None) -> str | None:
    text = banner.decode("utf-8", "replace")
    m = re.search(r"PID (\d+) RUNNING AT (\S+)", text)
    if not m:
        return None
    pid, host = int(m.group(1)), m.group(2)
    code = re.search(r"EXIT CODE: (\d+)", text)
    how = re.search(r"EXIT STRING: ([^\n]*)", text)
    if first is not None:
        rank, pid = first
        return (f"tensor parallelism: rank {rank} (pid {pid} on {host}) was lost: "
                f"{_why(how, code)}; every rank was stopped")
    rank = None
    for name in os.listdir(rundir):
        if name.endswith(".pid"):
            try:
                with open(os.path.join(rundir, name)) as fh:
                    if int(fh.read().split()[0]) == pid:
                        rank = int(name[:-4])
            except (OSError, ValueError, IndexError):
                pass
    who = f"rank {rank}" if rank is not None else "a rank"
    return (f"tensor parallelism: {who} (pid {pid} on {host}) was lost: {_why(how, code)}; "
            f"every rank was stopped")


def _why(how, code) -> str:
    return how.group(1).strip() if how else (f"exit code {code.group(1)}" if code else "died")


def launch(n: int, argv: list[str], threads: int | None) -> int:
    """Run ``ds4tools <argv>`` as ``n`` ranks under mpiexec; returns the exit code."""
    mpiexec = find_mpiexec()
    env = dict(os.environ)
    own_dir = "DS4TOOLS_TP_RUNDIR" not in env
    rundir = tempfile.mkdtemp(prefix="ds4tools-tp-") if own_dir else env["DS4TOOLS_TP_RUNDIR"]
    env["DS4TOOLS_TP_RUNDIR"] = rundir
    if threads is None and "NUMBA_NUM_THREADS" not in env:  # the cores shared out between ranks
        env["NUMBA_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // n))
    cmd = [mpiexec, "-n", str(n), sys.executable, "-m", "ds4tools.cli"] + list(argv)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, env=env, preexec_fn=_die_with_parent)
    watch = _FirstToEnd(rundir, n)
    out = sys.stdout.buffer
    try:
        try:
            banner = _pump(proc.stdout.fileno(), out)
            code = proc.wait()
            first = watch.stop()
        except BaseException:  # Ctrl-C, SIGTERM: mpiexec passes it on to every rank
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
            raise
        if banner is not None:
            line = _lost_rank_line(banner, rundir, first)
            if line is not None and code != 0:
                print(f"ds4tools: {line}", file=sys.stderr)
                return 1
            out.write(banner)
            out.flush()
        return code
    finally:
        watch.stop()
        if own_dir:
            shutil.rmtree(rundir, ignore_errors=True)


def run_rank(tp_arg: int | None, run_kwargs: dict) -> int:
    """This process is one rank of an MPI world of size > 1: the leader runs the generation,
    a worker runs its shard."""
    from ..engine.api import Engine
    from ..engine.run import run
    session = TPSession()
    if tp_arg is not None and tp_arg != session.size:
        if session.leader:
            session.stop(2)
            raise UsageError(f"--tp {tp_arg}, but mpiexec started {session.size} processes")
        return 0
    if not session.leader:
        # DS4TOOLS_TP_MODEL: where the model file lies on this worker's machine, if elsewhere
        return worker_main(session, lambda o: Engine(os.environ.get("DS4TOOLS_TP_MODEL") or o["model"],
                                                     n_ctx=o["n_ctx"],
                                                     threads=o["threads"],
                                                     cache_type=o["cache_type"],
                                                     exact=o["exact"], tp=session))
    code = 1
    try:
        code = run(**run_kwargs, tp=session)
    finally:
        session.stop(code)
    return code


def tp_requested(tp_arg: int | None) -> bool:
    return world_size_from_env() > 1 or (tp_arg is not None and tp_arg > 1)
