"""How stream state is laid out in memory, as both the engine that holds it and the planner that sizes it
count it: blocks of a global layer's cache, the rounding of growing shapes, bytes per cached element."""

from __future__ import annotations

import numpy as np

KV_BLOCK = 128  # positions per block of a global layer's cache
PARAMS = 2  # a u8 row's scale and offset
STORAGE = {"f32": "float32", "f16": "float16", "u8": "uint8"}  # numpy dtype of each KV precision


def steady_size(count: int, most: int | None = None) -> int:
    """A count of keys or key blocks rounded up (by at most an eighth, and not beyond `most`) so that a
    growing history changes a step's input shapes only eight times per doubling.

    The CPU plugin plans and allocates a dynamic model's intermediate tensors again whenever an input
    shape changes: with a band or far region one key or block longer at every step, that re-planning
    cost as much as the attention itself. The padding is masked, and costs far less.
    """
    if count > 8:
        step = 1 << (count.bit_length() - 4)
        count = -(-count // step) * step
    return count if most is None else min(count, most)


def blocks_for(rows: int) -> int:
    return max(1, -(-rows // KV_BLOCK))


def cache_blocks(limit: int) -> int:
    """Blocks a global layer's cache holds once a stream has used its whole budget of `limit` positions."""
    return steady_size(blocks_for(limit))


def far_blocks_for(far_keys: int, block: int = KV_BLOCK) -> int:
    """Blocks of the far region a step passes when its streams have at most `far_keys` far keys."""
    return steady_size(max(1, -(-far_keys // block)))


def bytes_per_element(precision: str, head_dim: int) -> float:
    """Bytes one cached key or value element costs, a u8 row's scale and offset included."""
    params = PARAMS * 4 / head_dim if precision == "u8" else 0.0
    return np.dtype(STORAGE[precision]).itemsize + params
