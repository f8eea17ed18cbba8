"""The sharded decoder on every rank, the leader's frames and the workers' loop.

The leader's model is a ShardTransformer whose every forward first sends a PREFILL / DECODE /
VERIFY frame, and whose cache sends COMMIT when it is truncated: the decoding loops
(plain, speculative) run unchanged on it. A worker runs the same forward on each frame it
receives, without logits.
"""
from __future__ import annotations

import time

from ..engine.kv_cache import KVCache
from ..engine.transformer import Transformer
from . import frames
from .shard import Group, ShardPlan, local_hparams, shard_weights


class Link:
    """The leader's side of the frames: one MPI message per worker per frame."""

    def __init__(self, group: Group):
        self.group = group
        self.seq = 0
        self.seconds = 0.0
        self.counts = {name: 0 for name in frames.NAMES.values()}
        self.stopped = False

    def send(self, kind: int, arg: int, tokens=None) -> None:
        t0 = time.perf_counter()
        data = frames.encode(kind, self.seq, arg, tokens)
        self.seq += 1
        comm = self.group.comm
        for r in range(1, self.group.size):
            comm.Send([data, self.group.MPI.BYTE], dest=r, tag=frames.FRAME_TAG)
        self.counts[frames.NAMES[kind]] += 1
        self.seconds += time.perf_counter() - t0

    def stop(self, code: int = 0) -> None:
        if not self.stopped:
            self.stopped = True
            self.send(frames.STOP, code)


class FramedKVCache(KVCache):
    """The leader's cache: a truncate is a COMMIT every rank applies."""

    link: Link | None = None

    def truncate(self, n: int) -> None:
        super().truncate(n)
        if self.link is not None:
            self.link.send(frames.COMMIT, n)


class ShardMixin:
    """This rank's shard run by the model's own decoder. ``hp`` stays the whole model's (what
    drafters and callers see); the layers run on ``layer_hp``, the narrowed one. Put before the
    model class: ``class ShardTransformer(ShardMixin, Transformer)``."""

    def __init__(self, hp, weights, *, group: Group, plan: ShardPlan, leader: bool,
                 shard=shard_weights, **options):
        local = local_hparams(hp, plan, group.rank)
        super().__init__(local, shard(weights, hp, plan, group), **options)
        self.local_hp = local
        self.hp = hp
        self.group = group
        self.plan = plan
        self.link = Link(group) if leader else None
        if leader:
            old = self.cache
            self.cache = FramedKVCache(old.n_layer, local.n_head_kv, old.n_ctx, local.head_dim,
                                       old.cache_type)
            self.cache.link = self.link

    @property
    def layer_hp(self):
        return self.local_hp

    def _forward(self, tokens, start_pos, hidden_layers, want_final_hidden, logits, cache):
        if self.link is not None and cache is self.cache:
            kind = (frames.PREFILL if start_pos == 0 else
                    frames.DECODE if tokens.shape[0] == 1 else frames.VERIFY)
            self.link.send(kind, start_pos, tokens)
        return super()._forward(tokens, start_pos, hidden_layers, want_final_hidden, logits, cache)


class ShardTransformer(ShardMixin, Transformer):
    """A llama / qwen3 shard."""


def glm4moe_shard(hp, weights, *, group: Group, plan: ShardPlan, leader: bool, **options):
    """A glm4moe shard: attention and dense FFNs split, experts distributed (tp/moe.py)."""
    from .moe import Glm4MoeShardMixin, Glm4MoeTransformer, plan_experts, shard_glm4moe_weights

    class ShardGlm4Moe(Glm4MoeShardMixin, ShardMixin, Glm4MoeTransformer):
        pass

    experts = plan_experts(hp.moe.n_expert, group.size)
    plan.experts = experts
    model = ShardGlm4Moe(hp, weights, group=group, plan=plan, leader=leader,
                         shard=lambda w, h, p, g: shard_glm4moe_weights(w, h, p, g, experts),
                         **options)
    model.experts = experts
    return model


class ProtocolError(RuntimeError):
    pass


def worker_loop(model: ShardTransformer) -> int:
    """Run the leader's frames until STOP; returns STOP's exit code."""
    g = model.group
    MPI = g.MPI
    status = MPI.Status()
    expect = 0
    while True:
        g.comm.Probe(source=0, tag=frames.FRAME_TAG, status=status)
        size = status.Get_count(MPI.BYTE)
        buf = bytearray(size)
        g.comm.Recv([buf, MPI.BYTE], source=0, tag=frames.FRAME_TAG)
        f = frames.decode(buf, size)
        if f.seq != expect & 0xFFFFFFFF:
            raise ProtocolError(f"frame {f.seq} arrived, expected {expect}")
        expect += 1
        if f.kind == frames.STOP:
            return f.arg
        if f.kind == frames.COMMIT:
            model.cache.truncate(f.arg)
        else:
            model.forward(f.tokens, f.arg, logits="none")
