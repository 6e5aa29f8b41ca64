"""Stream state: windows, rewinds, batching across streams, budgets."""

from __future__ import annotations

import gc
import itertools
import threading
import time
import weakref

import numpy as np
import pytest

from cascadia.engine.batch import Segment
from cascadia.engine.engine import StageEngine, StreamError
from cascadia.engine.settings import EngineSettings
from cascadia.engine.state import BudgetExceeded
from cascadia.model.checkpoint import load_stage
from cascadia.model.config import load_shape

IDS = np.array([1, *range(30, 90)])


@pytest.fixture(scope="module")
def engine(tiny) -> StageEngine:
    return StageEngine(load_stage(tiny, 0, load_shape(tiny).num_layers), EngineSettings(context=256))


def feed(engine: StageEngine, stream: str, ids: np.ndarray, window: int, start: int = 0) -> np.ndarray:
    logits = []
    position = start
    while position < start + len(ids):
        n = min(window, start + len(ids) - position)
        chunk = ids[position - start : position - start + n]
        logits.append(engine.step([Segment(stream, position, n)], chunk).logits)
        position += n
    return np.concatenate(logits)


def test_prefill_windows_equal_token_by_token_decode(engine):
    results = {}
    for window in (1, 3, 8, len(IDS)):
        engine.open(f"w{window}")
        results[window] = feed(engine, f"w{window}", IDS, window)
        engine.close(f"w{window}")
    for window, logits in results.items():
        np.testing.assert_allclose(
            logits, results[1], rtol=0, atol=2e-5 * np.abs(results[1]).max(), err_msg=str(window)
        )


def test_rewind_then_redecode_reproduces_the_state(engine):
    engine.open("r")
    first = feed(engine, "r", IDS, 8)
    engine.rewind("r", 40)
    assert engine.position("r") == 40
    again = feed(engine, "r", IDS[40:], 1, start=40)
    np.testing.assert_allclose(again, first[40:], rtol=0, atol=2e-5 * np.abs(first).max())
    # a different continuation after the rewind, then back: still exact
    engine.rewind("r", 50)
    feed(engine, "r", np.array([7, 8, 9]), 3, start=50)
    engine.rewind("r", 50)
    tail = feed(engine, "r", IDS[50:], 2, start=50)
    np.testing.assert_allclose(tail, first[50:], rtol=0, atol=2e-5 * np.abs(first).max())
    engine.close("r")


def test_rewind_beyond_the_slack_is_refused_without_changing_state(engine):
    engine.open("far")
    feed(engine, "far", IDS, 16)
    with pytest.raises(ValueError, match="rewind slack"):
        engine.rewind("far", 0)
    assert engine.position("far") == len(IDS)
    engine.close("far")


def test_a_stream_taking_over_anothers_state_continues_as_if_it_had_been_fed_the_same_tokens(engine):
    engine.open("old")
    first = feed(engine, "old", IDS, 8)
    engine.open("busy")
    with pytest.raises(StreamError, match="'busy' is already open"):
        engine.adopt("old", "busy", 40)
    with pytest.raises(ValueError, match="rewind slack"):
        engine.adopt("old", "new", 0)
    assert engine.streams == ["old", "busy"] and engine.position("old") == len(IDS)  # nothing changed
    engine.adopt("old", "new", len(IDS) - 20)
    assert sorted(engine.streams) == ["busy", "new"] and engine.position("new") == len(IDS) - 20
    again = feed(engine, "new", IDS[-20:], 5, start=len(IDS) - 20)
    np.testing.assert_allclose(again, first[-20:], rtol=0, atol=2e-5 * np.abs(first).max())
    with pytest.raises(StreamError, match="'old' is not open"):
        engine.adopt("old", "other", 1)
    engine.close("new")
    engine.close("busy")


