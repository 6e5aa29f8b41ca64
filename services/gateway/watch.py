"""Requests whose client may go away: what runs for them stops when it does."""

from __future__ import annotations

import asyncio

from fastapi import Request

from cascadia.gateway.choices import Choices
from cascadia.gateway.errors import ApiError


async def wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_watched(request: Request, choices: Choices) -> None:
    """Run a non-streaming request's generations; stop them on the router if the client disconnects."""
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
