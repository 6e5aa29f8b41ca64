"""Per-stream state of a layer range: KV rows and short-convolution histories.

Sliding layers keep a ring of window - 1 + slack key/value rows; global layers keep every position
up to the context budget (grown on demand); each layer keeps the last K - 1 + slack inputs of its
four short convolutions. The slack is how far a stream can be rewound.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


class BudgetExceeded(RuntimeError):
    """A stream would pass its context budget, or the engine its memory budget."""


class RingRows:
    """The last `capacity` rows of a sequence, addressed by absolute position."""

    def __init__(self, capacity: int, row_shape: tuple[int, ...], dtype: str = "float32") -> None:
        self.capacity = capacity
        self.data = np.zeros((capacity, *row_shape), dtype=dtype)

    def write(self, positions: np.ndarray, rows: np.ndarray) -> None:
        self.data[positions % self.capacity] = rows

    def read(self, positions: np.ndarray) -> np.ndarray:
        return self.data[positions % self.capacity]

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


class GrowingRows:
    """Every row from position 0, allocated in doublings up to `limit` rows.

    Index 0 of the storage is a padding row and position p lives at index p + 1, so the usual read of
    a step plan -- padding slots, then consecutive positions -- is a view of the storage, not a copy
    of the whole history (which is what long-history decode steps would otherwise pay each time).
    """

    def __init__(self, limit: int, row_shape: tuple[int, ...], initial: int = 64, dtype: str = "float32") -> None:
        self.limit = limit
        self.data = np.zeros((min(initial, limit) + 1, *row_shape), dtype=dtype)

    @property
    def capacity(self) -> int:
        return self.data.shape[0] - 1

    def _capacity_for(self, rows: int) -> int:
        """Positions held after growing (by doublings, up to the limit) to hold `rows`."""
        size = self.capacity
        while size < rows:
            size *= 2
        return min(size, self.limit)

    def reserve(self, rows: int) -> int:
        """Grow to hold `rows` positions; returns the bytes added."""
        if rows <= self.capacity:
            return 0
        if rows > self.limit:
            raise BudgetExceeded(f"{rows} positions exceed the context budget of {self.limit}")
        grown = np.zeros((self._capacity_for(rows) + 1, *self.data.shape[1:]), dtype=self.data.dtype)
        grown[: self.data.shape[0]] = self.data
        added = grown.nbytes - self.data.nbytes
        self.data = grown
        return added

    def growth_bytes(self, rows: int) -> int:
        if rows <= self.capacity:
            return 0
        return (self._capacity_for(rows) - self.capacity) * int(np.prod(self.data.shape[1:])) * self.data.itemsize

    def write(self, positions: np.ndarray, rows: np.ndarray) -> None:
        self.data[np.asarray(positions) + 1] = rows

    def read(self, positions: np.ndarray) -> np.ndarray:
        """Rows at `positions`; -1 reads an arbitrary row (padding, masked by the caller).

        Plans put padding first and then consecutive positions; then the rows just before the run
        stand in for the padding and the read is a view.
        """
        index = np.asarray(positions) + 1
        pads = int(np.count_nonzero(index == 0))
        first = int(index[pads]) - pads if pads < len(index) else -1
        run = np.arange(first + pads, first + len(index))
        if first >= 0 and not index[:pads].any() and np.array_equal(index[pads:], run):
            return self.data[first : first + len(index)]
        return self.data[index]

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


Rows = RingRows | GrowingRows


@dataclass
class LayerState:
    keys: Rows
    values: Rows
    convs: dict[str, RingRows]  # "k", "v", "o", "m": inputs of the four short convolutions

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes + sum(c.nbytes for c in self.convs.values())


@dataclass
class StreamState:
    layers: list[LayerState]
    position: int = 0  # positions fed so far
    slack: int = 0
    limits: list[str] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    def conv_history(self, layer: int, conv: str, start: int, kernel: int) -> np.ndarray:
        """Inputs at positions start-K+1 .. start-1 (zeros before the stream began), oldest first."""
        ring = self.layers[layer].convs[conv]
        positions = np.arange(start - kernel + 1, start)
        rows = ring.read(np.maximum(positions, 0))
        rows[positions < 0] = 0.0
        return rows

    def rewind(self, position: int) -> None:
        if not 0 <= position <= self.position:
            raise ValueError(f"cannot rewind to position {position}: the stream is at {self.position}")
        if self.position - position > self.slack:
            raise ValueError(f"cannot rewind {self.position - position} positions: the rewind slack is {self.slack}")
        self.position = position