def test_a_copy_of_a_streams_first_positions_goes_on_as_the_stream_would_and_leaves_it_alone(engine):
    engine.open("src")
    first = feed(engine, "src", IDS, 16)
    at = len(IDS) - 12
    engine.copy("src", "copy", at)
    assert sorted(engine.streams) == ["copy", "src"] and engine.position("copy") == at
    again = feed(engine, "copy", IDS[at:], 3, start=at)
    np.testing.assert_allclose(again, first[at:], rtol=0, atol=2e-5 * np.abs(first).max())
    # the source is untouched: its own continuation equals the copy's on the same tokens
    tail = np.array([9, 8, 7])
    mine = feed(engine, "src", tail, 3, start=len(IDS))
    theirs = feed(engine, "copy", tail, 3, start=len(IDS))
    np.testing.assert_allclose(theirs, mine, rtol=0, atol=2e-5 * np.abs(mine).max())
    with pytest.raises(ValueError, match="rewind slack"):
        engine.copy("src", "far", 0)
    with pytest.raises(StreamError, match="'copy' is already open"):
        engine.copy("src", "copy", at)
    assert sorted(engine.streams) == ["copy", "src"]
    engine.close("src")
    engine.close("copy")


def test_rewinds_in_a_row_are_bounded_by_the_furthest_position_fed(engine):
    """Two rewinds within the slack each but not together would read ring rows later positions overwrote."""
    engine.open("twice")
    first = feed(engine, "twice", IDS, 8)
    engine.rewind("twice", len(IDS) - 30)
    with pytest.raises(ValueError, match=f"cannot rewind {len(IDS) - 5} positions \\(it has been fed to {len(IDS)}\\)"):
        engine.rewind("twice", 5)
    assert engine.position("twice") == len(IDS) - 30
    engine.rewind("twice", len(IDS) - 32)
    again = feed(engine, "twice", IDS[-32:], 4, start=len(IDS) - 32)
    np.testing.assert_allclose(again, first[-32:], rtol=0, atol=2e-5 * np.abs(first).max())
    engine.close("twice")


def test_a_batch_of_streams_at_different_positions_equals_each_stream_alone(engine):
    alone = {}
    # b's far keys reach into a second cache block while a and c have none or part of one
    for name, ids in (("a", IDS[:20]), ("b", np.resize(IDS[5:], 150)), ("c", np.resize(IDS[::-1], 80))):
        engine.open(name)
        alone[name] = (ids, feed(engine, name, ids, len(ids)))
        engine.close(name)
    for name in alone:
        engine.open(name)
    positions = dict.fromkeys(alone, 0)
    got: dict[str, list[np.ndarray]] = {name: [] for name in alone}
    windows = {"a": 1, "b": 8, "c": 5}  # decode rows and prefill windows mixed in one call
    while any(positions[n] < len(alone[n][0]) for n in alone):
        segments, inputs = [], []
        for name, (ids, _) in alone.items():
            if positions[name] < len(ids):
                n = min(windows[name], len(ids) - positions[name])
                segments.append(Segment(name, positions[name], n))
                inputs.extend(ids[positions[name] : positions[name] + n])
        logits = engine.step(segments, np.array(inputs)).logits
        row = 0
        for seg in segments:
            got[seg.stream].append(logits[row : row + seg.length])
            row += seg.length
            positions[seg.stream] += seg.length
    for name, (_, expected) in alone.items():
        np.testing.assert_allclose(np.concatenate(got[name]), expected, rtol=0, atol=2e-5 * np.abs(expected).max())
        engine.close(name)


def test_streams_opened_and_closed_around_a_stream_leave_its_rows_and_theirs_alone(engine):
    """A stage keeps every stream's rings in one pool per layer: opening streams grows the pools (every
    ring moves) and a closed stream's slot goes to the next one opened. Neither may change a living
    stream's rows, and a stream in a reused slot starts as clean as one in a new slot."""
    ids = np.resize(IDS, 150)  # past the sliding window and the rewind slack: the rings wrap around
    engine.open("alone")
    expected = feed(engine, "alone", ids, 10)
    engine.close("alone")
    engine.open("kept")
    got, others, opened = [], [], 0
    short = IDS[::-1][:7]
    for start in range(0, len(ids), 10):
        got.append(engine.step([Segment("kept", start, 10)], ids[start : start + 10]).logits)
        for _ in range(3):
            name = f"other-{opened}"
            opened += 1
            engine.open(name)
            others.append((name, feed(engine, name, short, 3)))
        for name, _ in others[::2]:  # half of them close, so later ones take their slots
            engine.close(name)
        others = others[1::2]
        if start == 0:
            first_other = others[0][1]
    np.testing.assert_allclose(np.concatenate(got), expected, rtol=0, atol=2e-5 * np.abs(expected).max())
    for name, logits in others:
        np.testing.assert_allclose(logits, first_other, rtol=0, atol=2e-5 * np.abs(first_other).max())
        engine.close(name)
    engine.close("kept")


