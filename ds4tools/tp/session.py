"""A tensor-parallel run: the world, the handshake before loading, and what the leader reports.

Messages besides the frames (rank 0 <-> workers, before the first frame):

    START   tag 40, leader -> worker: a pickled dict of the load options (model path resolved)
    STATUS  tag 42, worker -> leader: None once the shard is loaded, else the error line

A leader that fails before START (a usage error) sends STOP instead. A rank that cannot load
reports it; the leader prints every such line and stops all ranks (exit code 1).
"""
from __future__ import annotations

import os
import socket
import sys

from ..errors import Ds4Error, InvalidContentError, UsageError
from .shard import Group, TPError, plan_shards

START_TAG, STATUS_TAG = 40, 42

MTP_DISABLED = ("MTP is disabled under tensor parallelism: its head drafts one token at a time "
                "from the target's final hidden state, a round trip per draft that the TP frames "
                "do not carry (as in ds4); decoding token by token")


def world_size_from_env() -> int:
    """The size of the MPI world this process was started in (1 when not under mpiexec)."""
    for key in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS"):
        v = os.environ.get(key)
        if v and v.isdigit():
            return int(v)
    return 1


class TPSession:
    """This rank's part of a run under MPI (COMM_WORLD, size > 1)."""

    def __init__(self, comm=None):
        try:
            from mpi4py import MPI
        except ImportError:
            raise UsageError("tensor parallelism needs mpi4py and an MPI: pip install "
                             "'ds4tools[tp]'") from None
        self.group = Group(comm or MPI.COMM_WORLD)
        self.rank, self.size = self.group.rank, self.group.size
        self.model = None
        self.plan = None
        self.mtp_disabled: str | None = None
        self.started = False
        d = os.environ.get("DS4TOOLS_TP_RUNDIR")
        if d:  # the launcher maps a lost process back to its rank
            try:
                with open(os.path.join(d, f"{self.rank}.pid"), "w") as fh:
                    fh.write(f"{os.getpid()} {socket.gethostname()}\n")
            except OSError:
                pass

    @property
    def leader(self) -> bool:
        return self.rank == 0

    # --- the leader ---------------------------------------------------------------------------

    def check_spec(self, spec, err):
        """MTP falls back to plain decoding (one stderr line); DSpark and lookup stay."""
        if spec is None:
            return None
        mtp = (spec.mtp_file is not None and not spec.dspark) or spec.glm_mtp
        if mtp:
            self.mtp_disabled = MTP_DISABLED
            print(f"ds4tools: {MTP_DISABLED}", file=err)
            return None
        return spec

    def start(self, options: dict) -> None:
        """Send the load options to every worker (the leader, once the request is checked)."""
        for r in range(1, self.size):
            self.group.comm.send(options, dest=r, tag=START_TAG)
        self.started = True

    def open_engine(self, make, err=None):
        """The leader's engine, once every rank has loaded its shard (or the errors, reported)."""
        err = err or sys.stderr
        mine = None
        try:
            engine = make()
        except Ds4Error as e:
            engine, mine = None, e
        lines = []
        for r in range(1, self.size):
            st = self.group.comm.recv(source=r, tag=STATUS_TAG)
            if st is not None and (mine is None or st != str(mine)):  # the leader's says it
                lines.append(f"rank {r}: {st}")
        if mine is not None or lines:
            for line in lines:
                print(f"ds4tools: {line}", file=err)
            self.stop(1)
            if mine is not None:
                raise mine
            raise InvalidContentError(f"{len(lines)} of {self.size - 1} workers could not load "
                                      f"their shard; every rank stopped")
        return engine

    def stop(self, code: int = 0) -> None:
        """Tell every worker to exit (a STOP frame); once."""
        if self.model is not None and self.model.link is not None:
            self.model.link.stop(code)
            return
        if getattr(self, "_stopped", False):
            return
        self._stopped = True
        from . import frames
        data = frames.encode(frames.STOP, 0, code)  # the first and only frame
        for r in range(1, self.size):
            self.group.comm.Send([data, self.group.MPI.BYTE], dest=r, tag=frames.FRAME_TAG)

    # --- every rank ---------------------------------------------------------------------------

    def make_model(self, architecture, hp, weights, **options):
        """The Engine's hook: this rank's ShardTransformer instead of the whole model."""
        from ..engine.glm4moe import Glm4MoeTransformer
        from ..engine.transformer import Transformer
        from .model import ShardTransformer, glm4moe_shard
        make = {Transformer: ShardTransformer, Glm4MoeTransformer: glm4moe_shard}.get(architecture.model)
        if make is None:
            raise UsageError(f"tensor parallelism runs llama, qwen3 and glm4moe models so far, "
                             f"not {hp.arch}")
        try:
            self.plan = plan_shards(hp, self.size)
            self.model = make(hp, weights, group=self.group, plan=self.plan, leader=self.leader,
                              **options)
        except (TPError, ValueError) as e:
            raise UsageError(str(e)) from None
        return self.model

    # --- what the leader reports ----------------------------------------------------------------

    def as_dict(self) -> dict:
        m = self.model
        link = m.link
        steps = link.counts["PREFILL"] + link.counts["DECODE"] + link.counts["VERIFY"]
        comm = self.group.seconds + link.seconds
        return {"ranks": self.size, "shards": self.plan.as_dict(), "frames": dict(link.counts),
                "frame_seconds": link.seconds, "allgathers": self.group.calls,
                "allgather_seconds": self.group.seconds, "allgather_bytes": self.group.bytes,
                "comm_seconds": comm, "comm_seconds_per_step": comm / steps if steps else 0.0,
                "mtp_disabled": self.mtp_disabled}

    def summary_lines(self) -> list[str]:
        d = self.as_dict()
        f = d["frames"]
        steps = f["PREFILL"] + f["DECODE"] + f["VERIFY"]
        return [f"tensor parallel: {self.size} ranks ({self.plan.describe()})",
                f"tp frames: {steps} forward steps (PREFILL {f['PREFILL']}, DECODE {f['DECODE']}, "
                f"VERIFY {f['VERIFY']}), COMMIT {f['COMMIT']}; sending {1e3 * d['frame_seconds']:.1f} ms",
                f"tp communication: {d['allgathers']} all-gathers, "
                f"{1e3 * d['allgather_seconds']:.1f} ms; {1e3 * d['comm_seconds_per_step']:.3f} ms "
                f"per step (warm-up included)"]


