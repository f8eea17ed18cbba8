"""DeepSeek V4's low-precision checkpoint formats, decoded to float32 (and encoded, for tests and
tiny synthetic checkpoints).

- **FP8 E4M3** (safetensors dtype ``F8_E4M3``, the "FN" variant: no infinities, 0x7F/0xFF are
  NaN, largest finite 448): dense weights, with one **E8M0** scale (``F8_E8M0``: the byte b is
  2^(b-127), 255 is NaN) per 128 x 128 block of the [out, in] matrix.
- **FP4 E2M1** packed two per byte, the low nibble first (dtype ``I8`` or ``U8``): routed experts,
  with one E8M0 scale per 32 consecutive inputs of a row.

Decoding is table lookups and broadcasts (numpy); every shape is checked first, so a lying
header is a clear ValueError, never a huge allocation.
"""
from __future__ import annotations

import numpy as np

__all__ = ["E4M3_VALUES", "E2M1_VALUES", "FP8_BLOCK", "FP4_GROUP", "e4m3_to_float32",
           "e8m0_to_float32", "dequantize_fp8", "dequantize_fp4", "encode_e4m3", "encode_e2m1",
           "quantize_fp8", "quantize_fp4", "fp8_scale_shape", "fp4_scale_shape"]

FP8_BLOCK = 128  # E8M0 scale blocks of FP8 weights: 128 x 128
FP4_GROUP = 32  # inputs per E8M0 scale of FP4 weights


def _e4m3_table() -> np.ndarray:
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp = (codes >> 3) & 0xF
    man = codes & 0x7
    normal = (1.0 + man / 8.0) * np.exp2(exp - 7.0)
    subnormal = (man / 8.0) * 2.0 ** -6
    v = sign * np.where(exp == 0, subnormal, normal)
    v[(codes & 0x7F) == 0x7F] = np.nan
    return v.astype(np.float32)


def _e2m1_table() -> np.ndarray:
    codes = np.arange(16)
    sign = np.where(codes & 0x8, -1.0, 1.0)
    exp = (codes >> 1) & 0x3
    man = codes & 0x1
    v = sign * np.where(exp == 0, man * 0.5, (1.0 + man / 2.0) * np.exp2(exp - 1.0))
    return v.astype(np.float32)


#: code -> value, for every byte / nibble
E4M3_VALUES = _e4m3_table()
E2M1_VALUES = _e2m1_table()
_E8M0_VALUES = np.array([np.nan if b == 255 else 2.0 ** (b - 127) for b in range(256)], np.float32)


def _as_u8(a, what: str) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype.itemsize != 1 or a.dtype.kind not in "uib":
        raise ValueError(f"{what} must be stored one byte per value, got dtype {a.dtype}")
    return a.view(np.uint8)


def e4m3_to_float32(codes) -> np.ndarray:
    return E4M3_VALUES[_as_u8(codes, "E4M3 data")]


def e8m0_to_float32(codes) -> np.ndarray:
    return _E8M0_VALUES[_as_u8(codes, "E8M0 scales")]


def fp8_scale_shape(shape) -> tuple[int, int]:
    rows, cols = (int(s) for s in shape)
    return -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)


def fp4_scale_shape(shape) -> tuple[int, int]:
    """E8M0 scales of an FP4 matrix of logical ``shape`` (rows, inputs)."""
    rows, cols = (int(s) for s in shape)
    return rows, cols // FP4_GROUP


def dequantize_fp8(weight, scale) -> np.ndarray:
    """An FP8 E4M3 [out, in] matrix times its E8M0 128 x 128 block scales, as float32."""
    w = _as_u8(weight, "FP8 weight")
    s = _as_u8(scale, "FP8 scale")
    if w.ndim != 2:
        raise ValueError(f"FP8 weight must be 2-D, got shape {list(w.shape)}")
    want = fp8_scale_shape(w.shape)
    if s.shape != want:
        raise ValueError(f"FP8 scale has shape {list(s.shape)}, expected {list(want)} for a "
                         f"{list(w.shape)} weight in {FP8_BLOCK} x {FP8_BLOCK} blocks")
    rows, cols = w.shape
    out = E4M3_VALUES[w]
    scale_f = _E8M0_VALUES[s]
    col_scale = np.repeat(scale_f, FP8_BLOCK, axis=1)[:, :cols]  # (row blocks, cols)
    for b in range(want[0]):  # one 128-row band at a time: no full-size scale temporary
        out[b * FP8_BLOCK:(b + 1) * FP8_BLOCK] *= col_scale[b]
    return out