def test_ring_pools_give_back_a_burst_of_streams_once_it_is_over(tiny):
    """After many streams close, the pools shrink to the slots still in use; a stream left in a low
    slot keeps its rows, and one opened and closed at the edge does not make the pools grow again."""
    engine = StageEngine(load_stage(tiny, 0, load_shape(tiny).num_layers), EngineSettings(context=256))

    def pool_bytes() -> int:
        return sum(pool.data.nbytes for rings in engine._io.rings for pool in rings.pools)

    ids = np.resize(IDS, 40)
    engine.open("alone")
    expected = feed(engine, "alone", ids, 8)
    engine.close("alone")
    assert pool_bytes() == 0

    engine.open("kept")
    got = [engine.step([Segment("kept", 0, 20)], ids[:20]).logits]
    one_slot = pool_bytes()
    burst = [f"burst-{n}" for n in range(15)]
    for name in burst:
        engine.open(name)
        feed(engine, name, IDS[:5], 5)
    assert pool_bytes() == 16 * one_slot
    for name in burst:
        engine.close(name)
    assert pool_bytes() == one_slot
    engine.open("edge")
    grown = pool_bytes()
    engine.close("edge")
    assert pool_bytes() == grown == 2 * one_slot
    got.append(engine.step([Segment("kept", 20, 20)], ids[20:]).logits)
    np.testing.assert_allclose(np.concatenate(got), expected, rtol=0, atol=2e-5 * np.abs(expected).max())
    engine.close("kept")


def test_far_blocks_kept_between_steps_follow_rewinds_and_streams_that_leave(tiny):
    """Streams decoding together past two cache blocks of far keys give each stream's own logits, while
    one of them steps back over far rows of its own (the tiny preset's band is shorter than the
    rewind slack) and takes another path before coming back, and streams leave one by one."""
    engine = StageEngine(load_stage(tiny, 0, load_shape(tiny).num_layers), EngineSettings(context=512))
    seqs = {"a": np.resize(IDS, 300), "b": np.resize(IDS[7:], 330), "c": np.resize(IDS[::-1], 280)}
    alone = {}
    for name, ids in seqs.items():
        engine.open(name)
        alone[name] = feed(engine, name, ids, 1)
        engine.close(name)
    positions = {}
    for name, ids in seqs.items():
        engine.open(name)
        feed(engine, name, ids[:120], 64)
        positions[name] = 120
    got: dict[str, dict[int, np.ndarray]] = {name: {} for name in seqs}
    for step in itertools.count():
        if not positions:
            break
        names = list(positions)
        ids = np.array([seqs[n][positions[n]] for n in names])
        logits = engine.step([Segment(n, positions[n], 1) for n in names], ids).logits
        for n, row in zip(names, logits, strict=True):
            got[n][positions[n]] = row
            positions[n] += 1
            if positions[n] == len(seqs[n]):
                engine.close(n)
                del positions[n]
        if step == 150:
            back = positions["b"] - 20
            engine.rewind("b", back)
            feed(engine, "b", np.array([3, 4, 5, 6, 7]), 5, start=back)
            engine.rewind("b", back)
            positions["b"] = back
    for name, rows in got.items():
        ours = np.stack([rows[p] for p in range(120, len(seqs[name]))])
        ref = alone[name][120:]
        np.testing.assert_allclose(ours, ref, rtol=0, atol=2e-5 * np.abs(ref).max(), err_msg=name)
    assert engine.held_state_bytes() == 0


