"""Multi-head latent attention (MLA, DeepSeek V2/V3), in llama.cpp's "absorbed" form, and the
latent cache it reads.

    q      = h Wq                     or  rmsnorm(h Wq_a) Wq_b          (the low-rank q path)
    q      = [q_nope | q_pe] per head  (n_nope + n_rot dimensions)
    kv     = h Wkv_a                  = [c | k_pe]   (kv_lora_rank + n_rot, shared by all heads)
    c      = rmsnorm(c) ; k_pe = rope(k_pe) ; q_pe = rope(q_pe)
    cache[pos] = [c | k_pe]           the latent: one row of kv_lora_rank + n_rot per position
    q_abs  = Wk_b[h] q_nope           (per head: n_nope -> kv_lora_rank)
    a      = softmax(scale * [q_abs | q_pe] . cache rows) @ c rows        per head
    out    = (Wv_b[h] a for each head) Wo                                   (kv_lora_rank -> n_v)

The cache (latent_cache.py) holds the latent, never expanded keys and values, so a position
costs kv_lora_rank + n_rot floats per layer whatever the head count.

The per-head projections Wk_b and Wv_b are 3-D tensors (n_head, n_out, n_in); they multiply
through the grouped matmul of the mixture-of-experts block with the head as the "expert", one
(row, head) pair per input row, so a row's bits never depend on the batch; one compiled call
for all heads (Wk_b's rows of n_nope are Q5_0 / Q8_0 in llama.cpp's mixes and take the float32
path: its grouped kernel replaced a Python loop over the heads that cost a third of a step).

The block is written against a backend's operations (``ws.ops``: backends/), so the same code
runs on the CPU and on CUDA. Shared by the architectures with MLA attention (deepseek2; glm-dsa
adds its indexer on top).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import formats
from .backends.cpu import CPU
from .latent_cache import LatentCache, LatentSnapshot  # noqa: F401  (the cache of this block)
from .moe import ExpertMatrices
from .weights import Linear, SharedInput, WeightsError, _linear, _tensor, _vector, int8_for


@dataclass(frozen=True)
class MLAShape:
    n_head: int
    n_lora_q: int       # 0: q comes from one matrix (DeepSeek V2-Lite)
    n_lora_kv: int      # the latent width (kv_lora_rank)
    n_nope: int         # per-head query/key dimensions without rope
    n_rot: int          # per-head rope dimensions (and the shared k_pe's)
    n_v: int            # per-head value width after Wv_b

    @property
    def n_k(self) -> int:
        """A head's query/key length as the model defines it (n_nope + n_rot)."""
        return self.n_nope + self.n_rot

    @property
    def n_latent(self) -> int:
        """A cache row: the compressed vector and the rope key part."""
        return self.n_lora_kv + self.n_rot


# --- weights ------------------------------------------------------------------------------------


@dataclass
class MLAWeights:
    attn_norm: np.ndarray
    wkv_a: Linear                     # attn_kv_a_mqa (n_lora_kv + n_rot, n_embd)
    kv_a_norm: np.ndarray             # (n_lora_kv,)
    wk_b: ExpertMatrices              # attn_k_b (n_head, n_lora_kv, n_nope)
    wv_b: ExpertMatrices              # attn_v_b (n_head, n_v, n_lora_kv)
    wo: Linear                        # attn_output (n_embd, n_head * n_v)
    wq: Linear | None = None          # attn_q, or
    wq_a: Linear | None = None        # attn_q_a (n_lora_q, n_embd)
    q_a_norm: np.ndarray | None = None
    wq_b: Linear | None = None        # attn_q_b (n_head * n_k, n_lora_q)

    def linears(self) -> list:
        q = [self.wq] if self.wq is not None else [self.wq_a, self.wq_b]
        return q + [self.wkv_a, self.wk_b, self.wv_b, self.wo]


def _per_head(tensors: dict, name: str, n_head: int, n_out: int, n_in: int, int8: str) -> ExpertMatrices:
    t = _tensor(tensors, name, (n_head, n_out, n_in))
    fmt = formats.format_for_type(t.ggml_type)
    if n_in % fmt.block_size:
        raise WeightsError(f"tensor {name}: row length {n_in} is not a multiple of "
                           f"{fmt.name}'s block size {fmt.block_size}")
    return ExpertMatrices(name, np.asarray(t.raw()), fmt, n_head, n_out, n_in,
                          int8=int8_for(fmt, int8, n_in))


def load_mla(tensors: dict, prefix: str, s: MLAShape, n_embd: int, int8: str) -> MLAWeights:
    """One layer's attention from llama.cpp's tensor names under ``prefix`` (``blk.N.``)."""
    p, H = prefix, n_embd
    q = {}
    if s.n_lora_q:
        q = dict(wq_a=_linear(tensors, p + "attn_q_a.weight", s.n_lora_q, H, int8),
                 q_a_norm=_vector(tensors, p + "attn_q_a_norm.weight", s.n_lora_q),
                 wq_b=_linear(tensors, p + "attn_q_b.weight", s.n_head * s.n_k, s.n_lora_q, int8))
    else:
        q = dict(wq=_linear(tensors, p + "attn_q.weight", s.n_head * s.n_k, H, int8))
    return MLAWeights(
        attn_norm=_vector(tensors, p + "attn_norm.weight", H),
        wkv_a=_linear(tensors, p + "attn_kv_a_mqa.weight", s.n_latent, H, int8),
        kv_a_norm=_vector(tensors, p + "attn_kv_a_norm.weight", s.n_lora_kv),
        wk_b=_per_head(tensors, p + "attn_k_b.weight", s.n_head, s.n_lora_kv, s.n_nope, int8),
        wv_b=_per_head(tensors, p + "attn_v_b.weight", s.n_head, s.n_v, s.n_lora_kv, int8),
        wo=_linear(tensors, p + "attn_output.weight", H, s.n_head * s.n_v, int8),
        **q)


