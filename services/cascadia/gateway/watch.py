"""Requests whose client may go away: what runs for them stops when it does."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable

from fastapi import Request
from fastapi.responses import StreamingResponse

from cascadia.gateway.choices import Choices
from cascadia.gateway.errors import ApiError
from cascadia.gateway.metrics import GatewayMetrics

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_watched(request: Request, choices: Choices, release: Callable[[], None]) -> None:
    """Run a non-streaming request's generations; stop them on the router if the client disconnects, and
    call `release` however it ends."""
    work = asyncio.ensure_future(choices.run())
    watch = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            choices.abort()
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            raise ApiError(499, "The client closed the connection.", code="client_disconnected")
        work.result()
    finally:
        watch.cancel()
        release()


def watched_stream(
    request: Request,
    choices: Choices,
    events: AsyncIterator[str],
    failed: Callable[[ApiError], Iterable[str]],
    release: Callable[[], None],
    metrics: GatewayMetrics,
) -> StreamingResponse:
    """Server-sent `events` of a request's generations: stopped on the router when the client goes away, a
    failure after the headers sent as the `failed` events, and `release` called however it ends."""

    async def stream() -> AsyncIterator[str]:
        watch = asyncio.ensure_future(wait_for_disconnect(request))
        watch.add_done_callback(lambda task: None if task.cancelled() else choices.abort())
        try:
            async for event in events:
                yield event
        except ApiError as exc:  # headers are sent: the error travels as an event
            metrics.errors.labels(exc.code or exc.type).inc()
            for event in failed(exc):
                yield event
        except asyncio.CancelledError:
            metrics.errors.labels("client_disconnected").inc()
            raise
        finally:
            watch.cancel()
            release()

    return StreamingResponse(stream(), media_type="text/event-stream", headers=SSE_HEADERS)
