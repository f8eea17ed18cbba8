"""Throughput of every registered format: quantize, dequantize and the fused matrix-vector product.

For each format and matrix size it prints, measured in this process (best of --repeat):

* quantize and dequantize in GB/s of float32 (rows * n * 4 bytes), ours against gguf.quants
  (where gguf-py has the operation) and against ggml's own quantizer (ggml-python's
  ggml_quantize_chunk with the rows split over 2 Python threads; ctypes drops the GIL);
* a matrix-vector product (one token): our fused kernel, and the int8-activation path where the
  format has one, against numpy's float32 BLAS on the already dequantized matrix, and the GB/s
  of weight bytes each reads next to a numpy memory copy measured at the start of the run
  (a buffer four times the last-level cache, so it comes from memory); the mat-vec is timed
  twice: on one matrix called again and again (from cache where it fits) and cycling through
  copies of it that together fill twice the last-level cache (from memory, as a decoding step
  reads a model larger than the cache); then the verify cost r(k) = time(k rows) / time(1 row)
  of the int8 path for k = 2, 4, 8, 16;
* llama.cpp's mat-vec on the same matrix, timed the same two ways: ggml_mul_mat on ggml's
  CPU backend with as many threads as numba's (ggml_matvec.py; the libggml of
  llama-cpp-python, else of ggml-python, or of any llama.cpp build with ``--llama-lib DIR``),
  with the largest difference of its result from ours (relative to ours).

``--matvec-only`` skips the quantize / dequantize baselines (ggml, gguf-py).

Ratios are "times faster than the baseline" (> 1 means we are faster).

    python benchmarks/bench_formats.py                      # all formats, 4096x4096 and 4096x14336
    python benchmarks/bench_formats.py --formats Q4_K,IQ2_XXS --sizes 4096x4096 --repeat 5
    python benchmarks/bench_formats.py --quick              # small sizes, a smoke run
    python benchmarks/bench_formats.py --sizes 4096x14336 --matvec-only
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys
import threading
import time

import numpy as np

try:
    from ds4tools import formats
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from ds4tools import formats
if os.path.dirname(os.path.abspath(__file__)) not in sys.path:  # ggml_matvec, beside this file
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

DEFAULT_SIZES = "4096x4096,4096x14336"
QUICK_SIZES = "256x1024"
GGML_THREADS = 2


def parse_sizes(text: str) -> list[tuple[int, int]]:
    sizes = []
    for part in text.split(","):
        try:
            rows, n = (int(v) for v in part.lower().split("x"))
        except ValueError:
            raise SystemExit(f"bad size {part!r}: use ROWSxCOLS, e.g. 4096x4096") from None
        if rows <= 0 or n <= 0:
            raise SystemExit(f"bad size {part!r}: both sides must be positive")
        sizes.append((rows, n))
    return sizes


def best_time(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


# --- baselines ------------------------------------------------------------------------------

def _load_ggml():
    try:
        import ggml  # ggml-python: the `test` extra
        return ggml
    except Exception:
        return None


def ggml_quantize_threads(ggml, x: np.ndarray, name: str, imatrix, threads: int) -> np.ndarray:
    """ggml_quantize_chunk over row ranges in `threads` Python threads."""
    rows, n = x.shape
    t = getattr(ggml, "GGML_TYPE_" + name)
    ggml.ggml_quantize_init(t)  # builds IQ tables once, before the threads start
    out = np.empty((rows, ggml.ggml_row_size(t, n)), np.uint8)
    fptr = ctypes.POINTER(ctypes.c_float)
    src = x.ctypes.data_as(fptr)
    dst = out.ctypes.data_as(ctypes.c_void_p)
    w = None if imatrix is None else imatrix.ctypes.data_as(fptr)
    bounds = np.linspace(0, rows, threads + 1).astype(int)

    def work(r0, r1):
        if r1 > r0:
            ggml.ggml_quantize_chunk(t, src, dst, int(r0) * n, int(r1 - r0), n, w)

    pool = [threading.Thread(target=work, args=(bounds[i], bounds[i + 1])) for i in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    return out


def gguf_py_op(name: str, op: str):
    """gguf.quants' quantize / dequantize for this type, or None where gguf-py lacks it."""
    qtype = GGMLQuantizationType[name]
    probe_rows = np.zeros((1, max(formats.FORMATS[name].block_size, 256)), np.float32)
    try:
        if op == "quantize":
            if np.shares_memory(gguf_quants.quantize(probe_rows, qtype), probe_rows):
                return None  # F32: gguf-py hands the input back, there is nothing to time
            return lambda a, imatrix=None: gguf_quants.quantize(a, qtype)
        raw = formats.quantize(probe_rows, name, imatrix=np.ones(probe_rows.shape[1], np.float32))
        if np.shares_memory(gguf_quants.dequantize(raw, qtype), raw):
            return None
        return lambda raw: gguf_quants.dequantize(raw, qtype)
    except NotImplementedError:
        return None


