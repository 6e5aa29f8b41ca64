"""Pure planning of one engine step: which rows, history and keys each row of the batch sees.

A step is a list of segments, one per stream: `length` consecutive positions starting at `start`
(a prefill window, a decode row, or a verify run). Rows are laid out segment after segment.
Nothing here touches weights or OpenVINO, so it is tested with hand-made inputs.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from cascadia.kv_layout import KV_BLOCK, far_blocks_for, steady_size

NEG_INF = np.float32(-np.inf)


@dataclass(frozen=True)
class Segment:
    stream: Hashable
    start: int
    length: int


@dataclass(frozen=True)
class KeyPlan:
    """Keys for one attention kind (a sliding window, or unbounded for global layers).

    Each stream's cached keys are read into two regions. The far region (global layers with a
    relative bias) holds keys every row of the step sees with no bias (distance >= the bias extent):
    positions 0 .. far - 1, read straight from the cache's blocks with only a per-stream mask,
    whatever the history's length. The band holds the nearest cached keys and this step's own, where
    visibility and bias depend on the row: those tables are [T, band], not [T, history].
    """

    past_positions: np.ndarray  # [S, 1 + Ln] the band's cached positions: a padding slot, then the near keys; -1 = pad
    step_keys: np.ndarray  # [T, W] rows of this step a row may attend to (its own stream's)
    key_mask: np.ndarray  # [T, Ln + W] 0 or -inf, over the band
    key_distance: np.ndarray  # [T, Ln + W] query position - key position, over the band
    far_keys: np.ndarray  # [S] far keys of each stream (all zero without a far region)
    far_blocks: int = 0  # cache blocks the far region spans (0: no far region)
    far_mask: np.ndarray | None = None  # [S, far_blocks * block] 0 on far keys, -inf elsewhere


@dataclass(frozen=True)
class StepPlan:
    segments: tuple[Segment, ...]
    row_stream: np.ndarray  # [T] segment index of each row
    row_position: np.ndarray  # [T]
    row_offset: np.ndarray  # [S] first row of each segment
    conv_index: np.ndarray  # [T, K] into [history rows (S*(K-1)); step rows]
    keys: dict[int | None, KeyPlan]
    # rows laid out per stream for attention: cell s*W + j is row j of segment s (W = longest segment);
    # a padding cell repeats its segment's first row and is never read back
    cell_rows: np.ndarray  # [S * W]
    row_cells: np.ndarray  # [T]

    @property
    def rows(self) -> int:
        return int(self.row_stream.shape[0])


def check_segments(segments: Sequence[Segment]) -> None:
    """A step has at least one segment, none empty, and at most one per stream."""
    if not segments:
        raise ValueError("a step needs at least one segment")
    seen: set[Hashable] = set()
    for seg in segments:
        if seg.length < 1 or seg.start < 0:
            raise ValueError(f"stream {seg.stream!r}: segment start {seg.start} length {seg.length} is empty")
        if seg.stream in seen:
            raise ValueError(f"stream {seg.stream!r} appears twice in one step")
        seen.add(seg.stream)


def plan_step(
    segments: Sequence[Segment],
    kernel: int,
    windows: Sequence[int | None],
    global_band: int | None = None,
    far_block: int = KV_BLOCK,
) -> StepPlan:
    """Index tables for a step over `segments` with conv kernel `kernel` and the given attention windows.

    `global_band`: cached keys nearer than this may carry a row-dependent bias on global layers (the
    relative extent - 1; 0 with no bias); farther ones go to the far region, read in cache blocks of
    `far_block` positions. None keeps every cached key in the band.
    """
    check_segments(segments)
    lengths = np.array([s.length for s in segments], dtype=np.int64)
    starts = np.array([s.start for s in segments], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    row_stream = np.repeat(np.arange(len(segments)), lengths)
    within = np.arange(int(lengths.sum())) - offsets[row_stream]  # j: row's index inside its segment
    row_position = starts[row_stream] + within

    # conv taps: tap k of a row reads position p - (K-1) + k; lag m = K-1-k
    history = len(segments) * (kernel - 1)
    lags = np.arange(kernel - 1, -1, -1)
    in_step = within[:, None] >= lags[None, :]
    step_index = history + offsets[row_stream][:, None] + within[:, None] - lags[None, :]
    # history row b*(K-1) + (K-1-m') holds position start - m' (oldest first)
    back = lags[None, :] - within[:, None]  # m' = how far before the segment start
    hist_index = row_stream[:, None] * (kernel - 1) + (kernel - 1) - back
    conv_index = np.where(in_step, step_index, hist_index).astype(np.int32)

    keys = {
        window: _key_plan(
            starts,
            lengths,
            offsets,
            row_stream,
            row_position,
            window,
            global_band if window is None else None,
            far_block,
        )
        for window in set(windows)
    }
    width = int(lengths.max())
    j = np.arange(width)
    cell_rows = np.where(j[None, :] < lengths[:, None], offsets[:, None] + j[None, :], offsets[:, None]).reshape(-1)
    row_cells = row_stream * width + within
    return StepPlan(
        tuple(segments),
        row_stream.astype(np.int32),
        row_position,
        offsets.astype(np.int32),
        conv_index,
        keys,
        cell_rows.astype(np.int32),
        row_cells.astype(np.int32),
    )


def _key_plan(
    starts: np.ndarray,
    lengths: np.ndarray,
    offsets: np.ndarray,
    row_stream: np.ndarray,
    row_position: np.ndarray,
    window: int | None,
    band: int | None,
    block: int,
) -> KeyPlan:
    first = np.zeros_like(starts) if window is None else np.maximum(0, starts - (window - 1))
    counts = starts - first
    near_slots = int(counts.max()) if band is None else min(band, int(counts.max()))
    near = np.minimum(counts, near_slots)
    far = counts - near
    most = band if band is not None else (None if window is None else window - 1)
    near_slots = steady_size(near_slots, most)
    # slot 0 is always padding; the near keys are right-aligned, so a band slot means the same
    # distance for every stream
    slot = np.arange(1 + near_slots)
    near_start = 1 + near_slots - near
    in_near = slot[None, :] >= near_start[:, None]
    past_positions = np.where(in_near, first[:, None] + far[:, None] + slot[None, :] - near_start[:, None], -1)
    far_blocks, far_mask = 0, None
    if band is not None:  # global layers: far keys are positions 0 .. far - 1, read in cache blocks
        far_blocks = far_blocks_for(int(far.max()), block)
        position = np.arange(far_blocks * block)
        far_mask = np.where(position[None, :] < far[:, None], np.float32(0.0), NEG_INF).astype(np.float32)

    width = int(lengths.max())
    w = np.arange(width)
    seg_len = lengths[row_stream]
    step_keys = np.where(w[None, :] < seg_len[:, None], offsets[row_stream][:, None] + w[None, :], 0)
    step_pos = np.where(w[None, :] < seg_len[:, None], starts[row_stream][:, None] + w[None, :], -1)

    key_pos = np.concatenate([past_positions[row_stream, 1:], step_pos], axis=1)
    distance = row_position[:, None] - key_pos
    visible = (key_pos >= 0) & (distance >= 0)
    if window is not None:
        visible &= distance < window
    mask = np.where(visible, np.float32(0.0), NEG_INF).astype(np.float32)
    return KeyPlan(
        past_positions.astype(np.int64),
        step_keys.astype(np.int32),
        mask,
        np.where(key_pos >= 0, distance, -1).astype(np.int32),
        far.astype(np.int64),
        far_blocks,
        far_mask,
    )
