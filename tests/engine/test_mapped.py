"""Compiled stages read their weights through a file mapping, and give what in-memory weights give."""

from __future__ import annotations

import gc
import logging
import os
import time
from pathlib import Path

import numpy as np
import pytest

from cascadia.engine import mapped
from cascadia.engine.batch import Segment
from cascadia.engine.engine import StageEngine
from cascadia.engine.settings import EngineSettings
from cascadia.model.loader import load_shape, load_stage, resolve


def _mapped_weight_files(root: Path) -> list[str]:
    lines = Path("/proc/self/maps").read_text().splitlines()
    return [line for line in lines if str(root) in line and "stage.bin" in line]


def _decode(engine: StageEngine, prompt: list[int], steps: int) -> tuple[list[int], np.ndarray]:
    engine.open("s")
    try:
        logits = engine.step([Segment("s", 0, len(prompt))], np.array(prompt), np.array([len(prompt) - 1])).logits
        ids, last = [int(logits[-1].argmax())], logits[-1]
        for position in range(len(prompt), len(prompt) + steps - 1):
            last = engine.step([Segment("s", position, 1)], np.array(ids[-1:])).logits[-1]
            ids.append(int(last.argmax()))
        return ids, last
    finally:
        engine.close("s")


@pytest.mark.parametrize("model", ["tiny", "smollm2-135m"])
def test_mapped_weights_give_the_in_memory_outputs_and_leave_no_files(model, tiny, tmp_path, monkeypatch):
    monkeypatch.setenv(mapped.CACHE_ENV, str(tmp_path))
    path = tiny if model == "tiny" else resolve(model)
    layers = load_shape(path).num_layers
    in_memory = StageEngine(load_stage(path, 0, layers), EngineSettings(map_weights=False))
    assert not _mapped_weight_files(tmp_path)
    on_disk = StageEngine(load_stage(path, 0, layers), EngineSettings())
    # the weight files are gone from the directory, yet mapped (deleted) until the engine goes
    assert list(tmp_path.iterdir()) == []
    assert _mapped_weight_files(tmp_path) and all("(deleted)" in line for line in _mapped_weight_files(tmp_path))
    prompt = [5, 17, 300, 42, 77, 9]
    ids, logits = _decode(on_disk, prompt, 12)
    expected_ids, expected_logits = _decode(in_memory, prompt, 12)
    assert ids == expected_ids
    np.testing.assert_array_equal(logits, expected_logits)
    del on_disk
    gc.collect()
    assert not _mapped_weight_files(tmp_path)


def test_a_paged_last_stage_alone_reads_its_attention_back(tmp_path, monkeypatch):
    """The last stage compiles PagedAttention first thing: its ops and run-time info survive the file."""
    monkeypatch.setenv(mapped.CACHE_ENV, str(tmp_path))
    path = resolve("smollm2-135m")
    layers = load_shape(path).num_layers
    engine = StageEngine(load_stage(path, layers - 2, layers), EngineSettings())
    assert _mapped_weight_files(tmp_path)
    engine.open("s")
    hidden = np.random.default_rng(0).standard_normal((3, engine.shape.hidden_size)).astype(np.float32)
    logits = engine.step([Segment("s", 0, 3)], hidden).logits
    assert logits.shape == (3, engine.shape.vocab_size) and np.isfinite(logits).all()


def test_an_unwritable_directory_keeps_weights_in_memory_and_says_so(tiny, tmp_path, monkeypatch, caplog):
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    monkeypatch.setenv(mapped.CACHE_ENV, str(blocked / "cache"))
    monkeypatch.setattr(mapped, "_warned", False)
    with caplog.at_level(logging.WARNING, logger="cascadia.engine.mapped"):
        engine = StageEngine(load_stage(tiny, 0, load_shape(tiny).num_layers), EngineSettings())
    assert [r for r in caplog.records if "weights stay in memory" in r.getMessage()]
    assert len(caplog.records) == 1  # said once, not once per compiled graph
    ids, _ = _decode(engine, [5, 17, 300], 4)
    assert len(ids) == 4


def test_directories_left_by_a_dead_process_are_swept_and_fresh_ones_kept(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv(mapped.CACHE_ENV, str(tmp_path))
    old, fresh = tmp_path / "stage-old", tmp_path / "stage-fresh"
    for d in (old, fresh):
        d.mkdir()
        (d / "stage.bin").write_bytes(b"x")
    hours_ago = time.time() - 2 * mapped.STALE_AFTER_S
    os.utime(old, (hours_ago, hours_ago))
    assert mapped.stale_dirs(tmp_path, time.time()) == [old]
    StageEngine(load_stage(tiny, 0, load_shape(tiny).num_layers), EngineSettings())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stage-fresh"]


def test_memory_in_use_leaves_out_the_pages_of_mapped_files(tmp_path):
    """What the shard's memory probe counts: a file read through a mapping makes the process larger
    by its size, but not the memory in use, as the system can drop those pages and read them again."""
    import mmap

    import psutil

    from cascadia.engine.memory import resident_in_use

    size = 64 << 20
    path = tmp_path / "weights.bin"
    path.write_bytes(os.urandom(size))
    rss, in_use = psutil.Process().memory_info().rss, resident_in_use()
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
        touched = np.frombuffer(view, dtype=np.uint8)[::4096].sum()  # one byte of every page
        assert touched >= 0
        grown = psutil.Process().memory_info().rss - rss
        added = resident_in_use() - in_use
        del touched
    assert grown > size // 2
    assert added < size // 8


def test_the_igpu_keeps_compiled_kernels_in_the_node_s_compile_cache_and_the_cpu_does_not(tmp_path, monkeypatch):
    import openvino as ov

    from cascadia.engine.mapped import COMPILE_CACHE_ENV, use_compile_cache

    monkeypatch.setenv(COMPILE_CACHE_ENV, str(tmp_path / "kernels"))
    cpu = ov.Core()
    assert use_compile_cache(cpu, "CPU") is None and cpu.get_property("CACHE_DIR") == ""
    gpu = ov.Core()
    assert use_compile_cache(gpu, "GPU") == tmp_path / "kernels"
    assert gpu.get_property("CACHE_DIR") == str(tmp_path / "kernels") and (tmp_path / "kernels").is_dir()
    monkeypatch.delenv(COMPILE_CACHE_ENV)
    assert use_compile_cache(ov.Core(), "GPU") is None