# --- one format, one size -------------------------------------------------------------------

def _gbps(rows: int, n: int, seconds: float) -> float:
    return rows * n * 4 / seconds / 1e9


def _ratio(baseline: float | None, ours: float) -> str:
    return "   n/a" if baseline is None else f"{baseline / ours:6.2f}x"


def copies_beyond_cache(raw: np.ndarray, cache_bytes: int) -> list:
    """Copies of ``raw`` filling twice ``cache_bytes``: called one after another, each call
    reads its matrix from memory."""
    return [raw.copy() for _ in range(max(2, -(-2 * cache_bytes // raw.nbytes)))]


def matvec_from_memory(mats: list, name: str, shape, vec, int8: bool, repeat: int) -> float:
    """Seconds per mat-vec over the copies ``mats``, one after another."""
    def sweep():
        for m in mats:
            formats.matmul(m, name, shape, vec, int8=int8)

    return best_time(sweep, repeat) / len(mats)


def ggml_matvec_times(lib_dir: str, name: str, raw, mats: list, vec, repeat: int, threads: int):
    """(seconds in cache, seconds from memory or None, max |ggml - ours| / max |ours| or None):
    llama.cpp's mat-vec (ggml_matvec.GgmlMatvec) on ``raw`` called again and again, and
    cycling through ``mats``; None where ggml does not run this type here."""
    from ggml_matvec import GgmlMatvec
    try:
        g = GgmlMatvec(lib_dir, name, [raw] + mats, vec.shape[1], threads)
    except (OSError, AttributeError, KeyError, RuntimeError):
        return None
    try:
        g.set_input(vec)
        g.run_first()
        ours = formats.matmul(raw, name, (raw.shape[0], vec.shape[1]), vec)[0]
        err = float(np.abs(g.output(0) - ours).max() / max(np.abs(ours).max(), 1e-30))
        t_cache = best_time(g.run_first, max(3, 5 * repeat))
        t_mem = best_time(g.run_rest, repeat) / len(mats) if mats else None
        return t_cache, t_mem, err
    finally:
        g.close()


def bench_one(name: str, rows: int, n: int, repeat: int, ggml, rng, memcpy_gbps: float,
              matvec_only: bool = False, cache_bytes: int = 0,
              llama_lib: str | None = None) -> list[str]:
    f = formats.FORMATS[name]
    if n % f.block_size:
        return [f"{name:8s} {rows}x{n}: skipped (row length not a multiple of {f.block_size})"]
    x = rng.standard_normal((rows, n)).astype(np.float32)
    imatrix = (rng.random(n).astype(np.float32) + 0.05) if f.requires_imatrix else None
    warm = x[:2]
    formats.quantize(warm, name, imatrix=imatrix)  # compile (or load) the kernels first

    raw = None

    def ours_q():
        nonlocal raw
        raw = formats.quantize(x, name, imatrix=imatrix)

    tq = best_time(ours_q, 1 if matvec_only else repeat)
    gq = None if matvec_only else gguf_py_op(name, "quantize")
    tq_gguf = best_time(lambda: gq(x), repeat) if gq else None
    tq_ggml = None
    if ggml is not None and not matvec_only:
        ggml_quantize_threads(ggml, warm, name, imatrix, GGML_THREADS)
        tq_ggml = best_time(lambda: ggml_quantize_threads(ggml, x, name, imatrix, GGML_THREADS),
                            repeat)

    formats.dequantize(raw[:2], name, warm.shape)
    w_deq = None

    def ours_dq():
        nonlocal w_deq
        w_deq = formats.dequantize(raw, name, x.shape)

    tdq = best_time(ours_dq, 1 if matvec_only else repeat)
    gdq = None if matvec_only else gguf_py_op(name, "dequantize")
    tdq_gguf = best_time(lambda: gdq(raw), max(1, min(repeat, 2))) if gdq else None

    vec = rng.standard_normal((1, n)).astype(np.float32)
    formats.matmul(raw[:2], name, (2, n), vec)
    mv_repeat = max(3, 5 * repeat)
    t_mv = best_time(lambda: formats.matmul(raw, name, x.shape, vec), mv_repeat)
    t_mv8 = None
    if f.has_int8_matmul:
        formats.matmul(raw[:2], name, (2, n), vec, int8=True)
        t_mv8 = best_time(lambda: formats.matmul(raw, name, x.shape, vec, int8=True), mv_repeat)
    w_t = np.ascontiguousarray(w_deq)
    t_blas = best_time(lambda: vec @ w_t.T, mv_repeat)
    t_fast = t_mv8 if t_mv8 is not None else t_mv
    t_mem = copies = None
    mats = copies_beyond_cache(raw, cache_bytes) if cache_bytes else []
    if mats:
        copies = len(mats)
        t_mem = matvec_from_memory(mats, name, x.shape, vec, t_mv8 is not None, repeat)
    from numba import get_num_threads
    threads = get_num_threads()
    llama = (ggml_matvec_times(llama_lib, name, raw, mats, vec, repeat, threads)
             if llama_lib else None)
    del mats
    r_k = {}
    for k in (2, 4, 8, 16):
        xk = rng.standard_normal((k, n)).astype(np.float32)
        r_k[k] = best_time(lambda: formats.matmul(raw, name, x.shape, xk, int8=t_mv8 is not None),
                           mv_repeat) / t_fast

    lines = [
        f"{name:8s} {rows}x{n}  quantize {_gbps(rows, n, tq):7.3f} GB/s ({tq * 1e3:8.1f} ms)"
        f"  vs gguf.quants {_ratio(tq_gguf, tq)}  vs ggml {GGML_THREADS}-thread {_ratio(tq_ggml, tq)}"
        + (f" ({tq_ggml * 1e3:.1f} ms)" if tq_ggml else ""),
        f"{'':8s} {'':{len(f'{rows}x{n}')}}  dequantize {_gbps(rows, n, tdq):5.3f} GB/s ({tdq * 1e3:8.1f} ms)"
        f"  vs gguf.quants {_ratio(tdq_gguf, tdq)}",
        f"{'':8s} {'':{len(f'{rows}x{n}')}}  matvec fused {t_mv * 1e3:7.2f} ms"
        + (f", int8 {t_mv8 * 1e3:7.2f} ms" if t_mv8 is not None else "")
        + f"  vs numpy f32 BLAS on the dequantized matrix ({t_blas * 1e3:.2f} ms): fused {_ratio(t_blas, t_mv)}"
        + (f", int8 {_ratio(t_blas, t_mv8)}" if t_mv8 is not None else ""),
        f"{'':8s} {'':{len(f'{rows}x{n}')}}  matvec weights read at {raw.nbytes / t_fast / 1e9:6.2f} GB/s"
        f" = {raw.nbytes / t_fast / 1e9 / memcpy_gbps:4.2f} x memcpy ({'int8' if t_mv8 is not None else 'f32'});"
        + (f" from memory ({copies} copies cycled) {raw.nbytes / t_mem / 1e9:6.2f} GB/s"
           f" = {raw.nbytes / t_mem / 1e9 / memcpy_gbps:4.2f} x memcpy;" if t_mem else "")
        + "  r(k) " + " ".join(f"{k}:{v:.2f}" for k, v in r_k.items()),
    ]
    if llama is not None:
        lc, lm, err = llama
        lines.append(
            f"{'':8s} {'':{len(f'{rows}x{n}')}}  ggml_mul_mat ({threads} threads):"
            f" {raw.nbytes / lc / 1e9:6.2f} GB/s = {raw.nbytes / lc / 1e9 / memcpy_gbps:4.2f} x memcpy"
            + (f"; from memory {raw.nbytes / lm / 1e9:6.2f} GB/s"
               f" = {raw.nbytes / lm / 1e9 / memcpy_gbps:4.2f} x memcpy" if lm else "")
            + f";  ours vs ggml {_ratio(lc, t_fast)}"
            + (f", from memory {_ratio(lm, t_mem)}" if lm and t_mem else "")
            + f"  (max |difference| / max |y| {err:.1e})")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--formats", default=None,
                   help="comma-separated format names (default: every registered format)")
    p.add_argument("--sizes", default=None, help=f"ROWSxCOLS list (default {DEFAULT_SIZES})")
    p.add_argument("--repeat", type=int, default=3, help="take the best of this many runs")
    p.add_argument("--quick", action="store_true",
                   help=f"small sizes ({QUICK_SIZES}) and one run: a smoke test")
    p.add_argument("--cache-mib", type=int, default=None,
                   help="the last-level cache size to plan the from-memory runs for (default: "
                        "this machine's, from sysfs; 0: no from-memory runs)")
    p.add_argument("--matvec-only", action="store_true",
                   help="time the mat-vecs only (no quantize / dequantize baselines)")
    p.add_argument("--llama-lib", default=None, metavar="DIR",
                   help="folder of the libggml-base.so and libggml-cpu.so whose ggml_mul_mat is "
                        "the mat-vec baseline (default: llama-cpp-python's, else ggml-python's; "
                        "'none': no baseline)")
    args = p.parse_args(argv)
    names = list(formats.FORMATS) if not args.formats else [
        formats.get_format(s).name for s in args.formats.split(",") if s.strip()]
    sizes = parse_sizes(args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES))
    repeat = 1 if args.quick else max(1, args.repeat)
    ggml = _load_ggml()
    from numba import get_num_threads
    print(f"# ds4tools formats benchmark: numba threads {get_num_threads()}, best of {repeat}; "
          f"ggml baseline: {'ggml_quantize_chunk on %d threads' % GGML_THREADS if ggml else 'ggml-python not installed'}")
    from ds4tools.bench.measure import last_level_cache_bytes, memcpy_bandwidth
    if args.cache_mib is not None:
        cache_bytes = max(0, args.cache_mib) << 20
    else:
        cache_bytes = 0 if args.quick else last_level_cache_bytes()
    copy_bytes = max(1 << 26 if args.quick else 1 << 28, 4 * cache_bytes)
    memcpy_gbps = memcpy_bandwidth(copy_bytes)
    print(f"# numpy memory copy: {memcpy_gbps:.1f} GB/s (bytes read per second, this run, "
          f"{copy_bytes >> 20} MiB"
          + (f"; last-level cache {cache_bytes >> 20} MiB)" if cache_bytes else ")"))
    from ggml_matvec import default_lib_dir
    llama_lib = (None if args.llama_lib == "none" else args.llama_lib or default_lib_dir())
    print("# mat-vec baseline: "
          + (f"ggml_mul_mat (llama.cpp's CPU kernels) from {llama_lib}" if llama_lib else
             "none (neither llama-cpp-python nor ggml-python installed; --llama-lib DIR names "
             "a llama.cpp build)"))
    print("# ratios: times faster than the baseline (> 1: ours is faster)")
    rng = np.random.default_rng(0)
    for rows, n in sizes:
        for name in names:
            for line in bench_one(name, rows, n, repeat, ggml, rng, memcpy_gbps,
                                  args.matvec_only, cache_bytes, llama_lib):
                print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