def test_ring_pools_sized_for_planned_streams_hold_one_slot_each_until_more_open(tiny):
    """Five planned streams: the pools double up to five slots, not eight; a sixth stream doubles them."""
    settings = EngineSettings(context=256, planned_streams=5)
    engine = StageEngine(load_stage(tiny, 0, load_shape(tiny).num_layers), settings)
    held = []
    for n in range(6):
        engine.open(f"s{n}")
        held.append(max(pool.slots for rings in engine._io.rings for pool in rings.pools))
    assert held == [1, 2, 4, 4, 5, 10]


def test_held_state_bytes_count_the_free_pool_slots_until_the_pools_shrink(tiny):
    """What a stage reports holding: the closed streams' slots stay counted until the pools give them back."""
    engine = StageEngine(load_stage(tiny, 0, load_shape(tiny).num_layers), EngineSettings(context=256))
    for name in ("a", "b", "c"):
        engine.open(name)
        feed(engine, name, IDS[:20], 10)
    assert engine.held_state_bytes() >= sum(engine.stream_bytes(s) for s in ("a", "b", "c"))
    engine.close("c")
    assert engine.held_state_bytes() > engine.stream_bytes("a") + engine.stream_bytes("b")
    engine.close("b")
    assert engine.held_state_bytes() == engine.stream_bytes("a")
    engine.close("a")
    assert engine.held_state_bytes() == 0


def test_state_figures_read_beside_streams_opening_and_closing_never_fail(tiny):
    """A shard's `Stats` reads these while its compute thread opens, steps and closes streams."""
    engine = StageEngine(load_stage(tiny, 0, load_shape(tiny).num_layers), EngineSettings(context=256))
    engine.open("kept")
    feed(engine, "kept", IDS[:20], 10)
    assert engine.state_bytes() == engine.stream_bytes("kept")
    stop = threading.Event()

    def churn() -> None:
        for n in itertools.count():
            if stop.is_set():
                return
            engine.open(f"c{n}")
            engine.step([Segment(f"c{n}", 0, 3)], IDS[:3])
            engine.close(f"c{n}")

    worker = threading.Thread(target=churn)
    worker.start()
    try:
        deadline = time.monotonic() + 1.0
        reads = 0
        while time.monotonic() < deadline:
            assert engine.state_bytes() >= engine.stream_bytes("kept")
            assert engine.held_state_bytes() >= engine.stream_bytes("kept")
            reads += 1
    finally:
        stop.set()
        worker.join()
    assert reads > 100
    assert engine.state_bytes() == engine.stream_bytes("kept")


def test_context_budget_is_a_clear_error_and_leaves_the_stream_usable(tiny):
    engine = StageEngine(load_stage(tiny, 0, load_shape(tiny).num_layers), EngineSettings(context=32))
    engine.open("s")
    feed(engine, "s", IDS[:30], 10)
    with pytest.raises(BudgetExceeded, match="context budget of 32"):
        engine.step([Segment("s", 30, 5)], IDS[30:35])
    assert engine.position("s") == 30
    engine.step([Segment("s", 30, 2)], IDS[30:32])
    with pytest.raises(BudgetExceeded):
        engine.open("big", context=64)


def test_stream_errors_name_the_stream(engine):
    with pytest.raises(StreamError, match="'nope' is not open"):
        engine.step([Segment("nope", 0, 1)], np.array([1]))
    engine.open("p")
    with pytest.raises(StreamError, match="already open"):
        engine.open("p")
    with pytest.raises(StreamError, match="starts at 3 but the stream is at 0"):
        engine.step([Segment("p", 3, 1)], np.array([1]))
    with pytest.raises(ValueError, match="token ids must lie"):
        engine.step([Segment("p", 0, 1)], np.array([10_000]))
    engine.close("p")


def test_stream_memory_is_accounted_and_grows_with_global_positions(engine):
    engine.open("m")
    empty = engine.stream_bytes("m")
    feed(engine, "m", np.resize(IDS, 200), 50)
    assert engine.stream_bytes("m") > empty
    engine.close("m")
    assert "m" not in engine.streams


