"""Typed reads of GGUF metadata, with ds4's rules where ds4 reads the key.

ds4 reads an integer key only when it is stored as UINT32 (anything else reads as missing),
accepts FLOAT32 / FLOAT64 / UINT32 / INT32 for floats, and UINT32 or INT32 arrays (no negative
values) for layer lists, of which it keeps the first 8.
"""
from __future__ import annotations

from gguf import GGUFValueType as V

from ..gguf_io import GGUFFile

__all__ = ["u32", "u32_any", "u32_array_any", "number", "string", "int_array", "boolean",
           "first_key", "MAX_TARGET_LAYERS"]

MAX_TARGET_LAYERS = 8  # DS4_DSPARK_MAX_TARGET_LAYERS: ds4 reads at most this many


def _type(f: GGUFFile, key: str):
    try:
        return f.value_type(key)
    except KeyError:
        return None, None


def u32(f: GGUFFile, key: str) -> int | None:
    """The value of a UINT32 key; None when missing or stored with another type."""
    main, _ = _type(f, key)
    return int(f.metadata[key]) if main == V.UINT32 else None


def first_key(f: GGUFFile, keys) -> str | None:
    return next((k for k in keys if k in f.metadata), None)


def u32_any(f: GGUFFile, keys) -> int | None:
    """The first of ``keys`` that holds a UINT32 (ds4's model_get_u32_any)."""
    for k in keys:
        v = u32(f, k)
        if v is not None:
            return v
    return None


def u32_array_any(f: GGUFFile, keys, limit: int = MAX_TARGET_LAYERS) -> list[int] | None:
    """The first of ``keys`` that holds a UINT32 / INT32 array without negative values, cut to
    ``limit`` entries (ds4's model_get_u32_array_any); None when there is none."""
    for k in keys:
        main, sub = _type(f, k)
        if main != V.ARRAY or sub not in (V.UINT32, V.INT32):
            continue
        values = [int(x) for x in f.metadata[k]]
        if any(v < 0 for v in values):
            continue
        return values[:limit]
    return None


def int_array(f: GGUFFile, key: str) -> list[int] | None:
    """Any integer array (llama.cpp's get_arr reads INT32 and UINT32 alike)."""
    main, sub = _type(f, key)
    if main != V.ARRAY or sub not in (V.UINT32, V.INT32, V.UINT64, V.INT64, V.UINT16, V.INT16,
                                      V.UINT8, V.INT8):
        return None
    return [int(x) for x in f.metadata[key]]


def number(f: GGUFFile, key: str) -> float | None:
    """A float key as ds4 reads one (FLOAT32, FLOAT64, UINT32 or INT32)."""
    main, _ = _type(f, key)
    if main in (V.FLOAT32, V.FLOAT64, V.UINT32, V.INT32):
        return float(f.metadata[key])
    return None


def string(f: GGUFFile, key: str) -> str | None:
    main, _ = _type(f, key)
    return f.metadata[key] if main == V.STRING else None


def boolean(f: GGUFFile, key: str) -> bool | None:
    main, _ = _type(f, key)
    return bool(f.metadata[key]) if main == V.BOOL else None


def integer(f: GGUFFile, key: str) -> int | None:
    """Any scalar integer key (llama.cpp's get_key converts between integer types)."""
    main, _ = _type(f, key)
    if main in (V.UINT8, V.INT8, V.UINT16, V.INT16, V.UINT32, V.INT32, V.UINT64, V.INT64):
        return int(f.metadata[key])
    return None
