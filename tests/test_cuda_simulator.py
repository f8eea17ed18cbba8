"""Runs tests/cuda in its own pytest process under numba's CUDA simulator.

NUMBA_ENABLE_CUDASIM must be set before numba is first imported, which this process has
already done; a child process starts clean.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_cuda_kernels_under_the_simulator():
    pytest.importorskip("numba.cuda", reason="numba's CUDA target is needed for the simulator")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "tests" / "cuda")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, f"CUDA simulator suite failed (exit {proc.returncode}):\n{tail}"
    assert " passed" in proc.stdout and "no tests ran" not in proc.stdout, tail
