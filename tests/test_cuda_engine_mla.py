"""deepseek2's latent attention on the CUDA backend (tests/cuda/test_engine_cuda_mla.py), under
numba's CUDA simulator."""
from tests.cuda_simulator import MLA_FILES, run_simulated


def test_latent_attention_on_cuda_under_the_simulator():
    run_simulated(*MLA_FILES)