MLA_TENSORS = ("attn_norm.weight", "attn_q.weight", "attn_q_a.weight", "attn_q_a_norm.weight",
               "attn_q_b.weight", "attn_kv_a_mqa.weight", "attn_kv_a_norm.weight",
               "attn_k_b.weight", "attn_v_b.weight", "attn_output.weight")


# --- the attention block ------------------------------------------------------------------------


class MLAWorkspace:
    """The block's activation buffers for up to ``rows`` rows on the device of backend ``ops``
    (see transformer.Workspace)."""

    def __init__(self, s: MLAShape, n_embd: int, rows: int, ops=CPU):
        self.ops = ops
        self.norm = ops.empty((rows, n_embd))
        self.q_a = ops.empty((rows, max(s.n_lora_q, 1)))
        self.q = ops.empty((rows, s.n_head, s.n_k))
        self.q_nope = ops.empty((rows, s.n_head, s.n_nope))
        self.q_abs = ops.empty((rows, s.n_head, s.n_lora_kv))
        self.q_cat = ops.empty((rows, s.n_head, s.n_latent))
        self.latent = ops.empty((rows, s.n_latent))
        self.ctx = ops.empty((rows, s.n_head, s.n_lora_kv))
        self.v = ops.empty((rows, s.n_head, s.n_v))
        self.proj = ops.empty((rows, n_embd))
        #: row t * n_head + h multiplies with head h's matrix (on the host, and once on the device)
        self.head_ids = np.tile(np.arange(s.n_head, dtype=np.int64), rows).reshape(rows * s.n_head, 1)
        self.device_head_ids = ops.asarray(self.head_ids.reshape(-1))


def mla_attention_block(x, w: MLAWeights, s: MLAShape, rms_eps: float, kq_scale: float,
                        cache: LatentCache, layer: int, positions, limits, rope: tuple,
                        ws: MLAWorkspace, select=None) -> None:
    """x (k, n_embd) += the attention half of an MLA decoder layer, in place. Writes the layer's
    latent rows at ``positions``; query row t attends to cache rows [0, limits[t]). ``rope``:
    (cos, sin) tables over n_rot ("norm" pairs, as llama.cpp's deepseek2). ``select``: None, or
    a sparse attention's chooser (glm-dsa's indexer), called as select(h, q_a) with the normed
    input (a SharedInput) and the normed low-rank query; it returns the positions each row
    attends to (see LatentCache.attend). Arrays are on the device of ``ws.ops``."""
    ops = ws.ops
    k = x.shape[0]
    kh = k * s.n_head
    h = ws.norm[:k]
    ops.rmsnorm(x, w.attn_norm, rms_eps, h)
    hs = SharedInput(h)  # quantized once for the q and kv projections
    q = ws.q[:k]
    if w.wq is not None:
        w.wq.matmul(hs, q.reshape(k, s.n_head * s.n_k))
    else:
        qa = ws.q_a[:k]
        w.wq_a.matmul(hs, qa)
        ops.rmsnorm(qa, w.q_a_norm, rms_eps, qa)
        w.wq_b.matmul(qa, q.reshape(k, s.n_head * s.n_k))
    if select is not None:
        if w.wq is not None:
            raise ValueError("a sparse attention's chooser needs the low-rank query path")
        selected = select(hs, qa)
    latent = ws.latent[:k]
    w.wkv_a.matmul(hs, latent)
    c = latent[:, :s.n_lora_kv]
    ops.rmsnorm(c, w.kv_a_norm, rms_eps, c)
    cos, sin = rope
    ops.rope(latent.reshape(k, 1, s.n_latent)[:, :, s.n_lora_kv:], positions, cos, sin, False)
    cache.store(layer, latent, positions)

    # the query in latent space: [Wk_b q_nope | rope(q_pe)]
    q_nope = ws.q_nope[:k]
    ops.copy_into(q_nope, q[:, :, :s.n_nope])
    q_abs = ws.q_abs[:k]
    ids, device_ids = ws.head_ids[:kh], ws.device_head_ids[:kh]
    w.wk_b.matmul(q_nope.reshape(kh, s.n_nope), ids, q_abs.reshape(kh, 1, s.n_lora_kv),
                  device_ids=device_ids)
    q_cat = ws.q_cat[:k]
    ops.copy_into(q_cat[:, :, :s.n_lora_kv], q_abs)
    ops.copy_into(q_cat[:, :, s.n_lora_kv:], q[:, :, s.n_nope:])
    ops.rope(q_cat[:, :, s.n_lora_kv:], positions, cos, sin, False)

    ctx = ws.ctx[:k]
    if select is None:
        cache.attend(layer, q_cat, limits, kq_scale, ctx)
    else:
        cache.attend(layer, q_cat, limits, kq_scale, ctx, selected)
    v = ws.v[:k]
    w.wv_b.matmul(ctx.reshape(kh, s.n_lora_kv), ids, v.reshape(kh, 1, s.n_v),
                  device_ids=device_ids)
    o = ws.proj[:k]
    w.wo.matmul(v.reshape(k, s.n_head * s.n_v), o)
    ops.add_into(x, o)
