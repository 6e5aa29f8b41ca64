"""Weight storage formats and their sizes: pure arithmetic, shared by the engine and the planner."""

from __future__ import annotations

import math
from typing import Literal

WeightFormat = Literal["f32", "f16", "int8", "int4"]
WEIGHT_FORMATS: tuple[WeightFormat, ...] = ("f32", "f16", "int8", "int4")
INT4_GROUP = 32


def stored_bytes(weight_shape: tuple[int, ...], fmt: WeightFormat) -> int:
    """Bytes a weight of this shape occupies in `fmt` (values plus scales)."""
    n = math.prod(weight_shape)
    if fmt == "f32":
        return 4 * n
    if fmt == "f16":
        return 2 * n
    if fmt == "int8":
        return n + 4 * n // weight_shape[-1]
    return n // 2 + 2 * (n // INT4_GROUP)
