"""The pure step planner, from hand-made segments."""

from __future__ import annotations

import numpy as np
import pytest

from cascadia.engine.batch import Segment, plan_step
from cascadia.kv_layout import steady_size


def test_rows_are_laid_out_segment_after_segment():
    plan = plan_step([Segment("a", 5, 1), Segment("b", 0, 3)], kernel=4, windows=[None])
    assert plan.row_stream.tolist() == [0, 1, 1, 1]
    assert plan.row_position.tolist() == [5, 0, 1, 2]
    assert plan.row_offset.tolist() == [0, 1]


def test_conv_taps_read_history_then_rows_of_the_same_step():
    plan = plan_step([Segment("a", 5, 1), Segment("b", 0, 3)], kernel=3, windows=[None])
    history = 2 * 2  # two streams, K - 1 = 2 rows each
    # stream a, one decode row: its two history rows, then itself
    assert plan.conv_index[0].tolist() == [0, 1, history + 0]
    # stream b's third row: both taps before it are rows of this step
    assert plan.conv_index[3].tolist() == [history + 1, history + 2, history + 3]
    # stream b's first row: its history (zeros for a fresh stream), then itself
    assert plan.conv_index[1].tolist() == [2, 3, history + 1]


def test_sliding_keys_stop_at_the_window_and_global_keys_do_not():
    plan = plan_step([Segment("a", 10, 2)], kernel=4, windows=[4, None])
    sliding, full = plan.keys[4], plan.keys[None]
    # slot 0 is the far region's padding; with no band given every cached key is in the band
    assert sliding.past_positions.tolist() == [[-1, 7, 8, 9]]
    assert full.past_positions.tolist() == [[-1, *range(10)]]
    assert sliding.far_mask is None and full.far_mask is None
    visible = np.isfinite(sliding.key_mask)
    # row at position 10 sees 7, 8, 9 and itself; row 11 sees 8, 9, 10, 11
    assert visible.tolist() == [[True, True, True, True, False], [False, True, True, True, True]]
    assert sliding.key_distance[1].tolist() == [4, 3, 2, 1, 0]
    assert np.isfinite(full.key_mask).sum(axis=1).tolist() == [11, 12]


def test_padding_slots_are_masked():
    plan = plan_step([Segment("a", 0, 1), Segment("b", 3, 1)], kernel=2, windows=[None])
    keys = plan.keys[None]
    assert keys.past_positions.tolist() == [[-1, -1, -1, -1], [-1, 0, 1, 2]]
    assert np.isfinite(keys.key_mask).tolist() == [[False, False, False, True], [True, True, True, True]]


def test_global_keys_beyond_the_bias_band_go_to_the_far_region():
    """With a band of 2, stream a (10 cached) keeps its 2 nearest keys row-dependent and 8 in the far
    region; stream b (3 cached) 2 and 1; c (1 cached) has no far key. The band is right-aligned, so
    its slots mean the same distance for every stream; far keys are positions 0 .. far - 1, read as
    cache blocks under a mask, and at least a band away from every row."""
    segments = [Segment("a", 10, 2), Segment("b", 3, 1), Segment("c", 1, 1)]
    keys = plan_step(segments, kernel=4, windows=[None], global_band=2, far_block=4).keys[None]
    assert keys.past_positions.tolist() == [[-1, 8, 9], [-1, 1, 2], [-1, -1, 0]]
    assert keys.far_keys.tolist() == [8, 1, 0]
    assert keys.far_blocks == 2
    assert keys.far_mask is not None
    assert np.isfinite(keys.far_mask).tolist() == [[True] * 8, [True] + [False] * 7, [False] * 8]
    # the band: 2 cached slots and this step's 2 (rows of a, then b, then c)
    assert keys.key_distance.tolist() == [[2, 1, 0, -1], [3, 2, 1, 0], [2, 1, 0, -1], [-1, 1, 0, -1]]
    assert np.isfinite(keys.key_mask).tolist() == [
        [True, True, True, False],
        [True, True, True, True],
        [True, True, True, False],
        [False, True, True, False],
    ]
    row_positions = np.array([10, 11, 3, 1])
    stream_of_row = np.array([0, 0, 1, 2])
    far_positions = np.arange(8)
    visible = np.isfinite(keys.far_mask)[stream_of_row]
    nearest_far = np.where(visible, row_positions[:, None] - far_positions[None, :], 99).min(axis=1)
    assert (nearest_far >= 3).all()  # the bias extent is band + 1


