"""`cascadia router`: the gateway-facing gRPC API (Generate, Cancel, Stats, health) over a chain."""

from __future__ import annotations

import asyncio
import itertools
import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from cascadia.router.pipeline import PipelineDriver
from cascadia.router.scheduler import Overloaded, Request
from cascadia.wire import CHANNEL_OPTIONS, pb, rpc, sampling_params, tls

log = logging.getLogger("cascadia.router")


class RouterServicer(rpc.RouterServicer):
    def __init__(self, driver: PipelineDriver) -> None:
        self.driver = driver
        self._ids = itertools.count()

    async def Generate(self, request, context):
        try:
            params = sampling_params(request.sampling, request.max_tokens or 16, frozenset(request.stop_ids) or None)
            rid = request.request_id or f"req-{next(self._ids)}"
            pending = await self.driver.submit(
                Request(
                    rid,
                    tuple(request.prompt_ids),
                    params,
                    speculate=not request.speculation_off,
                    score_prompt=request.score_prompt,
                    shared_prefix=request.shared_prefix,
                )
            )
        except Overloaded as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        try:
            first = True
            while True:
                item = await pending.events.get()
                if item is None:
                    break
                event, sampled = item
                yield pb.GenerateEvent(
                    token=event.token,
                    logprob=sampled.logprob,
                    finish_reason=event.finished or "",
                    top=sampled.top,
                    prompt=pending.prompt_scores if first else (),
                    cached_tokens=event.cached,
                )
                first = False
            if pending.error and pending.error != "cancelled":
                code = grpc.StatusCode.INVALID_ARGUMENT if pending.invalid else grpc.StatusCode.UNAVAILABLE
                await context.abort(code, pending.error)
        finally:
            if not pending.done.is_set():  # the client went away: free the stream on every stage
                await self.driver.cancel(rid)
            self.driver.release(rid)

    async def Capture(self, request, context):
        """The same capture request to every stage; a stage that refuses it fails the call, naming it."""
        try:
            replies = await self.driver.capture(request)
        except grpc.aio.AioRpcError as exc:
            code = exc.code() if exc.code() == grpc.StatusCode.INVALID_ARGUMENT else grpc.StatusCode.UNAVAILABLE
            await context.abort(code, exc.details() or "a stage did not answer")
        return pb.FleetCaptureStatus(stages=replies)

    async def Cancel(self, request, context):
        await self.driver.cancel(request.request_id)
        return pb.Ack()

    async def Stats(self, request, context):
        s = self.driver.scheduler
        return pb.StatsReply(
            active_streams=s.active,
            queued_requests=s.queued,
            frames_in_flight=s.in_flight,
            stage_serving=await self.driver.stage_health(),
            verify_rounds=self.driver.spec_stats["rounds"],
            drafted_tokens=self.driver.spec_stats["proposed"],
            accepted_tokens=self.driver.spec_stats["accepted"],
            sources=[
                pb.SourceStats(source=source, drafted_tokens=drafted, accepted_tokens=accepted)
                for source, (drafted, accepted) in sorted(self.driver.spec_by_source.items())
            ],
            reused_positions=s.reused_positions,
            kept_streams=s.kept_streams,
            shared_prefixes=s.shared_prefixes,
        )


async def serve(driver: PipelineDriver, listen: str) -> None:
    await driver.start()
    server = tls.server(CHANNEL_OPTIONS)
    rpc.add_RouterServicer_to_server(RouterServicer(driver), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    await health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    tls.add_port(server, listen)
    await server.start()
    log.info("router on %s, waiting for %d stages", listen, len(driver.stage_addrs))
    was_serving = False
    try:
        while True:  # readiness follows the whole chain
            serving = all(await driver.stage_health())
            if serving and not was_serving:  # stages that came back may hold other settings
                await driver.learn_limits()
            was_serving = serving
            driver.scheduler.set_chain_ready(serving)
            if serving:
                await driver.pump()  # requests queued while the chain was down go out now
            status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
            await health_servicer.set("", status)
            await asyncio.sleep(1.0)
    finally:
        await server.stop(grace=2)
        await driver.stop()
