"""The gateway's side of the router's gRPC API."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cascadia.gateway.errors import ApiError
from cascadia.sampling_params import SamplingParams
from cascadia.wire import pb, rpc, sampling_message, tls


@dataclass(frozen=True)
class Readiness:
    ready: bool
    detail: str


def api_error(exc: grpc.aio.AioRpcError) -> ApiError:
    """What a router failure means to an API client."""
    code, message = exc.code(), exc.details() or exc.code().name
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return ApiError(400, message)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return ApiError(429, f"The fleet is overloaded: {message}", "rate_limit_error", code="overloaded")
    return ApiError(503, f"The fleet is unavailable: {message}", "server_error", code="unavailable")


class RouterClient:
    def __init__(self, address: str) -> None:
        self.address = address
        self._channel: grpc.aio.Channel | None = None

    def _connect(self) -> grpc.aio.Channel:
        # an aio channel belongs to the event loop it was made in: make it inside the server's loop
        if self._channel is None:
            self._channel = tls.channel(self.address)
            self._stub = rpc.RouterStub(self._channel)
            self._health = health_pb2_grpc.HealthStub(self._channel)
        return self._channel

    @property
    def stub(self):
        self._connect()
        return self._stub

    @property
    def health(self):
        self._connect()
        return self._health

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    def generate(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        speculation: bool = True,
        score_prompt: bool = False,
        shared_prefix: int = 0,
    ) -> grpc.aio.UnaryStreamCall:
        sampling = sampling_message(params)
        message = pb.GenerateRequest(
            request_id=request_id,
            prompt_ids=prompt,
            sampling=sampling,
            max_tokens=params.max_tokens,
            stop_ids=sorted(params.stop_ids),
            speculation_off=not speculation,
            score_prompt=score_prompt,
            shared_prefix=shared_prefix,
        )
        return self.stub.Generate(message)

    async def events(self, call: grpc.aio.UnaryStreamCall) -> AsyncIterator:
        try:
            async for event in call:
                yield event
        except grpc.aio.AioRpcError as exc:
            raise api_error(exc) from None

    async def cancel(self, request_id: str) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError):  # a router that is gone took the request with it
            await self.stub.Cancel(pb.CancelRequest(request_id=request_id), timeout=5)

    async def stats(self, timeout: float = 2.0):
        return await self.stub.Stats(pb.StatsRequest(), timeout=timeout)

    async def readiness(self) -> Readiness:
        try:
            health = await self.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
            stats = await self.stats()
        except grpc.aio.AioRpcError as exc:
            return Readiness(False, f"router {self.address}: {exc.code().name}")
        down = [i for i, serving in enumerate(stats.stage_serving) if not serving]
        if down:
            return Readiness(False, f"stages not serving: {down}")
        if health.status != health_pb2.HealthCheckResponse.SERVING:
            return Readiness(False, "router not serving yet")
        return Readiness(True, f"{len(stats.stage_serving)} stages serving")
