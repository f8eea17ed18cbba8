"""What the int8 matmul kernels compile to: the packed integer instructions in their machine code.

numba does not show the assembly of code loaded from its cache, so the kernel is compiled once
more, uncached, for the signature it already ran with. Used by tests/test_kernel_asm.py (which
fails when a hot loop is scalar) and benchmarks/kernel_asm.py (the table in docs/engine.md).
"""
from __future__ import annotations

import warnings
from collections import Counter

import numba
import numpy as np

#: packed integer multiply(-add)s, the instructions an int8 dot product should run on:
#: VNNI (vpdpbusd u8 x s8, vpdpwssd s16 x s16), AVX2 / SSE (pmaddubsw, pmaddwd), AArch64 (sdot)
PACKED_DOT = ("vpdpbusd", "vpdpbusds", "vpdpwssd", "vpdpwssds", "vpmaddubsw", "pmaddubsw",
              "vpmaddwd", "pmaddwd", "sdot", "udot")
#: what a scalar integer multiply looks like on x86 (for the report)
SCALAR_MUL = ("imull", "imulq")


def _exercise(fmt) -> None:
    """Run the format's int8 matmul once on a small matrix so its kernel has a signature."""
    from . import matmul, quantize
    from .activations import quantize_activations
    n_in = 2 * max(256, fmt.block_size)
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, n_in)).astype(np.float32)
    imatrix = np.ones(n_in, np.float32) if fmt.requires_imatrix else None
    raw = quantize(w, fmt.name, imatrix=imatrix)
    # 8 tokens too: a few tokens may take another kernel (kquants.NATURAL_FEW); and from
    # activations quantized apart (float rows may reach the kernel from compiled code only)
    for k in (1, 2, 8):
        x = rng.standard_normal((k, n_in)).astype(np.float32)
        matmul(raw, fmt.name, w.shape, x, int8=True)
        fmt._cpu_matmul_q8(raw, quantize_activations(x, fmt.act_type),
                           np.empty((k, w.shape[0]), np.float32))


def kernel_assembly(fmt, parallel: bool = True, attr: str = "q8_kernel") -> str:
    """The machine code (AT&T syntax, as LLVM prints it) of ``fmt.q8_kernel`` (or the kernel
    ``attr`` names, e.g. ``q8_kernel_few``) for this host. ``parallel=False`` compiles the same
    loops without numba's parallel outlining: the hot loops vectorize alike (the same packed-dot
    counts) for a third of the compile time."""
    kernel = getattr(fmt, attr, None)
    if kernel is None:
        raise TypeError(f"format {fmt.name} names no {attr}")
    if not kernel.signatures:
        _exercise(fmt)
    if not kernel.signatures:
        raise RuntimeError(f"format {fmt.name}: {attr} does not run on this host")
    options = {k: v for k, v in kernel.targetoptions.items() if k not in ("cache", "nopython")}
    if not parallel:
        options["parallel"] = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fresh = numba.njit(**options)(kernel.py_func)
        fresh.compile(kernel.signatures[0])
        return fresh.inspect_asm(fresh.signatures[0])


def instruction_counts(asm: str, names=PACKED_DOT + SCALAR_MUL) -> Counter:
    """How often each instruction in ``names`` appears in ``asm`` (as a mnemonic)."""
    found = Counter()
    for line in asm.splitlines():
        parts = line.split()
        if parts and parts[0] in names:
            found[parts[0]] += 1
    return found


def host_cpu() -> str:
    """The CPU numba compiles for, and its dot-product features."""
    import llvmlite.binding as llvm
    feats = llvm.get_host_cpu_features()
    have = [f for f in ("avx2", "avx512bw", "avx512vnni", "avxvnni") if feats.get(f)]
    return f"{llvm.get_host_cpu_name()} ({', '.join(have) or 'no AVX2'})"

