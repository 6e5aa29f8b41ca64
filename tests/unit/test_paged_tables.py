"""The sequence tables PagedAttention reads, and the block pool behind them (pure, no OpenVINO)."""

from __future__ import annotations

import numpy as np
import pytest

from cascadia.engine.batch import Segment
from cascadia.engine.paged import PAGE, BlockPool, paged_tables
from cascadia.engine.state import BudgetExceeded


def test_tables_lay_out_streams_at_different_positions():
    # "a" decodes its 41st position (two blocks); "b" prefills three rows (one block)
    tables = paged_tables([Segment("a", 40, 1), Segment("b", 0, 3)], [[5, 2, 9], [7]])
    assert tables.past_lens.tolist() == [40, 0]
    assert tables.subsequence_begins.tolist() == [0, 1, 4]
    assert tables.block_indices.tolist() == [5, 2, 7]  # "a"'s third block holds nothing yet
    assert tables.block_indices_begins.tolist() == [0, 2, 3]
    assert int(tables.max_context_len) == 41
    assert tables.row_position.tolist() == [40, 0, 1, 2]
    assert all(v.dtype == np.int32 for v in tables.as_inputs().values())


def test_a_block_table_too_short_for_its_rows_is_refused():
    with pytest.raises(ValueError, match="'a': 1 blocks cannot hold 33 positions"):
        paged_tables([Segment("a", 30, 3)], [[0]])
    with pytest.raises(ValueError, match="twice"):
        paged_tables([Segment("a", 0, 1), Segment("a", 0, 1)], [[0], [0]])


def test_pool_grows_by_doubling_keeps_its_blocks_and_reuses_released_ones():
    pool = BlockPool(layers=2, kv_heads=1, head_dim=4, dtype="float32", initial=2)
    first = pool.allocate(2)
    pool.keys[1][first[1]] = 7.0
    generation = pool.generation
    more = pool.allocate(3)  # 5 blocks needed: 2 -> 4 -> 8
    assert pool.capacity == 8 and pool.generation == generation + 1
    assert len(set(first + more)) == 5
    assert (pool.keys[1][first[1]] == 7.0).all()
    assert pool.keys[0].shape == (8, 1, PAGE, 4)
    pool.release(more)
    assert sorted(pool.allocate(3)) == sorted(more)
    assert pool.block_bytes == 2 * 2 * PAGE * 4 * 4


def test_pool_shrinks_once_the_blocks_in_use_lie_in_its_lowest_quarter_and_keeps_them():
    pool = BlockPool(layers=1, kv_heads=1, head_dim=4, dtype="float32", initial=2)
    kept = pool.allocate(1)
    pool.keys[0][kept[0]] = 5.0
    burst = pool.allocate(15)  # 16 blocks
    assert pool.capacity == 16 and kept == [0]
    pool.release(burst[:8])
    assert pool.capacity == 16  # blocks 9..15 still in use
    generation = pool.generation
    pool.release(burst[8:])
    assert pool.capacity == 2 and pool.generation == generation + 1  # bound requests must bind again
    assert (pool.keys[0][0] == 5.0).all() and pool.free_blocks == 1
    # a stream opening and closing at the edge: grows once, then stays
    edge = pool.allocate(2)
    assert pool.capacity == 4
    pool.release(edge)
    assert pool.capacity == 4 and sorted(pool.allocate(2)) == sorted(edge)


def test_pool_past_its_budget_is_a_clear_error_and_hands_out_nothing():
    pool = BlockPool(layers=1, kv_heads=1, head_dim=4, dtype="float16", max_blocks=4, initial=2)
    pool.allocate(3)
    with pytest.raises(BudgetExceeded, match="needs 6 blocks"):
        pool.allocate(3)
    assert pool.free_blocks == 1
