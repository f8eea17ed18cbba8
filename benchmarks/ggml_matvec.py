"""llama.cpp's mat-vec, for bench_formats.py's baseline: a ggml_mul_mat graph computed by
ggml's CPU backend on a persistent thread pool (as llama.cpp runs a decoding step), called
through ctypes on the libggml that llama-cpp-python ships, else ggml-python's (or the
libggml-base.so and libggml-cpu.so of any llama.cpp build: ``--llama-lib DIR``). Build
llama-cpp-python for the CPU you compare on (docs/engine.md, "AVX2 against an AVX2
llama.cpp").

Only the handful of ggml calls a mat-vec needs are declared; the structs passed by value or
filled in (ggml_init_params, ggml_cplan) are the ones of ggml's headers since mid-2024, and
the thread pool's parameters are filled by ggml itself (ggml_threadpool_params_init).
"""
from __future__ import annotations

import ctypes
import os

import numpy as np
from gguf import GGMLQuantizationType

GGML_TYPE_F32 = 0


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p),
                ("no_alloc", ctypes.c_bool)]


class _Cplan(ctypes.Structure):
    _fields_ = [("work_size", ctypes.c_size_t), ("work_data", ctypes.c_void_p),
                ("n_threads", ctypes.c_int), ("threadpool", ctypes.c_void_p),
                ("abort_callback", ctypes.c_void_p), ("abort_callback_data", ctypes.c_void_p),
                ("use_ref", ctypes.c_bool), ("_spare", ctypes.c_char * 64)]


def default_lib_dir() -> str | None:
    """The folder of llama-cpp-python's libggml (llama.cpp's own build), else of ggml-python's
    (the `test` extra: ggml's CPU kernels at the version it pins), else None."""
    for module in ("llama_cpp", "ggml"):
        try:
            mod = __import__(module)
        except ImportError:
            continue
        folder = os.path.join(os.path.dirname(mod.__file__), "lib")
        if os.path.exists(os.path.join(folder, "libggml-cpu.so")):
            return folder
    return None


class GgmlMatvec:
    """ggml's y = W x for copies of one weight matrix (raw GGUF rows of one type), computed
    on ``threads`` threads of one thread pool: the first alone, or all the others in one
    graph."""

    def __init__(self, lib_dir: str, type_name: str, raw_copies: list, n_in: int, threads: int):
        p = lambda name: os.path.join(lib_dir, name)  # noqa: E731
        base = ctypes.CDLL(p("libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
        cpu = ctypes.CDLL(p("libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
        vp, i64 = ctypes.c_void_p, ctypes.c_int64
        base.ggml_init.restype, base.ggml_init.argtypes = vp, [_InitParams]
        base.ggml_new_tensor_2d.restype = vp
        base.ggml_new_tensor_2d.argtypes = [vp, ctypes.c_int, i64, i64]
        base.ggml_get_data.restype, base.ggml_get_data.argtypes = vp, [vp]
        base.ggml_mul_mat.restype, base.ggml_mul_mat.argtypes = vp, [vp, vp, vp]
        base.ggml_new_graph.restype, base.ggml_new_graph.argtypes = vp, [vp]
        base.ggml_build_forward_expand.argtypes = [vp, vp]
        base.ggml_threadpool_params_init.argtypes = [vp, ctypes.c_int]
        base.ggml_free.argtypes = [vp]
        cpu.ggml_threadpool_new.restype, cpu.ggml_threadpool_new.argtypes = vp, [vp]
        cpu.ggml_threadpool_free.argtypes = [vp]
        cpu.ggml_graph_plan.restype = _Cplan
        cpu.ggml_graph_plan.argtypes = [vp, ctypes.c_int, vp]
        cpu.ggml_graph_compute.restype = ctypes.c_int
        cpu.ggml_graph_compute.argtypes = [vp, ctypes.POINTER(_Cplan)]
        if hasattr(cpu, "ggml_cpu_init"):
            cpu.ggml_cpu_init()
        self._base, self._cpu = base, cpu
        gtype = int(GGMLQuantizationType[type_name])
        n_out = raw_copies[0].shape[0]
        mem = sum(r.nbytes for r in raw_copies) + (len(raw_copies) + 2) * (n_out + n_in) * 4 \
            + len(raw_copies) * (1 << 16) + (1 << 22)
        self._ctx = base.ggml_init(_InitParams(mem, None, False))
        if not self._ctx:
            raise RuntimeError("ggml_init failed")
        self._x = base.ggml_new_tensor_2d(self._ctx, GGML_TYPE_F32, n_in, 1)
        self._outs = []
        for r in raw_copies:
            w = base.ggml_new_tensor_2d(self._ctx, gtype, n_in, n_out)
            ctypes.memmove(base.ggml_get_data(w), r.ctypes.data, r.nbytes)
            self._outs.append(base.ggml_mul_mat(self._ctx, w, self._x))
        # graph 0: the first matrix alone; graph 1: all the others, one node each, as a
        # decoding step's graph holds its matmuls
        self._graphs = [base.ggml_new_graph(self._ctx)
                        for _ in range(2 if len(raw_copies) > 1 else 1)]
        base.ggml_build_forward_expand(self._graphs[0], self._outs[0])
        for y in self._outs[1:]:
            base.ggml_build_forward_expand(self._graphs[1], y)
        self.n_rest = len(raw_copies) - 1
        # ggml_threadpool_params, filled in by ggml itself
        self._params = ctypes.create_string_buffer(1 << 14)
        base.ggml_threadpool_params_init(self._params, threads)
        self._pool = cpu.ggml_threadpool_new(self._params)
        # one work buffer for every graph, as llama.cpp has one per step
        self._plans = [cpu.ggml_graph_plan(g, threads, self._pool) for g in self._graphs]
        self._work = np.zeros(max(1, max(plan.work_size for plan in self._plans)), np.uint8)
        for plan in self._plans:
            plan.work_data = self._work.ctypes.data
        self.n_in, self.n_out = n_in, n_out

    def set_input(self, x: np.ndarray) -> None:
        x = np.ascontiguousarray(x, np.float32).reshape(self.n_in)
        ctypes.memmove(self._base.ggml_get_data(self._x), x.ctypes.data, x.nbytes)

    def run_first(self) -> None:
        """y = W x for the first matrix."""
        self._compute(0)

    def run_rest(self) -> None:
        """y = W x for each of the other matrices (n_rest of them), in one graph."""
        self._compute(1)

    def _compute(self, i: int) -> None:
        if self._cpu.ggml_graph_compute(self._graphs[i], ctypes.byref(self._plans[i])) != 0:
            raise RuntimeError("ggml_graph_compute failed")

    def output(self, i: int = 0) -> np.ndarray:
        """y of matrix i (after its graph ran)."""
        buf = (ctypes.c_float * self.n_out).from_address(self._base.ggml_get_data(self._outs[i]))
        return np.frombuffer(buf, np.float32).copy()

    def close(self) -> None:
        if self._pool:
            self._cpu.ggml_threadpool_free(self._pool)
            self._pool = None
        if self._ctx:
            self._base.ggml_free(self._ctx)
            self._ctx = None
