"""Per-stream state of a layer range: KV rows and short-convolution histories.

Sliding layers keep a ring of window - 1 + slack key/value rows; global layers keep every position
up to the context budget (grown on demand, in blocks attention reads in place); each layer keeps the
last K - 1 + slack inputs of its four short convolutions. The slack is how far a stream can be rewound.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

import numpy as np

from cascadia.engine.kv_quant import quantize
from cascadia.kv_layout import KV_BLOCK, PARAMS, blocks_for, cache_blocks


class BudgetExceeded(RuntimeError):
    """A stream would pass its context budget, or the engine its memory budget."""


def _params_for(data: np.ndarray) -> np.ndarray | None:
    """u8 rows carry a scale and an offset per row (see `kv_quant`); other precisions nothing."""
    return np.zeros((*data.shape[:-1], PARAMS), dtype=np.float32) if data.dtype == np.uint8 else None


class RingPool:
    """One layer's ring of every open stream, in one array [slots, capacity, *row]; a stream owns a slot.

    A step reads and writes all its streams' rows with one indexing call per pool instead of one per
    stream: at 32 streams the per-stream calls were most of the host's share of a decode step.
    """

    def __init__(self, capacity: int, row_shape: tuple[int, ...], dtype: str = "float32") -> None:
        self.capacity = capacity
        self.data = np.zeros((0, capacity, *row_shape), dtype=dtype)
        self.params = _params_for(self.data)

    @property
    def slots(self) -> int:
        return self.data.shape[0]

    @property
    def nbytes(self) -> int:
        """Every slot's rows, the free ones too: what the pool holds, not what its streams use."""
        return self.data.nbytes + (0 if self.params is None else self.params.nbytes)

    def reserve(self, slots: int, planned: int = 0) -> None:
        """Hold at least `slots` streams; grows by doublings, so streams opened one by one copy little,
        but not past `planned` streams while they are enough."""
        if slots <= self.slots:
            return
        count = _grown_slots(self.slots, slots, planned)
        self.data = _grown_to(self.data, count)
        if self.params is not None:
            self.params = _grown_to(self.params, count)

    def shrink(self, slots: int) -> None:
        """Keep only the first `slots` streams' rows (in arrays of their own, so the rest is freed)."""
        self.data = self.data[:slots].copy()
        if self.params is not None:
            self.params = self.params[:slots].copy()

    def clear(self, slot: int) -> None:
        self.data[slot] = 0
        if self.params is not None:
            self.params[slot] = 0

    def write(self, slots: np.ndarray, positions: np.ndarray, rows: np.ndarray) -> None:
        """Row i goes to stream slot `slots[i]` at `positions[i]` (at most `capacity` rows per slot)."""
        index = (slots, positions % self.capacity)
        if self.params is None:
            self.data[index] = rows
        else:
            self.data[index], self.params[index] = quantize(rows)

    def read(self, slots: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Rows [S, L, *row]: stream slot `slots[b]` at `positions[b]` [S, L]."""
        return self.data[slots[:, None], positions % self.capacity]

    def read_params(self, slots: np.ndarray, positions: np.ndarray) -> np.ndarray:
        assert self.params is not None, "only u8 rows have params"
        return self.params[slots[:, None], positions % self.capacity]


def _grown_slots(held: int, wanted: int, planned: int) -> int:
    doubled = 2 * held
    if wanted <= planned:
        doubled = min(doubled, planned)
    return max(wanted, doubled)


def _grown_to(array: np.ndarray, count: int) -> np.ndarray:
    grown = np.zeros((count, *array.shape[1:]), dtype=array.dtype)
    grown[: array.shape[0]] = array
    return grown


class RingRows:
    """The last `capacity` rows of one stream's sequence, addressed by absolute position: a slot of a
    pool. Steps read and write the pool for all their streams at once (`RingPool.read`, `.write`)."""

    def __init__(self, pool: RingPool, slot: int) -> None:
        self.pool = pool
        self.slot = slot

    @property
    def capacity(self) -> int:
        return self.pool.capacity

    @property
    def data(self) -> np.ndarray:
        return self.pool.data[self.slot]

    @property
    def params(self) -> np.ndarray | None:
        return None if self.pool.params is None else self.pool.params[self.slot]

    def write(self, positions: np.ndarray, rows: np.ndarray) -> None:
        positions = np.asarray(positions)
        self.pool.write(np.full(len(positions), self.slot), positions, rows)

    @property
    def nbytes(self) -> int:
        params = self.params
        return self.data.nbytes + (0 if params is None else params.nbytes)


class LowestFirst:
    """Indices [0, count) handed out lowest first, so that after a burst the ones still in use lie low
    and their holder can shrink to them (`span`, then `truncate`)."""

    def __init__(self, count: int = 0) -> None:
        self.count = count
        self._free = list(range(count))  # a heap

    def __len__(self) -> int:
        """Free indices."""
        return len(self._free)

    def take(self) -> int:
        """The lowest free index, or a new one after all the others."""
        if self._free:
            return heapq.heappop(self._free)
        self.count += 1
        return self.count - 1

    def extend(self, count: int) -> None:
        """Indices up to `count`, all free."""
        for index in range(self.count, count):
            heapq.heappush(self._free, index)
        self.count = max(self.count, count)

    def give_back(self, index: int) -> None:
        heapq.heappush(self._free, index)

    def span(self) -> int:
        """One past the highest index in use (0 when none is)."""
        free = set(self._free)
        top = self.count
        while top and top - 1 in free:
            top -= 1
        return top

    def truncate(self, count: int) -> None:
        """Forget the indices from `count` on; none of them may be in use."""
        self._free = [index for index in self._free if index < count]
        heapq.heapify(self._free)
        self.count = count


class StreamSlots:
    """Slots in a stage's ring pools, handed to streams as they open and taken back as they close.

    The lowest free slot is handed out first, so that after a burst of streams the high slots fall
    free together: once the used slots fit in a quarter of the pools, the pools shrink to them.
    """

    def __init__(self, pools: list[RingPool], planned: int = 0) -> None:
        self._pools = pools
        self._planned = planned
        self._slots = LowestFirst()

    def take(self) -> int:
        slot = self._slots.take()
        for pool in self._pools:
            pool.reserve(self._slots.count, self._planned)
            pool.clear(slot)  # a reused slot still holds its last stream's rows
        return slot

    def give_back(self, slot: int) -> None:
        self._slots.give_back(slot)
        used = self._slots.span()
        held = max((pool.slots for pool in self._pools), default=0)
        # a quarter, not a half: the pools grow by doublings, so a stream opening and closing at the
        # edge must not make them grow and shrink in turn
        if used <= held // 4:
            self._slots.truncate(used)
            for pool in self._pools:
                pool.shrink(used)


_cache_serials = itertools.count()


class GrowingRows:
    """Every key (or value) row of a global layer from position 0, kept in blocks of `KV_BLOCK` positions.

    The storage is [blocks, heads, KV_BLOCK, D]: within a block each head's rows are consecutive, so
    attention reads the blocks as they lie (no transpose of the history per step), and any prefix of
    blocks is a view of the storage, not a copy. Blocks are allocated in doublings up to `limit`
    positions.
    """

    def __init__(self, limit: int, row_shape: tuple[int, int], initial: int = 64, dtype: str = "float32") -> None:
        self.limit = limit
        self.serial = next(_cache_serials)  # names this cache to the far stacks, which outlive it
        heads, width = row_shape
        self.data = np.zeros((blocks_for(min(initial, limit)), heads, KV_BLOCK, width), dtype=dtype)
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
        return min(blocks, cache_blocks(self.limit))

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

    def copy_from(self, other: GrowingRows, rows: int) -> None:
        """Hold `other`'s first `rows` positions (whole blocks: later rows are overwritten as they come)."""
        self.reserve(rows)
        blocks = blocks_for(rows)
        self.data[:blocks] = other.data[:blocks]
        if self.params is not None and other.params is not None:
            self.params[:blocks] = other.params[:blocks]

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


Rows = RingRows | GrowingRows


@dataclass(frozen=True)
class HistorySlots:
    """Where a step's short-convolution histories lie in the streams' rings.

    Stream b's inputs at positions start-K+1 .. start-1, oldest first, are rows `slots[b]` [S, K-1]
    of its convolution ring (all conv rings of a stage have one capacity); `before_start` marks the
    rows of the concatenated histories that precede a stream's first position, which read as zeros
    (None when no stream is that young). Worked out once per step, not per layer.
    """

    slots: np.ndarray
    before_start: np.ndarray | None


def history_slots(starts: list[int], kernel: int, capacity: int) -> HistorySlots:
    positions = np.asarray(starts)[:, None] + np.arange(1 - kernel, 0)
    slots = np.maximum(positions, 0) % capacity
    young = positions < 0
    return HistorySlots(slots, young.reshape(-1) if young.any() else None)


def conv_histories(pool: RingPool, streams: np.ndarray, where: HistorySlots) -> np.ndarray:
    """The histories of the streams in pool slots `streams`, concatenated [S * (K - 1), width]."""
    rows = pool.data[streams[:, None], where.slots].reshape(-1, pool.data.shape[-1])
    if where.before_start is not None:
        rows[where.before_start] = 0.0
    return rows


@dataclass(frozen=True)
class LayerRings:
    """A layer's ring pools: sliding keys and values (None on global layers, whose caches grow per
    stream) and the short-convolution inputs (None without convolutions)."""

    keys: RingPool | None
    values: RingPool | None
    convs: RingPool | None

    @property
    def pools(self) -> list[RingPool]:
        return [pool for pool in (self.keys, self.values, self.convs) if pool is not None]


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
    ring_slot: int = -1  # the stream's slot in its stage's ring pools (-1: a stage without rings)
    reached: int = 0  # the furthest position fed, which a rewind may go back at most `slack` from

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    def advance(self, count: int) -> None:
        self.position += count
        self.reached = max(self.reached, self.position)

    def rewind(self, position: int) -> None:
        """Step back to `position`, at most `slack` positions behind the furthest the stream has been fed.

        The bound is from the furthest position, not the current one: the rings keep the rows of the
        last window plus slack positions before it, so a second rewind right after a first must not
        reach back to rows the later positions have overwritten.
        """
        if not 0 <= position <= self.position:
            raise ValueError(f"cannot rewind to position {position}: the stream is at {self.position}")
        if self.reached - position > self.slack:
            behind = f" (it has been fed to {self.reached})" if self.reached > self.position else ""
            raise ValueError(
                f"cannot rewind {self.reached - position} positions{behind}: the rewind slack is {self.slack}"
            )
        self.position = position
