"""Arrays in and out: any numpy array, buffer-protocol object or DLPack
tensor (on the CPU) in; numpy arrays out, in the layout's dtype. The wire
layout is per KV head K rows ``[tokens][head_dim]`` then V rows,
little-endian (proto/kvtier/v1/kvtier.proto, BYTE LAYOUT)."""

from __future__ import annotations

from typing import Any, Tuple

import numpy as np

try:  # bfloat16 as its own dtype when ml_dtypes (a JAX/TF dependency) is present
    from ml_dtypes import bfloat16 as _bfloat16

    _BF16: Any = np.dtype(_bfloat16)
except ImportError:  # otherwise its bit patterns, as uint16
    _BF16 = np.dtype("<u2")

DTYPES = {"f32": np.dtype("<f4"), "f16": np.dtype("<f2"), "bf16": _BF16}


def storage_dtype(dtype: str) -> np.dtype:
    """The numpy dtype pages of a layout's ``dtype`` come back in (bf16:
    ``ml_dtypes.bfloat16`` if installed, else its bits as ``uint16``)."""
    return DTYPES[dtype]


def widened(a: np.ndarray) -> np.ndarray:
    """``a`` as float32: a float array cast, bfloat16 bits (``uint16``,
    :func:`storage_dtype` without ml_dtypes) shifted into place."""
    if a.dtype == np.uint16:
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32, copy=False)


def as_array(x: Any, name: str) -> np.ndarray:
    """``x`` as a numpy array without a copy where possible."""
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "__dlpack__"):
        try:
            return np.from_dlpack(x)
        except (TypeError, RuntimeError, BufferError) as e:
            raise TypeError(
                f"{name}: numpy cannot import this DLPack tensor ({e}): it must be on the CPU, and bfloat16 "
                "goes as its bits (torch: t.view(torch.int16))"
            ) from e
    return np.asarray(x)


def _to_bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 → bfloat16 bits, rounding to nearest even (NaN kept NaN)."""
    bits = np.ascontiguousarray(a, dtype="<f4").view("<u4")
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    nan = np.isnan(a)
    if nan.any():
        rounded = np.where(nan, (bits >> 16) | 0x40, rounded)
    return rounded.astype("<u2")


def encode(x: Any, dtype: str, name: str) -> np.ndarray:
    """``x`` in the layout's storage dtype, little-endian and contiguous.
    Floating-point input is cast; for bf16 also its bits as uint16 or int16."""
    a = as_array(x, name)
    if dtype == "bf16":
        if a.dtype in (_BF16, np.dtype("<u2"), np.dtype("<i2")):
            return np.ascontiguousarray(a).view("<u2")
        if a.dtype.kind != "f":
            raise TypeError(f"{name}: expected floating-point values, got {a.dtype}")
        return _to_bf16_bits(a.astype(np.float32, copy=False))
    if a.dtype.kind != "f":
        raise TypeError(f"{name}: expected floating-point values, got {a.dtype}")
    return np.ascontiguousarray(a, dtype=DTYPES[dtype])


def kv_arrays(k: Any, v: Any, dtype: str, head_dim: int) -> Tuple[np.ndarray, np.ndarray]:
    """K and V, each ``[kv_heads, tokens, head_dim]``, checked and in the
    layout's storage dtype, contiguous."""
    k = encode(k, dtype, "k")
    v = encode(v, dtype, "v")
    if k.ndim != 3:
        raise ValueError(f"k: expected [kv_heads, tokens, head_dim], got shape {k.shape}")
    if k.shape != v.shape:
        raise ValueError(f"v: shape {v.shape} differs from k's {k.shape}")
    if k.shape[2] != head_dim:
        raise ValueError(f"k: head_dim is {k.shape[2]}, the layout's is {head_dim}")
    return k, v


def pack_kv(k: Any, v: Any, dtype: str, head_dim: int) -> Tuple[bytes, int, int]:
    """K and V, each ``[kv_heads, tokens, head_dim]``, as one ``kv`` field;
    returns ``(bytes, kv_heads, tokens)``."""
    k, v = kv_arrays(k, v, dtype, head_dim)
    return np.stack([k, v], axis=1).tobytes(), k.shape[0], k.shape[1]


def unpack(buf: Any, rows: int, head_dim: int, dtype: str) -> Tuple[np.ndarray, np.ndarray]:
    """One page's bytes (a view is kept, not copied) as ``(k, v)``, each
    ``[rows, head_dim]``."""
    a = np.frombuffer(buf, dtype=storage_dtype(dtype))
    if a.size != 2 * rows * head_dim:
        raise ValueError(f"a page of {a.size} elements is not 2 x {rows} rows x head_dim {head_dim}")
    kv = a.reshape(2, rows, head_dim)
    return kv[0], kv[1]
