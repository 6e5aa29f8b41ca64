"""Speculative decoding: acceptance rules, the suffix automaton, the scheduler's verify rounds, the draft
service with a real Redis, and greedy identity with speculation on and off across real shard processes."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from cascadia.draft.proposer import HybridProposer
from cascadia.draft.suffix import SuffixAutomaton
from cascadia.engine.batch import Segment
from cascadia.engine.engine import StageEngine
from cascadia.engine.generate import generate
from cascadia.engine.sampling import SamplingParams, filtered_probabilities
from cascadia.engine.settings import EngineSettings
from cascadia.engine.speculation import accept_draft
from cascadia.model.loader import load_shape, load_stage
from cascadia.router.local import free_port
from cascadia.router.scheduler import (
    PROBE_EVERY,
    Request,
    RoundCosts,
    Scheduler,
    SchedulerConfig,
    draft_length,
    grown_draft,
    paying_draft,
    smoothed_acceptance,
)
from tests.helpers import router_ready, serving

# -- acceptance -------------------------------------------------------------------------------------


def test_greedy_acceptance_keeps_matching_drafts_then_adds_the_models_token():
    logits = np.full((4, 6), -1.0)
    for row, best in enumerate([2, 5, 1, 3]):
        logits[row, best] = 1.0
    greedy = SamplingParams()
    rng = np.random.default_rng(0)
    assert accept_draft(logits, [2, 5, 1], greedy, rng) == [2, 5, 1, 3]  # all accepted, plus the bonus token
    assert accept_draft(logits, [2, 4, 1], greedy, rng) == [2, 5]  # first mismatch: the model's token
    assert accept_draft(logits[:1], [], greedy, rng) == [2]
    with pytest.raises(ValueError, match="need 3 rows"):
        accept_draft(logits, [1, 2], greedy, rng)


@pytest.mark.parametrize("draft", [[0], [3], [1, 4]])
def test_rejection_sampling_leaves_the_output_distributed_as_plain_sampling(draft):
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(len(draft) + 1, 5)) * 1.5
    params = SamplingParams(temperature=0.8, top_k=4)
    expected = filtered_probabilities(logits[0], params)
    n = 40000
    first = Counter(accept_draft(logits, draft, params, rng)[0] for _ in range(n))
    observed = np.array([first[t] / n for t in range(5)])
    # each frequency within 4.5 standard errors of the target probability (and impossible tokens never)
    tolerance = 4.5 * np.sqrt(expected * (1 - expected) / n) + 1e-9
    assert np.all(np.abs(observed - expected) <= tolerance), (observed, expected)


# -- the suffix automaton -------------------------------------------------------------------------


def _brute_force(tokens: list[int]) -> int:
    """Length of the longest suffix that also ends at an earlier position."""
    n = len(tokens)
    for length in range(n - 1, 0, -1):
        suffix = tokens[n - length :]
        if any(tokens[end - length + 1 : end + 1] == suffix for end in range(length - 1, n - 1)):
            return length
    return 0


def test_suffix_automaton_finds_the_longest_earlier_occurrence():
    rng = np.random.default_rng(2)
    for _ in range(30):
        tokens = [int(t) for t in rng.integers(0, 3, size=int(rng.integers(1, 40)))]
        automaton = SuffixAutomaton()
        for i, t in enumerate(tokens):
            automaton.append(t)
            length, end = automaton.longest_repeat()
            seen = tokens[: i + 1]
            assert length == _brute_force(seen)
            if length:
                assert end < i and seen[end - length + 1 : end + 1] == seen[i - length + 1 :]


def test_suffix_proposal_continues_a_copied_passage():
    text = [5, 6, 7, 8, 9, 10, 11, 1, 2, 5, 6, 7]
    length, proposal = SuffixAutomaton(text).propose(4)
    assert length == 3 and proposal == [8, 9, 10, 11]


def test_suffix_proposal_of_a_repeating_run_repeats_its_period():
    """The latest repeat ends 3 tokens back: the proposal runs on as the period, not 3 tokens and stop."""
    length, proposal = SuffixAutomaton([9, 1, 2, 3, 1, 2, 3, 1, 2, 3]).propose(7)
    assert length == 6 and proposal == [1, 2, 3, 1, 2, 3, 1]
    _, proposal = SuffixAutomaton([4, 4, 4]).propose(5)
    assert proposal == [4, 4, 4, 4, 4]
    _, proposal = SuffixAutomaton([7, 1, 2, 7, 1]).propose(2)
    assert proposal == [2, 7]


# -- scheduling of verify rounds (pure) ------------------------------------------------------------


def test_draft_length_pays_only_for_light_load_and_follows_acceptance():
    assert draft_length(1, 8, 7, accepted_ema=3.0) == 7
    assert draft_length(1, 8, 7, accepted_ema=0.0) == 1  # recent misses: short drafts
    assert draft_length(4, 8, 7, accepted_ema=3.0) == 1
    assert draft_length(8, 8, 7, accepted_ema=3.0) == 0  # decode rows fill the group: no speculation
    assert draft_length(1, 8, 0, accepted_ema=3.0) == 0


def test_a_round_that_accepts_nothing_ends_the_long_drafts_at_once():
    ema = 1.0
    for _ in range(4):  # a copy: every round accepts all it drafted
        ema = smoothed_acceptance(ema, draft_length(1, 16, 15, ema))
    assert draft_length(1, 16, 15, ema) == 15
    ema = smoothed_acceptance(ema, 0)  # the copy ended
    assert draft_length(1, 16, 15, ema) == 1
    ema = smoothed_acceptance(ema, 1)  # it picks up again
    assert draft_length(1, 16, 15, ema) == 2
    assert smoothed_acceptance(6.0, 2) == 4.0  # a partial miss only halves the lead


def test_scheduler_sends_drafts_and_rewinds_the_rejected_positions():
    s = Scheduler(SchedulerConfig(stages=1, max_draft=3))
    s.set_chain_ready(True)
    s.submit(Request("a", (1, 2, 3), SamplingParams(max_tokens=10)))
    (prefill,) = s.next_frames()
    s.on_frame_done(prefill.id, {"a": 7})
    (wanted,) = s.drafts_wanted()
    assert wanted.context == (1, 2, 3, 7) and wanted.k == 3
    s.set_draft("a", [8, 9, 4])
    (verify,) = s.next_frames()
    assert verify.rows[0].tokens == (7, 8, 9, 4) and verify.rows[0].draft == (8, 9, 4) and verify.rows[0].start == 3
    # the last stage accepted 8, rejected 9 and chose 5: positions 3 (7) and 4 (8) stand, 5 and 6 go
    emitted = s.on_frame_done(verify.id, {"a": [8, 5]})
    assert [e.token for e in emitted] == [8, 5]
    assert s.verified[0].proposed == 3 and s.verified[0].accepted == 1
    (next_frame,) = s.next_frames()
    assert next_frame.rewinds == (("a", 5),)
    assert next_frame.rows[0].start == 5 and next_frame.rows[0].tokens == (5,)
    with pytest.raises(ValueError, match="returned"):
        s.on_frame_done(next_frame.id, {"a": [1, 2]})  # two tokens for a block without a draft


def test_prefilling_and_queued_streams_leave_less_room_for_drafts():
    """A lone decoding stream drafts 3; with 3 more streams admitted or waiting 1; with 7 more none."""
    s = Scheduler(SchedulerConfig(stages=1, max_draft=3, max_streams=4))
    s.set_chain_ready(True)
    s.submit(Request("a", (1, 2, 3), SamplingParams(max_tokens=10)))
    (prefill,) = s.next_frames()
    s.on_frame_done(prefill.id, {"a": 7})
    assert [w.k for w in s.drafts_wanted()] == [3]
    for rid in "bcd":
        s.submit(Request(rid, (1, 2, 3, 4), SamplingParams(max_tokens=10)))
    assert [w.k for w in s.drafts_wanted()] == [1]
    for rid in "efgh":
        s.submit(Request(rid, (1, 2), SamplingParams(max_tokens=10)))
    assert s.drafts_wanted() == []


def _decoding(config: SchedulerConfig, streams: str, max_tokens: int) -> Scheduler:
    """A scheduler whose streams (one per letter) have prefilled together and decode."""
    s = Scheduler(config)
    s.set_chain_ready(True)
    for rid in streams:
        s.submit(Request(rid, (1, 2, 3), SamplingParams(max_tokens=max_tokens)))
    (prefill,) = s.next_frames()
    s.on_frame_done(prefill.id, {rid: 7 for rid in streams})
    return s


def test_large_groups_still_draft_only_within_the_draft_rows():
    """A one-machine chain's 64-row groups: drafts as if the group were 8 rows (none with 8 streams)."""
    s = _decoding(SchedulerConfig(stages=1, rows_per_group=64, max_draft=3, draft_rows=8), "abcdefgh", 10)
    assert s.drafts_wanted() == []
    assert SchedulerConfig(stages=1, rows_per_group=64, max_draft=3).draft_room == 64


