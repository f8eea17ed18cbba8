"""The format base class and the registry every ggml tensor type joins.

A format is one small class: its ggml type id, block geometry and the kernels that move
between float32 rows and raw GGUF block bytes. Subclasses implement the ``_cpu_*`` and
``_cuda_*`` hooks on already validated, C-contiguous 2-D arrays; the public wrappers in
``ds4tools.formats`` do the checking, reshaping and dispatch, once for every format.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

FORMATS: dict[str, "QuantFormat"] = {}
_BY_TYPE: dict[int, "QuantFormat"] = {}


def register(cls):
    """Class decorator: instantiate a format and add it to the registry."""
    fmt = cls()
    FORMATS[fmt.name] = fmt
    _BY_TYPE[int(fmt.ggml_type)] = fmt
    return cls


def format_for_type(ggml_type) -> "QuantFormat | None":
    return _BY_TYPE.get(int(ggml_type))


def _missing(fmt, what):
    # Hooks a subclass leaves out: a clear error rather than a silent wrong result.
    raise TypeError(f"format {fmt.name} does not implement a {what}")


class QuantFormat:
    #: name as ggml spells it ("Q4_K")
    name: str = ""
    ggml_type: GGMLQuantizationType
    #: elements per block and bytes per block (1 and the element size for float types)
    block_size: int = 1
    type_size: int = 4
    #: whether ggml's quantizer takes importance weights for this type
    uses_imatrix: bool = False
    #: whether ggml refuses to quantize this type without them
    requires_imatrix: bool = False

    # --- geometry -------------------------------------------------------------------------
    def row_bytes(self, n_per_row: int) -> int:
        return n_per_row // self.block_size * self.type_size

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.type_size / self.block_size

    # --- kernels (x: float32 (rows, n) C-contiguous and finite; raw: uint8 (rows, row_bytes)) -
    def _cpu_quantize(self, x: np.ndarray, imatrix: np.ndarray | None) -> np.ndarray:
        return _missing(self, "CPU quantizer")

    def _cpu_dequantize(self, raw: np.ndarray, n_per_row: int) -> np.ndarray:
        return _missing(self, "CPU dequantizer")

    def _cpu_matmul(self, raw: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
        """out[t, r] = sum_i W[r, i] * x[t, i] with W decoded on the fly from raw blocks.

        The reduction order for one (r, t) pair must not depend on how many rows t the call
        carries: one token alone and the same token inside a batch give bit-identical results.
        """
        return _missing(self, "fused CPU matmul")

    #: ggml's vec_dot_type: the int8 activation blocks ("Q8_0" or "Q8_K", see ``activations``)
    #: that this format's integer matmul takes, or None where it has none
    act_type: str | None = None

    #: the shortest row for which the int8 kernel beats the float32 one (measured, 1 thread, k=1):
    #: shorter rows are padded to the kernel's tile width and a small matmul is dominated by
    #: per-row set-up, so the engine's default mode keeps float32 activations below it
    int8_min_row: int = 0
    #: ... and the fewest weights (n_out x n_in) for which it does: the int8 path pays a fixed
    #: cost per call (quantizing the activations, its layout, one more dispatch), which a small
    #: matrix's faster dots do not earn back
    int8_min_weights: int = 0

    @property
    def has_int8_matmul(self) -> bool:
        return self.act_type is not None

    def _cpu_matmul_int8(self, raw: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
        """Like _cpu_matmul, but x is first quantized to int8 blocks of ``act_type`` and blocks
        are dotted in integers. Faster, not exact to the f32 product; still bit-identical for a
        token alone or inside a batch."""
        from .activations import quantize_activations
        self._cpu_matmul_q8(raw, quantize_activations(x, self.act_type), out)

    def _cpu_matmul_q8(self, raw: np.ndarray, act, out: np.ndarray) -> None:
        """out[t, r] = sum_i W[r, i] * x[t, i] from already quantized activations ``act``
        (an ``activations.QuantizedActivations`` of this format's ``act_type``)."""
        return _missing(self, "int8-activation CPU matmul")

    def _cuda_quantize(self, x: np.ndarray, imatrix: np.ndarray | None) -> np.ndarray:
        return _missing(self, "CUDA quantizer")

    def _cuda_dequantize(self, raw: np.ndarray, n_per_row: int) -> np.ndarray:
        return _missing(self, "CUDA dequantizer")

    def __repr__(self) -> str:
        return f"<format {self.name}: {self.block_size} x {self.type_size} B>"
