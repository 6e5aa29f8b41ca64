"""`cascadia draft`: the hybrid proposer behind gRPC, shared by every router that points at it."""

from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from cascadia.draft.proposer import HybridProposer
from cascadia.wire import pb, rpc, tls

log = logging.getLogger("cascadia.draft")
MAX_K = 64


class DraftServicer(rpc.DraftServicer):
    def __init__(self, proposer: HybridProposer) -> None:
        self.proposer = proposer
        # proposals may run a draft model: off the event loop, one at a time
        self._lock = asyncio.Lock()

    async def Propose(self, request, context):
        if not request.stream or request.k < 0 or request.k > MAX_K or request.known < 0:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"stream must be named, 0 <= k <= {MAX_K}, known >= 0"
            )
        async with self._lock:
            have = self.proposer.known(request.stream)
            if have != request.known:  # the caller and this service disagree (e.g. after a restart): start over
                self.proposer.forget(request.stream, share=False)
                if request.known:
                    return pb.Proposal(have=0)
            have = self.proposer.append(request.stream, request.tokens)
            tokens, source = await asyncio.to_thread(self.proposer.propose, request.stream, request.k)
        return pb.Proposal(tokens=tokens, source=source, have=have)

    # Observe, Forget and Stats may reach the shared index in Redis: off the event loop, so that a slow
    # or hung Redis (each call waits up to its socket timeout) does not hold up the service's other calls
    async def Observe(self, request, context):
        await asyncio.to_thread(self.proposer.observe, request.source, request.proposed, request.accepted)
        return pb.Ack()

    async def Forget(self, request, context):
        async with self._lock:
            await asyncio.to_thread(self.proposer.forget, request.stream, request.share)
        return pb.Ack()

    async def Stats(self, request, context):
        shared = self.proposer.shared
        reachable = shared is not None and await asyncio.to_thread(lambda: shared.available)
        return pb.DraftStats(streams=len(self.proposer.streams), shared_index=bool(reachable))


async def serve(proposer: HybridProposer, listen: str) -> None:
    server = tls.server()
    rpc.add_DraftServicer_to_server(DraftServicer(proposer), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    tls.add_port(server, listen)
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    log.info("draft service on %s (shared contexts: %s)", listen, "on" if proposer.shared else "off")
    try:
        await server.wait_for_termination()
    finally:
        await server.stop(grace=2)
