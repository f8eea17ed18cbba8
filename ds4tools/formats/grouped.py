"""Grouped matmul for mixture-of-experts: a 3-D expert tensor applied to the rows routed to it.

GGUF stores a MoE layer's experts as one 3-D tensor (``ffn_gate_exps``, ``ffn_up_exps``,
``ffn_down_exps``): raw bytes ``(n_expert, n_out, row_bytes)``. A forward pass routes each of its
``k`` rows (tokens) to ``n_used`` experts; ``grouped_matmul`` computes, for every row ``t`` and
slot ``j``, ``x[t] @ W[expert_ids[t, j]].T`` in one call:

* the activations are quantized once (int8 path) for all experts, or can be passed in already
  quantized (``act``), so gate and up share them;
* each expert that some row uses is read once: all its routed rows go through the format's
  multi-row kernel together (``_cpu_matmul_q8`` / ``_cpu_matmul``); experts no row uses are
  never touched (a memory-mapped tensor's pages for them are not even faulted in);
* a row's result is bit-identical to a plain ``formats.matmul`` of that row with that expert's
  matrix in the same mode: the kernels give the same bits for a row whatever rows share the
  call, and activation rows are quantized independently. So a token's output does not depend on
  which other tokens share its batch or its experts.

The loop over the *used* experts is a Python loop of compiled multi-row calls. Measured (2
cores, busy machine, tiny 32x256 experts so the kernels cost nothing): about 5 us of Python
routing per used expert at k=1 (10 us at k=16, where rows are gathered and scattered) plus
3-5 us per kernel dispatch; next to reading one real expert (a 1408x2048 Q4_K matrix is 1.6 MB,
~200-300 us) that is a few percent.
"""
from __future__ import annotations

import numpy as np

from .activations import QuantizedActivations, quantize_activations
from .base import QuantFormat


def _get_format(fmt) -> QuantFormat:
    from . import get_format  # the package's lookup; imported here to avoid an import cycle
    return get_format(fmt)


_ZERO = np.zeros(1, np.int64)


def route(expert_ids: np.ndarray, n_expert: int):
    """Group (row, slot) pairs by expert: yields (expert, rows, slots, unique_rows, inverse)
    for every used expert in increasing order, where rows[i], slots[i] is a pair routed to
    the expert, unique_rows the distinct rows (sorted) and unique_rows[inverse] == rows."""
    k, n_used = expert_ids.shape
    flat = expert_ids.ravel()
    order = np.argsort(flat, kind="stable")
    es = flat[order]
    starts = np.flatnonzero(np.r_[True, es[1:] != es[:-1]]) if es.size else np.zeros(0, np.int64)
    ends = np.r_[starts[1:], es.size]
    for s, e in zip(starts.tolist(), ends.tolist()):
        sel = order[s:e]  # increasing: the rows come sorted
        rows = sel // n_used
        slots = sel - rows * n_used
        if e - s == 1:
            yield int(es[s]), rows, slots, rows, _ZERO
            continue
        new_row = np.empty(e - s, np.bool_)
        new_row[0] = True
        np.not_equal(rows[1:], rows[:-1], out=new_row[1:])
        inv = np.cumsum(new_row) - 1
        yield int(es[s]), rows, slots, rows[new_row], inv


def _subset(act: QuantizedActivations, rows: np.ndarray, k: int) -> QuantizedActivations:
    if rows.size == k:  # every row (rows are distinct and sorted): no copy
        return act
    return QuantizedActivations(act.kind, act.q[rows], act.d[rows], act.sums[rows])


def grouped_matmul(raw3d, fmt, n_out: int, n_in: int, x, expert_ids, out=None, int8: bool = True,
                   act: QuantizedActivations | None = None) -> np.ndarray:
    """out[t, j] = x[t] @ W[expert_ids[t, j]].T for the experts of a 3-D tensor.

    ``raw3d``: uint8 ``(n_expert, n_out, row_bytes)`` raw GGUF blocks of ``fmt`` (any array
    that reshapes to that without a copy, e.g. a memmap); ``x``: float32 ``(k, n_in)``;
    ``expert_ids``: integers ``(k, n_used)`` in ``[0, n_expert)`` (a row may name an expert in
    more than one slot); ``out``: float32 ``(k, n_used, n_out)`` C-contiguous, or None.
    ``int8``: ggml's int8-activation path where the format has one, else the float32 path
    (as ``formats.matmul``). ``act``: x already quantized to the format's ``act_type`` (int8
    path only), to share one quantization between matrices that read the same input.
    """
    f = _get_format(fmt)
    n_out, n_in = int(n_out), int(n_in)
    if n_in <= 0 or n_out <= 0 or n_in % f.block_size:
        raise ValueError(f"bad matrix shape ({n_out}, {n_in}) for {f.name} (block {f.block_size})")
    row_bytes = f.row_bytes(n_in)
    r = np.asarray(raw3d)
    if r.dtype != np.uint8:
        raise ValueError(f"raw3d must be uint8 bytes, got dtype {r.dtype}")
    per_expert = n_out * row_bytes
    if r.size % per_expert or r.size == 0:
        raise ValueError(f"raw3d has {r.size} bytes, not a whole number of {f.name} "
                         f"({n_out}, {n_in}) matrices ({per_expert} bytes each)")
    if not r.flags.c_contiguous:
        raise ValueError("raw3d must be C-contiguous (copying it would read every expert)")
    n_expert = r.size // per_expert
    r = r.reshape(n_expert, n_out, row_bytes)

    xa = np.asarray(x)
    if xa.dtype.kind != "f" or xa.ndim != 2 or xa.shape[1] != n_in:
        raise ValueError(f"x must be floating point of shape (k, {n_in}), got {xa.dtype} {xa.shape}")
    xa = np.ascontiguousarray(xa, dtype=np.float32)
    k = xa.shape[0]
    ids = np.asarray(expert_ids)
    if ids.dtype.kind not in "iu" or ids.ndim != 2 or ids.shape[0] != k:
        raise ValueError(f"expert_ids must be integers of shape ({k}, n_used), got {ids.dtype} {ids.shape}")
    ids = ids.astype(np.int64, copy=False)
    if ids.size and (ids.min() < 0 or ids.max() >= n_expert):
        raise ValueError(f"expert_ids must lie in [0, {n_expert}), got {ids.min()}..{ids.max()}")
    n_used = ids.shape[1]
    if out is None:
        out = np.empty((k, n_used, n_out), np.float32)
    elif (not isinstance(out, np.ndarray) or out.shape != (k, n_used, n_out)
          or out.dtype != np.float32 or not out.flags.c_contiguous):
        raise ValueError(f"out must be C-contiguous float32 of shape {(k, n_used, n_out)}")

    use_int8 = int8 and f.has_int8_matmul
    if use_int8:
        if act is None:
            act = quantize_activations(xa, f.act_type)
        elif act.kind != f.act_type or act.q.shape != (k, n_in):
            raise ValueError(f"act must be {f.act_type} activations of shape ({k}, {n_in})")
    for e, rows, slots, uniq, inv in route(ids, n_expert):
        tmp = np.empty((uniq.size, n_out), np.float32)
        if use_int8:
            f._cpu_matmul_q8(r[e], _subset(act, uniq, k), tmp)
        else:
            f._cpu_matmul(r[e], xa if uniq.size == k else xa[uniq], tmp)
        if rows.size == 1:
            out[rows[0], slots[0]] = tmp[0]
        else:
            out[rows, slots] = tmp[inv]
    return out