def test_round_costs_find_the_widest_frame_measured_about_as_fast():
    costs = RoundCosts()
    assert costs.widest_at_cost(8, 16) == 8  # nothing measured yet
    for rows, seconds in ((1, 0.026), (4, 0.042), (8, 0.063), (12, 0.062), (16, 0.065)):
        costs.observe(rows, seconds)
    assert costs.widest_at_cost(8, 16) == 16
    assert costs.widest_at_cost(8, 12) == 12  # never beyond the limit
    assert costs.widest_at_cost(4, 16) == 4  # 8 rows cost 50% more than 4
    assert costs.widest_at_cost(10, 16) == 16  # unmeasured 10 rows cost no less than the measured 8
    costs.observe(16, 0.2)  # slower measurements pull the smoothed cost up
    assert 0.065 < costs.seconds[16] < 0.2 and costs.widest_at_cost(8, 16) == 12


def test_drafts_grow_only_into_rows_measured_near_free_and_never_after_misses():
    costs = RoundCosts({2: 0.034, 8: 0.063, 16: 0.065})
    assert grown_draft(7, 15, 0, costs) == 15
    assert grown_draft(0, 15, 0, costs) == 0  # a stream whose drafts miss is not grown
    assert grown_draft(1, 15, 0, costs) == 1  # 8 rows cost far more than 2
    assert grown_draft(7, 11, 0, costs) == 7  # 16 rows would exceed the room
    assert grown_draft(3, 11, 4, costs) == 11  # another stream's 4 rows share the frame: 8 -> 16 rows