def test_middle_stage_takes_hidden_rows_and_checks_their_shape(tiny):
    first = StageEngine(load_stage(tiny, 0, 2), EngineSettings())
    last = StageEngine(load_stage(tiny, 2, load_shape(tiny).num_layers), EngineSettings())
    whole = StageEngine(load_stage(tiny, 0, load_shape(tiny).num_layers), EngineSettings())
    for e in (first, last, whole):
        e.open("s")
    hidden = first.step([Segment("s", 0, 20)], IDS[:20]).hidden
    assert hidden.shape == (20, 64) and hidden.dtype == np.float32
    with pytest.raises(ValueError, match="expected hidden rows"):
        last.step([Segment("s", 0, 20)], hidden[:, :10])
    split = last.step([Segment("s", 0, 20)], hidden).logits
    np.testing.assert_allclose(split, whole.step([Segment("s", 0, 20)], IDS[:20]).logits, rtol=0, atol=1e-5)


def test_f16_expert_arithmetic_on_the_cpu_is_refused_with_a_reason_or_runs_close_to_f32(tiny):
    # whether the CPU plugin compiles f16 fused experts depends on the processor (AVX2-only parts
    # run the f16 hint in f32; some AVX-512 parts refuse the fused graph): either outcome must be right
    from cascadia.engine.compiled import UnsupportedSettings

    settings = EngineSettings(expert_weights="f16", expert_compute="f16")
    try:
        engine = StageEngine(load_stage(tiny, 1, 2), settings)
    except UnsupportedSettings as exc:
        assert "expert_compute=f16" in str(exc)
        return
    reference = StageEngine(load_stage(tiny, 1, 2), EngineSettings(expert_weights="f16"))
    rows = np.random.default_rng(0).standard_normal((5, load_shape(tiny).hidden_size)).astype(np.float32)
    out = []
    for e in (engine, reference):
        e.open("s")
        out.append(e.step([Segment("s", 0, 5)], rows).hidden)
    rel = np.sqrt(np.mean((out[0] - out[1]) ** 2) / np.mean(out[1] ** 2))
    assert rel < 1e-2


def test_f16_kv_halves_the_cache_and_stays_within_a_thousandth(tiny, engine):
    from cascadia.engine.generate import generate
    from cascadia.sampling_params import SamplingParams

    half = StageEngine(
        load_stage(tiny, 0, load_shape(tiny).num_layers), EngineSettings(context=256, kv_precision="f16")
    )
    assert half.kv_bytes_per_position() * 2 == engine.kv_bytes_per_position() > 0
    ids = np.array([1, *range(30, 230)])  # past the sliding window and the relative extent
    engine.open("f32-kv")
    half.open("f16-kv")
    full_logits = feed(engine, "f32-kv", ids, 16)
    half_logits = feed(half, "f16-kv", ids, 16)
    rel = np.sqrt(np.mean((half_logits - full_logits) ** 2)) / np.sqrt(np.mean(full_logits**2))
    assert 0 < rel <= 1e-3, rel
    for e, name in ((engine, "f32-kv"), (half, "f16-kv")):
        e.close(name)
    prompt = [1, 5, 9, 200, 31]
    assert (
        generate(half, prompt, SamplingParams(max_tokens=32)).token_ids
        == generate(engine, prompt, SamplingParams(max_tokens=32)).token_ids
    )
    with pytest.raises(ValueError, match="kv_precision 'u4'"):
        EngineSettings(kv_precision="u4")  # type: ignore[arg-type]


def test_u8_kv_attends_exactly_over_its_dequantised_rows_in_about_a_quarter_of_the_memory(tiny, engine):
    """u8 keys and values (a scale and an offset per row and head) against the f32 engine whose caches
    hold the same rows quantised and dequantised: the graph's widening and the block and ring stores
    are exact, so the only difference from f32 is the rounding itself."""
    from cascadia.engine.kv_quant import dequantize, quantize

    u8 = StageEngine(load_stage(tiny, 0, load_shape(tiny).num_layers), EngineSettings(context=256, kv_precision="u8"))
    assert u8.kv_bytes_per_position() < 0.4 * engine.kv_bytes_per_position()
    ids = np.array([1, *range(30, 230)])  # past the sliding window, the relative extent and a cache block
    u8.open("u8-kv")
    engine.open("rounded")
    # sliding layers' rows are written through their stage-wide ring pools, global layers' per stream
    stores = [store for layer in engine._stream("rounded").layers for store in (layer.keys, layer.values)]
    targets = list({id(target): target for target in (getattr(s, "pool", s) for s in stores)}.values())
    for target in targets:
        write = target.write
        target.write = lambda *where, write=write: write(*where[:-1], dequantize(*quantize(where[-1])))
    try:
        rounded = feed(engine, "rounded", ids, 16)
    finally:
        for target in targets:
            del target.write
    ours = feed(u8, "u8-kv", ids, 16)
    rel = np.sqrt(np.mean((ours - rounded) ** 2)) / np.sqrt(np.mean(rounded**2))
    assert rel <= 1e-5, rel

    def kv_bytes(e: StageEngine, stream: str) -> int:
        return sum(layer.keys.nbytes + layer.values.nbytes for layer in e._stream(stream).layers)

    assert kv_bytes(u8, "u8-kv") < 0.4 * kv_bytes(engine, "rounded")
    u8.close("u8-kv")
    engine.close("rounded")


