"""The admitting side of a chain: turns scheduler frames into gRPC frames and collects sampled tokens.

A thin shell around `scheduler.Scheduler`: it submits each frame to stage 0, receives the last
stage's results on its Collector service, and feeds them back to the scheduler.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cascadia.frame_stream import FrameStream
from cascadia.router.limits import UNREPORTED, FleetLimits, check_request, fleet_limits
from cascadia.router.scheduler import (
    DraftWanted,
    Emitted,
    Frame,
    Request,
    Scheduler,
    SchedulerConfig,
    choose_draft,
)
from cascadia.sampling_params import SamplingParams
from cascadia.wire import CHANNEL_OPTIONS, pb, rpc, sampling_message, tls

log = logging.getLogger("cascadia.router")
CLOSE_ONLY_FRAME = 2**63  # frames that only free state carry this id and return no tokens
MTP_SOURCE = "mtp"
GRAMMAR_SOURCE = "grammar"  # tokens a stream's grammar allows alone, sent by the last stage


class Proposer(Protocol):
    """Where speculative rounds get their drafts (`cascadia.draft.client`: in-process or the draft service)."""

    async def propose(self, stream: str, context: Sequence[int], k: int) -> tuple[list[int], str]: ...
    async def observe(self, stream: str, source: str, proposed: int, accepted: int) -> None: ...
    async def forget(self, stream: str, share: bool) -> None: ...
    async def close(self) -> None: ...


class RequestFailed(RuntimeError):
    pass


@dataclass
class _Pending:
    request: Request
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # (Emitted, SampledToken), then None
    error: str | None = None
    invalid: bool = False  # the error is the request's own: it does not fit the fleet
    first_token_at: float | None = None
    token_times: list[float] = field(default_factory=list)
    prompt_scores: list = field(default_factory=list)  # ScoredToken of prompt positions 1, 2, ... (score_prompt)


class _Collector(rpc.CollectorServicer):
    def __init__(self, driver: PipelineDriver) -> None:
        self.driver = driver

    async def Deliver(self, result, context):
        self.driver.on_result(result)
        return pb.Ack()

    async def DeliverAll(self, results, context):
        # Ends with OK when the driver stops: the last stage keeps its stream open, and a stream
        # still open when the server stops is cancelled (and gRPC prints that for every stream).
        stopping = asyncio.ensure_future(self.driver.stopping.wait())
        try:
            while True:
                read = asyncio.ensure_future(context.read())
                await asyncio.wait({read, stopping}, return_when=asyncio.FIRST_COMPLETED)
                if not read.done():
                    read.cancel()
                    return
                result = read.result()
                if result is grpc.aio.EOF:
                    return
                self.driver.on_result(result)
                await context.write(pb.Receipt(frame_id=result.frame_id))
        finally:
            stopping.cancel()


class PipelineDriver:
    def __init__(
        self,
        stage_addrs: Sequence[str],
        listen: str,
        config: SchedulerConfig,
        frame_timeout: float = 30.0,
        proposer: Proposer | None = None,
    ):
        self.stage_addrs = list(stage_addrs)
        self.proposer = proposer  # drafts for speculative rounds (config.max_draft > 0)
        self.spec_stats = {"rounds": 0, "proposed": 0, "accepted": 0}
        self.spec_by_source: dict[str, list[int]] = {}  # source -> [proposed, accepted]
        self.listen = listen
        self.scheduler = Scheduler(config)
        self.frame_timeout = frame_timeout
        self._pending: dict[str, _Pending] = {}
        self._sent_at: dict[int, float] = {}
        self._closes: list[str] = []
        self._server: grpc.aio.Server | None = None
        self._channels: list[grpc.aio.Channel] = []
        self._first: FrameStream | None = None
        self._watchdog: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self.stopping = asyncio.Event()
        self.down_after_s = 2.0  # health checks failing this long mark a stage down
        self._failing_since: dict[int, float] = {}
        self.limits: FleetLimits | None = None  # learnt from the stages once they all serve

    async def start(self) -> None:
        self._server = tls.server(CHANNEL_OPTIONS)
        rpc.add_CollectorServicer_to_server(_Collector(self), self._server)
        tls.add_port(self._server, self.listen)
        await self._server.start()
        self._channels = [tls.channel(a, CHANNEL_OPTIONS) for a in self.stage_addrs]
        first = rpc.ShardStub(self._channels[0]).Push
        self._first = FrameStream(first, self._refused, f"stage 0 at {self.stage_addrs[0]}")
        self._watchdog = asyncio.create_task(self._watch())

    async def wait_ready(self, timeout: float = 120.0) -> None:
        """Admission opens only when every stage reports SERVING."""
        deadline = time.monotonic() + timeout
        while True:
            states = await self.stage_health()
            if all(states):
                await self.learn_limits()
                self.scheduler.set_chain_ready(True)
                await self.pump()
                return
            if time.monotonic() > deadline:
                missing = [i for i, ok in enumerate(states) if not ok]
                raise RequestFailed(f"stages {missing} are not serving after {timeout:.0f} s")
            await asyncio.sleep(0.1)

    async def stage_stats(self, timeout: float = 5.0) -> list:
        """Every stage's `Stats` (open streams, state bytes, busy seconds, frames computed), in chain order."""
        calls = (rpc.ShardStub(c).Stats(pb.StatsRequest(), timeout=timeout) for c in self._channels)
        return list(await asyncio.gather(*calls))

    async def learn_limits(self, timeout: float = 5.0) -> None:
        """What requests must fit from now on, as the stages report it (kept as it was if one does not answer).
        Requests still waiting for admission are checked against them: one that no longer fits (it came
        before any stage answered, or a stage came back with other settings) fails alone."""
        if not self._channels:  # not started
            return
        with contextlib.suppress(grpc.aio.AioRpcError):
            self.limits = fleet_limits(await self.stage_stats(timeout))
        if self.limits is None:
            return
        self.scheduler.rewind_slack, self.scheduler.context = self.limits.rewind_slack, self.limits.context
        self.scheduler.drop_all_kept()  # a stage that came back has lost them
        self._closes.extend(self.scheduler.take_dropped())
        for request in self.scheduler.waiting():
            try:
                check_request(request.prompt, request.params, self.limits)
            except ValueError as exc:
                self.scheduler.cancel(request.id)
                self._fail([request.id], str(exc), invalid=True)

    async def stage_health(self) -> list[bool]:
        async def one(channel: grpc.aio.Channel) -> bool:
            try:
                reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
            except grpc.aio.AioRpcError:
                return False
            return reply.status == health_pb2.HealthCheckResponse.SERVING

        return list(await asyncio.gather(*(one(c) for c in self._channels)))

    async def capture(self, request) -> list:
        """Forward a capture request to every stage, first to last. While the stages capture, no stream
        takes over a kept one's state, so that each captured stream's rows start at its first position."""
        if not request.status_only:
            self.scheduler.taking_over = not request.enable
        replies = []
        for i, channel in enumerate(self._channels):
            try:
                replies.append(await rpc.ShardStub(channel).Capture(request, timeout=10))
            except grpc.aio.AioRpcError as exc:
                raise grpc.aio.AioRpcError(
                    exc.code(), exc.initial_metadata(), exc.trailing_metadata(), f"stage {i}: {exc.details()}"
                ) from None
        return replies

    async def stop(self) -> None:
        if self._watchdog:
            self._watchdog.cancel()
        if self._tasks:  # let the last close frames go out
            await asyncio.wait(list(self._tasks), timeout=2)
        if self._first is not None:
            self.scheduler.drop_all_kept()  # the stages free what no router will take over
            self._closes.extend(self.scheduler.take_dropped())
            if self._closes:
                self._submit(pb.Frame(frame_id=CLOSE_ONLY_FRAME, closes=self._take_closes()), None)
            await self._first.close()
        self.stopping.set()
        for channel in self._channels:
            await channel.close()
        if self.proposer is not None:
            await self.proposer.close()
        if self._server:
            await self._server.stop(grace=1)

    async def submit(self, request: Request) -> _Pending:
        """Queue a request (raises `Overloaded` when the queue is full); its events arrive on `.events`."""
        if request.id in self._pending:
            raise ValueError(f"request {request.id} is already running")
        if self.limits is None:  # before the chain was first ready: ask the stages that answer already
            await self.learn_limits(timeout=1.0)
        check_request(request.prompt, request.params, self.limits or UNREPORTED)
        if self.scheduler.kept(request.id):  # the name comes back: its old state goes before it opens again
            self.scheduler.drop_kept(request.id)
            self._submit(pb.Frame(frame_id=CLOSE_ONLY_FRAME, closes=self._take_closes()), None)
        pending = _Pending(request)
        self.scheduler.submit(request)
        self._pending[request.id] = pending
        await self.pump()
        return pending

    async def generate(self, request: Request) -> _Pending:
        pending = await self.submit(request)
        await pending.done.wait()
        self._pending.pop(request.id, None)
        if pending.error:
            raise RequestFailed(pending.error)
        return pending

    def release(self, request_id: str) -> None:
        self._pending.pop(request_id, None)

    async def cancel(self, request_id: str) -> None:
        if self.scheduler.cancel(request_id):
            self._closes.append(request_id)
        self._closes.extend(self.scheduler.take_dropped())
        if self.proposer is not None:
            self._spawn(self.proposer.forget(request_id, share=False))
        pending = self._pending.get(request_id)
        if pending and not pending.done.is_set():
            pending.error = "cancelled"
            pending.done.set()
            pending.events.put_nowait(None)
        await self.pump()

    def on_result(self, result) -> None:
        if result.frame_id == CLOSE_ONLY_FRAME:
            return
        sent_at = self._sent_at.pop(result.frame_id, None)
        if result.error:
            failed = self.scheduler.on_frame_failed(result.frame_id)
            self._closes.extend(failed)  # the other stages still hold their state
            self._fail(failed, result.error)
        else:
            for scores in result.scores:  # they come in order, before the stream's first token
                pending = self._pending.get(scores.stream)
                if pending is not None:
                    pending.prompt_scores.extend(scores.tokens)
            sampled: dict[str, list] = {}
            for t in result.tokens:  # a verified block returns several tokens, in order
                sampled.setdefault(t.stream, []).append(t)
            tokens = {s: [t.token for t in ts] for s, ts in sampled.items()}
            drafts = {
                s: {GRAMMAR_SOURCE: ts[-1].forced, MTP_SOURCE: ts[-1].draft}
                for s, ts in sampled.items()
                if ts[-1].forced or ts[-1].draft
            }
            seconds = time.monotonic() - sent_at if sent_at is not None else None
            for event in self.scheduler.on_frame_done(result.frame_id, tokens, drafts, seconds):
                self._emit(event, sampled[event.stream].pop(0))
            for v in self.scheduler.verified:
                self.spec_stats["rounds"] += 1
                self.spec_stats["proposed"] += v.proposed
                self.spec_stats["accepted"] += v.accepted
                counts = self.spec_by_source.setdefault(v.source or "none", [0, 0])
                counts[0] += v.proposed
                counts[1] += v.accepted
                if self.proposer is not None:
                    self._spawn(self.proposer.observe(v.stream, v.source, v.proposed, v.accepted))
        self._spawn(self.pump())

    def _spawn(self, coroutine) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _emit(self, event: Emitted, sampled) -> None:
        pending = self._pending.get(event.stream)
        if pending is None:
            return
        now = time.perf_counter()
        if pending.first_token_at is None:
            pending.first_token_at = now
        pending.token_times.append(now)
        pending.tokens.append(event.token)
        pending.logprobs.append(sampled.logprob)
        pending.events.put_nowait((event, sampled))
        if event.finished:
            if not self.scheduler.kept(event.stream):
                self._closes.append(event.stream)
            pending.done.set()
            pending.events.put_nowait(None)
            if self.proposer is not None:
                self._spawn(self.proposer.forget(event.stream, share=True))

    def _fail(self, streams: list[str], error: str, invalid: bool = False) -> None:
        for stream in streams:
            pending = self._pending.get(stream)
            if pending and not pending.done.is_set():
                pending.error = error
                pending.invalid = invalid
                pending.done.set()
                pending.events.put_nowait(None)

    async def pump(self) -> None:
        wanted = self.scheduler.drafts_wanted()
        if wanted:
            proposals = [([], "")] * len(wanted)
            if self.proposer is not None:
                try:
                    proposals = await asyncio.gather(*(self._timed_proposal(w) for w in wanted))
                except Exception:  # a draft is only ever an optimisation: decode without one
                    log.exception("the proposer failed; this round goes without drafts")
            for w, (tokens, source) in zip(wanted, proposals, strict=True):
                # the last stage's drafts are more sources, ranked with the others by measured agreement;
                # what a grammar forces comes first, since a tie goes to the earlier candidate
                stage = dict(w.stage)
                candidates = [(list(stage.get(GRAMMAR_SOURCE, ())), GRAMMAR_SOURCE), (tokens[: w.k], source)]
                candidates.append((list(stage.get(MTP_SOURCE, ())), MTP_SOURCE))
                chosen, chosen_source = choose_draft(candidates, self.spec_by_source)
                self.scheduler.set_draft(w.stream, chosen, chosen_source)
        frames = self.scheduler.next_frames()
        self._closes.extend(self.scheduler.take_dropped())
        if not frames and self._closes:
            self._submit(pb.Frame(frame_id=CLOSE_ONLY_FRAME, closes=self._take_closes()), None)
        for frame in frames:
            self._submit(self._to_proto(frame), frame)

    async def _timed_proposal(self, wanted: DraftWanted) -> tuple[list[int], str]:
        """The proposer's draft for `wanted`; the scheduler learns how long asking took."""
        assert self.proposer is not None
        started = time.perf_counter()
        proposal = await self.proposer.propose(wanted.stream, wanted.context, wanted.k)
        self.scheduler.observe_proposal(wanted.stream, wanted.k, time.perf_counter() - started)
        return proposal

    def _take_closes(self) -> list[str]:
        closes, self._closes = self._closes, []
        return closes

    def _to_proto(self, frame: Frame):
        out = pb.Frame(frame_id=frame.id)
        for row in frame.rows:
            if row.opens:
                # a shared prefix has no request: it samples nothing
                request = None if row.prefix else self._pending[row.stream].request
                sampling = sampling_message(request.params if request else SamplingParams())
                out.opens.append(
                    pb.StreamOpen(
                        stream=row.stream,
                        sampling=sampling,
                        mtp=row.mtp,
                        score_prompt=request is not None and request.score_prompt,
                        resume_from=row.resume_from,
                        copy_from=row.copy_from,
                        position=row.start if row.resume_from or row.copy_from else 0,
                    )
                )
            out.rows.append(
                pb.RowBlock(
                    stream=row.stream,
                    start=row.start,
                    length=len(row.tokens),
                    wants_token=row.wants_token,
                    draft=row.draft,
                    propose=row.propose,
                )
            )
            out.token_ids.extend(row.tokens)
        out.rewinds.extend(pb.Rewind(stream=stream, position=position) for stream, position in frame.rewinds)
        out.closes.extend(self._take_closes())
        return out

    def _submit(self, message, frame: Frame | None) -> None:
        if frame is not None:
            self._sent_at[frame.id] = time.monotonic()
        self._first.send(message)

    def _refused(self, frame_id: int, reason: str) -> None:
        """Stage 0 refused a frame, or the stream to it broke before its receipt came."""
        if frame_id == CLOSE_ONLY_FRAME or self._sent_at.pop(frame_id, None) is None:
            return
        self._fail(self.scheduler.on_frame_failed(frame_id), f"stage 0: {reason}")

    async def _stage_down(self) -> int | None:
        """The first stage whose health checks have failed for `down_after_s` without a break: one
        slow answer over a lossy link is not a dead stage."""
        states = await self.stage_health()
        now = time.monotonic()
        for i, ok in enumerate(states):
            if ok:
                self._failing_since.pop(i, None)
            else:
                self._failing_since.setdefault(i, now)
        return next((i for i, t in sorted(self._failing_since.items()) if now - t >= self.down_after_s), None)

    async def _watch(self) -> None:
        """Frames that never come back fail their requests, naming the first stage that is down."""
        while True:
            await asyncio.sleep(0.5)
            now = time.monotonic()
            late = [fid for fid, t in self._sent_at.items() if now - t > self.frame_timeout]
            if not late:
                unhealthy = await self._stage_down() if self._sent_at else None
                if unhealthy is None:
                    if not self._sent_at:  # nothing in flight, nothing checked: start afresh next time
                        self._failing_since.clear()
                    continue
                late = list(self._sent_at)
                reason = f"stage {unhealthy} is not serving"
            else:
                reason = f"no result within {self.frame_timeout:.0f} s"
            for fid in late:
                self._sent_at.pop(fid, None)
                self._fail(self.scheduler.on_frame_failed(fid), reason)