def test_streams_sharing_a_frame_draft_only_what_their_acceptance_pays_for():
    # four rows 16 ms, five 19 ms, seven 28 ms (this machine's curve): tokens per second decide
    costs = RoundCosts({4: 0.016, 5: 0.019, 7: 0.028})
    assert paying_draft(3, 4, 1.2, costs) == 1  # 5 tokens in 19 ms beat 4 in 16; 5.2 in 28 do not
    assert paying_draft(3, 4, 0.5, costs) == 0  # misses half the time: no draft pays
    assert paying_draft(3, 4, 3.0, costs) == 1  # even a copy: 7 tokens in 28 ms are fewer a second than 5 in 19
    assert paying_draft(3, 4, 3.0, RoundCosts({4: 0.016, 5: 0.019, 7: 0.020})) == 3  # where 7 rows cost little
    assert paying_draft(3, 1, 0.0, costs) == 3  # a lone stream is left to its acceptance
    assert paying_draft(3, 2, 0.0, costs) == 3  # frames never measured are drafted, and so measured


def test_four_streams_stop_drafting_once_the_frames_say_it_does_not_pay():
    s = _decoding(SchedulerConfig(stages=1, rows_per_group=64, max_draft=15, draft_rows=16), "abcd", 40)
    for rid in "abcd":
        s._active[rid].accepted_ema = 1.0
    assert {w.k for w in s.drafts_wanted()} == {3}  # nothing measured yet: the room's share
    _drafted_and_verified(s, "abcd")
    for rows, seconds in ((4, 0.016), (5, 0.019), (6, 0.024), (7, 0.028)):
        s.round_costs.observe(rows, seconds)
    for rid in "abcd":
        s._active[rid].accepted_ema = 0.6
    assert s.drafts_wanted() == []
    for rid in "abcd":
        s._active[rid].accepted_ema = 3.0
    assert {w.k for w in s.drafts_wanted()} == {1}  # copies: one draft each pays, three do not
    for rid in "abcd":  # all missed since, and 16 more tokens went by: one probe each, then none again
        s._active[rid].accepted_ema = 0.0
        s._active[rid].generated += [7] * 16
    assert {w.k for w in s.drafts_wanted()} == {1}
    assert {w.k for w in s.drafts_wanted()} == {1}  # nothing was proposed: the probe is still open
    _drafted_and_verified(s, "abcd")
    assert s.drafts_wanted() == []


