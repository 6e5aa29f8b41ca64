"""The chain across real shard processes, with real gRPC over loopback."""

from __future__ import annotations

import asyncio
import time

import grpc
import numpy as np
import pytest

from cascadia.engine.batch import Segment
from cascadia.engine.engine import StageEngine
from cascadia.engine.generate import generate
from cascadia.engine.sampling import SamplingParams, log_softmax
from cascadia.engine.settings import EngineSettings
from cascadia.model.checkpoint import load_stage
from cascadia.model.config import load_shape
from cascadia.router.limits import FleetLimits
from cascadia.router.local import LocalFleet, free_port
from cascadia.router.pipeline import PipelineDriver, RequestFailed
from cascadia.router.scheduler import Request, SchedulerConfig
from cascadia.wire import pb, rpc
from tests.helpers import next_token_log_probs, router_ready

pytestmark = pytest.mark.slow


def prompts(count: int, seed: int = 0) -> list[Request]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 40, size=count)
    return [
        Request(f"r{i}", tuple(int(t) for t in rng.integers(3, 500, size=n)), SamplingParams(max_tokens=8))
        for i, n in enumerate(lengths)
    ]


@pytest.fixture(scope="module")
def solo_engine(tiny):
    return StageEngine(load_stage(tiny, 0, load_shape(tiny).num_layers), EngineSettings())


@pytest.fixture(scope="module")
def solo(solo_engine):
    return lambda r: generate(solo_engine, r.prompt, r.params, stream="solo").token_ids


async def run_fleet(fleet: LocalFleet, requests: list[Request], config: SchedulerConfig | None = None):
    driver = PipelineDriver(fleet.stage_addrs, fleet.reply_addr, config or SchedulerConfig(stages=fleet.shards))
    await driver.start()
    try:
        await driver.wait_ready(timeout=120)
        results = await asyncio.gather(*(driver.generate(r) for r in requests), return_exceptions=True)
        return driver, results
    finally:
        await driver.stop()


@pytest.fixture
def fleet_of(tiny, tmp_path):
    fleets = []

    def make(shards: int) -> LocalFleet:
        fleet = LocalFleet(tiny, shards)
        fleet.start(log_dir=tmp_path)
        fleets.append(fleet)
        return fleet

    yield make
    for fleet in fleets:
        fleet.stop()


@pytest.mark.parametrize("shards", [1, 2, 3, 4])
def test_a_chain_of_n_stages_gives_the_single_process_ids(fleet_of, solo, shards):
    requests = prompts(6, seed=shards)
    _, results = asyncio.run(run_fleet(fleet_of(shards), requests))
    assert [r.tokens for r in results] == [solo(r) for r in requests]


def test_sixty_four_concurrent_streams_each_get_the_ids_they_get_alone(fleet_of, solo):
    requests = prompts(64, seed=11)
    _, results = asyncio.run(run_fleet(fleet_of(3), requests))
    assert [r.tokens for r in results] == [solo(r) for r in requests]


def test_log_probs_are_computed_only_for_streams_that_ask_and_match_the_engine(fleet_of, solo_engine):
    prompt = (5, 17, 300, 42, 77, 9)
    asked = Request("asked", prompt, SamplingParams(max_tokens=8, logprobs=True))
    plain = Request("plain", prompt, SamplingParams(max_tokens=8))
    _, (with_logprobs, without) = asyncio.run(run_fleet(fleet_of(2), [asked, plain]))
    assert with_logprobs.tokens == without.tokens
    assert without.logprobs == [0.0] * len(without.tokens)
    # every sampled token's log-prob from one pass of the whole model over the prompt and the output
    ids = np.array([*prompt, *with_logprobs.tokens[:-1]])
    rows = np.arange(len(prompt) - 1, len(ids))
    solo_engine.open("logprobs")
    try:
        logits = solo_engine.step([Segment("logprobs", 0, len(ids))], ids, rows).logits
    finally:
        solo_engine.close("logprobs")
    expected = log_softmax(logits)[np.arange(len(rows)), with_logprobs.tokens]
    np.testing.assert_allclose(with_logprobs.logprobs, expected, atol=1e-4)
    assert min(expected) < -1e-3  # the check can fail: not every token is certain


