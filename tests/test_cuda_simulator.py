"""The CUDA kernels (quantizer and engine) and the CUDA benchmark's tiny run, under numba's
CUDA simulator (tests/cuda; the engine on CUDA is tests/test_cuda_engine.py and
tests/test_cuda_engine_mla.py)."""
from tests.cuda_simulator import ENGINE_FILES, KERNEL_FILES, MLA_FILES, ROOT, run_simulated


def test_every_simulator_file_runs_somewhere():
    found = {p.name for p in (ROOT / "tests" / "cuda").glob("test_*.py")}
    assert found == set(KERNEL_FILES) | set(ENGINE_FILES) | set(MLA_FILES)


def test_cuda_kernels_under_the_simulator():
    run_simulated(*KERNEL_FILES)