def test_a_lone_stream_stops_asking_for_drafts_that_take_longer_than_they_save():
    """A draft model as slow as the chain (on one machine it shares its cores) costs a lone stream
    more than its accepted drafts gain; a suffix match that costs nothing still pays. The stream probes
    now and then, and a cheap probe opens drafting again."""
    s = _decoding(SchedulerConfig(stages=1, rows_per_group=64, max_draft=4, draft_rows=16), "a", 60)
    stream = s._active["a"]
    stream.accepted_ema = 4.0  # every draft accepted
    s.round_costs.observe(5, 0.0186)
    (asked,) = s.drafts_wanted()
    assert asked.k == 4  # how long asking takes is not known yet
    s.observe_proposal("a", asked.k, 4 * 0.0116)  # a model drafting at the chain's own pace
    s.set_draft("a", [8, 8, 8, 8])
    stream.draft = ()
    assert s.drafts_wanted() == []  # a frame without drafts was never measured: one goes, and measures it
    s.round_costs.observe(1, 0.0116)
    assert s.drafts_wanted() == []  # 5 tokens in 63 ms against 1 in 11.6
    stream.generated += [7] * PROBE_EVERY
    (probe,) = s.drafts_wanted()
    assert probe.k == 1
    s.observe_proposal("a", probe.k, 0.0)  # the probe found a match in the request itself
    s.set_draft("a", [8])
    stream.draft = ()
    s.observe_proposal("a", 1, 0.0)
    (asked,) = s.drafts_wanted()
    assert asked.k == 4


def _drafted_and_verified(s: Scheduler, streams: str) -> None:
    for rid in streams:
        s.set_draft(rid, [8])
        s._active[rid].draft = ()  # verified (accepted or not) in the next frame


def test_a_lone_stream_drafts_into_a_block_the_chain_ran_as_fast():
    """Frames of 8 and 16 rows measured alike: a stream that drafts 7 drafts 15 instead."""
    s = Scheduler(SchedulerConfig(stages=1, rows_per_group=64, max_draft=15, draft_rows=16))
    s.set_chain_ready(True)
    s.submit(Request("a", (1, 2, 3, 4, 5, 6, 7, 8), SamplingParams(max_tokens=40)))
    (prefill,) = s.next_frames()
    s.on_frame_done(prefill.id, {"a": 9}, seconds=0.06)  # an 8-row frame
    s._active["a"].accepted_ema = 3.0  # recent rounds accepted their drafts
    (wanted,) = s.drafts_wanted()
    assert wanted.k == 7
    s.set_draft("a", list(range(10, 17)))
    (verify,) = s.next_frames()
    s.on_frame_done(verify.id, {"a": list(range(10, 18))}, seconds=0.061)  # all 7 accepted, 8 rows again
    assert s.round_costs.widest_at_cost(8, 16) == 8  # 16 rows never measured: no growth yet
    s.round_costs.observe(16, 0.063)
    (wanted,) = s.drafts_wanted()
    assert wanted.k == 15


def test_penalised_and_seeded_sampling_requests_are_not_speculated():
    s = Scheduler(SchedulerConfig(stages=1, max_draft=3))
    s.set_chain_ready(True)
    for rid, params in (
        ("penalty", SamplingParams(max_tokens=8, presence_penalty=0.5)),
        ("seeded", SamplingParams(max_tokens=8, temperature=0.7, seed=3)),
        ("greedy-seed", SamplingParams(max_tokens=8, seed=3)),
    ):
        s.submit(Request(rid, (1, 2), params))
    (frame,) = s.next_frames()
    s.on_frame_done(frame.id, {"penalty": 4, "seeded": 4, "greedy-seed": 4})
    assert [w.stream for w in s.drafts_wanted()] == ["greedy-seed"]


# -- a rejected draft leaves no trace in the engine ------------------------------------------------


def test_rewinding_a_rejected_draft_restores_the_state_exactly(tiny):
    engine = StageEngine(load_stage(tiny, 0, load_shape(tiny).num_layers), EngineSettings())
    prompt = np.array([5, 9, 200, 31, 7, 7, 12, 40, 41, 42, 43, 44])  # longer than the tiny window of 8
    engine.open("plain")
    engine.open("spec")
    engine.step([Segment("plain", 0, 12), Segment("spec", 0, 12)], np.concatenate([prompt, prompt]))
    # "spec" verifies a draft of 3 wrong tokens, then rewinds to keep only its first row
    engine.step([Segment("spec", 12, 4)], np.array([99, 100, 101, 102]))
    engine.rewind("spec", 13)
    plain = engine.step([Segment("plain", 12, 2)], np.array([99, 55])).logits
    spec = engine.step([Segment("spec", 13, 1)], np.array([55])).logits
    np.testing.assert_allclose(spec[0], plain[1], rtol=1e-5, atol=1e-5)  # batch shapes differ: not bit-equal
    # teeth: continuing past the rejected rows without the rewind gives something else entirely
    engine.open("leak")
    engine.step([Segment("leak", 0, 12)], prompt)
    engine.step([Segment("leak", 12, 4)], np.array([99, 100, 101, 102]))
    leaked = engine.step([Segment("leak", 16, 1)], np.array([55])).logits
    assert np.abs(leaked[0] - plain[1]).max() > 1e-2