def dequantize_fp4(packed, scale, n_inputs: int | None = None) -> np.ndarray:
    """Packed FP4 E2M1 rows (two values per byte, the low nibble first) times their E8M0 scales
    (one per 32 inputs), as float32 [rows, inputs]."""
    p = _as_u8(packed, "FP4 weight")
    s = _as_u8(scale, "FP4 scale")
    if p.ndim != 2:
        raise ValueError(f"packed FP4 weight must be 2-D, got shape {list(p.shape)}")
    rows, cols = p.shape[0], 2 * p.shape[1]
    if n_inputs is not None and n_inputs != cols:
        raise ValueError(f"packed FP4 weight holds {cols} inputs per row, expected {n_inputs}")
    if cols % FP4_GROUP:
        raise ValueError(f"FP4 rows of {cols} values are not a multiple of {FP4_GROUP}")
    want = fp4_scale_shape((rows, cols))
    if s.shape != want:
        raise ValueError(f"FP4 scale has shape {list(s.shape)}, expected {list(want)} (one per "
                         f"{FP4_GROUP} inputs of each row)")
    vals = np.empty((rows, cols), np.float32)
    vals[:, 0::2] = E2M1_VALUES[p & 0x0F]
    vals[:, 1::2] = E2M1_VALUES[p >> 4]
    vals = vals.reshape(rows, want[1], FP4_GROUP)
    vals *= _E8M0_VALUES[s][:, :, None]
    return vals.reshape(rows, cols)


# --- encoders (tests and synthetic checkpoints) -------------------------------------------------


def _nearest_code(x: np.ndarray, table: np.ndarray, sign_bit: int) -> np.ndarray:
    """The code of the nearest finite value of ``table`` (ties to the even code), saturating."""
    pos_codes = np.arange(sign_bit)
    pos_vals = table[pos_codes]
    finite = np.isfinite(pos_vals)
    pos_codes, pos_vals = pos_codes[finite], pos_vals[finite]
    order = np.argsort(pos_vals, kind="stable")
    pos_codes, pos_vals = pos_codes[order], pos_vals[order]
    a = np.minimum(np.abs(x), pos_vals[-1])
    hi = np.clip(np.searchsorted(pos_vals, a), 1, len(pos_vals) - 1)
    lo = hi - 1
    d_lo, d_hi = a - pos_vals[lo], pos_vals[hi] - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (pos_codes[hi] % 2 == 0))
    code = np.where(pick_hi, pos_codes[hi], pos_codes[lo])
    code = np.where(np.signbit(x) & (code != 0), code | sign_bit, code)
    return code.astype(np.uint8)


def encode_e4m3(x) -> np.ndarray:
    """float -> E4M3 code, round to nearest (ties to even), saturating at +-448."""
    return _nearest_code(np.asarray(x, np.float32), E4M3_VALUES, 0x80)


def encode_e2m1(x) -> np.ndarray:
    """float -> E2M1 nibble, round to nearest (ties to even), saturating at +-6."""
    return _nearest_code(np.asarray(x, np.float32), E2M1_VALUES, 0x8)


def _pow2_scale_code(amax: np.ndarray, top: float) -> np.ndarray:
    """E8M0 code of the smallest power of two s with amax / s <= top (1.0 for zero blocks)."""
    with np.errstate(divide="ignore"):
        e = np.ceil(np.log2(np.where(amax > 0, amax / top, 1.0)))
    return np.clip(e + 127, 0, 254).astype(np.uint8)


def quantize_fp8(w) -> tuple[np.ndarray, np.ndarray]:
    """float [out, in] -> (E4M3 codes, E8M0 128 x 128 block scales), as DeepSeek V4 stores them."""
    w = np.asarray(w, np.float32)
    rb, cb = fp8_scale_shape(w.shape)
    pad = np.zeros((rb * FP8_BLOCK, cb * FP8_BLOCK), np.float32)
    pad[:w.shape[0], :w.shape[1]] = np.abs(w)
    amax = pad.reshape(rb, FP8_BLOCK, cb, FP8_BLOCK).max(axis=(1, 3))
    scale = _pow2_scale_code(amax, 448.0)
    full = np.repeat(np.repeat(_E8M0_VALUES[scale], FP8_BLOCK, 0), FP8_BLOCK, 1)
    return encode_e4m3(w / full[:w.shape[0], :w.shape[1]]), scale


def quantize_fp4(w) -> tuple[np.ndarray, np.ndarray]:
    """float [rows, in] -> (packed E2M1 bytes [rows, in/2], E8M0 scales [rows, in/32])."""
    w = np.asarray(w, np.float32)
    rows, cols = w.shape
    if cols % FP4_GROUP:
        raise ValueError(f"FP4 rows of {cols} values are not a multiple of {FP4_GROUP}")
    g = w.reshape(rows, cols // FP4_GROUP, FP4_GROUP)
    scale = _pow2_scale_code(np.abs(g).max(axis=2), 6.0)
    codes = encode_e2m1(g / _E8M0_VALUES[scale][:, :, None]).reshape(rows, cols)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return packed, scale