def test_with_no_bias_band_every_cached_key_is_far_and_the_band_is_the_step_itself():
    """Llama's layers: cached keys are read as cache blocks under a per-stream mask; the band is the
    step's own rows, so the per-row tables stay [T, W] however long the history grows."""
    keys = plan_step([Segment("a", 10, 2)], kernel=4, windows=[None], global_band=0, far_block=4).keys[None]
    assert keys.past_positions.tolist() == [[-1]]
    assert keys.far_keys.tolist() == [10] and keys.far_blocks == 3
    assert keys.far_mask is not None
    assert np.isfinite(keys.far_mask).tolist() == [[True] * 10 + [False] * 2]
    assert np.isfinite(keys.key_mask).tolist() == [[True, False], [True, True]]
    fresh = plan_step([Segment("a", 0, 1)], kernel=4, windows=[None], global_band=0, far_block=4).keys[None]
    assert fresh.far_blocks == 1 and not np.isfinite(fresh.far_mask).any()


def test_far_blocks_grow_in_steps_of_at_most_an_eighth():
    counts = [steady_size(n) for n in range(1, 1025)]
    assert counts[:8] == list(range(1, 9))
    assert all(n <= c <= n + n / 8 for n, c in zip(range(1, 1025), counts, strict=True))
    assert counts == sorted(counts)
    # a history growing from 512 to 1024 blocks changes the far input's shape 8 times, not 512
    assert len(set(counts[512:1024])) == 8


def test_a_long_history_reads_padded_far_blocks_that_are_wholly_masked():
    keys = plan_step([Segment("a", 1300, 1)], kernel=4, windows=[None], global_band=2, far_block=4).keys[None]
    assert keys.far_keys.tolist() == [1298]
    assert keys.far_blocks == steady_size(325) == 352
    assert keys.far_mask is not None
    assert np.isfinite(keys.far_mask).sum() == 1298 and np.isfinite(keys.far_mask[0, :1298]).all()


def test_a_growing_band_is_padded_to_steady_sizes_but_never_beyond_what_the_window_holds():
    keys = plan_step([Segment("a", 19, 1)], kernel=4, windows=[32]).keys[32]
    assert keys.past_positions.tolist() == [[-1, -1, *range(19)]]
    assert np.isfinite(keys.key_mask).sum() == 19 + 1
    assert keys.key_distance[0, 0] == -1
    full = plan_step([Segment("a", 40, 1)], kernel=4, windows=[32]).keys[32]
    assert full.past_positions.tolist() == [[-1, *range(9, 40)]]


def test_without_a_far_region_every_cached_key_is_in_the_band():
    keys = plan_step([Segment("a", 10, 1)], kernel=4, windows=[None]).keys[None]
    assert keys.past_positions.tolist() == [[-1, *range(10)]]
    assert keys.far_blocks == 0 and keys.far_mask is None


@pytest.mark.parametrize(
    ("segments", "message"),
    [
        ([], "at least one segment"),
        ([Segment("a", 0, 0)], "is empty"),
        ([Segment("a", 0, 1), Segment("a", 1, 1)], "appears twice"),
    ],
)
def test_bad_steps_are_refused(segments, message):
    with pytest.raises(ValueError, match=message):
        plan_step(segments, kernel=4, windows=[None])