# -- the draft service and Redis --------------------------------------------------------------------


def _prompt_whose_output_repeats(engine: StageEngine, tokens: int = 16) -> tuple[list[int], list[int]]:
    """A prompt whose greedy output the request-local source drafts correctly at least twice, found by
    replaying what the proposer would see (a random model copies only by chance)."""
    for seed in range(200):
        rng = np.random.default_rng(seed)
        motif = [int(t) for t in rng.integers(3, 500, size=4)]
        prompt = [*motif, *rng.integers(3, 500, size=2).tolist(), *motif, *motif[:2]]
        expected = generate(engine, prompt, SamplingParams(max_tokens=tokens)).token_ids
        hits = 0
        for i in range(1, tokens):
            _, proposal = SuffixAutomaton([*prompt, *expected[:i]]).propose(1, min_match=2)
            hits += proposal == expected[i : i + 1]
        if hits >= 2:
            return prompt, expected
    raise AssertionError("no prompt among 200 makes the tiny model repeat itself")


def _draft_service(listen: str, redis_url: str, tmp_path: Path, name: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "cascadia.cli", "draft", "--listen", listen, "--redis", redis_url, "--warmup", "4"]
    log = open(tmp_path / f"{name}.log", "w")  # noqa: SIM115 (lives as long as the process)
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


@pytest.mark.slow
def test_two_draft_replicas_share_contexts_through_redis_and_survive_its_loss(redis_server, tmp_path):
    from cascadia.draft.client import DraftClient

    url, redis_process = redis_server
    addresses = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    services = [_draft_service(a, url, tmp_path, f"draft-{i}") for i, a in enumerate(addresses)]
    passage = [int(t) for t in np.random.default_rng(3).integers(100, 900, size=60)]

    async def scenario() -> None:
        first, second = DraftClient(addresses[0], timeout=5), DraftClient(addresses[1], timeout=5)
        for _ in range(100):  # both replicas up
            if all(
                [await c.propose("probe", [1], 1) == ([], "") and c._sent.get("probe") == 1 for c in (first, second)]
            ):
                break
            await asyncio.sleep(0.1)
        # request A (on replica 0) writes the passage and finishes: it becomes a shared context
        tokens, source = await first.propose("A", passage, 4)
        assert (tokens, source) == ([], "")  # nothing repeats inside A, and nothing is shared yet
        await first.forget("A", share=True)
        # request B (on replica 1) starts quoting the passage: replica 1 proposes its continuation
        quote = [7, 8, *passage[10:20]]
        tokens, source = await second.propose("B", quote, 5)
        assert source == "shared:A" and tokens == passage[20:25]
        # a source that keeps being wrong loses trust after the warm-up
        for _ in range(3):
            await second.observe("B", source, 5, 0)
        await second.observe("B", source, 5, 0)
        tokens, source = await second.propose("B", [*quote, *passage[20:22]], 5)
        assert source != "shared:A"
        # Redis goes away: drafting goes on from the request's own tokens, nothing fails
        redis_process.terminate()
        redis_process.wait(10)
        repeated = [3, 4, 5, 6, 50, 51, 3, 4, 5]
        tokens, source = await first.propose("C", repeated, 3)
        assert (tokens, source) == ([6, 50, 51], "local")
        await first.forget("C", share=True)  # publishing to a dead Redis is skipped, not an error
        for client in (first, second):
            await client.close()

    try:
        asyncio.run(scenario())
        assert all(s.poll() is None for s in services), "a draft service died"
    finally:
        for s in services:
            s.terminate()
            s.wait(10)
    log = (tmp_path / "draft-0.log").read_text()
    assert "local proposals" in log or "unavailable" in log


def test_a_hung_redis_is_left_alone_for_a_while_then_asked_again(redis_server):
    """The first call waits out its timeout; the next ones return at once until the back-off ends."""
    from cascadia.draft.shared import RedisContexts

    url, redis_process = redis_server
    contexts = RedisContexts(url, retry_after_s=0.5)
    contexts.publish("A", list(range(100, 120)))
    suffix = [104, 105, 106, 107]
    assert contexts.lookup(suffix, 3) == ("shared:A", [108, 109, 110])
    os.kill(redis_process.pid, signal.SIGSTOP)
    try:
        started = time.perf_counter()
        assert contexts.lookup(suffix, 3) is None
        first = time.perf_counter() - started
        started = time.perf_counter()
        assert all(contexts.lookup(suffix, 3) is None for _ in range(20))
        rest = time.perf_counter() - started
    finally:
        os.kill(redis_process.pid, signal.SIGCONT)
    assert first >= 0.15 and rest < 0.05, (first, rest)
    time.sleep(0.6)
    assert contexts.lookup(suffix, 3) == ("shared:A", [108, 109, 110])


