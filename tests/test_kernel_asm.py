"""The int8 matmuls' hot loops compile to packed integer SIMD (pmaddwd / pmaddubsw, or VNNI's
vpdpwssd / vpdpbusd), never to scalar multiplies: the machine code numba emits for this host
is read back and searched (ds4tools.formats.kernel_asm)."""
import pytest

from ds4tools import formats
from ds4tools.formats.kernel_asm import PACKED_DOT, instruction_counts, kernel_assembly

INT8_FORMATS = [name for name, f in formats.FORMATS.items() if f.has_int8_matmul]


def test_every_quantized_format_has_an_int8_path():
    floats = {"F32", "F16", "BF16"}
    assert set(INT8_FORMATS) == set(formats.FORMATS) - floats


@pytest.mark.parametrize("name", INT8_FORMATS)
def test_int8_hot_loop_is_packed_simd(name):
    # compiled without the parallel outlining (a third of the compile time, the same
    # packed-dot counts: benchmarks/kernel_asm.py prints the parallel kernels' for docs/engine.md)
    counts = instruction_counts(kernel_assembly(formats.FORMATS[name], parallel=False))
    packed = {op: n for op, n in counts.items() if op in PACKED_DOT}
    assert packed, f"{name}: no packed integer dot instruction in its kernel ({dict(counts)})"


def test_few_token_k_quant_kernel_is_avx2_packed_simd(monkeypatch):
    """The K-quants' stored-order kernel (decoding steps on AVX2 hosts without VNNI) runs on
    vpmaddubsw + vpmaddwd. Checked on every AVX2 host: on VNNI hosts it is switched on here."""
    from ds4tools.formats import kquants
    from ds4tools.formats._llvm_ir import host_cpu_features
    if "avx2" not in host_cpu_features():
        pytest.skip("the stored-order K kernels are written with AVX2 intrinsics")
    monkeypatch.setattr(kquants, "NATURAL_FEW", True)
    counts = instruction_counts(kernel_assembly(formats.FORMATS["Q6_K"], parallel=False,
                                                attr="q8_kernel_few"))
    assert counts["vpmaddubsw"] and counts["vpmaddwd"], dict(counts)
