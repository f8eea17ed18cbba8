"""Attention and swiglu kernels against their previous versions, same run.

Attention: a chunk of k query rows (causal: row t sees keys [0, n_ctx - k + t + 1)) against
a float32 cache of n_ctx keys, 16 query heads over 8 kv heads, head_dim 64 (the 350M qwen3).
swiglu: 512 x 2816 in place, as the decoder calls it. Times are the best of --repeat runs,
old and new interleaved so both see the same machine load.

    python benchmarks/bench_attention.py                  # 1 and 2 threads
    python benchmarks/bench_attention.py --threads 1 --repeat 20
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numba
import numpy as np
from numba import njit

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ds4tools.engine import kernels  # noqa: E402
from ds4tools.engine.kernels import exp_f32  # noqa: E402


# --- the previous kernels -----------------------------------------------------------------
# The previous attention (three passes per (row, head), a horizontal sum per key) still lives in
# kernels.py as the fallback for head dims that are no multiple of 16: kernels._attention_scalar.
# The previous swiglu (serial, scalar in place) is kept here.

@njit(cache=True, fastmath=True, error_model="numpy")
def old_swiglu(gate, up, out):
    for t in range(gate.shape[0]):
        for i in range(gate.shape[1]):
            g = gate[t, i]
            out[t, i] = g / (np.float32(1.0) + exp_f32(-g)) * up[t, i]


def _best(fns, repeat, setup=lambda: None):
    """Best wall time of each callable (setup() untimed before each call), calls interleaved."""
    for f in fns.values():
        setup()
        f()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeat):
        for name, f in fns.items():
            setup()
            t0 = time.perf_counter()
            f()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 32, 512], help="query rows k")
    ap.add_argument("--n-ctx", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=10)
    args = ap.parse_args(argv)

    rng = np.random.default_rng(0)
    n_kv, n_head, hd, n_ctx = 8, 16, 64, args.n_ctx
    cache_k = rng.standard_normal((n_kv, n_ctx, hd)).astype(np.float32)
    cache_v = rng.standard_normal((n_kv, n_ctx, hd)).astype(np.float32)
    scale = np.float32(hd ** -0.5)
    gate0 = (2 * rng.standard_normal((512, 2816))).astype(np.float32)
    up = rng.standard_normal((512, 2816)).astype(np.float32)
    gate = gate0.copy()

    for n in args.threads:
        numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
        print(f"# {numba.get_num_threads()} thread(s)")
        for k in (k for k in args.rows if k <= n_ctx):
            q = rng.standard_normal((k, n_head, hd)).astype(np.float32)
            limits = np.arange(n_ctx - k + 1, n_ctx + 1, dtype=np.int64)
            out = np.empty_like(q)
            best = _best({
                "old": lambda: kernels._attention_scalar(q, cache_k, cache_v, limits, scale, out),
                "new": lambda: kernels.attention_f32(q, cache_k, cache_v, limits, scale, out),
            }, args.repeat)
            pairs = int(limits.sum()) * n_head
            print(f"attention k={k:<4d} keys<={n_ctx}: old {best['old'] * 1e3:7.3f} ms  "
                  f"new {best['new'] * 1e3:7.3f} ms  ({best['new'] / pairs * 1e9:.2f} ns per "
                  f"query-key pair)  new/old {best['new'] / best['old']:.3f}")
        best = _best({  # in place, as the decoder calls it
            "old": lambda: old_swiglu(gate, up, gate),
            "new": lambda: kernels.swiglu(gate, up, gate),
        }, args.repeat, setup=lambda: np.copyto(gate, gate0))
        print(f"swiglu 512x2816 in place: old {best['old'] * 1e3:7.3f} ms  "
              f"new {best['new'] * 1e3:7.3f} ms  new/old {best['new'] / best['old']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
