"""Per-stream state of a layer range: KV rows and short-convolution histories.

Sliding layers keep a ring of window - 1 + slack key/value rows; global layers keep every position
up to the context budget (grown on demand, in blocks attention reads in place); each layer keeps the
last K - 1 + slack inputs of its four short convolutions. The slack is how far a stream can be rewound.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from cascadia.engine.kv_quant import PARAMS, quantize


class BudgetExceeded(RuntimeError):
    """A stream would pass its context budget, or the engine its memory budget."""


def _params_for(data: np.ndarray) -> np.ndarray | None:
    """u8 rows carry a scale and an offset per row (see `kv_quant`); other precisions nothing."""
    return np.zeros((*data.shape[:-1], PARAMS), dtype=np.float32) if data.dtype == np.uint8 else None


class RingRows:
    """The last `capacity` rows of a sequence, addressed by absolute position."""

    def __init__(self, capacity: int, row_shape: tuple[int, ...], dtype: str = "float32") -> None:
        self.capacity = capacity
        self.data = np.zeros((capacity, *row_shape), dtype=dtype)
        self.params = _params_for(self.data)

    def write(self, positions: np.ndarray, rows: np.ndarray) -> None:
        slots = positions % self.capacity
        if self.params is None:
            self.data[slots] = rows
        else:
            self.data[slots], self.params[slots] = quantize(rows)

    def read(self, positions: np.ndarray) -> np.ndarray:
        return self.data[positions % self.capacity]

    def read_params(self, positions: np.ndarray) -> np.ndarray:
        assert self.params is not None, "only u8 rows have params"
        return self.params[positions % self.capacity]

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + (0 if self.params is None else self.params.nbytes)


KV_BLOCK = 128  # positions per block of a global layer's cache


class GrowingRows:
    """Every key (or value) row of a global layer from position 0, kept in blocks of `KV_BLOCK` positions.

    The storage is [blocks, heads, KV_BLOCK, D]: within a block each head's rows are consecutive, so
    attention reads the blocks as they lie (no transpose of the history per step), and any prefix of
    blocks is a view of the storage, not a copy. Blocks are allocated in doublings up to `limit`
    positions.
    """

    def __init__(self, limit: int, row_shape: tuple[int, int], initial: int = 64, dtype: str = "float32") -> None:
        self.limit = limit
        heads, width = row_shape
        self.data = np.zeros((_blocks_for(min(initial, limit)), heads, KV_BLOCK, width), dtype=dtype)
        self.params = _params_for(self.data)

    @property
    def capacity(self) -> int:
        return min(self.data.shape[0] * KV_BLOCK, self.limit)

    def _blocks_after_growth(self, rows: int) -> int:
        """Blocks held after growing (by doublings, up to the limit) to hold `rows` positions."""
        blocks = self.data.shape[0]
        while blocks * KV_BLOCK < rows:
            blocks *= 2
        # up to the steady size of the budget's blocks, so that the far blocks a step reads are a view
        return min(blocks, steady_size(_blocks_for(self.limit)))

    def reserve(self, rows: int) -> int:
        """Grow to hold `rows` positions; returns the bytes added."""
        if rows <= self.capacity:
            return 0
        if rows > self.limit:
            raise BudgetExceeded(f"{rows} positions exceed the context budget of {self.limit}")
        before = self.nbytes
        self.data = self._grown(self.data, rows)
        if self.params is not None:
            self.params = self._grown(self.params, rows)
        return self.nbytes - before

    def _grown(self, array: np.ndarray, rows: int) -> np.ndarray:
        grown = np.zeros((self._blocks_after_growth(rows), *array.shape[1:]), dtype=array.dtype)
        grown[: array.shape[0]] = array
        return grown

    def growth_bytes(self, rows: int) -> int:
        if rows <= self.capacity:
            return 0
        block_bytes = self.data[0].nbytes + (0 if self.params is None else self.params[0].nbytes)
        return (self._blocks_after_growth(rows) - self.data.shape[0]) * block_bytes

    def write(self, positions: np.ndarray, rows: np.ndarray) -> None:
        positions = np.asarray(positions)
        blocks, slots = positions // KV_BLOCK, positions % KV_BLOCK
        if self.params is None:
            self.data[blocks, :, slots] = rows
        else:
            self.data[blocks, :, slots], self.params[blocks, :, slots] = quantize(rows)

    def read(self, positions: np.ndarray) -> np.ndarray:
        """Rows [len(positions), heads, D]; -1 reads an arbitrary row (padding, masked by the caller)."""
        positions = np.maximum(np.asarray(positions), 0)
        return self.data[positions // KV_BLOCK, :, positions % KV_BLOCK]

    def read_params(self, positions: np.ndarray) -> np.ndarray:
        assert self.params is not None, "only u8 rows have params"
        positions = np.maximum(np.asarray(positions), 0)
        return self.params[positions // KV_BLOCK, :, positions % KV_BLOCK]

    def blocks(self, count: int) -> np.ndarray:
        """The first `count` blocks [count, heads, KV_BLOCK, D], a view of the storage."""
        return self.data[:count]

    def block_params(self, count: int) -> np.ndarray:
        assert self.params is not None, "only u8 rows have params"
        return self.params[:count]

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + (0 if self.params is None else self.params.nbytes)


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


def _blocks_for(rows: int) -> int:
    return max(1, -(-rows // KV_BLOCK))


Rows = RingRows | GrowingRows


@dataclass(frozen=True)
class HistorySlots:
    """Where a step's short-convolution histories lie in the streams' rings.

    Stream b's inputs at positions start-K+1 .. start-1, oldest first, are rows `slots[b]` of each of
    its convolution rings (all rings of a stage have one capacity); `before_start` marks the rows of
    the concatenated histories that precede a stream's first position, which read as zeros (None
    when no stream is that young). Worked out once per step, not per layer and convolution.
    """

    slots: list[np.ndarray]
    before_start: np.ndarray | None


def history_slots(starts: list[int], kernel: int, capacity: int) -> HistorySlots:
    positions = np.asarray(starts)[:, None] + np.arange(1 - kernel, 0)
    slots = np.maximum(positions, 0) % capacity
    young = positions < 0
    return HistorySlots(list(slots), young.reshape(-1) if young.any() else None)


def conv_histories(rings: list[RingRows], where: HistorySlots) -> np.ndarray:
    """The histories in `rings` of every stream, concatenated [S * (K - 1), width]."""
    rows = np.concatenate([ring.data[slots] for ring, slots in zip(rings, where.slots, strict=True)])
    if where.before_start is not None:
        rows[where.before_start] = 0.0
    return rows


@dataclass
class LayerState:
    keys: Rows
    values: Rows
    # the inputs of the layer's four short convolutions (k, v, o, m) side by side in one ring, so a
    # step writes and reads them once per stream, not four times; None without convolutions
    convs: RingRows | None

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes + (0 if self.convs is None else self.convs.nbytes)


@dataclass
class StreamState:
    layers: list[LayerState]
    position: int = 0  # positions fed so far
    slack: int = 0
    # paged stages keep no per-layer rows here: the stream's blocks in the stage's pool, and its budget
    blocks: list[int] = field(default_factory=list)
    context: int = 0

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    def rewind(self, position: int) -> None:
        if not 0 <= position <= self.position:
            raise ValueError(f"cannot rewind to position {position}: the stream is at {self.position}")
        if self.position - position > self.slack:
            raise ValueError(f"cannot rewind {self.position - position} positions: the rewind slack is {self.slack}")
        self.position = position