def test_prompt_scores_are_the_engines_log_probs_of_each_prompt_token_across_windows(fleet_of, solo_engine, solo):
    prompt = tuple(3 + (i * 29) % 250 for i in range(21))  # windows of 8, 8 and 5 rows
    scored = Request("scored", prompt, SamplingParams(max_tokens=3, top_logprobs=2), score_prompt=True)
    plain = Request("plain", prompt, SamplingParams(max_tokens=3))
    config = SchedulerConfig(stages=2, prefill_window=8)
    _, (with_scores, without) = asyncio.run(run_fleet(fleet_of(2), [scored, plain], config))
    assert with_scores.tokens == without.tokens == solo(plain)
    assert without.prompt_scores == []
    expected = next_token_log_probs(solo_engine, prompt)
    got = with_scores.prompt_scores
    assert len(got) == len(prompt) - 1
    np.testing.assert_allclose([t.logprob for t in got], expected[np.arange(len(got)), prompt[1:]], atol=1e-4)
    assert [[t.token for t in s.top] for s in got] == [list(np.argsort(-row, kind="stable")[:2]) for row in expected]
    assert min(expected[np.arange(len(got)), prompt[1:]]) < -1e-3  # the check can fail


def test_stage_stats_account_every_frame_and_the_chain_costs_add_up(fleet_of):
    """Stats from every real stage before and after a run: each stage computed every frame once, and
    with one frame on the chain a frame's time covers the stages' busy time."""
    from cascadia.bench.fleet import chain_costs

    fleet = fleet_of(3)

    async def go():
        driver = PipelineDriver(fleet.stage_addrs, fleet.reply_addr, fleet.scheduler_config())
        await driver.start()
        try:
            await driver.wait_ready(timeout=120)
            before, started = await driver.stage_stats(), time.perf_counter()
            await asyncio.gather(*(driver.generate(r) for r in prompts(4, seed=5)))
            elapsed = time.perf_counter() - started
            deadline = time.monotonic() + 10
            while True:  # the frame that closes the finished streams may still be on its way down the chain
                after = await driver.stage_stats()
                if len({s.frames_computed for s in after}) == 1 or time.monotonic() > deadline:
                    return before, after, elapsed
                await asyncio.sleep(0.05)
        finally:
            await driver.stop()

    before, after, elapsed = asyncio.run(go())
    frames = [b.frames_computed - a.frames_computed for a, b in zip(before, after, strict=True)]
    assert len(set(frames)) == 1 and frames[0] >= 8  # 8 tokens each: at least 8 frames, on every stage
    costs = chain_costs(before, after, elapsed)
    assert costs["frames"] == frames[0] and len(costs["stage_ms"]) == 3
    assert all(ms > 0 for ms in costs["stage_ms"]) and costs["chain_ms"] >= 0
    assert costs["frame_ms"] * costs["frames"] == pytest.approx(elapsed * 1e3)


def test_malformed_frames_are_refused_and_the_shard_keeps_serving(fleet_of, solo):
    fleet = fleet_of(2)
    requests = prompts(2, seed=3)

    async def go():
        driver = PipelineDriver(fleet.stage_addrs, fleet.reply_addr, SchedulerConfig(stages=2))
        await driver.start()
        await driver.wait_ready()
        bad_frames = {
            "unknown stream": (
                0,
                pb.Frame(frame_id=1, rows=[pb.RowBlock(stream="x", start=0, length=1)], token_ids=[5]),
            ),
            "position gap": (
                0,
                pb.Frame(
                    frame_id=2,
                    opens=[pb.StreamOpen(stream="g")],
                    rows=[pb.RowBlock(stream="g", start=3, length=1)],
                    token_ids=[5],
                ),
            ),
            "token ids": (
                0,
                pb.Frame(
                    frame_id=3,
                    opens=[pb.StreamOpen(stream="t")],
                    rows=[pb.RowBlock(stream="t", start=0, length=2)],
                    token_ids=[5],
                ),
            ),
            "hidden rows": (
                1,
                pb.Frame(
                    frame_id=4,
                    opens=[pb.StreamOpen(stream="h")],
                    rows=[pb.RowBlock(stream="h", start=0, length=1)],
                    hidden=pb.Tensor(shape=[1, 3], data=b"\0" * 12),
                ),
            ),
        }
        errors = {}
        for name, (stage, frame) in bad_frames.items():
            async with grpc.aio.insecure_channel(fleet.stage_addrs[stage]) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await rpc.ShardStub(channel).Submit(frame, timeout=5)
                errors[name] = info.value
        receipts = {}  # the same frames over the stream stages use: refused by receipt, the stream lives on
        for name, (stage, frame) in bad_frames.items():
            async with grpc.aio.insecure_channel(fleet.stage_addrs[stage]) as channel:
                call = rpc.ShardStub(channel).Push()
                await call.write(frame)
                await call.write(frame)
                receipts[name] = [await call.read(), await call.read()]
                await call.done_writing()
        results = [await driver.generate(r) for r in requests]
        await driver.stop()
        return errors, receipts, results

    errors, receipts, results = asyncio.run(go())
    for name, error in errors.items():
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, name
    assert "position gap" in errors["position gap"].details()
    assert "expected (1, 64) FP32" in errors["hidden rows"].details()
    frame_ids = {"unknown stream": 1, "position gap": 2, "token ids": 3, "hidden rows": 4}
    for name, frame_id in frame_ids.items():
        assert [r.frame_id for r in receipts[name]] == [frame_id, frame_id], name
    assert all("position gap" in r.error for r in receipts["position gap"])
    assert all(r.error == errors[name].details() for name in receipts for r in receipts[name])
    assert [r.tokens for r in results] == [solo(r) for r in requests]