@pytest.mark.slow
def test_a_stalled_redis_does_not_hold_up_the_draft_services_other_calls(redis_server, tmp_path):
    """Observations go to Redis, whose calls wait out their socket timeout when it hangs: they must
    wait off the event loop, so that the service keeps answering everything else meanwhile."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from cascadia.draft.client import DraftClient
    from cascadia.wire import tls

    url, redis_process = redis_server
    address = f"127.0.0.1:{free_port()}"
    service = _draft_service(address, url, tmp_path, "draft")

    async def scenario() -> tuple[float, list[float]]:
        client = DraftClient(address, timeout=5)
        for _ in range(100):
            if await client.propose("probe", [1], 1) == ([], "") and client._sent.get("probe") == 1:
                break
            await asyncio.sleep(0.1)
        channel = tls.channel(address)
        health = health_pb2_grpc.HealthStub(channel)
        os.kill(redis_process.pid, signal.SIGSTOP)  # Redis hangs: every call waits for its timeout
        try:
            started = time.perf_counter()
            observing = asyncio.gather(*(client.observe("B", "shared:A", 5, 5) for _ in range(4)))
            latencies = []
            while not observing.done():
                before = time.perf_counter()
                await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
                latencies.append(time.perf_counter() - before)
                await asyncio.sleep(0.01)
            await observing
            observed = time.perf_counter() - started
        finally:
            os.kill(redis_process.pid, signal.SIGCONT)
        await channel.close()
        await client.close()
        return observed, latencies

    try:
        observed, latencies = asyncio.run(scenario())
        assert service.poll() is None, "the draft service died"
    finally:
        service.terminate()
        service.wait(10)
    assert observed >= 0.15  # the observations did wait for the hung Redis
    assert latencies and max(latencies) < 0.1, latencies


# -- greedy identity across real shard processes ---------------------------------------------------

COPY_PROMPT = (
    "Repeat the list exactly. List: red apple, green pear, yellow banana, purple grape, orange mango. "
    "Repeat: red apple, green pear,"
)


def _generate(model: str, shards: int, speculation: str, prompt_args: list[str], tokens: int = 32) -> list[int]:
    cmd = [sys.executable, "-m", "cascadia.cli", "generate", "--model", model, "--shards", str(shards)]
    cmd += [*prompt_args, "--max-tokens", str(tokens), "--json", "--speculation", speculation]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])["token_ids"]


class SlowDrafter:
    """A draft model that takes as long as a small model's step, and notes how many draft at once."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.running, self.most = seconds, 0, 0

    def draft(self, context, k: int, stream: str) -> list[int]:
        self.running += 1
        self.most = max(self.most, self.running)
        time.sleep(self.seconds)
        self.running -= 1
        return [7] * k

    def forget(self, stream: str) -> None:
        return None


def test_a_draft_model_in_the_routers_process_leaves_its_event_loop_free():
    """The router's in-process proposer runs a draft model in a thread, one proposal at a time: the
    loop goes on (it takes the pipeline's replies) while two streams' drafts are worked out."""
    from cascadia.draft.client import LocalProposer

    drafter = SlowDrafter(0.2)
    local = LocalProposer(HybridProposer(model=drafter))

    async def run() -> tuple[list[tuple[list[int], str]], int]:
        ticks = 0

        async def ticking() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.create_task(ticking())
        proposals = await asyncio.gather(local.propose("a", [1, 2, 3], 4), local.propose("b", [4, 5, 6], 2))
        await local.forget("a", share=False)
        ticker.cancel()
        return proposals, ticks

    proposals, ticks = asyncio.run(run())
    assert proposals == [([7] * 4, "model"), ([7] * 2, "model")]
    assert ticks >= 20  # 0.4 s of drafting at 10 ms a tick; on the loop itself it would be none
    assert drafter.most == 1


@pytest.mark.slow
@pytest.mark.parametrize("shards", [1, 3])
def test_greedy_output_is_identical_with_speculation_on_smollm(shards):
    off = _generate("smollm2-135m", shards, "off", ["--prompt", COPY_PROMPT])
    on = _generate("smollm2-135m", shards, "on", ["--prompt", COPY_PROMPT])
    assert on == off


