"""The llama / qwen3 decoder, top to bottom.

    x = embed(tokens)
    for each layer:
        h = rmsnorm(x) ; q, k, v = h Wq, h Wk, h Wv (+ biases)
        qwen3: q, k = rmsnorm per head (q_norm, k_norm)
        q, k = rope(q, k)            llama: adjacent pairs ("norm"), qwen3: halves ("neox")
        cache[positions] = k, v ; a = attention(q, cache rows [0, limit)) ; x += a Wo
        h = rmsnorm(x) ; x += (silu(h Wg) * h Wu) Wd
    logits = rmsnorm(x) Wout         (Wout = token embedding when tied)

The two architectures differ only by the per-head q/k norm and the rope pairing.
Every step is one compiled call over all rows of the batch; rows never interact except through
the cache, so a token's logits do not depend on how many tokens shared its forward.
The steps are a backend's operations (``ws.ops``: backends/), so the same code runs on the CPU
and on a GPU; the forward's inputs and results (token ids, logits, hidden rows) are numpy.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass, field

import numba
import numpy as np

from . import kernels
from .backends import get_backend
from .backends.cpu import CPU
from .hparams import HParams
from .kv_cache import KVCache
from .weights import LayerWeights, ModelWeights, SharedInput, load_layer

#: rows per internal pass: long inputs (prefill) run in chunks of this many tokens (measured on a
#: 350M Q4_K_M model, 512-token prefill, 1 thread: 256 is 3% faster than 128, which is 20-25%
#: faster than 32; 512 is 2% slower than 128: its activations no longer stay in L2)
DEFAULT_CHUNK = 256
MAX_CHUNK = 512
#: a model whose largest matrix is smaller than this runs on one thread: its kernels take less
#: time than starting a parallel region (tiny demo model, 2 threads on loaded cores: 170 t/s
#: against 540 t/s on one). The same compiled kernels run either way, so results are the same.
SINGLE_THREAD_BELOW_BYTES = 1 << 20
#: ... except for batches of at least this many rows (prefill), whose kernels are long enough to
#: split over the threads (demo model, 512-token prefill on 2 threads: 13.5-15K t/s against 9.5K)
SINGLE_THREAD_BELOW_ROWS = 64
#: a model whose largest matrix is between this and SINGLE_THREAD_BELOW_BYTES runs on one thread
#: only where the CPUs are busy (load average): on idle cores its matmuls are long enough to
#: split (demo model, largest matrix 408 KiB, 2 idle cores, AVX2 code: 680 us a token on one
#: thread, 540 on two); on cores busy with another job two threads take twice as long as one,
#: and MPI ranks that each took 2 threads on 2 cores ran the TP tests 4.7x slower
PARALLEL_WHEN_IDLE_FROM_BYTES = 1 << 18


def one_thread_for(largest_bytes: int, threads: int, load: float | None, cpus: int) -> bool:
    """Whether a model whose largest matrix has ``largest_bytes`` runs its short batches on one
    thread, with ``threads`` threads set (in all, over the MPI ranks on this host), the 1-minute
    load average ``load`` (None: unknown) on ``cpus`` CPUs: below PARALLEL_WHEN_IDLE_FROM_BYTES
    always, below SINGLE_THREAD_BELOW_BYTES unless the CPUs have a free core for every thread
    (as ``make --load-average`` judges it)."""
    if largest_bytes >= SINGLE_THREAD_BELOW_BYTES:
        return False
    if largest_bytes < PARALLEL_WHEN_IDLE_FROM_BYTES or load is None:
        return True
    return cpus - load < threads - 0.5


def _load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # not on this platform
        return None


def _local_ranks() -> int:
    """The processes of this MPI job on this host (MPICH's mpiexec says; 1 outside MPI): they
    start together, so the load average does not show the other ranks' threads yet."""
    try:
        return max(1, int(os.environ.get("MPI_LOCALNRANKS", "1")))
    except ValueError:
        return 1


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class NonFiniteLogits(ArithmeticError):
    """A forward produced NaN or infinite logits: corrupt weights (flipped bytes) or an
    overflow. The caller names the model file."""


@dataclass
class ForwardResult:
    logits: np.ndarray | None                 # (k, n_vocab) float32, or (1, n_vocab) for "last"
    hidden: dict = field(default_factory=dict)  # layer -> (k, n_embd) raw layer outputs
    final_hidden: np.ndarray | None = None    # (k, n_embd) after the final norm


class Workspace:
    """Activation buffers for up to ``rows`` rows on the device of backend ``ops``, reused by
    every forward (fresh arrays per call would cost page faults or allocations); kernels get
    C-contiguous leading slices of them. ``ops`` also runs the layers' operations on them."""

    def __init__(self, hp: HParams, rows: int, ops=CPU):
        self.ops = ops
        self.rows = rows
        self.norm = ops.empty((rows, hp.n_embd))
        self.q = ops.empty((rows, hp.n_head, hp.head_dim))
        self.k = ops.empty((rows, hp.n_head_kv, hp.head_dim))
        self.v = ops.empty((rows, hp.n_head_kv, hp.head_dim))
        self.attn = ops.empty((rows, hp.n_head, hp.head_dim))
        self.proj = ops.empty((rows, hp.n_embd))
        self.gate = ops.empty((rows, hp.n_ff))
        self.up = ops.empty((rows, hp.n_ff))


def layer_forward(x: np.ndarray, lw: LayerWeights, hp: HParams, cache: KVCache, layer: int,
                  positions: np.ndarray, limits: np.ndarray, rope: tuple, ws: Workspace) -> None:
    """One decoder layer on x (k, n_embd), in place (x is the residual stream).

    Writes this layer's K/V rows at ``positions`` into ``cache`` (layer index ``layer``) and
    lets query row t attend to cache rows [0, limits[t]): causal decoding uses
    limits = positions + 1; a drafter can pass any prefix (e.g. a bidirectional block)."""
    attention_block(x, lw, hp, cache, layer, positions, limits, rope, ws)
    ops = ws.ops
    k = x.shape[0]
    h = ws.norm[:k]
    o = ws.proj[:k]
    ops.rmsnorm(x, lw.ffn_norm, hp.rms_eps, h)
    g = ws.gate[:k]
    u = ws.up[:k]
    hs = SharedInput(h)  # quantized once for gate and up
    lw.w_gate.matmul(hs, g)
    lw.w_up.matmul(hs, u)
    ops.swiglu(g, u, g)
    lw.w_down.matmul(g, o)
    ops.add_into(x, o)


def attention_block(x: np.ndarray, lw, hp: HParams, cache: KVCache, layer: int,
                    positions: np.ndarray, limits: np.ndarray, rope: tuple, ws: Workspace) -> None:
    """x += the attention half of a decoder layer (pre-norm GQA with optional biases, per-head
    q/k norms and rope over the first n_rot dimensions): layer_forward's first half, shared by
    the decoders built on this one (glm4moe). lw: attn_norm, wq, wk, wv, wo and the optional
    bq, bk, bv, bo, q_norm, k_norm."""
    ops = ws.ops
    k = x.shape[0]
    h = ws.norm[:k]
    q = ws.q[:k]
    kr = ws.k[:k]
    vr = ws.v[:k]
    ops.rmsnorm(x, lw.attn_norm, hp.rms_eps, h)
    hs = SharedInput(h)  # quantized once for q, k and v
    lw.wq.matmul(hs, q.reshape(k, hp.n_q))
    lw.wk.matmul(hs, kr.reshape(k, hp.n_kv))
    lw.wv.matmul(hs, vr.reshape(k, hp.n_kv))
    if lw.bq is not None:
        ops.add_bias(q.reshape(k, hp.n_q), lw.bq)
    if lw.bk is not None:
        ops.add_bias(kr.reshape(k, hp.n_kv), lw.bk)
    if lw.bv is not None:
        ops.add_bias(vr.reshape(k, hp.n_kv), lw.bv)
    if lw.q_norm is not None:
        q2 = q.reshape(k * hp.n_head, hp.head_dim)
        ops.rmsnorm(q2, lw.q_norm, hp.rms_eps, q2)
    if lw.k_norm is not None:
        k2 = kr.reshape(k * hp.n_head_kv, hp.head_dim)
        ops.rmsnorm(k2, lw.k_norm, hp.rms_eps, k2)
    cos, sin = rope
    neox = hp.rope_type == "neox"
    ops.rope(q, positions, cos, sin, neox)
    ops.rope(kr, positions, cos, sin, neox)
    cache.store(layer, kr, vr, positions)
    a = ws.attn[:k]
    cache.attend(layer, q, limits, hp.attention_scale, a)
    o = ws.proj[:k]
    lw.wo.matmul(a.reshape(k, hp.n_q), o)
    if lw.bo is not None:
        ops.add_bias(o, lw.bo)
    ops.add_into(x, o)


class Transformer:
    """A llama / qwen3 model: weights, rope tables, a workspace, and its KV cache."""

    def __init__(self, hp: HParams, weights: ModelWeights, *, n_ctx: int,
                 cache_type: str = "f32", chunk: int = DEFAULT_CHUNK, device: str = "cpu"):
        if n_ctx <= 0:
            raise ValueError(f"context size must be positive, got {n_ctx}")
        if not 1 <= chunk <= MAX_CHUNK:
            raise ValueError(f"chunk must be in 1..{MAX_CHUNK}, got {chunk}")
        self.hp = hp
        self.ops = ops = get_backend(device)
        self.n_ctx = n_ctx
        self.chunk = chunk
        freq_factors = weights.rope_freqs  # numpy, or on the device when weights were placed
        if freq_factors is not None and not isinstance(freq_factors, np.ndarray):
            freq_factors = ops.to_host(freq_factors)
        cos, sin = kernels.rope_tables(
            n_ctx, hp.n_rot, hp.rope_freq_base, freq_scale=hp.rope_freq_scale,
            freq_factors=freq_factors, yarn=hp.yarn)
        self.rope = (ops.asarray(cos), ops.asarray(sin))
        self.weights = ops.place_weights(weights)  # weights placed before stay where they are
        self.ws = Workspace(hp, chunk, ops)
        self.cache_type = cache_type
        self.cache = self.new_cache()
        self.single_thread = one_thread_for(max(lin.nbytes for lin in weights.linears()),
                                            numba.get_num_threads() * _local_ranks(),
                                            _load_average(), _cpus())

    @contextmanager
    def threads(self, rows: int = 1):
        """The thread count for this model's kernels on batches of ``rows`` rows: one for a
        small model's short batches, else as set."""
        if not self.single_thread or rows >= SINGLE_THREAD_BELOW_ROWS:
            yield
            return
        n = numba.get_num_threads()
        numba.set_num_threads(1)
        try:
            yield
        finally:
            numba.set_num_threads(n)

    @property
    def layer_hp(self) -> HParams:
        """The hyper-parameters the decoder layers run with: the model's (a tensor-parallel
        shard narrows its heads and FFN rows: ds4tools.tp)."""
        return self.hp

    def new_cache(self, n_ctx: int | None = None, n_layer: int | None = None) -> KVCache:
        """A cache shaped for this model (``n_layer`` other than the model's: for a drafter's
        own layers); at most the model's context, which the rope tables cover."""
        hp = self.hp
        n_ctx = n_ctx or self.n_ctx
        if n_ctx > self.n_ctx:
            raise ValueError(f"a cache of {n_ctx} positions exceeds the model's context of {self.n_ctx}")
        return self.ops.kv_cache(n_layer or hp.n_layer, hp.n_head_kv, n_ctx, hp.head_dim,
                                 self.cache_type)

    # --- the NextN (MTP) layer, for the MTP drafter (speculative/mtp.py) ---------------------

    #: whether ds4's MTP layout (mtp.0.*: one dense llama / qwen3 layer) fits this model
    dense_mtp_heads = True

    def load_nextn_layer(self, tensors: dict, block: int, int8: str) -> LayerWeights:
        """The decoder-layer weights of NextN block ``block`` (``blk.{block}.*``) in this
        architecture's layout; raises WeightsError."""
        return load_layer(tensors, f"blk.{block}.", self.hp, int8)

    def nextn_layer(self, layer: LayerWeights) -> "NextNLayer":
        """The runnable NextN layer (``cache``, ``forward``) over ``layer``'s weights."""
        return NextNLayer(self, layer)

    def mtp_head(self, weights):
        """The runnable MTP head (``cache``, ``hidden_width``, ``run``, ``head``) over
        ``weights`` (speculative.mtp.MtpHeadWeights): the NextN layer over one hidden row. An
        architecture whose MTP layer reads something else (deepseek4: hyper-connection
        streams) returns its own."""
        from .speculative.mtp import MtpHead
        return MtpHead(self, weights)

    def load_ds4_mtp_head(self, sf, int8: str):
        """MtpHeadWeights from ds4's MTP support file ``sf`` when this architecture has its
        own ds4 layout (deepseek4); None: the file is ds4's dense layout (one llama / qwen3
        layer), which the drafter's loader reads."""
        return None

    def load_ds4_dspark(self, sf, int8: str):
        """DSparkWeights from a DSpark support file in ds4's layout when this architecture has
        one (deepseek4); None: no ds4-layout draft runs on this architecture."""
        return None

    def embed(self, tokens) -> np.ndarray:
        """Token embeddings (k, n_embd) float32, on the model's device."""
        return self.weights.token_embd.rows(tokens)

    def output(self, x):
        """Final norm and logits of rows x (k, n_embd, on the device): returns (normed,
        logits), numpy."""
        k = x.shape[0]
        ops = self.ops
        normed = ops.empty(x.shape)
        ops.rmsnorm(x, self.weights.output_norm, self.hp.rms_eps, normed)
        out = ops.empty((k, self.hp.n_vocab))
        self.weights.output.matmul(normed, out)
        normed, out = ops.to_host(normed), ops.to_host(out)
        if not np.isfinite(out).all():
            raise NonFiniteLogits("the forward produced non-finite logits (NaN or Inf): the weights "
                                  "are corrupt or overflow float32")
        return normed, out

    def forward(self, tokens, start_pos: int, *, hidden_layers=(), want_final_hidden: bool = False,
                logits: str = "all", cache: KVCache | None = None) -> ForwardResult:
        """Run tokens (k,) at positions start_pos.. through the model.

        Writes K/V for those positions and sets the cache length to start_pos + k (start_pos
        may be below the length: the rows are overwritten, an implicit truncate). Returns
        logits for every row ("all"), only the last ("last") or none ("none"), the raw
        outputs of ``hidden_layers`` and, if asked, the final normed hidden state."""
        cache = self.cache if cache is None else cache
        tokens = np.ascontiguousarray(np.asarray(tokens, np.int64).reshape(-1))
        k = tokens.shape[0]
        if k == 0:
            raise ValueError("forward needs at least one token")
        if logits not in ("all", "last", "none"):
            raise ValueError(f"logits must be 'all', 'last' or 'none', got {logits!r}")
        if not 0 <= start_pos <= cache.length:
            raise ValueError(f"start position {start_pos} is past the cache length {cache.length}")
        if start_pos + k > cache.n_ctx:
            raise ValueError(f"{start_pos + k} positions do not fit the context of {cache.n_ctx}")
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= self.hp.n_vocab:
            raise ValueError(f"token id {lo if lo < 0 else hi} outside the vocabulary "
                             f"(0..{self.hp.n_vocab - 1})")
        hidden_layers = tuple(sorted(set(int(i) for i in hidden_layers)))
        for i in hidden_layers:
            if not 0 <= i < self.hp.n_layer:
                raise ValueError(f"hidden layer {i} outside 0..{self.hp.n_layer - 1}")

        with self.threads(min(k, self.chunk)):
            return self._forward(tokens, start_pos, hidden_layers, want_final_hidden, logits, cache)

    def _forward(self, tokens, start_pos, hidden_layers, want_final_hidden, logits, cache):
        k = tokens.shape[0]
        want_rows = logits == "all" or want_final_hidden
        hidden = {i: [] for i in hidden_layers}
        finals, logit_rows = [], []
        cache.length = start_pos  # rows at and above start_pos are rewritten now
        for c0 in range(0, k, self.chunk):
            c1 = min(k, c0 + self.chunk)
            x = self.embed(tokens[c0:c1])
            positions = np.arange(start_pos + c0, start_pos + c1, dtype=np.int64)
            self.run_layers(x, positions, positions + 1, cache, hidden)
            cache.length = start_pos + c1
            last_chunk = c1 == k
            if want_rows:
                normed, lg = self.output(x) if logits == "all" else (self._norm(x), None)
                finals.append(normed)
                if lg is not None:
                    logit_rows.append(lg)
            if logits == "last" and last_chunk:
                logit_rows.append(self.output(x[-1:])[1])
        result = ForwardResult(None, {i: np.concatenate(v) for i, v in hidden.items()})
        if logit_rows:
            result.logits = logit_rows[0] if len(logit_rows) == 1 else np.concatenate(logit_rows)
        if want_final_hidden:
            result.final_hidden = finals[0] if len(finals) == 1 else np.concatenate(finals)
        return result

    def run_layers(self, x: np.ndarray, positions: np.ndarray, limits: np.ndarray,
                   cache: KVCache, hidden: dict | None = None, layers=None) -> None:
        """All decoder layers (or ``layers``, an iterable of indices) on x (k <= chunk rows),
        in place; copies of the raw outputs of the layers in ``hidden`` are appended there."""
        # The kernels do not check bounds: everything they index is checked here, once.
        positions = np.ascontiguousarray(positions, np.int64)
        limits = np.ascontiguousarray(limits, np.int64)
        k = x.shape[0]
        if k > self.ws.rows:
            raise ValueError(f"{k} rows exceed the workspace of {self.ws.rows}")
        if x.shape != (k, self.hp.n_embd) or x.dtype != np.float32 or not self.ops.is_c_contiguous(x):
            raise ValueError(f"x must be C-contiguous float32 of shape (k, {self.hp.n_embd})")
        if positions.shape != (k,) or limits.shape != (k,):
            raise ValueError("positions and limits need one entry per row")
        hp = self.layer_hp
        if cache.k.shape[1:] != (hp.n_head_kv, cache.n_ctx, hp.head_dim):
            raise ValueError("the cache does not fit this model's attention shape")
        if k and (positions.min() < 0 or positions.max() >= min(cache.n_ctx, self.rope[0].shape[0])
                  or limits.min() < 1 or limits.max() > cache.n_ctx):
            raise ValueError(f"positions must lie in [0, {cache.n_ctx}) and limits in [1, {cache.n_ctx}]")
        layers = range(self.hp.n_layer) if layers is None else tuple(layers)
        for il in layers:
            if not 0 <= il < cache.n_layer:
                raise ValueError(f"layer {il} has no slot in a cache of {cache.n_layer} layers")
        positions, limits = self.ops.asarray(positions), self.ops.asarray(limits)
        for il in layers:
            layer_forward(x, self.weights.layers[il], hp, cache, il, positions, limits,
                          self.rope, self.ws)
            if hidden is not None and il in hidden:
                hidden[il].append(self.ops.host_copy(x))

    def _norm(self, x) -> np.ndarray:
        normed = self.ops.empty(x.shape)
        self.ops.rmsnorm(x, self.weights.output_norm, self.hp.rms_eps, normed)
        return self.ops.to_host(normed)


class NextNLayer:
    """A decoder layer run as an MTP head's layer: ``layer_forward`` at slot 0 of a one-layer
    cache of its own, with a workspace of its own."""

    def __init__(self, model: Transformer, layer: LayerWeights):
        self.model = model
        self.layer = layer
        self.cache = model.new_cache(n_layer=1)
        self.ws = Workspace(model.hp, model.chunk, model.ops)

    def forward(self, x: np.ndarray, positions: np.ndarray, limits: np.ndarray) -> None:
        """x (k <= chunk rows, n_embd) through the layer, in place; writes the cache rows at
        ``positions``."""
        m = self.model
        positions, limits = m.ops.asarray(positions), m.ops.asarray(limits)
        layer_forward(x, self.layer, m.hp, self.cache, 0, positions, limits, m.rope, self.ws)
