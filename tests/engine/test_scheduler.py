"""The router's pure scheduling decisions, driven by hand-made results and by a real engine."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace as Stats

import numpy as np
import pytest

from cascadia.engine.batch import Segment
from cascadia.engine.engine import StageEngine
from cascadia.engine.generate import generate
from cascadia.engine.settings import EngineSettings
from cascadia.grammar import GrammarError, json_grammar, regex_grammar
from cascadia.model.checkpoint import load_stage
from cascadia.model.config import load_shape
from cascadia.router.limits import UNREPORTED, FleetLimits, check_request, fleet_limits
from cascadia.router.scheduler import Frame, Overloaded, Request, Scheduler, SchedulerConfig
from cascadia.sampling_params import SamplingParams


def request(rid: str, length: int, max_tokens: int = 4, stop: frozenset[int] = frozenset()) -> Request:
    return Request(rid, tuple(range(10, 10 + length)), SamplingParams(max_tokens=max_tokens, stop_ids=stop))


def test_nothing_is_admitted_before_the_whole_chain_is_ready():
    s = Scheduler(SchedulerConfig(stages=3))
    s.submit(request("a", 4))
    assert s.next_frames() == []
    s.set_chain_ready(True)
    assert len(s.next_frames()) == 1


def test_one_frame_per_stage_in_flight_and_rows_per_group_respected():
    s = Scheduler(SchedulerConfig(stages=2, rows_per_group=4, prefill_window=4))
    s.set_chain_ready(True)
    for i in range(5):
        s.submit(request(f"r{i}", 4))
    frames = s.next_frames()
    assert len(frames) == 2 and s.in_flight == 2
    assert all(f.size <= 4 for f in frames)
    assert s.next_frames() == []  # both stage slots are taken


def test_decode_rows_go_first_and_a_long_prompt_is_cut_into_windows():
    s = Scheduler(SchedulerConfig(stages=1, rows_per_group=8, prefill_window=8))
    s.set_chain_ready(True)
    s.submit(request("short", 2))
    (frame,) = s.next_frames()
    s.on_frame_done(frame.id, {"short": 99})
    s.submit(request("long", 40))
    (frame,) = s.next_frames()
    # the decoding stream's row comes first; the long prompt gets the 7 rows left
    assert [(r.stream, len(r.tokens)) for r in frame.rows] == [("short", 1), ("long", 7)]
    assert frame.rows[0].tokens == (99,) and frame.rows[0].start == 2
    assert frame.rows[1].opens and not frame.rows[1].wants_token


def test_a_long_prompt_fills_the_pipeline_and_decodes_only_after_its_last_window_returns():
    # Windows of one prompt follow each other down the chain (stages run frames in order), so on a
    # 4-stage chain four windows are in flight at once instead of one per round trip of the chain.
    s = Scheduler(SchedulerConfig(stages=4, rows_per_group=8, prefill_window=8))
    s.set_chain_ready(True)
    s.submit(request("long", 40, max_tokens=2))
    frames = s.next_frames()
    assert [(f.rows[0].start, len(f.rows[0].tokens)) for f in frames] == [(0, 8), (8, 8), (16, 8), (24, 8)]
    assert [r.opens for f in frames for r in f.rows] == [True, False, False, False]
    assert not any(r.wants_token for f in frames for r in f.rows)
    s.on_frame_done(frames[0].id, {})
    (last,) = s.next_frames()
    assert (last.rows[0].start, len(last.rows[0].tokens), last.rows[0].wants_token) == (32, 8, True)
    for f in frames[1:]:
        s.on_frame_done(f.id, {})
    assert s.next_frames() == []  # no decode row before the prompt's token is back
    s.on_frame_done(last.id, {"long": 5})
    (decode,) = s.next_frames()
    assert decode.rows[0].tokens == (5,) and decode.rows[0].start == 40
    # a short prompt arriving behind a long one is not held back by the long one's windows
    s3 = Scheduler(SchedulerConfig(stages=4, rows_per_group=8, prefill_window=8))
    s3.set_chain_ready(True)
    s3.submit(request("long", 40))
    s3.submit(request("short", 4))
    frames = s3.next_frames()
    assert [[(r.stream, r.start, len(r.tokens)) for r in f.rows] for f in frames[:2]] == [
        [("long", 0, 8)],
        [("short", 0, 4), ("long", 8, 4)],
    ]
    # a lost window fails the stream once; its other frames in flight are then ignored
    s2 = Scheduler(SchedulerConfig(stages=3, rows_per_group=8, prefill_window=8))
    s2.set_chain_ready(True)
    s2.submit(request("x", 24))
    first, second, third = s2.next_frames()
    assert s2.on_frame_failed(second.id) == ["x"]
    assert s2.on_frame_failed(third.id) == [] and s2.on_frame_done(first.id, {}) == []
    assert s2.active == 0


def test_stop_ids_max_tokens_and_cancellation_free_streams():
    s = Scheduler(SchedulerConfig(stages=1))
    s.set_chain_ready(True)
    s.submit(request("a", 1, max_tokens=2))
    s.submit(request("b", 1, stop=frozenset({7})))
    (f,) = s.next_frames()
    events = s.on_frame_done(f.id, {"a": 5, "b": 7})
    assert [(e.stream, e.finished) for e in events] == [("a", None), ("b", "stop")]
    (f,) = s.next_frames()
    assert [(e.stream, e.finished) for e in s.on_frame_done(f.id, {"a": 6})] == [("a", "length")]
    assert s.active == 0
    s.submit(request("c", 3))
    (f,) = s.next_frames()
    assert s.cancel("c") is True  # stages hold its state: the router must close it everywhere
    assert s.on_frame_done(f.id, {"c": 1}) == []
    s.submit(request("d", 3))
    assert s.cancel("d") is False  # still queued (no chain slot taken yet): nothing to close


def test_a_bounded_queue_refuses_with_overloaded():
    s = Scheduler(SchedulerConfig(stages=1, max_streams=1, max_queue=2))
    for i in range(2):
        s.submit(request(f"q{i}", 2))
    with pytest.raises(Overloaded, match="overloaded"):
        s.submit(request("q9", 2))


def test_a_failed_frame_fails_exactly_its_streams():
    s = Scheduler(SchedulerConfig(stages=2, rows_per_group=2, prefill_window=2))
    s.set_chain_ready(True)
    for i in range(4):
        s.submit(request(f"r{i}", 2))
    first, _second = s.next_frames()
    assert sorted(s.on_frame_failed(first.id)) == sorted(r.stream for r in first.rows)
    assert s.active == 4 - len(first.rows)


def test_scheduled_frames_through_an_engine_give_each_stream_the_ids_it_gets_alone(tiny):
    """Many streams of different lengths, interleaved by the scheduler, each get their solo output."""
    shape = load_shape(tiny)
    engine = StageEngine(load_stage(tiny, 0, shape.num_layers), EngineSettings())
    rng = np.random.default_rng(5)
    requests = [
        Request(f"r{i}", tuple(int(t) for t in rng.integers(3, 500, size=n)), SamplingParams(max_tokens=6))
        for i, n in enumerate([1, 3, 9, 17, 30, 5, 12, 2])
    ]
    alone = {r.id: generate(engine, r.prompt, r.params, stream="solo").token_ids for r in requests}
    s = Scheduler(SchedulerConfig(stages=3, rows_per_group=8, prefill_window=8))
    s.set_chain_ready(True)
    for r in requests:
        s.submit(r)
    got: dict[str, list[int]] = {r.id: [] for r in requests}
    while s.active or s.queued:
        for frame in s.next_frames():
            segments, ids, want = [], [], []
            for row in frame.rows:
                if row.opens:
                    engine.open(row.stream)
                segments.append(Segment(row.stream, row.start, len(row.tokens)))
                ids.extend(row.tokens)
                if row.wants_token:
                    want.append((row.stream, len(ids) - 1))
            result = engine.step(segments, np.array(ids), np.array([i for _, i in want], dtype=np.int64))
            tokens = {stream: int(result.logits[k].argmax()) for k, (stream, _) in enumerate(want)}
            for event in s.on_frame_done(frame.id, tokens):
                got[event.stream].append(event.token)
                if event.finished:
                    engine.close(event.stream)
    assert got == alone
    assert engine.streams == []


def test_decoding_streams_spread_over_one_frame_per_stage():
    from cascadia.router.scheduler import decode_rows_per_frame

    assert decode_rows_per_frame(8, 3, 8) == 3
    assert decode_rows_per_frame(88, 11, 8) == 8
    assert decode_rows_per_frame(176, 11, 8) == 8  # never more than a group
    assert decode_rows_per_frame(1, 4, 8) == 1
    s = Scheduler(SchedulerConfig(stages=3, rows_per_group=8, prefill_window=8))
    s.set_chain_ready(True)
    for i in range(8):
        s.submit(request(f"r{i}", 1))
    (prefill,) = s.next_frames()  # all 8 one-token prompts fit one group
    s.on_frame_done(prefill.id, {f"r{i}": 5 for i in range(8)})
    frames = s.next_frames()
    assert sorted(f.size for f in frames) == [2, 3, 3]  # every stage gets work


def test_one_frame_in_flight_keeps_the_decoding_streams_in_one_batch():
    """Stages sharing their cores (a fleet on one machine): one frame on the chain, as large as a group."""
    s = Scheduler(SchedulerConfig(stages=3, rows_per_group=8, prefill_window=8, frames_in_flight=1))
    s.set_chain_ready(True)
    for i in range(8):
        s.submit(request(f"r{i}", 1))
    (prefill,) = s.next_frames()
    assert s.next_frames() == []  # nothing more until it returns
    s.on_frame_done(prefill.id, {f"r{i}": 5 for i in range(8)})
    (decode,) = s.next_frames()
    assert decode.size == 8
    with pytest.raises(ValueError, match="frames_in_flight"):
        SchedulerConfig(stages=3, frames_in_flight=-1)


def test_a_speculating_schedule_drafts_as_long_as_a_lone_streams_block_has_room_for():
    base = SchedulerConfig(stages=3, rows_per_group=64, draft_rows=16)
    assert base.speculating().max_draft == 15
    assert base.speculating(4, mtp_draft=2).max_draft == 4
    assert base.speculating(4, mtp_draft=2).mtp_draft == 2
    assert base.max_draft == 0  # the schedule it came from is unchanged
    with pytest.raises(ValueError, match="max_draft"):
        SchedulerConfig(stages=3, rows_per_group=8).speculating(8)


def test_fleet_limits_come_from_the_first_last_and_tightest_stages_and_refuse_what_does_not_fit():
    stages = [
        Stats(vocab_size=512, sampled_vocab=500, context=0, grammars=False, rewind_slack=32),
        Stats(vocab_size=512, sampled_vocab=500, context=64, grammars=True, rewind_slack=16),
    ]
    limits = fleet_limits(stages)
    assert limits == FleetLimits(vocab=512, sampled_vocab=500, context=64, grammars=True, rewind_slack=16)
    check_request((1, 511), SamplingParams(max_tokens=62, logit_bias=((499, 5.0),)), limits)
    with pytest.raises(ValueError, match="token id 512 is outside the vocabulary"):
        check_request((1, 512), SamplingParams(), limits)
    with pytest.raises(ValueError, match="logit_bias names token 500"):
        check_request((1,), SamplingParams(logit_bias=((500, 5.0),)), limits)
    with pytest.raises(ValueError, match="2 prompt tokens and max_tokens 63 exceed the fleet's context of 64"):
        check_request((1, 2), SamplingParams(max_tokens=63), limits)
    check_request((10**6,) * 100, SamplingParams(max_tokens=10**6), FleetLimits(0, 0, 0))  # nothing reported


def test_a_grammar_is_refused_when_it_does_not_parse_or_the_last_stage_cannot_match_it():
    limits = FleetLimits(vocab=512, sampled_vocab=500, context=64)
    good = SamplingParams(grammar=json_grammar({"type": "object"}), stop_ids=frozenset({2}))
    check_request((1,), good, limits)
    check_request((1,), good, UNREPORTED)
    with pytest.raises(ValueError, match="no tokenizer to hold the text to a grammar"):
        check_request((1,), good, replace(limits, grammars=False))
    for unparsable in (regex_grammar("(unclosed"), json_grammar({"type": "frob"}), "start: missing_rule"):
        with pytest.raises(GrammarError):  # checked even before any stage has reported its limits
            check_request((1,), replace(good, grammar=unparsable), UNREPORTED)
    with pytest.raises(ValueError, match="a grammar needs stop_ids"):
        SamplingParams(grammar=good.grammar)


def _finish(s: Scheduler, rid: str, tokens: list[int]) -> None:
    """Run `rid` (already submitted) to its end, sampling `tokens` one frame after another."""
    for token in tokens:
        (frame,) = s.next_frames()
        assert any(r.stream == rid for r in frame.rows)
        events = s.on_frame_done(frame.id, {r.stream: token for r in frame.rows if r.wants_token})
    assert events[-1].finished


def test_a_finished_streams_state_serves_a_prompt_that_starts_with_its_tokens():
    s = Scheduler(SchedulerConfig(stages=1, rows_per_group=64, prefill_window=64))
    s.set_chain_ready(True)
    s.rewind_slack = 4
    first = Request("turn1", (1, 2, 3, 4), SamplingParams(max_tokens=3))
    s.submit(first)
    _finish(s, "turn1", [7, 8, 9])
    assert s.kept("turn1") and s.kept_streams == 1 and s.active == 0
    # fed: the prompt and every sampled token but the last, which was never fed
    follow = Request("turn2", (1, 2, 3, 4, 7, 8, 9, 5, 6), SamplingParams(max_tokens=2))
    s.submit(follow)
    (frame,) = s.next_frames()
    (row,) = frame.rows
    assert (row.stream, row.opens, row.resume_from, row.start, row.tokens) == ("turn2", True, "turn1", 6, (9, 5, 6))
    assert not s.kept("turn1") and s.reused_positions == 6 and s.take_dropped() == []
    events = s.on_frame_done(frame.id, {"turn2": 11})
    assert events[0].cached == 6
    (frame,) = s.next_frames()
    assert frame.rows[0].start == 9 and not frame.rows[0].opens
    assert s.on_frame_done(frame.id, {"turn2": 12})[0].cached == 0


def test_a_kept_stream_serves_only_within_the_rewind_slack_and_the_prompts_last_token_is_fed_again():
    s = Scheduler(SchedulerConfig(stages=1, rows_per_group=64, prefill_window=64))
    s.set_chain_ready(True)
    s.submit(Request("a", tuple(range(20)), SamplingParams(max_tokens=1)))
    _finish(s, "a", [99])  # holds positions 0-19
    s.rewind_slack = 2
    s.submit(Request("far", (*range(17), 500), SamplingParams(max_tokens=1)))  # 17 shared: 3 back
    (frame,) = s.next_frames()
    assert frame.rows[0].resume_from == "" and frame.rows[0].start == 0 and s.kept("a")
    s.on_frame_done(frame.id, {"far": 1})
    s.submit(Request("same", tuple(range(20)), SamplingParams(max_tokens=1)))  # the whole prompt is held
    (frame,) = s.next_frames()
    assert (frame.rows[0].resume_from, frame.rows[0].start, frame.rows[0].tokens) == ("a", 19, (19,))


def test_kept_streams_give_way_oldest_first_and_are_given_up_when_a_frame_fails():
    s = Scheduler(SchedulerConfig(stages=1, max_streams=3, keep_finished=2))
    s.set_chain_ready(True)
    for i in range(3):
        s.submit(request(f"k{i}", 2, max_tokens=1))
        _finish(s, f"k{i}", [5])
    assert [s.kept(f"k{i}") for i in range(3)] == [False, True, True]
    assert s.take_dropped() == ["k0"]
    for rid, first in (("new1", 50), ("new2", 40)):  # prompts no kept stream starts
        s.submit(Request(rid, (first, 51, 52), SamplingParams()))
    frames = s.next_frames()
    assert s.active == 2 and s.take_dropped() == ["k1"]  # two active and one kept fill max_streams
    s.submit(Request("third", (60, 61), SamplingParams()))
    s.next_frames()
    assert s.active == 3 and s.take_dropped() == ["k2"]  # the last kept stream gave way
    s.submit(Request("fourth", (70, 71), SamplingParams()))
    s.next_frames()
    assert s.queued == 1  # the stages hold max_streams streams: it waits
    s.on_frame_done(frames[0].id, {"new1": 5, "new2": 5})
    s.cancel("fourth")
    s.cancel("third")
    _finish(s, "new1", [5] * 15)  # new2 decodes beside it, as far
    assert s.kept("new1") and s.kept("new2") and s.take_dropped() == []
    s.submit(Request("later", (80, 81), SamplingParams()))
    (frame,) = s.next_frames()
    s.on_frame_failed(frame.id)  # a stage that failed may have lost what it kept
    assert s.kept_streams == 0 and s.take_dropped() == ["new1", "new2"]
    with pytest.raises(ValueError, match="keep_finished"):
        SchedulerConfig(stages=1, keep_finished=-1)


def test_a_stream_taking_over_a_kept_one_and_cancelled_before_it_opens_frees_the_kept_state():
    s = Scheduler(SchedulerConfig(stages=1, rows_per_group=8))
    s.set_chain_ready(True)
    s.submit(request("a", 4, max_tokens=1))
    _finish(s, "a", [5])
    s.rewind_slack = 8
    s.submit(Request("b", (10, 11, 12, 13, 6), SamplingParams()))
    s._admit()  # admitted, not yet in a frame
    assert not s.kept("a")
    assert s.cancel("b") is False and s.take_dropped() == ["a"]


def test_a_stream_the_mtp_head_follows_takes_over_only_such_a_stream():
    s = Scheduler(SchedulerConfig(stages=1, rows_per_group=8, max_draft=2, mtp_draft=1))
    s.set_chain_ready(True)
    s.rewind_slack = 8
    s.submit(request("mtp", 2, max_tokens=1))
    _finish(s, "mtp", [5])
    assert s.kept("mtp")
    seeded = SamplingParams(temperature=1.0, seed=3)  # a seed promises one sample path: no drafts, no MTP
    s.submit(Request("plain", (10, 11, 12), seeded))
    (frame,) = s.next_frames()
    assert frame.rows[0].resume_from == "" and not frame.rows[0].mtp and s.kept("mtp")
    s.on_frame_done(frame.id, {"plain": 1})
    s.submit(Request("follows", (10, 11, 5, 6), SamplingParams()))
    (frame,) = s.next_frames()
    (row,) = [r for r in frame.rows if r.stream == "follows"]
    assert (row.resume_from, row.start, row.mtp, row.opens) == ("mtp", 2, True, True)  # 5 was never fed


def test_a_kept_stream_the_mtp_head_follows_is_stepped_back_one_position_less_far():
    from cascadia.router.scheduler import Kept, reusable

    prompt = (1, 2, 3, 4, 9)
    assert reusable({"a": Kept((1, 2, 3, 4), reached=6)}, prompt, slack=2) == ("a", 4)
    assert reusable({"a": Kept((1, 2, 3, 4), reached=6, mtp=True)}, prompt, slack=2, mtp=True) is None
    assert reusable({"a": Kept((1, 2, 3, 4), reached=5, mtp=True)}, prompt, slack=2, mtp=True) == ("a", 4)
    assert reusable({"a": Kept((1, 2, 3, 4), reached=5, mtp=True)}, prompt, slack=2) is None  # not followed


def test_scored_prompts_and_captures_take_over_no_state():
    plain = Scheduler(SchedulerConfig(stages=1, rows_per_group=8))
    plain.set_chain_ready(True)
    plain.rewind_slack = 8
    plain.submit(request("a", 2, max_tokens=1))
    _finish(plain, "a", [5])
    plain.submit(Request("scored", (10, 11, 12), SamplingParams(), score_prompt=True))
    (frame,) = plain.next_frames()
    assert frame.rows[0].resume_from == "" and plain.kept("a")
    plain.on_frame_done(frame.id, {"scored": 1})
    plain.taking_over = False  # the stages capture: every stream's rows from its first position
    plain.submit(Request("captured", (10, 11, 12), SamplingParams()))
    (frame,) = plain.next_frames()
    (row,) = [r for r in frame.rows if r.stream == "captured"]
    assert row.resume_from == "" and row.start == 0 and plain.kept("a")


def test_a_name_still_kept_is_refused_by_the_scheduler():
    s = Scheduler(SchedulerConfig(stages=1))
    s.set_chain_ready(True)
    s.submit(request("a", 2, max_tokens=1))
    _finish(s, "a", [5])
    with pytest.raises(ValueError, match="already known"):
        s.submit(request("a", 2))
    s.drop_kept("a")
    s.submit(request("a", 2))


def test_a_prompt_like_a_running_ones_starts_as_a_copy_of_it_once_that_one_was_fed():
    from cascadia.router.scheduler import copy_source

    assert copy_source({"a": (1, 2, 3)}, (1, 2, 3)) == ("a", 2)  # the last token is fed again
    assert copy_source({"a": (1, 2, 3)}, (1, 2, 9, 9)) == ("a", 2)  # all but the running one's last token
    assert copy_source({"a": (1, 2, 3, 4)}, (1, 2, 9)) is None  # a shorter share: the source goes past it
    s = Scheduler(SchedulerConfig(stages=2, rows_per_group=8, prefill_window=4))
    s.set_chain_ready(True)
    s.rewind_slack = 4
    prompt = tuple(range(20, 30))
    s.submit(Request("c0", prompt, SamplingParams(max_tokens=2)))
    s.submit(Request("c1", prompt, SamplingParams(max_tokens=2, temperature=1.0)))
    first, second = s.next_frames()  # c0's windows go down the chain; c1 waits for them
    assert {r.stream for f in (first, second) for r in f.rows} == {"c0"}
    s.on_frame_done(first.id, {})
    (third,) = s.next_frames()  # c0's last window
    assert [(r.stream, r.start) for r in third.rows] == [("c0", 8)]
    s.on_frame_done(second.id, {})
    (fourth,) = s.next_frames()  # sent after c0's rows: it sees them
    (row,) = fourth.rows
    assert (row.stream, row.opens, row.copy_from, row.start, row.tokens) == ("c1", True, "c0", 9, (29,))
    assert s.reused_positions == 9
    s.on_frame_done(third.id, {"c0": 5})
    events = s.on_frame_done(fourth.id, {"c1": 6})
    assert events[0].cached == 9


def test_a_copy_whose_source_is_gone_or_too_far_ahead_computes_its_prompt_itself():
    s = Scheduler(SchedulerConfig(stages=1, rows_per_group=16, prefill_window=16))
    s.set_chain_ready(True)
    s.rewind_slack = 2
    prompt = tuple(range(20, 26))
    s.submit(Request("src", prompt, SamplingParams(max_tokens=8)))
    (frame,) = s.next_frames()
    s.submit(Request("gone", prompt, SamplingParams()))
    s.cancel("src")
    s.on_frame_done(frame.id, {})
    (frame,) = s.next_frames()
    assert [(r.stream, r.start, r.copy_from) for r in frame.rows] == [("gone", 0, "")]
    s.on_frame_done(frame.id, {"gone": 1})
    s.submit(Request("late", (*prompt, 7), SamplingParams()))  # its prompt and one token more
    s.submit(Request("later", prompt, SamplingParams()))  # its prompt: the last token is fed again
    (frame,) = s.next_frames()
    rows = {r.stream: (r.copy_from, r.start, r.tokens) for r in frame.rows}
    assert rows == {"gone": ("", 6, (1,)), "late": ("gone", 6, (7,)), "later": ("gone", 5, (25,))}
    s.on_frame_done(frame.id, dict.fromkeys(rows, 2))
    for _ in range(2):
        (frame,) = s.next_frames()
        s.on_frame_done(frame.id, dict.fromkeys([r.stream for r in frame.rows], 3))
    s.submit(Request("far", prompt, SamplingParams()))  # "gone" was fed to 9: 4 back is past the slack
    (frame,) = s.next_frames()
    (row,) = [r for r in frame.rows if r.stream == "far"]
    assert (row.copy_from, row.start) == ("", 0)


def test_common_prefix_agrees_with_a_token_by_token_count():
    from cascadia.tokens import common_prefix

    rng = np.random.default_rng(5)
    for _ in range(300):
        a = tuple(int(t) for t in rng.integers(0, 3, rng.integers(0, 40)))
        b = a[: rng.integers(0, len(a) + 1)] + tuple(int(t) for t in rng.integers(0, 3, rng.integers(0, 10)))
        naive = next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), min(len(a), len(b)))
        assert common_prefix(a, b) == common_prefix(b, a) == naive


def test_a_shared_prefix_is_worth_a_copy_only_past_what_is_served_and_copies_step_back_within_the_slack():
    from cascadia.router.scheduler import Kept, kept_source, reusable, shared_prefix

    recent = [(1, 2, 3, 4, 5, 6), (1, 2, 9)]
    assert shared_prefix(recent, (1, 2, 3, 4, 8), copied=0, shortest=4) == 4
    assert shared_prefix(recent, (1, 2, 3, 4, 8), copied=1, shortest=4) == 0  # 3 past what a copy gives
    assert shared_prefix(recent, (1, 2, 3, 4, 8), copied=0, shortest=0) == 0  # switched off
    assert shared_prefix([], (1, 2), copied=0, shortest=1) == 0
    # prompts that do not part: a next turn holds the last one whole, a shorter one is held whole
    assert shared_prefix([(1, 2, 3, 4)], (1, 2, 3, 4, 5, 6), copied=0, shortest=2) == 0
    assert shared_prefix([(1, 2, 3, 4, 5, 6)], (1, 2, 3), copied=0, shortest=2) == 0
    kept = {
        "conversation": Kept((1, 2, 3, 4, 5), reached=5, prompt=3),
        "p": Kept((1, 2, 3, 4), reached=6, prefix=True),
    }
    assert kept_source(kept, (1, 2, 3, 4, 7, 7), slack=2) == ("p", 4)  # a tie: the shared prefix
    assert kept_source(kept, (1, 2, 3, 4), slack=2) == ("conversation", 3)  # 3 positions: 3 back from "p"
    assert kept_source(kept, (1, 2, 3, 4), slack=3) == ("p", 3)
    assert kept_source(kept, (5, 1), slack=8) is None
    assert kept_source(kept, (1, 2, 3, 4, 7), slack=8, mtp=True) is None  # the MTP head follows neither
    # only a prompt that holds a finished stream's prompt whole takes it over; a prompt never takes a prefix
    assert reusable(kept, (1, 2, 3, 9), slack=8) == ("conversation", 3)
    assert reusable(kept, (1, 2, 9), slack=8) is None


def _run_prompt(s: Scheduler, rid: str, prompt: tuple[int, ...], token: int = 1) -> list[Frame]:
    """Submit `prompt` for one token and run frames until it is out; returns the frames sent."""
    return _run_request(s, Request(rid, prompt, SamplingParams(max_tokens=1)), token)


def _run_request(s: Scheduler, request: Request, token: int = 1) -> list[Frame]:
    s.submit(request)
    frames = []
    while s.active or s.queued:
        (frame,) = s.next_frames()
        frames.append(frame)
        s.on_frame_done(frame.id, {r.stream: token for r in frame.rows if r.wants_token})
    return frames


def test_prompts_that_part_after_a_shared_prefix_leave_a_kept_copy_that_later_prompts_start_from():
    s = Scheduler(SchedulerConfig(stages=1, rows_per_group=16, prefill_window=8, min_shared_prefix=8))
    s.set_chain_ready(True)
    s.rewind_slack = 4
    system = tuple(range(100, 120))
    _run_prompt(s, "a", (*system, *range(10)))  # kept, yet too far past 20 to step back to it
    assert s.kept_streams == 1  # "a" alone: no prompt shared its start yet
    frames = _run_prompt(s, "b", (*system, 4, 5, 6))  # shares 20 tokens with "a": leaves a copy at 20
    prefix_rows = [r for f in frames for r in f.rows if r.prefix]
    assert [(r.start, r.tokens, r.copy_from, r.opens, r.wants_token) for r in prefix_rows] == [
        (19, (119,), "b", True, False)
    ]
    name = prefix_rows[0].stream
    assert s.kept(name) and s.kept_streams == 3 and s.shared_prefixes == 1
    earlier = s.reused_positions
    s.submit(Request("c", (*system, 7, 8), SamplingParams(max_tokens=2)))
    (frame,) = s.next_frames()
    (row,) = frame.rows
    assert (row.copy_from, row.start, row.tokens, row.resume_from) == (name, 20, (7, 8), "")
    assert s.on_frame_done(frame.id, {"c": 9})[0].cached == 20 and s.reused_positions == earlier + 20
    assert s.kept(name)  # copied, not taken over: later prompts start from it too
    (frame,) = s.next_frames()
    s.on_frame_done(frame.id, {"c": 9})
    assert [r.prefix for f in frames for r in f.rows].count(True) == 1  # "c" was served: no second copy


def test_a_shared_prefix_on_its_way_is_given_up_with_its_frame_or_with_the_kept_streams():
    config = SchedulerConfig(stages=1, rows_per_group=64, prefill_window=64, min_shared_prefix=4)
    system = tuple(range(100, 110))
    s = Scheduler(config)
    s.set_chain_ready(True)
    s.rewind_slack = 2
    _run_prompt(s, "a", (*system, *range(40, 45)))  # fed 5 past where the next prompt parts: no copy
    s.submit(Request("c", (*system, 2, 3), SamplingParams(max_tokens=3)))
    (frame,) = s.next_frames()
    assert [(r.stream, r.start, len(r.tokens)) for r in frame.rows] == [("c", 0, 9)]  # stops where they part
    s.on_frame_done(frame.id, {})
    (frame,) = s.next_frames()
    prefix, rest = frame.rows
    assert (prefix.prefix, prefix.start, prefix.copy_from, rest.stream, rest.start) == (True, 9, "c", "c", 9)
    s.on_frame_failed(frame.id)
    assert s.kept_streams == 0 and prefix.stream in s.take_dropped()  # the stages that saw it close it
    s.submit(Request("d", (*system, 2, 4), SamplingParams(max_tokens=1)))
    (frame,) = s.next_frames()
    assert frame.rows[0].copy_from == "" and frame.rows[0].tokens == system  # nothing kept to start from
    s.on_frame_done(frame.id, {})
    (frame,) = s.next_frames()
    (prefix,) = [r for r in frame.rows if r.prefix]  # "d" shares 11 tokens with "c"
    s.drop_all_kept()  # a stage came back: the copy on its way is given up too
    s.on_frame_done(frame.id, {"d": 5})
    assert not s.kept(prefix.stream) and prefix.stream in s.take_dropped() and s.kept("d")


def test_shared_prefixes_count_as_kept_streams_and_the_one_last_copied_gives_way_last():
    s = Scheduler(SchedulerConfig(stages=1, rows_per_group=64, prefill_window=64, keep_finished=3))
    s.set_chain_ready(True)
    s.rewind_slack = 8
    system = tuple(range(100, 140))
    tails = {"a": range(10), "b": range(20, 30), "e": range(30, 40)}  # past the slack: none takes another over
    for rid in ("a", "b"):
        _run_prompt(s, rid, (*system, *tails[rid]))
    assert [s.kept(k) for k in ("a", "prefix-1", "b")] == [True] * 3  # oldest first
    _run_prompt(s, "e", (*system, *tails["e"]))  # a copy of prefix-1, which now gives way after "b"
    assert s.reused_positions == 40 and s.take_dropped() == ["a"]
    _run_prompt(s, "f", (7, 8, 9))
    assert s.take_dropped() == ["b"] and s.kept("prefix-1") and s.kept_streams == 3
    none = Scheduler(SchedulerConfig(stages=1, rows_per_group=64, prefill_window=64, keep_finished=0))
    none.set_chain_ready(True)
    none.rewind_slack = 8
    for rid in ("a", "b"):
        assert not any(r.prefix for f in _run_prompt(none, rid, (*system, *tails[rid])) for r in f.rows)
    with pytest.raises(ValueError, match="min_shared_prefix"):
        SchedulerConfig(stages=1, min_shared_prefix=-1)


def test_copies_nobody_started_from_give_way_before_conversations_once_they_take_too_many_places():
    from cascadia.router.scheduler import Kept, next_to_give_way

    conversation, told, shared = Kept((1, 2), 2, prompt=2), Kept((3,), 1, prefix=True), Kept((4,), 1, prefix=True)
    assert next_to_give_way({"c": conversation, "p": told}, unused_places=1) == "c"  # by age: a copy may stay
    assert next_to_give_way({"c": conversation, "p": told, "p2": shared}, unused_places=1) == "p"
    used = replace(shared, copies=1)
    assert next_to_give_way({"c": conversation, "q": used, "p": told}, unused_places=0) == "p"
    assert next_to_give_way({"q": used, "c": conversation}, unused_places=0) == "q"  # started from: by its age
    # a service whose system prompt differs per request: each first request leaves a copy nobody starts from
    s = Scheduler(SchedulerConfig(stages=1, rows_per_group=16, prefill_window=8, keep_finished=4, min_shared_prefix=8))
    s.set_chain_ready(True)
    s.rewind_slack = 4
    _run_prompt(s, "chat", tuple(range(300, 330)))  # a conversation, its next turn to come
    for user in range(2):
        system = tuple(range(100 + 40 * user, 120 + 40 * user))
        prompt = (*system, *range(50, 60))  # fed 10 past its system prompt: too far to step back to it
        _run_request(s, Request(f"u{user}", prompt, SamplingParams(max_tokens=1), shared_prefix=20))
    # oldest first, chat would have gone: with 4 places, one copy nobody started from may stay
    assert [name for name in ("chat", "u0", "prefix-2", "u1") if s.kept(name)] == ["chat", "u0", "prefix-2", "u1"]
    assert s.take_dropped() == ["prefix-1"] and s.shared_prefixes == 1
    frames = _run_prompt(s, "chat2", (*range(300, 330), 1, 5))  # the next turn takes the conversation over
    assert frames[0].rows[0].resume_from == "chat"
    # with every place held by finished streams, a new copy still outlives its maker for the next user
    for n in range(4):
        _run_prompt(s, f"other{n}", tuple(range(600 + 40 * n, 630 + 40 * n)))
    system = tuple(range(900, 920))
    _run_request(s, Request("v0", (*system, *range(50, 60)), SamplingParams(max_tokens=1), shared_prefix=20))
    frames = _run_request(s, Request("v1", (*system, 1, 2, 3), SamplingParams(max_tokens=1), shared_prefix=20))
    assert frames[0].rows[0].copy_from.startswith("prefix-") and frames[0].rows[0].start == 20


def test_a_prompt_that_parts_from_a_finished_streams_prompt_starts_as_a_copy_and_leaves_it_for_its_next_turn():
    s = Scheduler(SchedulerConfig(stages=1, rows_per_group=16, prefill_window=16, min_shared_prefix=8))
    s.set_chain_ready(True)
    s.rewind_slack = 8
    system = tuple(range(100, 120))
    _run_prompt(s, "a", (*system, 1, 2, 3), token=9)  # kept, fed to 23
    s.submit(Request("b", (*system, 4, 5, 6, 7), SamplingParams(max_tokens=1)))  # another user
    (frame,) = s.next_frames()
    assert [(r.stream, r.copy_from, r.resume_from, r.start) for r in frame.rows] == [("b", "a", "", 20)]
    assert s.on_frame_done(frame.id, {"b": 5})[0].cached == 20 and s.kept("a")
    s.submit(Request("a2", (*system, 1, 2, 3, 9, 6), SamplingParams(max_tokens=1)))  # a's next turn
    (frame,) = s.next_frames()
    assert [(r.stream, r.copy_from, r.resume_from, r.start) for r in frame.rows] == [("a2", "", "a", 23)]
    assert not s.kept("a") and s.take_dropped() == []


def test_a_copy_whose_source_name_passed_to_another_prompt_computes_its_prompt_itself():
    s = Scheduler(SchedulerConfig(stages=1, rows_per_group=64, prefill_window=64, min_shared_prefix=4))
    s.set_chain_ready(True)
    s.rewind_slack = 8
    system = tuple(range(100, 110))
    _run_prompt(s, "a", (*system, 1, 2))
    s.submit(Request("b", (*system, 3, 4), SamplingParams(max_tokens=1)))
    s._admit()  # to start as a copy of "a" at 10, not yet in a frame
    s.drop_kept("a")  # "a"'s name is wanted again, by another prompt
    s.submit(Request("a", tuple(range(200, 220)), SamplingParams(max_tokens=1)))
    (frame,) = s.next_frames()
    rows = {r.stream: (r.copy_from, r.start) for r in frame.rows}
    assert rows == {"a": ("", 0), "b": ("", 0)}


def test_a_prompt_that_announces_its_shared_prefix_leaves_a_copy_there_before_any_other_prompt_shares_it():
    s = Scheduler(SchedulerConfig(stages=1, rows_per_group=16, prefill_window=8, min_shared_prefix=8))
    s.set_chain_ready(True)
    s.rewind_slack = 4
    system = tuple(range(100, 120))
    first = Request("a", (*system, *range(10)), SamplingParams(max_tokens=1), shared_prefix=len(system))
    frames = _run_request(s, first)
    assert [len(r.tokens) for r in frames[0].rows] == [8] and frames[2].rows[0].tokens == system[16:19]
    (prefix,) = [r for f in frames for r in f.rows if r.prefix]
    assert (prefix.start, prefix.tokens, prefix.copy_from) == (19, (119,), "a")
    assert s.shared_prefixes == 1 and s.kept("a")  # "a" was fed too far past 20 to be stepped back to it
    # the next user starts from it, and announcing the same prefix leaves no second copy
    later = Request("b", (*system, 4, 5, 6), SamplingParams(max_tokens=1), shared_prefix=len(system))
    frames = _run_request(s, later)
    assert frames[0].rows[0].copy_from == prefix.stream and frames[0].rows[0].start == 20
    assert not any(r.prefix for f in frames for r in f.rows) and s.shared_prefixes == 1


def test_an_announced_prefix_is_left_only_where_worth_it_and_must_lie_within_the_prompt():
    from cascadia.router.scheduler import Kept, announced_prefix

    prompt = tuple(range(100, 130))

    def told(n: int, max_tokens: int = 1) -> Request:
        return Request("r", prompt, SamplingParams(max_tokens=max_tokens), shared_prefix=n)

    assert announced_prefix({}, told(20), copied=0, shortest=8, slack=4) == 20
    assert announced_prefix({}, told(20), copied=0, shortest=0, slack=4) == 0  # copies switched off
    assert announced_prefix({}, told(7), copied=0, shortest=8, slack=4) == 0  # too short to be worth one
    assert announced_prefix({}, told(20), copied=15, shortest=8, slack=4) == 0  # the copy it starts as serves it
    assert announced_prefix({}, told(30), copied=0, shortest=8, slack=4) == 0  # the whole prompt
    kept = {"p": Kept(prompt[:20], reached=20, prefix=True)}
    assert announced_prefix(kept, told(20), copied=0, shortest=8, slack=4) == 0  # kept already
    assert announced_prefix(kept, told(20), copied=0, shortest=8, slack=4, mtp=True) == 20  # not for the head
    # a finished stream fed past the slack from there cannot be stepped back to it
    far = {"a": Kept(prompt, reached=30, prompt=30)}
    assert announced_prefix(far, told(20), copied=0, shortest=8, slack=4) == 20
    assert announced_prefix(far, told(20), copied=0, shortest=8, slack=10) == 0
    for bad in (-1, 31):
        with pytest.raises(ValueError, match=f"shared_prefix {bad} must be in \\[0, 30\\]"):
            told(bad)


def test_stages_that_hold_every_row_keep_no_copies_since_each_stream_serves_its_own_start():
    s = Scheduler(SchedulerConfig(stages=1, rows_per_group=16, prefill_window=8, min_shared_prefix=8))
    s.set_chain_ready(True)
    s.rewind_slack = s.context = 64  # a Llama stage's reach: the whole context
    system = tuple(range(100, 120))
    sent = _run_request(s, Request("a", (*system, *range(10)), SamplingParams(max_tokens=1), shared_prefix=20))
    sent += _run_prompt(s, "b", (*system, 4, 5, 6))  # parts from "a" after 20 tokens, and copies it
    sent += _run_prompt(s, "c", (*system, 7, 8))
    assert not any(r.prefix for f in sent for r in f.rows) and s.shared_prefixes == 0
    assert s.reused_positions == 40 and s.kept_streams == 3


def test_users_with_their_own_system_prompts_keep_their_conversations_between_turns():
    """Six users, each with a system prompt of their own (told, as the gateway tells it), take turns for five
    rounds with 8 kept places: each first turn leaves a copy of its instructions nobody starts from, and
    every later turn still takes its conversation over (least recently used first, none would)."""
    s = Scheduler(SchedulerConfig(stages=1, rows_per_group=64, prefill_window=64, keep_finished=8))
    s.set_chain_ready(True)
    s.rewind_slack = 32
    history: dict[int, tuple[int, ...]] = {}
    taken_over = []
    for turn in range(5):
        for user in range(6):
            question = tuple(range(5000 + 50 * turn + user, 5020 + 50 * turn + user))
            prompt = (*history.get(user, tuple(range(1000 + 100 * user, 1060 + 100 * user))), *question)
            request = Request(f"u{user}t{turn}", prompt, SamplingParams(max_tokens=40), shared_prefix=60)
            s.submit(request)
            answer: list[int] = []
            while s.active or s.queued:
                (frame,) = s.next_frames()
                taken_over += [bool(r.resume_from) for r in frame.rows if r.opens and r.stream == request.id]
                done = s.on_frame_done(frame.id, {r.stream: 7 + len(answer) % 5 for r in frame.rows if r.wants_token})
                answer += [e.token for e in done if e.stream == request.id]
            history[user] = prompt + tuple(answer)
    assert taken_over == [False] * 6 + [True] * 24
