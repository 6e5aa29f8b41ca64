"""Keys and values kept as u8 codes: each row of each head with its own scale and offset.

A row of D values becomes D codes in 0..255 and two f32 numbers (scale, offset) such that
value ~= code * scale + offset; the error is at most half a step of that row's own range, so rows of
very different magnitude (keys after their norm, values) keep their relative precision.
"""

from __future__ import annotations

import numpy as np

LEVELS = 255


def quantize(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows [..., D] -> codes [..., D] (u8) and params [..., 2] (scale, offset; f32)."""
    rows = np.asarray(rows, dtype=np.float32)
    low = rows.min(axis=-1, keepdims=True)
    span = rows.max(axis=-1, keepdims=True) - low
    scale = np.where(span > 0, span / LEVELS, np.float32(1.0)).astype(np.float32)
    codes = np.clip(np.rint((rows - low) / scale), 0, LEVELS).astype(np.uint8)
    return codes, np.concatenate([scale, low], axis=-1)


def dequantize(codes: np.ndarray, params: np.ndarray) -> np.ndarray:
    return codes.astype(np.float32) * params[..., :1] + params[..., 1:]