def worker_main(session: TPSession, make_engine) -> int:
    """A worker: wait for START (or STOP), load the shard, report, run the frames."""
    from . import frames
    g = session.group
    MPI = g.MPI
    status = MPI.Status()
    g.comm.Probe(source=0, tag=MPI.ANY_TAG, status=status)
    if status.Get_tag() == frames.FRAME_TAG:  # the leader stopped before loading
        size = status.Get_count(MPI.BYTE)
        buf = bytearray(size)
        g.comm.Recv([buf, MPI.BYTE], source=0, tag=frames.FRAME_TAG)
        return 0
    options = g.comm.recv(source=0, tag=START_TAG)
    try:
        engine = make_engine(options)
    except Ds4Error as e:
        g.comm.send(str(e), dest=0, tag=STATUS_TAG)
        engine = None
    except MemoryError:
        g.comm.send("out of memory", dest=0, tag=STATUS_TAG)
        engine = None
    else:
        g.comm.send(None, dest=0, tag=STATUS_TAG)
    # A worker exits 0 once stopped: the leader reports and its exit code is the run's (MPICH's
    # mpiexec combines the ranks' codes)
    if engine is None:  # wait for the leader's STOP
        g.comm.Probe(source=0, tag=frames.FRAME_TAG, status=status)
        buf = bytearray(status.Get_count(MPI.BYTE))
        g.comm.Recv([buf, MPI.BYTE], source=0, tag=frames.FRAME_TAG)
        return 0
    from .model import worker_loop
    worker_loop(engine.model)
    return 0