@pytest.mark.slow
def test_greedy_output_is_identical_with_speculation_on_inkling(tiny):
    for seed in range(3):
        rng = np.random.default_rng(seed)
        motif = [int(t) for t in rng.integers(3, 500, size=5)]
        ids = " ".join(map(str, [*motif, *rng.integers(3, 500, size=3), *motif, *motif[:2]]))
        expected = generate(
            StageEngine(load_stage(tiny, 0, load_shape(tiny).num_layers), EngineSettings()),
            [int(t) for t in ids.split()],
            SamplingParams(max_tokens=24),
        ).token_ids
        for shards in (1, 3):
            assert _generate(str(tiny), shards, "on", ["--prompt-ids", ids], tokens=24) == expected


@pytest.mark.slow
def test_router_with_a_draft_service_verifies_drafts_and_keeps_greedy_ids(tiny, redis_server, tmp_path):
    """The router process drafting through `cascadia draft` (Redis-backed): rounds happen, drafts are
    accepted, every stage frees the streams, and greedy ids equal the engine's alone."""
    import grpc

    from cascadia.router.local import LocalFleet
    from cascadia.shard.service import pb, rpc

    url, _ = redis_server
    draft_addr = f"127.0.0.1:{free_port()}"
    draft = _draft_service(draft_addr, url, tmp_path, "draft")
    engine = StageEngine(load_stage(tiny, 0, load_shape(tiny).num_layers), EngineSettings())
    rng = np.random.default_rng(11)
    repeating, repeating_out = _prompt_whose_output_repeats(engine, 20)
    requests = [("r0", repeating, repeating_out)]
    for i in range(1, 4):
        motif = [int(t) for t in rng.integers(3, 500, size=6)]
        prompt = [*motif, *rng.integers(3, 500, size=2).tolist(), *motif, *motif[:3]]
        requests.append((f"r{i}", prompt, generate(engine, prompt, SamplingParams(max_tokens=20)).token_ids))
    fleet = LocalFleet(tiny, 2)
    fleet.start(tmp_path)
    port = free_port()
    fleet.start_router(port, tmp_path / "router.log", max_draft=5, draft=draft_addr)

    async def go():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = rpc.RouterStub(channel)
            await router_ready(stub)
            await serving(draft_addr)

            async def one(rid, prompt, off=False):
                message = pb.GenerateRequest(request_id=rid, prompt_ids=prompt, max_tokens=20, speculation_off=off)
                return [e.token async for e in stub.Generate(message, timeout=120)]

            got = await asyncio.gather(*(one(rid, prompt) for rid, prompt, _ in requests))
            stats = await stub.Stats(pb.StatsRequest(), timeout=5)
            plain = await one("off", requests[0][1], off=True)
            after = await stub.Stats(pb.StatsRequest(), timeout=5)
            return got, stats, plain, after

    try:
        got, stats, plain, after = asyncio.run(go())
    finally:
        fleet.stop()
        draft.terminate()
        draft.wait(10)
    assert got == [expected for _, _, expected in requests]
    assert plain == requests[0][2]
    assert stats.verify_rounds > 0 and stats.accepted_tokens > 0, stats
    assert stats.accepted_tokens <= stats.drafted_tokens
    assert after.verify_rounds == stats.verify_rounds  # the request that switched speculation off drafted nothing


@pytest.mark.slow
@pytest.mark.parametrize("form", ["text", "chat"])
def test_a_draft_model_with_another_tokenizer_proposes_what_the_target_would_say(form):
    """SmolLM2 drafting for itself through the text round trip: its drafts are the target's own greedy
    continuation, proposal after proposal as the stream grows (state kept and rewound in the drafter).
    A chat's markup is special tokens, which must survive the round trip as well."""
    from cascadia.draft.model import EngineDrafter
    from cascadia.gateway.text import TextCodec
    from cascadia.model.loader import resolve

    path = resolve("smollm2-135m")
    codec = TextCodec.from_model(path)
    drafter = EngineDrafter(path, codec, codec)
    target = StageEngine(load_stage(path, 0, load_shape(path).num_layers), EngineSettings())
    if form == "chat":
        context = codec.encode_chat([{"role": "user", "content": "Name the three primary colors."}])
    else:
        context = codec.encode("The three primary colors are")
    expected = generate(target, context, SamplingParams(max_tokens=24)).token_ids
    # the drafter alone: through the proposer a request-local match may come first (a chat reply repeats)
    produced: list[int] = []
    rounds = 0
    while len(produced) < 20:
        tokens = drafter.draft([*context, *produced], 4, "s")
        assert tokens == expected[len(produced) : len(produced) + 4], rounds
        # the target accepts them all and adds its own next token
        step = [*tokens, expected[len(produced) + len(tokens)]]
        produced += step
        rounds += 1
    assert rounds <= 5
    assert drafter.engine.position("s") == len(context) + len(produced) - 5  # kept, not fed again
    HybridProposer(model=drafter).forget("s", share=False)  # through the proposer, as a request ends
    assert drafter.engine.streams == []


