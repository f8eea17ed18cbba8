"""Tensor parallelism over MPI (mpi4py + an MPI such as the ``tp`` extra's mpich).

``ds4tools run --tp N`` starts N ranks through mpiexec (``launch``), or a process started by
``mpiexec -n N ds4tools run ...`` joins that world. Rank 0, the leader, owns the tokenizer,
sampling, drafting (DSpark, prompt lookup), output and statistics; every rank holds one shard
of the target (``shard``: heads and FFN rows, joined by all-gathers so that the output is
bit-identical to one process) and follows the leader's frames (``frames``: PREFILL, DECODE,
VERIFY, COMMIT, STOP). MTP falls back to plain decoding under TP. Nothing here imports mpi4py
until a session starts. Layout and use: docs/engine.md, "Tensor parallelism".
"""
