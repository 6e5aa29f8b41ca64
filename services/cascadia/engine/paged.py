"""Paged KV cache for Llama-family stages: one block pool per layer, a block table per stream.

The stage graph's attention is OpenVINO's PagedAttention op, which writes each step's keys and
values into the pool in place and reads every stream's history through its block table, so a step
passes only the tables (no cache inputs or outputs per layer, no host-side writes). Every layer of
a stage holds the same positions of a stream, so one block table serves all of them.

`paged_tables` is the pure part: from the step's segments and each stream's blocks, the op's
sequence tables. `BlockPool` owns the storage: blocks are handed out lowest first, the pool grows by
doublings and shrinks once the blocks in use lie low; each resize bumps `generation`, so a caller
knows to bind the new arrays.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cascadia.engine.batch import Segment, check_segments
from cascadia.engine.state import BudgetExceeded, LowestFirst

PAGE = 32  # positions per block: the CPU plugin's PagedAttention kernel runs blocks of 32


def blocks_for(positions: int) -> int:
    return -(-positions // PAGE)


@dataclass(frozen=True)
class PagedTables:
    """The sequence tables of PagedAttention for one step, rows in segment order."""

    past_lens: np.ndarray  # [S] positions cached before this step
    subsequence_begins: np.ndarray  # [S + 1] first row of each segment
    block_indices: np.ndarray  # [sum of blocks] each stream's blocks, in position order
    block_indices_begins: np.ndarray  # [S + 1]
    max_context_len: np.ndarray  # [] the longest stream after this step
    row_position: np.ndarray  # [T] each row's absolute position (for the rotary embedding)

    def as_inputs(self) -> dict[str, np.ndarray]:
        return {
            "past_lens": self.past_lens,
            "subsequence_begins": self.subsequence_begins,
            "block_indices": self.block_indices,
            "block_indices_begins": self.block_indices_begins,
            "max_context_len": self.max_context_len,
        }


def paged_tables(segments: Sequence[Segment], tables: Sequence[Sequence[int]]) -> PagedTables:
    """Tables for a step; `tables[b]` must cover segment b's positions up to start + length."""
    check_segments(segments)
    lengths = np.array([s.length for s in segments], dtype=np.int32)
    starts = np.array([s.start for s in segments], dtype=np.int32)
    ends = starts + lengths
    used = [list(table[: blocks_for(int(end))]) for table, end in zip(tables, ends, strict=True)]
    for seg, table, end in zip(segments, used, ends, strict=True):
        if len(table) < blocks_for(int(end)):
            raise ValueError(f"stream {seg.stream!r}: {len(table)} blocks cannot hold {int(end)} positions")
    begins = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    within = np.arange(int(begins[-1]), dtype=np.int32) - np.repeat(begins[:-1], lengths)
    return PagedTables(
        past_lens=starts,
        subsequence_begins=begins,
        block_indices=np.fromiter((b for table in used for b in table), dtype=np.int32),
        block_indices_begins=np.concatenate([[0], np.cumsum([len(t) for t in used])]).astype(np.int32),
        max_context_len=np.array(int(ends.max()), dtype=np.int32),
        row_position=np.repeat(starts, lengths) + within,
    )


class BlockPool:
    """Key and value blocks [blocks, kv_heads, PAGE, head_dim] for each layer of a stage."""

    def __init__(
        self, layers: int, kv_heads: int, head_dim: int, dtype: str, max_blocks: int | None = None, initial: int = 16
    ) -> None:
        self.max_blocks = max_blocks
        shape = (initial if max_blocks is None else min(initial, max_blocks), kv_heads, PAGE, head_dim)
        self.keys = [np.zeros(shape, dtype=dtype) for _ in range(layers)]
        self.values = [np.zeros(shape, dtype=dtype) for _ in range(layers)]
        self._initial = shape[0]
        # the lowest free block is handed out first, so that after a burst of long streams the blocks
        # still in use lie low and the pool can shrink to them
        self._free = LowestFirst(shape[0])
        self.generation = 0

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[0] if self.keys else 0

    @property
    def block_bytes(self) -> int:
        """Bytes one block of one stream costs across every layer (keys and values)."""
        return sum(k[0].nbytes + v[0].nbytes for k, v in zip(self.keys, self.values, strict=True))

    @property
    def nbytes(self) -> int:
        """Every block the pool has allocated, the free ones too."""
        return self.capacity * self.block_bytes

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            self._grow(self.capacity - len(self._free) + count)
        return [self._free.take() for _ in range(count)]

    def release(self, blocks: Sequence[int]) -> None:
        """Take blocks back; once the blocks in use all lie below the lowest quarter, shrink to them.

        A quarter, not a half: the pool grows by doublings, so a stream opening and closing at the
        edge must not make it grow and shrink in turn.
        """
        for block in blocks:
            self._free.give_back(block)
        top = self._free.span()
        size = max(self._initial, top)
        if top < self.capacity // 4 and size < self.capacity:
            self._resize(size)
            self._free.truncate(size)

    def _grow(self, needed: int) -> None:
        if self.max_blocks is not None and needed > self.max_blocks:
            raise BudgetExceeded(
                f"the KV pool needs {needed} blocks of {PAGE} positions; its budget is {self.max_blocks}"
            )
        size = self.capacity
        while size < needed:
            size *= 2
        if self.max_blocks is not None:
            size = min(size, self.max_blocks)
        self._resize(size)
        self._free.extend(size)

    def _resize(self, size: int) -> None:
        """Hold `size` blocks (keeping the first ones); requests bound to the old arrays must bind again."""
        for arrays in (self.keys, self.values):
            for n, array in enumerate(arrays):
                resized = np.zeros((size, *array.shape[1:]), dtype=array.dtype)
                kept = min(size, array.shape[0])
                resized[:kept] = array[:kept]
                arrays[n] = resized
        self.generation += 1
