import os

# The CUDA-simulator tests need NUMBA_ENABLE_CUDASIM set before numba is imported, so they run
# in their own pytest process (tests/test_cuda_simulator.py starts it); never collect them here.
collect_ignore = ["cuda"]

os.environ.setdefault("NUMBA_NUM_THREADS", str(min(2, os.cpu_count() or 1)))