def test_a_full_global_cache_holds_the_padded_far_blocks_a_step_reads_as_a_view():
    """Near its budget a stream's far region is read in a steady block count beyond the budget's own
    blocks; the cache keeps room for it, so the step reads its storage in place instead of a copy."""
    from cascadia.engine.state import GrowingRows
    from cascadia.kv_layout import KV_BLOCK, steady_size

    cache = GrowingRows(81 * KV_BLOCK, (2, 4))
    cache.reserve(81 * KV_BLOCK)
    assert cache.capacity == 81 * KV_BLOCK
    padded = steady_size(81)
    assert padded == 88
    blocks = cache.blocks(padded)
    assert blocks.shape[0] == padded and np.shares_memory(blocks, cache.data)


@pytest.mark.parametrize("dtype", ["float32", "uint8"])
def test_a_global_cache_grows_in_doubling_blocks_up_to_its_budget_and_keeps_its_rows(dtype):
    from cascadia.engine.kv_quant import dequantize
    from cascadia.engine.state import GrowingRows
    from cascadia.kv_layout import KV_BLOCK

    cache = GrowingRows(5 * KV_BLOCK, (2, 4), dtype=dtype)
    rows = np.random.default_rng(0).standard_normal((3 * KV_BLOCK, 2, 4)).astype(np.float32)
    cache.write(np.arange(KV_BLOCK), rows[:KV_BLOCK])
    expected = cache.growth_bytes(3 * KV_BLOCK)
    assert cache.reserve(3 * KV_BLOCK) == expected > 0
    assert cache.capacity == 4 * KV_BLOCK  # one block doubled twice
    cache.write(np.arange(KV_BLOCK, 3 * KV_BLOCK), rows[KV_BLOCK:])
    cache.reserve(5 * KV_BLOCK)
    assert cache.capacity == 5 * KV_BLOCK  # doubling stops at the budget
    with pytest.raises(BudgetExceeded, match="context budget"):
        cache.reserve(5 * KV_BLOCK + 1)
    positions = np.array([0, KV_BLOCK - 1, KV_BLOCK, 3 * KV_BLOCK - 1])
    back = (
        cache.read(positions) if dtype == "float32" else dequantize(cache.read(positions), cache.read_params(positions))
    )
    np.testing.assert_allclose(back, rows[positions], atol=0 if dtype == "float32" else 0.02)
    blocks = cache.blocks(2)
    assert np.shares_memory(blocks, cache.data) and blocks.shape == (2, 2, KV_BLOCK, 4)
    np.testing.assert_array_equal(blocks[1, :, 5], cache.read(np.array([KV_BLOCK + 5]))[0])


def test_a_dropped_engine_frees_its_compiled_models_without_a_garbage_collection(tiny):
    """A shard replacing its engine, or a bench moving to the next precision, gets the memory back at once."""
    engine = StageEngine(load_stage(tiny, 0, load_shape(tiny).num_layers), EngineSettings(context=64))
    engine.open("s")
    feed(engine, "s", IDS[:8], window=4)
    dropped = weakref.ref(engine)
    gc.disable()
    try:
        del engine
        assert dropped() is None, "the engine sits in a reference cycle"
    finally:
        gc.enable()
