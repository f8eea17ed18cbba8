import os

import pytest

if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
    pytest.exit("tests/cuda must run with NUMBA_ENABLE_CUDASIM=1 (tests/test_cuda_simulator.py "
                "starts them that way)", returncode=4)
