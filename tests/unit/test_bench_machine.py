"""What a benchmark records of the machine it ran on."""

from __future__ import annotations

import pytest

from cascadia.bench.machine import (
    cache_share,
    cache_size_bytes,
    last_level_cache_bytes,
)


@pytest.mark.parametrize(
    ("text", "size"),
    [("491520K", 480 << 20), ("2048K\n", 2 << 20), ("480 MiB", 480 << 20), ("1G", 1 << 30), ("512", 512)],
)
def test_cache_sizes_read_as_sysfs_and_lscpu_write_them(text, size):
    assert cache_size_bytes(text) == size


def test_a_cache_size_that_is_not_one_is_named():
    with pytest.raises(ValueError, match="'lots'"):
        cache_size_bytes("lots")


def write_cache(root, index, level, kind, size):
    entry = root / f"index{index}"
    entry.mkdir()
    (entry / "level").write_text(f"{level}\n")
    (entry / "type").write_text(f"{kind}\n")
    (entry / "size").write_text(f"{size}\n")


def test_the_last_level_cache_is_the_highest_data_or_unified_level(tmp_path):
    write_cache(tmp_path, 0, 1, "Data", "48K")
    write_cache(tmp_path, 1, 1, "Instruction", "64K")
    write_cache(tmp_path, 2, 2, "Unified", "2048K")
    assert last_level_cache_bytes(tmp_path) == 2048 << 10
    write_cache(tmp_path, 3, 4, "Instruction", "4096K")  # an instruction cache holds no weights
    assert last_level_cache_bytes(tmp_path) == 2048 << 10
    write_cache(tmp_path, 4, 3, "Unified", "32768K")
    assert last_level_cache_bytes(tmp_path) == 32 << 20


def test_no_reported_cache_is_none(tmp_path):
    assert last_level_cache_bytes(tmp_path) is None
    assert cache_share(1e6, None) is None


def test_the_cache_holds_at_most_the_whole_step():
    assert cache_share(4e9, 1 << 30) == pytest.approx((1 << 30) / 4e9)
    assert cache_share(1e6, 1 << 30) == 1.0