@pytest.mark.parametrize("stage", [1, 2], ids=["middle", "last"])
def test_a_killed_shard_fails_its_requests_within_seconds_naming_the_stage(fleet_of, stage):
    fleet = fleet_of(3)
    long = [Request(f"k{i}", (1, 2, 3), SamplingParams(max_tokens=100_000 // 100)) for i in range(4)]

    async def go():
        driver = PipelineDriver(fleet.stage_addrs, fleet.reply_addr, SchedulerConfig(stages=3), frame_timeout=20)
        await driver.start()
        await driver.wait_ready()
        tasks = [asyncio.ensure_future(driver.generate(r)) for r in long]
        await asyncio.sleep(1.0)
        fleet.kill(stage)
        killed_at = time.monotonic()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        elapsed = time.monotonic() - killed_at
        await driver.stop()
        return results, elapsed

    results, elapsed = asyncio.run(go())
    assert all(isinstance(r, RequestFailed) for r in results)
    assert all(f"stage {stage}" in str(r) for r in results), [str(r) for r in results]
    assert elapsed < 10
    assert fleet.dead() == [(stage, -9)]


def test_router_process_streams_tokens_cancels_and_reports_stats(fleet_of, solo, tmp_path):
    fleet = fleet_of(2)
    port = free_port()
    fleet.start_router(port, tmp_path / "router.log", max_queue=50, keep_finished=0)
    request = prompts(1, seed=9)[0]

    async def go():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = rpc.RouterStub(channel)
            await router_ready(stub)
            tokens = [
                e.token
                async for e in stub.Generate(
                    pb.GenerateRequest(request_id="one", prompt_ids=request.prompt, max_tokens=8), timeout=60
                )
            ]
            # a client that goes away mid-stream frees its stream on every stage
            call = stub.Generate(pb.GenerateRequest(request_id="two", prompt_ids=[1, 2, 3], max_tokens=900), timeout=60)
            await call.read()
            call.cancel()
            for _ in range(50):
                stats = await stub.Stats(pb.StatsRequest(), timeout=1)
                if stats.active_streams == 0 and stats.frames_in_flight == 0:
                    break
                await asyncio.sleep(0.1)
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                await stub.Generate(
                    pb.GenerateRequest(request_id="bad", prompt_ids=[], max_tokens=4), timeout=10
                ).read()
            with pytest.raises(grpc.aio.AioRpcError) as outside:
                await stub.Generate(
                    pb.GenerateRequest(request_id="outside", prompt_ids=[1, 10**6], max_tokens=4), timeout=10
                ).read()
            with pytest.raises(grpc.aio.AioRpcError) as past:
                message = pb.GenerateRequest(request_id="past", prompt_ids=[1, 2], max_tokens=4, shared_prefix=3)
                await stub.Generate(message, timeout=10).read()
            shard_stats = []
            for addr in fleet.stage_addrs:  # every stage freed the finished and the cancelled stream
                async with grpc.aio.insecure_channel(addr) as shard_channel:
                    for _ in range(50):
                        one = await rpc.ShardStub(shard_channel).Stats(pb.StatsRequest(), timeout=1)
                        if one.open_streams == 0:
                            break
                        await asyncio.sleep(0.1)
                    shard_stats.append(one)
            return tokens, stats, bad.value, outside.value, past.value, shard_stats

    tokens, stats, bad, outside, past, shard_stats = asyncio.run(go())
    assert tokens == solo(request)
    assert stats.active_streams == 0 and stats.frames_in_flight == 0
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt is empty" in bad.details()
    assert outside.code() == grpc.StatusCode.INVALID_ARGUMENT and "outside the vocabulary" in outside.details()
    assert past.code() == grpc.StatusCode.INVALID_ARGUMENT and "shared_prefix 3 must be in [0, 2]" in past.details()
    held = [(s.open_streams, s.state_bytes, s.held_state_bytes) for s in shard_stats]
    assert held == [(0, 0, 0)] * len(fleet.stage_addrs)


def test_a_stage_checks_a_stream_that_takes_over_or_copies_anothers_state():
    from cascadia.shard.service import FrameRejected, check_frame

    def frame(resume_from: str, position: int, start: int, mtp: bool = False):
        out = pb.Frame(frame_id=1, token_ids=[5])
        out.opens.append(pb.StreamOpen(stream="new", resume_from=resume_from, position=position, mtp=mtp))
        out.rows.append(pb.RowBlock(stream="new", start=start, length=1, wants_token=True))
        return out

    assert check_frame(frame("old", 6, 6), {"old": 9, "other": 3}, True, 64, 512) == {"new": 7, "other": 3}
    with pytest.raises(FrameRejected, match="resumes unknown stream 'gone'"):
        check_frame(frame("gone", 6, 6), {"old": 9}, True, 64, 512)
    with pytest.raises(FrameRejected, match="cannot resume 'old' at 10"):
        check_frame(frame("old", 10, 10), {"old": 9}, True, 64, 512)
    with pytest.raises(FrameRejected, match="position gap"):
        check_frame(frame("old", 6, 0), {"old": 9}, True, 64, 512)
    with pytest.raises(FrameRejected, match="MTP head follows resumes only such a stream"):
        check_frame(frame("old", 6, 6), {"old": 9}, True, 64, 512, mtp_depths=1, mtp_streams=frozenset({"old"}))
    with pytest.raises(FrameRejected, match="MTP head follows resumes only such a stream"):
        check_frame(frame("old", 6, 6, mtp=True), {"old": 9}, True, 64, 512, mtp_depths=1)
    followed = check_frame(frame("old", 6, 6, mtp=True), {"old": 9}, True, 64, 512, 1, frozenset({"old"}))
    assert followed == {"new": 7}

    def copy(source: str, position: int, mtp: bool = False):
        out = pb.Frame(frame_id=2, token_ids=[5])
        out.opens.append(pb.StreamOpen(stream="c", copy_from=source, position=position, mtp=mtp))
        out.rows.append(pb.RowBlock(stream="c", start=position, length=1, wants_token=True))
        return out

    assert check_frame(copy("old", 8), {"old": 9}, True, 64, 512) == {"old": 9, "c": 9}  # the source goes on
    both = copy("old", 8)
    both.opens[0].resume_from = "old"
    bad_copies = [
        (copy("gone", 8), "copies unknown stream 'gone'"),
        (copy("old", 10), "cannot copy 'old' at 10"),
        (both, "both resumes and copies"),
    ]
    for bad, reason in bad_copies:
        with pytest.raises(FrameRejected, match=reason):
            check_frame(bad, {"old": 9}, True, 64, 512)
    # the MTP head follows a copy exactly when it follows the source
    followed = frozenset({"old"})
    assert check_frame(copy("old", 8, mtp=True), {"old": 9}, True, 64, 512, 1, followed) == {"old": 9, "c": 9}
    for bad, mtp_streams in [(copy("old", 8, mtp=True), frozenset()), (copy("old", 8), followed)]:
        with pytest.raises(FrameRejected, match="copies only such a stream"):
            check_frame(bad, {"old": 9}, True, 64, 512, mtp_depths=1, mtp_streams=mtp_streams)


@pytest.mark.parametrize("speculate", [False, True])
def test_later_prompts_take_over_a_finished_streams_state_and_give_the_single_process_ids(fleet_of, solo, speculate):
    """A conversation's next turn starts with the last one's prompt and answer: its stream takes over
    the finished stream's positions (stepped back where the new prompt leaves them) and computes only
    the rest, and the ids are still exactly the single-process ones."""
    from cascadia.draft.client import LocalProposer

    fleet = fleet_of(2)
    config = SchedulerConfig(stages=2, rows_per_group=16, prefill_window=16)
    prompt = tuple(int(t) for t in np.random.default_rng(3).integers(3, 500, size=40))

    async def go():
        proposer = LocalProposer() if speculate else None
        driver = PipelineDriver(
            fleet.stage_addrs, fleet.reply_addr, config.speculating(4) if speculate else config, proposer=proposer
        )
        await driver.start()
        try:
            await driver.wait_ready(timeout=120)
            turns = [Request("turn1", prompt + prompt[:20], SamplingParams(max_tokens=12))]
            done = [await driver.generate(turns[0])]
            answer = tuple(done[0].tokens)
            # the whole last turn and more; then the same turn cut short of its answer's end, and one that
            # shares only the first prompt (stepped back further than the rewind slack allows: computed anew)
            for rid, tokens in [
                ("turn2", turns[0].prompt + answer[:-1] + (7, 8, 9)),
                ("turn3", turns[0].prompt + answer[:-1] + (7, 8, 9)[:1] + (44,)),
                ("turn4", (*prompt, 5)),
            ]:
                turns.append(Request(rid, tokens, SamplingParams(max_tokens=8)))
                done.append(await driver.generate(turns[-1]))
            cached = [p.events.get_nowait()[0].cached for p in done]
            open_streams = [s.open_streams for s in await driver.stage_stats()]
            return turns, done, cached, driver.scheduler.reused_positions, open_streams, driver.spec_stats
        finally:
            await driver.stop()

    async def open_after_stop() -> list[int]:
        """What the stages hold once the router has stopped: it closes the streams it kept."""
        deadline = time.monotonic() + 10
        while True:
            held = []
            for address in fleet.stage_addrs:
                async with grpc.aio.insecure_channel(address) as channel:
                    held.append((await rpc.ShardStub(channel).Stats(pb.StatsRequest(), timeout=5)).open_streams)
            if not any(held) or time.monotonic() > deadline:
                return held
            await asyncio.sleep(0.1)

    turns, done, cached, reused, open_streams, spec = asyncio.run(go())
    assert asyncio.run(open_after_stop()) == [0, 0]
    assert [p.tokens for p in done] == [solo(r) for r in turns]
    fed = len(turns[0].prompt) + len(done[0].tokens) - 1
    turn2_fed = len(turns[1].prompt) + len(done[1].tokens) - 1
    assert cached == [0, fed, len(turns[1].prompt) - 2, 0]  # turn3 diverges at turn2's prompt's last token
    assert turn2_fed - cached[2] <= 32  # within the stages' rewind slack
    assert reused == fed + cached[2]
    # turn3 parts from turn2's prompt (its last message edited): it starts as a copy, and turn2 stays kept;
    # turn4 parts from the others' prompts 40 tokens in and leaves a copy of those
    assert open_streams == [4, 4]  # turn2, turn3, turn4 and that copy are kept; turn1 was taken over
    if speculate:
        assert spec["rounds"] > 0


@pytest.mark.parametrize("announced", [False, True], ids=["found", "announced"])
def test_prompts_sharing_a_system_prompt_start_from_a_kept_copy_of_it_and_give_the_single_process_ids(
    fleet_of, solo, announced
):
    """Two prompts that start alike and part (one system prompt, other questions) leave a copy of the
    stream where they part, or the first leaves it where it says its system prompt ends; later prompts
    that start alike begin as copies of it on every stage, and the ids are still exactly the
    single-process ones."""
    fleet = fleet_of(2)
    rng = np.random.default_rng(12)
    system = tuple(int(t) for t in rng.integers(3, 500, size=45))
    # questions longer than the rewind slack: no prompt takes another's finished stream over
    questions = [tuple(int(t) for t in rng.integers(3, 500, size=40)) for _ in range(4)]
    requests = [Request("q0", system + questions[0], SamplingParams(max_tokens=8), shared_prefix=45 * announced)]
    requests.append(Request("q1", system + questions[1], SamplingParams(max_tokens=8)))
    requests.append(Request("q2", system + questions[2], SamplingParams(max_tokens=8, temperature=0.8, seed=4)))
    requests.append(Request("q3", system[:40] + questions[3], SamplingParams(max_tokens=8)))  # 5 short of it
    config = SchedulerConfig(stages=2, rows_per_group=16, prefill_window=16)

    async def go():
        driver = PipelineDriver(fleet.stage_addrs, fleet.reply_addr, config)
        await driver.start()
        try:
            await driver.wait_ready(timeout=120)
            done = [await driver.generate(r) for r in requests]
            return done, [s.open_streams for s in await driver.stage_stats()], driver.scheduler.reused_positions
        finally:
            await driver.stop()

    done, open_streams, reused = asyncio.run(go())
    assert [p.tokens for p in done] == [solo(r) for r in requests]
    cached = [p.events.get_nowait()[0].cached for p in done]
    # q3 steps the copy back to where it parts from the system prompt
    assert cached == [0, len(system) if announced else 0, len(system), 40]
    assert reused == sum(cached)
    assert open_streams == [5, 5]  # the four finished streams and the system prompt's copy


def test_requests_with_one_prompt_compute_it_once_and_each_gets_the_single_process_ids(fleet_of, solo):
    """A request's `n` choices: the first computes the prompt, the others start as copies of it on every
    stage (sampling each with its own seed), and every one equals its single-process run."""
    fleet = fleet_of(2)
    prompt = tuple(int(t) for t in np.random.default_rng(8).integers(3, 500, size=45))
    requests = [Request("c0", prompt, SamplingParams(max_tokens=10))] + [
        Request(f"c{i}", prompt, SamplingParams(max_tokens=10, temperature=0.8, seed=i)) for i in (1, 2)
    ]
    config = SchedulerConfig(stages=2, rows_per_group=16, prefill_window=16, keep_finished=0)
    driver, results = asyncio.run(run_fleet(fleet, requests, config))
    assert [r.tokens for r in results] == [solo(r) for r in requests]
    cached = [r.events.get_nowait()[0].cached for r in results]
    assert cached == [0, len(prompt) - 1, len(prompt) - 1]
    assert driver.scheduler.reused_positions == 2 * (len(prompt) - 1)
    assert results[1].tokens != results[2].tokens  # each copy samples on its own


def test_a_stream_past_its_context_budget_fails_naming_the_stage_and_the_chain_keeps_serving(fleet_of, solo):
    fleet = fleet_of(2)
    too_long = Request("long", tuple([5] * 1000), SamplingParams(max_tokens=100))
    after = prompts(2, seed=21)

    async def go():
        driver = PipelineDriver(fleet.stage_addrs, fleet.reply_addr, SchedulerConfig(stages=2))
        await driver.start()
        await driver.wait_ready()
        driver.limits = FleetLimits(0, 0, 0)  # nothing checked at the router: the stage's own check, behind it
        with pytest.raises(RequestFailed, match=r"stage \d: .*context budget of 1024"):
            await driver.generate(too_long)
        results = [await driver.generate(r) for r in after]
        await driver.stop()
        return results

    results = asyncio.run(go())
    assert [r.tokens for r in results] == [solo(r) for r in after]


def test_requests_beyond_the_fleets_limits_are_refused_at_the_router_and_others_run_on(fleet_of, solo):
    """A stage refuses a frame whole: a request it would refuse must never share a frame with others."""
    fleet = fleet_of(2)
    good = prompts(3, seed=5)
    vocab = load_shape(fleet.model).vocab_size
    bad = [
        (Request("long", tuple([5] * 1000), SamplingParams(max_tokens=100)), "exceed the fleet's context of 1024"),
        (Request("id", (5, vocab), SamplingParams(max_tokens=4)), f"token id {vocab} is outside"),
        (Request("bias", (5, 6), SamplingParams(logit_bias=((vocab + 3, 1.0),))), f"names token {vocab + 3}"),
    ]

    async def go():
        driver = PipelineDriver(fleet.stage_addrs, fleet.reply_addr, SchedulerConfig(stages=2))
        await driver.start()
        try:
            await driver.wait_ready()
            running = [asyncio.ensure_future(driver.generate(r)) for r in good]
            refusals = []
            for request, _ in bad:
                with pytest.raises(ValueError) as refused:
                    await driver.submit(request)
                refusals.append(str(refused.value))
            early = PipelineDriver(fleet.stage_addrs, f"127.0.0.1:{free_port()}", SchedulerConfig(stages=2))
            await early.start()
            try:
                with pytest.raises(ValueError, match="outside the vocabulary"):  # before it waited for the chain
                    await early.submit(bad[1][0])
            finally:
                await early.stop()
            return driver.limits, refusals, await asyncio.gather(*running)
        finally:
            await driver.stop()

    limits, refusals, results = asyncio.run(go())
    assert (limits.vocab, limits.context) == (vocab, 1024)
    for message, (_, expected) in zip(refusals, bad, strict=True):
        assert expected in message
    assert [r.tokens for r in results] == [solo(r) for r in good]


def test_requests_that_came_before_any_stage_answered_are_checked_once_the_stages_report(tiny, tmp_path, solo):
    """A request submitted while no stage answers `Stats` waits unchecked; when the limits arrive, one that
    does not fit fails alone, naming what, and the others run."""
    vocab = load_shape(tiny).vocab_size
    good = prompts(2, seed=6)
    bad = Request("bad", (5, vocab + 7), SamplingParams(max_tokens=4))
    fleet = LocalFleet(tiny, 2)
    fleet.start(log_dir=tmp_path)  # the shards load their layers for seconds before they answer

    async def go():
        driver = PipelineDriver(fleet.stage_addrs, fleet.reply_addr, SchedulerConfig(stages=2))
        await driver.start()
        try:
            waiting = [await driver.submit(r) for r in [good[0], bad, good[1]]]
            unchecked = driver.limits is None
            await driver.wait_ready(timeout=120)
            for pending in waiting:
                await pending.done.wait()
            return unchecked, waiting
        finally:
            await driver.stop()

    try:
        unchecked, (first, refused, second) = asyncio.run(go())
    finally:
        fleet.stop()
    assert unchecked  # the three were queued before the limits were known
    assert refused.invalid and f"token id {vocab + 7} is outside the vocabulary" in refused.error
    assert not first.error and not second.error
    assert [first.tokens, second.tokens] == [solo(r) for r in good]


def test_requests_queued_while_a_shard_is_down_are_served_once_it_is_back(fleet_of, solo, tmp_path):
    fleet = fleet_of(3)
    port = free_port()
    fleet.start_router(port, tmp_path / "router.log")
    request = prompts(1, seed=4)[0]

    async def wait_for(stub, serving: bool):
        for _ in range(300):
            try:
                stats = await stub.Stats(pb.StatsRequest(), timeout=1)
                if stats.stage_serving and all(stats.stage_serving) == serving:
                    return
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.2)
        raise AssertionError(f"chain never became serving={serving}")

    async def go():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = rpc.RouterStub(channel)
            await wait_for(stub, True)
            fleet.kill(2)
            await wait_for(stub, False)
            await asyncio.sleep(1.5)  # the router's readiness loop closes admission
            call = stub.Generate(
                pb.GenerateRequest(request_id="q", prompt_ids=request.prompt, max_tokens=8), timeout=120
            )
            reader = asyncio.ensure_future(_collect(call))
            await asyncio.sleep(1.0)
            assert not reader.done()  # queued, not failed
            fleet.restart(2)
            return await reader

    async def _collect(call):
        return [e.token async for e in call]

    tokens = asyncio.run(go())
    assert tokens == solo(request)


def test_a_fleet_on_one_machine_keeps_one_large_frame_on_the_chain(tmp_path):
    """Loopback shards share the cores: one frame at a time with every ready row; emulated links stand
    for separate machines and keep a frame per stage."""
    fleet = LocalFleet(tmp_path, 3)
    config = fleet.scheduler_config(max_draft=3)
    assert (config.stages, config.in_flight, config.max_draft) == (3, 1, 3)
    assert config.rows_per_group > 8 and config.prefill_window > 8 and config.draft_room == 16
    assert config.longest_draft == 15  # a lone stream's verify block fills the draft rows
    assert fleet.schedule_options()["frames_in_flight"] == 1
    fleet.network = object()  # type: ignore[assignment]
    assert fleet.scheduler_config().in_flight == 3
    assert fleet.scheduler_config().rows_per_group == SchedulerConfig(stages=3).rows_per_group
    assert fleet.scheduler_config().longest_draft == SchedulerConfig(stages=3).rows_per_group - 1
