"""The engine on its CUDA backend (tests/cuda/test_engine_cuda.py), under numba's CUDA
simulator."""
from tests.cuda_simulator import ENGINE_FILES, run_simulated


def test_the_engine_on_cuda_under_the_simulator():
    run_simulated(*ENGINE_FILES)