@pytest.mark.slow
def test_redis_and_draft_service_faults_never_fail_a_request(tiny, redis_server, tmp_path):
    """Redis stopped and restarted, the draft service killed with SIGKILL and restarted: every request
    still completes with its greedy ids, and speculative rounds resume once the draft service is back."""
    import grpc

    from cascadia.router.local import LocalFleet
    from cascadia.shard.service import pb, rpc

    url, redis_process = redis_server
    redis_port = url.split(":")[2].split("/")[0]
    draft_addr = f"127.0.0.1:{free_port()}"
    draft = _draft_service(draft_addr, url, tmp_path, "draft")
    engine = StageEngine(load_stage(tiny, 0, load_shape(tiny).num_layers), EngineSettings())
    prompt, expected = _prompt_whose_output_repeats(engine)
    fleet = LocalFleet(tiny, 2)
    fleet.start(tmp_path)
    port = free_port()
    fleet.start_router(port, tmp_path / "router.log", max_draft=5, draft=draft_addr)
    restarted: list[subprocess.Popen] = []

    async def go():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = rpc.RouterStub(channel)
            await router_ready(stub)

            async def one(rid: str) -> list[int]:
                message = pb.GenerateRequest(request_id=rid, prompt_ids=prompt, max_tokens=16)
                return [e.token async for e in stub.Generate(message, timeout=120)]

            async def round_of(tag: str) -> int:
                outs = await asyncio.gather(*(one(f"{tag}-{i}") for i in range(3)))
                assert all(out == expected for out in outs), tag
                return (await stub.Stats(pb.StatsRequest(), timeout=5)).verify_rounds

            await serving(draft_addr)
            rounds = {"healthy": await round_of("healthy")}
            redis_process.terminate()
            redis_process.wait(10)
            rounds["redis down"] = await round_of("redis-down")
            cmd = ["redis-server", "--port", redis_port, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
            restarted.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            await asyncio.sleep(0.5)
            rounds["redis back"] = await round_of("redis-back")
            draft.kill()
            draft.wait(10)
            rounds["draft down"] = await round_of("draft-down")
            restarted.append(_draft_service(draft_addr, url, tmp_path, "draft-again"))
            await serving(draft_addr)
            for attempt in range(10):  # the router's channel reconnects on its own schedule
                rounds["draft back"] = await round_of(f"draft-back-{attempt}")
                if rounds["draft back"] > rounds["draft down"]:
                    break
            return rounds

    try:
        rounds = asyncio.run(go())
    finally:
        fleet.stop()
        for process in [draft, *restarted]:
            if process.poll() is None:
                process.terminate()
                process.wait(10)
    assert rounds["healthy"] > 0
    assert rounds["redis down"] > rounds["healthy"]  # request-local drafting goes on without Redis
    assert rounds["draft down"] == rounds["redis back"]  # no draft service, no rounds, no failures
    assert rounds["draft back"] > rounds["draft down"]


def test_bench_families_go_through_the_chat_template_and_stop_with_the_turn():
    from cascadia.bench.spec import CHAT_FAMILIES, family_prompts
    from cascadia.gateway.text import TextCodec
    from cascadia.model.loader import resolve

    codec = TextCodec.from_model(resolve("smollm2-135m"))
    chat = family_prompts(codec, "chat", 64)
    raw = family_prompts(codec, "completion", 64)
    assert set(chat) == set(raw) == set(CHAT_FAMILIES)
    for family, (ids, params) in chat.items():
        assert ids == codec.encode_chat([{"role": "user", "content": CHAT_FAMILIES[family]}])
        assert params.stop_ids == codec.stop_token_ids and params.stop_ids  # ends where a chat reply ends
        assert codec.decode(ids).rstrip().endswith("assistant")
    assert all(not params.stop_ids and params.max_tokens == 64 for f, (_, params) in raw.items() if f != "json")
    for form in (chat, raw):  # the json family is held to its schema, which ends with the model's end token
        shaped = form["json"][1]
        assert shaped.grammar and shaped.stop_ids == codec.stop_token_ids
        assert all(not params.grammar for f, (_, params) in form.items() if f != "json")
    with pytest.raises(ValueError, match="form 'yaml' is not one of chat, completion"):
        family_prompts(codec, "yaml", 64)
