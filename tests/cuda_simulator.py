"""Runs test files of tests/cuda in a pytest child process under numba's CUDA simulator.

NUMBA_ENABLE_CUDASIM must be set before numba is first imported, which the calling process has
already done; a child process starts clean. Three test files call this (the kernels, the engine,
latent attention), so that pytest-xdist can give them a worker each.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: tests/cuda's files, in three runs: the kernels and the CUDA benchmark's tiny run; the engine
#: (llama, qwen3, glm4moe); the engine with latent attention (deepseek2)
KERNEL_FILES = ("test_cuda_formats.py", "test_engine_matmul.py", "test_engine_ops.py",
                "test_bench_cuda.py")
ENGINE_FILES = ("test_engine_cuda.py",)
MLA_FILES = ("test_engine_cuda_mla.py",)


def run_simulated(*files: str) -> None:
    """Run tests/cuda/<files>; fail with the child's output tail unless they pass."""
    pytest.importorskip("numba.cuda", reason="numba's CUDA target is needed for the simulator")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         *(str(ROOT / "tests" / "cuda" / f) for f in files)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, f"CUDA simulator suite failed (exit {proc.returncode}):\n{tail}"
    assert " passed" in proc.stdout and "no tests ran" not in proc.stdout, tail
