"""The CUDA backend (numba.cuda): ``backend`` places the model and runs the operations,
``matmul`` holds the fused dequantize-matmul kernels of every format, ``ops`` the norms, rope,
activations and attention. Imported only when device "cuda" is asked for."""
