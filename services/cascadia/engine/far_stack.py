"""Many streams' far blocks as one array, kept from step to step and brought up to date block by block.

A global layer's attention takes the far blocks of every stream in a step as one input [S, N, ...].
Copying them all at every step cost more than the attention over them (8 streams of 4,096 positions
on the mini preset: 19 ms of a 126 ms step). Between two decode steps of the same streams only each
stream's last far block changes, so the stack keeps its copy and rewrites only the blocks that may
have changed since.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class FarStack:
    """The far blocks of the streams of the last step that had them, for one input of one layer.

    A row may be kept without copying it again once it can no longer change: rewinds never reach it
    (`fixed`, the stream's furthest position fed less its rewind slack). Rows after that are copied at
    every step they are far. A different list of streams, or a different block count, starts over.
    """

    def __init__(self) -> None:
        self.data: np.ndarray | None = None
        self._owners: tuple[int, ...] = ()
        self._kept = np.zeros(0, dtype=np.int64)  # leading rows of each stream that are copied and final

    def gather(
        self, owners: tuple[int, ...], sources: Sequence[np.ndarray], blocks: int, far: np.ndarray, fixed: np.ndarray
    ) -> np.ndarray:
        """[S, blocks, ...]: stream i's first ceil(far[i] / block) blocks of `sources[i]`, the rest as they were.

        `owners` names the streams' caches (a cache's serial, never reused); `far` and `fixed` are each
        stream's far rows in this step and the rows that can no longer change.
        """
        shape = (len(sources), blocks, *sources[0].shape[1:])
        if self.data is None or self.data.shape != shape or self._owners != owners:
            self.data = np.zeros(shape, dtype=sources[0].dtype)
            self._owners = owners
            self._kept = np.zeros(len(sources), dtype=np.int64)
        block = shape[3]  # [S, N, heads, block, ...]
        for i, source in enumerate(sources):
            first = int(self._kept[i]) // block
            last = -(-int(far[i]) // block)
            if last > first:
                self.data[i, first:last] = source[first:last]
            self._kept[i] = max(int(self._kept[i]), min(last * block, int(fixed[i])))
        return self.data

    @property
    def nbytes(self) -> int:
        return 0 if self.data is None else self.data.nbytes
